"""Config fuzzing: random YAML documents and random `--set` strings either validate or
fail with exit status 2 and a message, never a traceback.

Hypothesis draws documents of random nesting whose keys come from the schema and from anywhere
else, and whose values take every YAML type (null, booleans, huge integers, NaN and infinities,
text, dates, lists, mappings); also raw text and raw bytes as the file, and `--set` strings both
well-formed and arbitrary. Each runs `llmcli config` in-process (`llmcli.cli.main`). Beyond "exit
0 or 2": documents that break a rule a simple independent check can see (an unknown section or
key, a value of the wrong YAML type) must fail and name the section; documents drawn only from
valid values must succeed and print exactly those values; a successful `--set` must land in the
printed config. A handful of the nastiest shapes also run as real processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import os
import re
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmcli.cli import main
from llmcli.config import SECTIONS, config_from_dict

ROOT = Path(__file__).resolve().parents[1]
FIELDS: dict[str, dict[str, Any]] = {
    name: typing.get_type_hints(cls) for name, cls in SECTIONS.items()
}
ALL_KEYS = sorted({key for hints in FIELDS.values() for key in hints})
WORDS = [
    "char",
    "bpe",
    "auto",
    "cpu",
    "cuda",
    "float32",
    "rope",
    "learned",
    "rmsnorm",
    "adamw",
    "wsd",
    "1e-3",
    "data/x.txt",
    "~",
    "null",
    "yes",
    "0x10",
    "1_000",
]
pytestmark = pytest.mark.slow

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


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


# --- strategies ------------------------------------------------------------------------------

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(),  # NaN and infinities included
    st.text(max_size=12),
    st.sampled_from(WORDS),
    st.dates(),
)
keys = st.one_of(
    st.sampled_from(ALL_KEYS),
    st.sampled_from(list(SECTIONS)),
    st.text(max_size=8),
    st.integers(),
    st.booleans(),
    st.none(),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=8,
)


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


def type_ok(hint: Any, value: Any) -> bool | None:
    """An independent check of a YAML value against a field's annotation (None: cannot tell)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        results = [type_ok(arg, value) for arg in typing.get_args(hint)]
        return True if True in results else None if None in results else False
    if origin is Literal:
        return isinstance(value, str) and value in typing.get_args(hint)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        if isinstance(value, str):
            return None  # "1e-3" is a number to the loader (YAML 1.1 reads it as text)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return False
        try:
            return math.isfinite(value)
        except OverflowError:  # an integer beyond any float
            return False
    if hint is str:
        return isinstance(value, str)
    return None


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
    for name, body in doc.items():
        if body is None:
            continue
        if not isinstance(body, dict) or any(
            key not in FIELDS[name] or type_ok(FIELDS[name][key], value) is False
            for key, value in body.items()
        ):
            bad.add(name)
    return bad


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


# --- documents -------------------------------------------------------------------------------


@FUZZ
@given(doc=documents())
@example(doc={"\x85": None})  # a section name that YAML does not read back as written
def test_random_documents_validate_or_exit_2_with_a_message(folder: Path, doc: Any) -> None:
    path = folder / "doc.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True, sort_keys=False), encoding="utf-8")
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
        for section, body in (doc or {}).items():
            for key, value in (body or {}).items():
                expected = float(value) if FIELDS[section][key] is float else value
                if isinstance(value, float) and math.isnan(value):
                    continue  # (NaN is refused anyway)
                assert resolved[section][key] == expected, (section, key)


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


VALID = {
    "model": {
        "n_layer": st.integers(1, 12),
        "n_head": st.sampled_from([1, 2, 4, 8]),
        "dropout": st.floats(0, 0.99),
        "bias": st.booleans(),
        "pos_emb": st.sampled_from(["learned", "rope"]),
        "norm": st.sampled_from(["layernorm", "rmsnorm"]),
        "qk_norm": st.booleans(),
    },
    "data": {
        "tokenizer": st.sampled_from(["char", "bpe", "tok.json"]),
        "vocab_size": st.integers(1, 2**40),
        "val_fraction": st.floats(0.001, 0.999),
        "cache_dir": st.none() | st.text(min_size=1, max_size=10),
    },
    "train": {
        "batch_size": st.integers(1, 2**31),
        "grad_accum": st.integers(1, 64),
        "weight_decay": st.floats(0, 10),
        "grad_clip": st.floats(0, 100),
        "seed": st.integers(0, 2**63 - 1),
        "compile": st.booleans(),
        "device": st.sampled_from(["auto", "cpu", "cuda", "mps"]),
    },
    "sample": {
        "max_new_tokens": st.integers(1, 10**9),
        "temperature": st.floats(0, 100),
        "top_k": st.none() | st.integers(1, 10**6),
        "top_p": st.floats(0.01, 1.0),
        "seed": st.integers(0, 2**63 - 1),
    },
}


@FUZZ
@given(
    doc=st.fixed_dictionaries(
        {},
        optional={
            section: st.fixed_dictionaries({}, optional=fields) for section, fields in VALID.items()
        },
    )
)
def test_documents_of_valid_values_validate_and_print_them(folder: Path, doc: dict) -> None:
    path = folder / "valid.yaml"
    path.write_text(yaml.safe_dump(doc), encoding="utf-8")
    code, out, err = run_config(path)
    resolved = check_outcome(code, out, err)
    assert code == 0, err
    for section, body in doc.items():
        for key, value in body.items():
            assert resolved[section][key] == value, (section, key)


# --- --set -----------------------------------------------------------------------------------


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
                + [
                    "",
                    "[1, 2]",
                    "{a: 1}",
                    "!!python/name:os.system",
                    "*x",
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
                    "%TAG",
                    "|",
                    "[" * 600,
                ]
            ),
            st.integers().map(str),
            st.floats().map(repr),
        )
    )
    return f"{section}.{key}={raw}"


def expected_value(section: str, key: str, raw: str) -> Any:
    """What `--set section.key=raw` means: the YAML scalar, as a float for a float field."""
    value = yaml.safe_load(raw) if raw.strip() else None
    return float(value) if FIELDS[section][key] is float else value


@FUZZ
@given(sets=st.lists(overrides(), min_size=1, max_size=3))
def test_random_set_strings_validate_or_exit_2_with_a_message(folder: Path, sets: list) -> None:
    path = folder / "base.yaml"
    if not path.exists():
        path.write_text("model: {n_layer: 2, n_head: 2, n_embed: 32}\n", encoding="utf-8")
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
