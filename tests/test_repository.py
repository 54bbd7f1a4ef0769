"""The repository stands alone: nothing in it reads files from outside it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

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
    "site",
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


def test_configs_name_only_bundled_corpora_or_a_hub_dataset() -> None:
    """A shipped config's text is a corpus bundled in data/, or a dataset on the Hugging Face
    Hub (too large to bundle: `org/name`, which no file of the repository can shadow)."""
    for config in (ROOT / "configs").glob("*.yaml"):
        data = yaml.safe_load(config.read_text())["data"]
        if data.get("path") is not None:
            assert (ROOT / data["path"]).is_file() and data["path"].startswith("data/"), config
        else:
            name = data["dataset"]
            assert re.fullmatch(r"[\w.-]+/[\w.-]+", name) and not (ROOT / name).exists(), config


def test_the_reading_path_is_real_and_every_file_on_it_says_what_it_holds() -> None:
    """docs/reading-the-code.md's links point at files that exist; the core files it lists in
    its table each open with a docstring that names the modules it leaves things to; README
    links the page."""
    page = (ROOT / "docs" / "reading-the-code.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(\.\./([^)]+)\)", page)
    assert links and all((ROOT / link).exists() for link in links), links
    table = page.split("## What sits beside each step")[0]
    path = re.findall(r"\]\(\.\./(llmcli/[^)]+\.py)\)", table)
    assert len(path) == 9 and path[0] == "llmcli/config/model.py", path
    for file in path:
        tree = ast.parse((ROOT / file).read_text(encoding="utf-8"))
        doc = ast.get_docstring(tree)
        assert doc and len(doc.splitlines()) >= 3, f"{file} opens with no docstring to read"
        module = file.removesuffix(".py").replace("/", ".")
        others = {m for m in re.findall(r"llmcli(?:\.\w+)+", doc) if not m.startswith(module)}
        assert others, f"{file}'s docstring names no module it leaves anything to"
    assert "docs/reading-the-code.md" in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_wheel_lists_every_subpackage() -> None:
    """pyproject.toml names the packages the wheel holds: a subpackage left out is missing from
    every install but a clone's (`llmcli export --format gguf` once was)."""
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    start = text.index("\npackages = [")
    listed = set(re.findall(r'"(llmcli[\w.]*)"', text[start : text.index("]", start)]))
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for init in (ROOT / "llmcli").rglob("__init__.py")
    }
    assert found - listed == set()
