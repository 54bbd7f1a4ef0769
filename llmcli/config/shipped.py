"""The configs shipped with llmcli, found by name, and the bundled corpora they train on."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any, Literal

from llmcli.errors import ConfigError, did_you_mean

# In a wheel the shipped configs and corpora are package data (`llmcli/configs/`,
# `llmcli/corpora/`); in a checkout (or an editable install) they are the repository's top-level
# `configs/` and `data/`, the single source the wheel is built from.
_PACKAGE_DIR = Path(__file__).resolve().parents[1]  # llmcli/
_SHIPPED = {"configs": ("configs", "configs"), "corpora": ("corpora", "data")}


def shipped_dir(kind: Literal["configs", "corpora"]) -> Path:
    """The folder of the shipped configs or of the bundled corpora, installed or in a checkout."""
    inside, checkout = _SHIPPED[kind]
    installed = _PACKAGE_DIR / inside
    return installed if installed.is_dir() else _PACKAGE_DIR.parent / checkout


def shipped_configs() -> dict[str, Path]:
    """Name -> file of every shipped config (`tiny` -> `.../configs/tiny.yaml`), sorted."""
    folder = shipped_dir("configs")
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))} if folder.is_dir() else {}


def describe_shipped() -> list[tuple[str, str]]:
    """(name, the first sentence of its leading comment) for every shipped config."""
    rows = []
    for name, path in shipped_configs().items():
        lines = iter(path.read_text(encoding="utf-8").splitlines())
        comment = itertools.takewhile(
            lambda line: line.startswith("#") and line.strip() != "#",
            itertools.dropwhile(lambda line: not line.startswith("#"), lines),
        )
        paragraph = " ".join(line.lstrip("#").strip() for line in comment)
        rows.append((name, re.split(r"(?<=[.!?])\s+(?=[A-Z])", paragraph)[0]))
    return rows


def find_config(spec: str | Path) -> tuple[Path, bool]:
    """The config file `spec` names, and whether it is a shipped one.

    `spec` is a path to a YAML file, or the name of a shipped config (`tiny`, `tiny.yaml`).
    A file that exists wins over a shipped name; a folder does not (`llmcli train tiny --out
    tiny` makes a folder `tiny`, and the same command must still find the config to resume).

    Raises:
        ConfigError: `spec` is neither; the message lists the shipped names.
    """
    path = Path(spec)
    shipped = shipped_configs()
    name = path.name[: -len(".yaml")] if path.name.endswith(".yaml") else path.name
    if len(path.parts) == 1 and name in shipped and not path.is_file():
        return shipped[name], True
    if path.exists():
        folder = shipped_dir("configs").resolve()
        return path, path.is_file() and path.resolve().parent == folder
    names = ", ".join(shipped) or "none (this installation lacks its configs: reinstall llmcli)"
    hint = did_you_mean(name, shipped) if len(path.parts) == 1 else ""
    raise ConfigError(
        f"config {str(spec)!r} does not exist, as a file or as a shipped config.{hint} Check "
        f"the path, or give one of the shipped names: {names} (`llmcli config --list` "
        "describes them)."
    )


def shipped_data(spec: str | Path) -> Path:
    """The file or folder `spec` names, where a relative `data/...` that does not exist here is
    the one shipped with llmcli (`data/dpo-val.jsonl` from any folder, as the docs' commands
    write it); any other path as it is.

    The folder the command runs in wins: a project's own `data/` shadows the shipped files.
    """
    path = Path(spec).expanduser()
    parts = path.parts
    if path.is_absolute() or path.exists() or len(parts) < 2 or parts[0] != "data":
        return path
    bundled = shipped_dir("corpora").joinpath(*parts[1:])
    return bundled if bundled.exists() else path


def bundled_paths(raw: Any, source: Path) -> Any:
    """A shipped config's relative `data/...` paths, pointed at the bundled corpora.

    Shipped configs name their corpus relative to the project (`data/shakespeare.txt`), which
    exists only in a checkout's root; this makes them work from any folder and in a wheel.
    """
    data = raw.get("data") if isinstance(raw, dict) else None
    if not isinstance(data, dict):
        return raw
    data = dict(data)
    for key in ("path", "val_path"):
        value = data.get(key)
        if not isinstance(value, str) or Path(value).is_absolute():
            continue
        parts = Path(value).parts
        if parts and parts[0] == "data":
            bundled = shipped_dir("corpora").joinpath(*parts[1:])
            # A shipped config always reads the shipped corpus, whatever `data/` is here.
            if not bundled.exists():
                raise ConfigError(
                    f"the shipped config {str(source)!r} trains on the bundled corpus "
                    f"{str(bundled)!r}, which is missing: this installation of llmcli is "
                    "incomplete, reinstall it (or give data.path with --set)."
                )
            data[key] = str(bundled)
    return {**raw, "data": data}
