"""Config fuzzing: random YAML documents and `--set` lists either validate or fail with exit
status 2 and a message naming what is wrong, never a traceback.

Each runs `llmcli config` in-process (`llmcli.cli.main`). Two kinds of fuzzer:

- The rule fuzzers draw documents, and `--set` lists, of known keys (the config classes'
  fields) with values of the right type and in range (tests/config_helpers.py's `GOOD`): each
  must validate and print exactly what it set. Then they break each rule in turn (`RULES`,
  `SET_RULES`: every range and cross-field rule of the sections, every way the loader refuses a
  file, every way a `--set` is malformed) with a value out of range or of the wrong type: each
  broken document must fail with that rule's message, and several breaks together with one of
  theirs. They count the rules reached, and print the counts (`pytest -s`).
- The shape fuzzers draw anything: documents of random nesting whose keys come from the schema
  and from anywhere else, whose values take every YAML type (null, booleans, huge integers, NaN
  and infinities, text, dates, lists, mappings); raw text and bytes as the file; arbitrary
  `--set` strings. Where a simple independent check sees that one must fail, it must, naming
  the section at fault.

All are derandomized, as test_fuzz_readers.py's: every run, CI's included, tries the same
examples. A handful of the nastiest shapes also run as real processes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import math
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from config_helpers import (
    ALL_KEYS,
    FIELDS,
    GOOD,
    NOT_YAML,
    RULES,
    SET_BASE,
    SET_RULES,
    STRATEGIES,
    WORDS,
    Rule,
    assert_prints,
    body,
    break_together,
    broken_sets,
    good_documents,
    good_set_lists,
    keys,
    printed,
    sets_together,
    settings_of,
    type_ok,
    values,
)
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from llmcli.cli import main
from llmcli.config import SECTIONS, config_from_dict

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

# Derandomized: every run, CI's included, tries the same examples, so a failure is reproducible
# rather than luck; set derandomize=False locally to explore new ones.
FUZZ = settings(
    max_examples=100,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
# The rule fuzzers' second half: each example breaks every rule, one at a time (about 60 runs),
# so it is not shrunk (minutes): a failure names the rule and the document that broke it.
RULE_FUZZ = settings(
    FUZZ,
    max_examples=8,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def run_config(path: Path, *overrides: str) -> tuple[int, str, str]:
    """`llmcli config PATH --set ...` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    args = ["config", str(path), *[a for o in overrides for a in ("--set", o)]]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as exc:
            return exc.code, out.getvalue(), err.getvalue()
    raise AssertionError("main() returned without exiting")


def check_outcome(code: int, out: str, err: str) -> dict | None:
    """Exit 0 with a config that validates again, or exit 2 with one `error:` message."""
    assert "Traceback" not in out + err
    assert code in (0, 2), (code, err)
    if code == 2:
        assert err.startswith("error: ") and len(err.strip()) > len("error: ") + 10, err
        assert out == ""
        return None
    resolved = yaml.safe_load(out)
    assert config_from_dict(resolved).to_dict() == resolved  # what it prints is a valid config
    return resolved


@pytest.fixture(autouse=True, scope="module")
def command_built_once():
    """Typer rebuilds the click command from the annotations on every call (~50 ms, most of a
    `config` run); build it once so hundreds of examples stay fast. Parsing, the command and the
    exit-status mapping in `main` are what they always are."""
    import functools

    import typer.main

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(typer.main, "get_command", functools.cache(typer.main.get_command))
        yield


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def write_doc(folder: Path, doc: Any, name: str = "doc.yaml") -> Path:
    """`doc` as YAML in `folder / name`, written over the old file and cut after, not emptied
    first: ext4 flushes a file emptied and rewritten as it is closed (~2 ms, most of a run)."""
    path = folder / name
    text = yaml.safe_dump(doc, allow_unicode=True, sort_keys=False).encode("utf-8")
    with open(path, "r+b" if path.exists() else "wb") as file:
        file.write(text)
        file.truncate()
    return path


def rule_of(rules: list[Rule], outcome: tuple[int, str, str]) -> str:
    """The one rule of `rules` whose message a failed run printed ("(validated)": none)."""
    check_outcome(*outcome)
    code, _, err = outcome
    if code == 0:
        return "(validated)"
    names = [rule.name for rule in rules if re.search(rule.pattern, err)]
    assert len(names) == 1, (names, err)
    return names[0]


def report(title: str, counts: Counter) -> None:
    """Print the counts (pytest -s shows them)."""
    print(f"\n{title}")
    for name, count in sorted(counts.items()):
        print(f"  {count:5d}  {name}")


def test_every_field_has_good_values() -> None:
    missing = [
        (s, k) for s, strategies in STRATEGIES.items() for k, v in strategies.items() if v is None
    ]
    assert not missing, f"add good values to GOOD for {missing}"
    stale = [(s, k) for s, good in GOOD.items() for k in good if k not in FIELDS[s]]
    assert not stale, f"GOOD has values for keys the config no longer has: {stale}"
    for rules in (RULES, SET_RULES):
        assert len({rule.name for rule in rules}) == len(rules)


def test_good_documents_validate_and_print_what_they_set(folder: Path) -> None:
    counts: Counter[str] = Counter()

    @FUZZ
    @given(doc=good_documents())
    def check(doc: dict) -> None:
        resolved = check_outcome(*run_config(write_doc(folder, doc)))
        assert resolved is not None, doc
        assert_prints(resolved, settings_of(doc))
        counts["documents that validated"] += 1
        counts["values they set"] += len(settings_of(doc))
        counts["of them setting 5+ values"] += len(settings_of(doc)) >= 5

    check()
    report("good documents", counts)
    assert counts["documents that validated"] >= 0.9 * FUZZ.max_examples
    assert counts["of them setting 5+ values"] >= 0.5 * counts["documents that validated"]


def test_documents_breaking_each_rule_fail_with_its_message(folder: Path) -> None:
    alone: Counter[str] = Counter()
    together_: Counter[str] = Counter()

    @RULE_FUZZ
    @given(doc=good_documents(keys_per_section=6), data=st.data())
    def check(doc: dict, data: st.DataObject) -> None:
        assert check_outcome(*run_config(write_doc(folder, doc))) is not None, doc
        for rule in RULES:
            broken, _ = rule.breaks(data.draw, copy.deepcopy(doc))
            assert rule_of(RULES, run_config(write_doc(folder, broken))) == rule.name, broken
            alone[rule.name] += 1
        rules = data.draw(
            st.lists(st.sampled_from(RULES), min_size=2, max_size=6, unique_by=lambda r: r.name)
        )
        every, applied = break_together(rules, data.draw, doc)
        fired = rule_of(RULES, run_config(write_doc(folder, every)))
        assert fired in applied, (applied, every)
        together_[f"{fired} (of {len(applied)})"] += 1

    check()
    report("documents breaking one rule: the rule reached", alone)
    report("documents breaking several: the rule reported (of how many broken)", together_)
    assert all(alone[rule.name] >= 0.9 * RULE_FUZZ.max_examples for rule in RULES)
    assert sum(together_.values()) >= 0.9 * RULE_FUZZ.max_examples


# --- the shape fuzzers: documents --------------------------------------------------------------


@st.composite
def section_bodies(draw: st.DrawFn, section: Any) -> Any:
    if draw(st.integers(0, 9)) == 0 or section not in FIELDS:
        return draw(values)
    schema_keys = st.sampled_from(sorted(FIELDS[section]))
    return draw(st.dictionaries(st.one_of(schema_keys, schema_keys, keys), values, max_size=5))


@st.composite
def documents(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 9)) == 0:
        return draw(values)  # not a mapping of sections at all, sometimes
    names = draw(
        st.lists(
            st.one_of(st.sampled_from(list(SECTIONS)), keys),
            max_size=5,
            unique_by=lambda k: (type(k), k),
        )
    )
    return {name: draw(section_bodies(name)) for name in names}


def must_fail(doc: Any) -> set[str]:
    """Why `doc` cannot validate, where a simple check sees it: the sections at fault (one of them
    is to be named), {"mapping"} for a document that is not a mapping; empty when it cannot tell.
    """
    if not isinstance(doc, dict):
        return {"mapping"}
    unknown = {str(name) for name in doc if name not in SECTIONS}
    if unknown:
        return unknown
    bad = set()
    for name, section_values in doc.items():
        if section_values is None:
            continue
        if not isinstance(section_values, dict) or any(
            key not in FIELDS[name] or type_ok(FIELDS[name][key], value) is False
            for key, value in section_values.items()
        ):
            bad.add(name)
    return bad


@FUZZ
@given(doc=documents())
@example(doc={"\x85": None})  # a section name that YAML does not read back as written
def test_random_documents_validate_or_exit_2_with_a_message(folder: Path, doc: Any) -> None:
    path = write_doc(folder, doc)
    # What the file holds as YAML reads it back: a round trip is not exact for every string
    # (a NEL character, U+0085, is a line break in YAML, so the name '\x85' comes back as ' ').
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    code, out, err = run_config(path)
    resolved = check_outcome(code, out, err)
    reasons = must_fail(doc)
    if reasons:
        assert code == 2, f"{doc!r} validated"
        if reasons != {"mapping"}:
            assert any(name in err for name in reasons), err
    if resolved is not None:  # every value the document set is in the printed config
        for section, section_values in (doc or {}).items():
            for key, value in (section_values or {}).items():
                if isinstance(value, float) and math.isnan(value):
                    continue  # (NaN is refused anyway)
                assert resolved[section][key] == printed(section, key, value), (section, key)


@FUZZ
@given(
    content=st.one_of(
        st.text(max_size=200),
        st.binary(max_size=200),
        st.lists(
            st.sampled_from(
                [
                    "model:",
                    "  n_layer: 2",
                    "train:",
                    "- x",
                    "  lr: .inf",
                    "&a [*a]",
                    "{",
                    "]",
                    ": :",
                    "\t",
                    "---",
                    "...",
                    "!!binary x",
                    "? k",
                ]
            ),
            max_size=8,
        ).map("\n".join),
    )
)
def test_random_files_validate_or_exit_2_with_a_message(folder: Path, content: Any) -> None:
    path = folder / "raw.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    code, out, err = run_config(path)
    check_outcome(code, out, err)
    if code == 2:  # the message names the file, or the section / key at fault
        assert str(path) in err or re.search(r"\b(model|data|train|sample)\b|a config must", err)


# --- --set: the rule fuzzer --------------------------------------------------------------------


def test_good_set_lists_validate_and_print_what_they_set(folder: Path) -> None:
    path = write_doc(folder, SET_BASE, "set-base.yaml")
    counts: Counter[str] = Counter()

    @FUZZ
    @given(sets=good_set_lists())
    def check(sets: tuple[list[str], dict]) -> None:
        texts, left = sets
        resolved = check_outcome(*run_config(path, *texts))
        assert resolved is not None, texts
        assert_prints(resolved, {**settings_of(SET_BASE), **left})
        counts["lists that validated"] += 1
        counts["of them with 2+ --sets"] += len(texts) >= 2
        counts["with a key set twice"] += len(texts) > len(left)

    check()
    report("good --set lists", counts)
    assert counts["lists that validated"] >= 0.9 * FUZZ.max_examples
    assert counts["of them with 2+ --sets"] >= 0.6 * counts["lists that validated"]
    assert counts["with a key set twice"] >= 0.2 * counts["lists that validated"]


def test_set_lists_breaking_each_rule_fail_with_its_message(folder: Path) -> None:
    path = write_doc(folder, SET_BASE, "set-base.yaml")
    alone: Counter[str] = Counter()
    together_: Counter[str] = Counter()

    @RULE_FUZZ
    @given(sets=good_set_lists(keys_per_section=6), data=st.data())
    def check(sets: tuple[list[str], dict], data: st.DataObject) -> None:
        texts, left = sets
        assert check_outcome(*run_config(path, *texts)) is not None, texts
        doc: dict = {}
        for (section, key), value in left.items():
            body(doc, section)[key] = value
        for rule in SET_RULES:
            bad, _ = broken_sets(rule, data.draw, doc)
            assert rule_of(SET_RULES, run_config(path, *texts, *bad)) == rule.name, bad
            alone[rule.name] += 1
        rules = data.draw(
            st.lists(st.sampled_from(SET_RULES), min_size=2, max_size=6, unique_by=lambda r: r.name)
        )
        bad, applied = sets_together(rules, data.draw, doc)
        fired = rule_of(SET_RULES, run_config(path, *texts, *bad))
        assert fired in applied, (applied, bad)
        together_[f"{fired} (of {len(applied)})"] += 1

    check()
    report("--set lists breaking one rule: the rule reached", alone)
    report("--set lists breaking several: the rule reported (of how many broken)", together_)
    assert all(alone[rule.name] >= 0.9 * RULE_FUZZ.max_examples for rule in SET_RULES)
    assert sum(together_.values()) >= 0.9 * RULE_FUZZ.max_examples


# --- --set: the shape fuzzer -------------------------------------------------------------------


@st.composite
def overrides(draw: st.DrawFn) -> str:
    """A `--set` string: arbitrary text, or section.key=value with parts from anywhere."""
    if draw(st.integers(0, 4)) == 0:
        return draw(st.text(max_size=30))
    section = draw(st.one_of(st.sampled_from(list(SECTIONS)), st.text(max_size=6)))
    key = draw(st.one_of(st.sampled_from(ALL_KEYS), st.text(max_size=8)))
    raw = draw(
        st.one_of(
            st.text(max_size=15),
            st.sampled_from(
                WORDS
                + NOT_YAML
                + [
                    "",
                    "[1, 2]",
                    "{a: 1}",
                    "&a 1",
                    ".nan",
                    "-.inf",
                    "1e400",
                    "9" * 400,
                    "2024-01-01",
                    "'quoted'",
                    '"q\\u00e9"',
                    "- 1",
                    "a: b",
                    "|",
                ]
            ),
            st.integers().map(str),
            st.floats().map(repr),
        )
    )
    return f"{section}.{key}={raw}"


def expected_value(section: str, key: str, raw: str) -> Any:
    """What `--set section.key=raw` means: the YAML scalar, as a float for a float field."""
    return printed(section, key, yaml.safe_load(raw) if raw.strip() else None)


@FUZZ
@given(sets=st.lists(overrides(), min_size=1, max_size=3))
def test_random_set_strings_validate_or_exit_2_with_a_message(folder: Path, sets: list) -> None:
    path = folder / "base.yaml"
    if not path.exists():
        write_doc(folder, SET_BASE, "base.yaml")
    code, out, err = run_config(path, *sets)
    resolved = check_outcome(code, out, err)
    if resolved is None:
        return
    # Every --set was well-formed, and the last one of each key is in the printed config.
    last: dict[tuple[str, str], str] = {}
    for text in sets:
        dotted, equals, raw = text.partition("=")
        section, key = dotted.strip().split(".")
        assert equals and section in SECTIONS and key in FIELDS[section], text
        last[(section, key)] = raw
    for (section, key), raw in last.items():
        assert resolved[section][key] == expected_value(section, key, raw), (section, key, raw)


def test_field_defaults_are_in_the_printed_config(folder: Path) -> None:
    # The fuzzers compare printed values with the ones set: the printed config must hold every
    # field of every section, with its default when unset.
    path = folder / "empty-sections.yaml"
    path.write_text("model:\ntrain:\n", encoding="utf-8")
    code, out, err = run_config(path)
    resolved = check_outcome(code, out, err)
    for name, cls in SECTIONS.items():
        defaults = {f.name: getattr(cls(), f.name) for f in dataclasses.fields(cls)}
        assert resolved[name] == defaults


# --- real processes --------------------------------------------------------------------------

NASTY = [
    pytest.param(b"\x00\x01\x02\xff" * 64, (), id="binary"),
    pytest.param(b"model: " + b"[" * 800 + b"\n", (), id="deep-unclosed"),
    pytest.param(b"a: &a [*a]\n", (), id="self-alias"),
    pytest.param(b"model: {n_layer: 2}\n", ("model.n_layer=" + "{" * 900,), id="set-deep"),
    pytest.param(b"model: {n_layer: 2}\n", ("train.lr=\udcff",), id="set-undecodable"),
]


@pytest.mark.parametrize(("content", "sets"), NASTY)
def test_real_processes_exit_2_with_a_message(
    tmp_path: Path, content: bytes, sets: tuple[str, ...]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    args = [sys.executable, "-m", "llmcli", "config", str(path)]
    args += [a for s in sets for a in ("--set", s.encode("utf-8", "surrogateescape"))]
    out = subprocess.run(
        args,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        timeout=60,
    )
    stderr = out.stderr.decode("utf-8", "replace")
    assert out.returncode == 2, stderr
    assert stderr.startswith("error: ") and b"Traceback" not in out.stdout + out.stderr
