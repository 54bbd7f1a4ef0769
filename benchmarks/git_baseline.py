"""llmcli as it was at a git revision, importable next to the working tree's: `llmcli_baseline`.

A benchmark that compares today's code with an earlier commit in one process (interleaved
rounds, so that a noisy machine slows both alike) extracts the package from git into a temporary
folder under another name and rewrites its own imports (`from llmcli.x` -> `from
llmcli_baseline.x`). Only the package's Python files are needed; nothing is installed.
"""

from __future__ import annotations

import atexit
import importlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

ROOT = Path(__file__).resolve().parents[1]
NAME = "llmcli_baseline"
_IMPORT = re.compile(r"^(\s*)(from|import) llmcli(?=[\s.])", re.MULTILINE)


def load_baseline(rev: str, modules: tuple[str, ...] = ("generate", "model")) -> dict[str, object]:
    """Import `modules` of the `llmcli` package at git revision `rev` as `llmcli_baseline.*`.

    Returns:
        `{"rev": full commit hash, name: module, ...}`.

    Raises:
        RuntimeError: not a git checkout, or `rev` unknown.
    """
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        archive = subprocess.run(
            ["git", "archive", "--format=tar", commit, "llmcli"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RuntimeError(f"cannot read llmcli at git revision {rev!r}: {exc}") from None
    folder = Path(tempfile.mkdtemp(prefix="llmcli-baseline-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")
    package = folder / NAME
    (folder / "llmcli").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(_IMPORT.sub(rf"\1\2 {NAME}", path.read_text(encoding="utf-8")))
    sys.path.insert(0, str(folder))
    loaded: dict[str, object] = {"rev": commit}
    for name in modules:
        module: ModuleType = importlib.import_module(f"{NAME}.{name}")
        loaded[name] = module
    return loaded


def has_file(rev: str, path: str) -> bool:
    """Whether git revision `rev` holds `path` (relative to the repository)."""
    found = subprocess.run(
        ["git", "cat-file", "-e", f"{rev}:{path}"], cwd=ROOT, capture_output=True
    )
    return found.returncode == 0


def fail(message: str) -> NoReturn:
    """Bad input: the message on stderr, exit status 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def load_run_sides(run_dir: Path, rev: str, modules: tuple[str, ...]) -> tuple[Any, Any, dict]:
    """A trained run loaded by today's `load_run` and by revision `rev`'s, with `rev`'s
    `modules` (which must include "runs.loading"); exits 2 naming what is missing."""
    from llmcli.errors import CheckpointError
    from llmcli.runs.loading import load_run

    if not (run_dir / "config.yaml").is_file():
        fail(
            f"no trained run at {run_dir}: make one with `llmcli train tiny` (it writes "
            "checkpoints/tiny), or pass --run DIR."
        )
    try:
        today = load_run(run_dir, device="cpu")
    except CheckpointError as exc:
        fail(str(exc))
    try:
        baseline = load_baseline(rev, modules)
    except (RuntimeError, ImportError) as exc:
        fail(f"--baseline {rev}: {str(exc).rstrip('.')}. Use a revision such as 5b00014.")
    return today, baseline["runs.loading"].load_run(run_dir, device="cpu"), baseline
