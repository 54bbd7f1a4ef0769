"""The repository stands alone: nothing in it reads files from outside it."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {
    ".git",
    "build",
    "dist",
    "checkpoints",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    ".hypothesis",
    ".venv",
}
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".html", ".cfg", ".json", ""}


def project_files() -> list[Path]:
    files = []
    for path in ROOT.rglob("*"):
        parts = set(path.relative_to(ROOT).parts)
        if (
            path.is_file()
            and not parts & SKIP_DIRS
            and not any(p.endswith(".egg-info") for p in parts)
            and path.suffix in TEXT_SUFFIXES
        ):
            files.append(path)
    return files


def test_nothing_refers_to_a_folder_outside_the_project() -> None:
    outside = "../" + "shared"  # spelled in two pieces so that this file does not match itself
    files = project_files()
    assert any(p.name == "speedrun-cpu.yaml" for p in files)  # the walk sees the configs
    offenders = [
        str(p.relative_to(ROOT))
        for p in files
        if outside in p.read_text(encoding="utf-8", errors="replace")
    ]
    assert offenders == []


def test_configs_name_only_bundled_corpora() -> None:
    for config in (ROOT / "configs").glob("*.yaml"):
        for line in config.read_text().splitlines():
            if line.strip().startswith("path:"):
                target = line.split(":", 1)[1].strip()
                assert (ROOT / target).is_file() and target.startswith("data/"), config.name
