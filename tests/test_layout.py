"""The package's layers, as docs/layout.md writes them down: every subpackage and top-level module
of llmcli on one layer, and no module importing a layer above its own, at the top of the file,
inside a function or under `if TYPE_CHECKING:` alike."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llmcli"
# `python -m llmcli` runs the command line: it sits on the cli layer (docs/layout.md's cli table).
ON_LAYER_OF = {"__main__": "cli"}


def layer_order() -> dict[str, int]:
    """Each name of docs/layout.md's order line (`errors < fileio < progress, device, hub < ...`,
    bottom to top) -> its layer's rank; names between commas share a layer."""
    page = (ROOT / "docs" / "layout.md").read_text(encoding="utf-8")
    same = r"\w+(, \w+)*"  # one layer: names between commas
    order = re.compile(rf"{same}( < {same})+")
    lines = [line.strip() for line in page.splitlines() if order.fullmatch(line.strip())]
    assert len(lines) == 1, f"docs/layout.md should hold one order line, holds {lines}"
    ranks: dict[str, int] = {}
    for rank, layer in enumerate(lines[0].split(" < ")):
        for name in layer.split(", "):
            assert name not in ranks, f"{name} is twice in docs/layout.md's order"
            ranks[name] = rank
    return ranks


def top_level_names() -> set[str]:
    """llmcli's subpackages and top-level modules (but `__init__` and `__main__`)."""
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"} - set(ON_LAYER_OF)
    return packages | modules


def layer_of(module: str) -> str | None:
    """`llmcli.x.y` -> `x`, the layer's name; None for the package root, `llmcli` itself."""
    parts = module.split(".")
    return ON_LAYER_OF.get(parts[1], parts[1]) if len(parts) > 1 else None


def imported(tree: ast.AST, module: str, is_package: bool) -> list[str]:
    """Every llmcli module `tree` (the source of `module`) imports, wherever the import sits:
    `from llmcli import x` names `llmcli.x` where x is a module, else the root `llmcli`."""
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                name = f"{base}.{alias.name}"
                path = PACKAGE.parent.joinpath(*name.split("."))
                found.append(name if path.with_suffix(".py").is_file() or path.is_dir() else base)
    return [name for name in dict.fromkeys(found) if name == "llmcli" or name.startswith("llmcli.")]


def upward_imports(ranks: dict[str, int]) -> list[str]:
    """One line per import of a layer above the importer's, or of no module of llmcli (a module
    whose own layer is missing from the order is left to
    `test_every_subpackage_and_top_level_module_is_on_one_layer`)."""
    wrong, names = [], top_level_names()
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        here = layer_of(module)
        if here is not None and here not in ranks:
            continue
        for target in imported(tree, module, is_package):
            there = layer_of(target)
            where = f"{path.relative_to(ROOT)} imports {target}"
            if here is None:
                wrong.append(f"{where}: the package root imports nothing of llmcli")
            elif there is None:
                continue  # the root (`__version__`) imports nothing, so it is below every layer
            elif there not in names:
                wrong.append(f"{where}: llmcli has no {there}")
            elif there not in ranks:
                wrong.append(f"{where}: {there} is on no layer of docs/layout.md")
            elif ranks[there] > ranks[here]:
                wrong.append(f"{where}: {there} is above {here}")
    return wrong


def test_every_subpackage_and_top_level_module_is_on_one_layer() -> None:
    ranks = layer_order()
    names = top_level_names()
    assert {"cli", "model", "errors"} <= names  # the walk sees the package
    assert sorted(names - set(ranks)) == [], "missing from docs/layout.md's order"
    assert sorted(set(ranks) - names) == [], "in docs/layout.md's order, but not in llmcli"


def test_no_module_imports_a_layer_above_its_own() -> None:
    wrong = upward_imports(layer_order())
    assert not wrong, "\n".join(wrong)


def test_every_import_counts_lazy_and_type_checking_ones_too() -> None:
    """The walk sees an import wherever it sits, and resolves relative ones."""
    source = """
from typing import TYPE_CHECKING
import llmcli.errors
from llmcli import __version__, cli
from . import rules
from ..model import gpt
if TYPE_CHECKING:
    from llmcli.serve.app import build_app
def late():
    import llmcli.hf.export
"""
    found = imported(ast.parse(source), "llmcli.config.sections", is_package=False)
    assert sorted(found) == [
        "llmcli",
        "llmcli.cli",
        "llmcli.config.rules",
        "llmcli.errors",
        "llmcli.hf.export",
        "llmcli.model.gpt",
        "llmcli.serve.app",
    ]
    assert layer_of("llmcli.inspection.sae.steer") == "inspection"
    assert layer_of("llmcli.__main__") == "cli" and layer_of("llmcli") is None
