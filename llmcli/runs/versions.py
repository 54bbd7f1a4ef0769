"""The software versions a run was made with, and warnings when they differ from today's.

Results depend on the versions of the model code, the tokenizer library and the framework, so a
run pins them: its `meta.json` holds `record()`, and readers (`load_run`) print a warning for
each component whose `warnings_for(recorded)` line says it differs.
"""

from __future__ import annotations

import platform
from importlib import metadata

from llmcli import __version__

# Packages whose release can change numbers: a different minor release of torch (kernels,
# defaults) or tokenizers (pre-tokenisation, normalisation) may change logits or token ids.
TRACKED = ("torch", "tokenizers", "safetensors", "numpy")


def _installed(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def record() -> dict[str, str | None]:
    """The versions in use now: llmcli, python and each tracked package."""
    versions: dict[str, str | None] = {"llmcli": __version__, "python": platform.python_version()}
    for package in TRACKED:
        versions[package] = _installed(package)
    return versions


def _major_minor(version: str | None) -> tuple[str, ...] | None:
    if version is None:
        return None
    # "2.13.0+cpu" -> ("2", "13"): the local build tag and patch level do not change results.
    return tuple(version.split("+")[0].split(".")[:2])


def warnings_for(recorded: dict[str, str | None] | None) -> list[str]:
    """One line per component whose major.minor version differs from what the run recorded."""
    if not recorded:
        return [
            "this run records no software versions (made by an older llmcli?); results "
            "may differ from when it was trained."
        ]
    now = record()
    lines = []
    for name in ("llmcli", "python", *TRACKED):
        then = recorded.get(name)
        if then is None:
            continue
        if _major_minor(then) != _major_minor(now.get(name)):
            lines.append(
                f"this run was made with {name} {then}, installed is {now.get(name) or 'none'}: "
                "results can differ."
            )
    return lines
