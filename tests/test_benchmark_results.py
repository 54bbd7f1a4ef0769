"""benchmarks/RESULTS.md is what benchmarks/results.py makes from benchmarks/results/*.json.

The page's figures come from the JSON the benchmarks printed, so these check that the page is
up to date with the row files, that every number a figure asks for is in its row's output, that
every benchmark script has a row, and that every link resolves, anchors included, as MkDocs
(Python-Markdown's toc extension) renders the archive's headings.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
_spec = importlib.util.spec_from_file_location("benchmark_results", BENCHMARKS / "results.py")
results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results)

ROWS = results.load_rows()
PAGE = (BENCHMARKS / "RESULTS.md").read_text(encoding="utf-8")
ARCHIVE = BENCHMARKS / results.ARCHIVE
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_page_is_what_results_py_makes() -> None:
    assert PAGE == results.page(), "run `python benchmarks/results.py --write`"
    assert results.main(["--check"]) == 0


@pytest.mark.parametrize("name", sorted(ROWS))
def test_every_placeholder_is_in_the_rows_output(name: str) -> None:
    row = ROWS[name]
    paths = results.placeholders(row["figure"])
    if row["output"] is None:
        assert not paths, f"{name}: placeholders {paths} but no output"
    else:
        assert paths, f"{name}: has an output, so its figure should be filled from it"
    for path in paths:
        results.lookup(row["output"], path)  # KeyError names the missing path
    results.fill(name, row)


def test_every_benchmark_script_has_a_row() -> None:
    scripts = {path.name for path in BENCHMARKS.glob("*.py")}
    with_rows = {row["benchmark"] for row in ROWS.values()}
    assert scripts - set(results.HELPERS) - with_rows == set()
    assert set(results.HELPERS) <= scripts, "a helper named in results.py is gone"
    for name, row in ROWS.items():
        if row["benchmark"].endswith(".py"):
            assert (BENCHMARKS / row["benchmark"]).is_file(), name


def test_rows_name_their_target_verdict_and_machine() -> None:
    for name, row in ROWS.items():
        assert row["met"] is not None or row["target"] is None, f"{name}: target without met"
        if row["date"] is not None:
            assert row["machine"], f"{name}: a measurement without its machine"


def test_every_link_and_archive_anchor_resolves() -> None:
    markdown = pytest.importorskip("markdown")
    rendered = markdown.Markdown(extensions=["toc", "tables", "fenced_code"])
    rendered.convert(ARCHIVE.read_text(encoding="utf-8"))

    def ids(tokens: list[dict]) -> set[str]:
        return {t["id"] for t in tokens} | {i for t in tokens for i in ids(t["children"])}

    anchors = ids(rendered.toc_tokens)
    ours = {anchor for _, anchor in results.archive_anchors(ARCHIVE.read_text(encoding="utf-8"))}
    assert ours == anchors, "results.archive_anchors disagrees with Python-Markdown's toc"
    links = LINK.findall(PAGE)
    assert links
    for link in links:
        target, _, anchor = link.partition("#")
        assert not re.match(r"[a-z]+:|/", target), f"{link}: not relative"
        assert (BENCHMARKS / target).is_file(), link
        if anchor:
            assert target == results.ARCHIVE and anchor in anchors, link


def test_record_writes_a_row_from_a_benchmarks_json(tmp_path: Path) -> None:
    output = results.read_output('{"a": 1}\n{"a": 2.5, "b": {"1.88": 3}}\n')
    assert output == [{"a": 1}, {"a": 2.5, "b": {"1.88": 3}}]
    given = {"figure": "{1.a:.2f} and {1.b[1.88]}", "command": "python x.py", "machine": "idle"}
    row = results.record("x", output, given, folder=tmp_path)
    assert results.fill("x", row) == "2.50 and 3"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", row["date"])
    newer = [{"a": 0}, {"a": 7, "b": {"1.88": 0}}]
    again = results.record("x", newer, {"machine": "busy"}, folder=tmp_path)
    assert results.fill("x", again) == "7.00 and 0" and again["command"] == "python x.py"
    assert json.loads((tmp_path / "x.json").read_text())["machine"] == "busy"
    with pytest.raises(ValueError, match="numbers come from the output"):
        results.record("x", output, {"figure": "typed by hand", "machine": "idle"}, folder=tmp_path)
    with pytest.raises(ValueError, match=r"\{1.c\} is not in its output"):
        results.record("x", output, {"figure": "{1.c}", "machine": "idle"}, folder=tmp_path)
