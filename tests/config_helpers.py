"""What the config fuzzers (tests/test_fuzz_config.py) draw and break.

Values of any shape (`values`) and an independent check of a value against a field's type
(`type_ok`); good values of every field of the config classes (`GOOD`, `good_documents`), any of
which together validate; and the rules a config can break (`RULES` for a file, `SET_RULES` for
`--set` lists), each with a way to break it and the pattern of the message that says so.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import math
import re
import string
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from hypothesis import strategies as st

from llmcli.config import LORA_TARGETS, SECTIONS, TRACKERS, LoraConfig

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


# --- values of any shape ---------------------------------------------------------------------

not_null = st.one_of(
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(),  # NaN and infinities included
    st.text(max_size=12),
    st.sampled_from(WORDS),
    st.dates(),
)
scalars = st.none() | not_null
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


def type_ok(hint: Any, value: Any) -> bool | None:
    """An independent check of a YAML value against a field's annotation (None: cannot tell)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        results = [type_ok(arg, value) for arg in typing.get_args(hint)]
        return True if True in results else None if None in results else False
    if origin is Literal:
        return isinstance(value, str) and value in typing.get_args(hint)
    if origin is list:
        if not isinstance(value, list):
            return False
        results = [type_ok(typing.get_args(hint)[0], item) for item in value]
        return False if False in results else None if None in results else True
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


# --- the rule fuzzers' values: known keys, the right types, in range ------------------------

CONTEXTS = [8, 16, 32, 64]  # every good tokens_per_step is a multiple; a context_keep <= 7 fits
NAMES = st.text(string.ascii_letters + string.digits + "._/-", min_size=1, max_size=12)
WORD = st.text(string.ascii_letters + string.digits + "_", min_size=1, max_size=10)
POSITIVE = st.integers(1, 10**6)


def reals(lo: float | None = None, hi: float | None = None, **bounds: bool) -> st.SearchStrategy:
    """Finite floats in [lo, hi] (`exclude_min`, `exclude_max`)."""
    return st.floats(lo, hi, allow_nan=False, allow_infinity=False, **bounds)


UNIT = reals(0, 1, exclude_max=True)  # [0, 1)
# Good values of each field whose annotation says too little (`from_hint` does the rest), such
# that any of them together validate, but for what `fix_up` mends.
GOOD: dict[str, dict[str, st.SearchStrategy]] = {
    "model": {
        "n_layer": st.integers(1, 12),
        # Each n_head divides each n_embed, with an even head size, as pos_emb: rope needs.
        "n_head": st.sampled_from([1, 2, 4, 8]),
        "n_embed": st.sampled_from([32, 64, 128]),
        "context_length": st.sampled_from(CONTEXTS),
        "dropout": UNIT | st.just(0),
        "attn_dropout": st.none() | UNIT,
        "rope_base": reals(1, 1e6) | st.integers(1, 10**6),
    },
    "data": {
        "path": NAMES,
        "val_path": st.none() | NAMES,
        "dataset": st.none() | NAMES,
        "split": WORD,
        "val_split": st.none() | WORD,
        "text_column": WORD,
        "tokenizer": st.sampled_from(["char", "bpe", "gpt2"]) | NAMES,
        "vocab_size": st.integers(1, 2**40),
        "tokenizer_sample": st.none()
        | st.integers(1, 2**40)
        | st.sampled_from(["256MB", "1GB", "64 KiB", "1000"]),
        "val_fraction": reals(0, 1, exclude_min=True, exclude_max=True),
        "cache_dir": st.none() | NAMES,
        "format": st.sampled_from(["text", "chat"]),
        "chat_template": st.none() | NAMES,
        "packing": st.booleans(),  # any format: the others ignore it
    },
    "train": {
        "threads": st.none() | st.just("auto") | st.integers(1, 64),
        "batch_size": st.integers(1, 2**31) | st.just("auto"),
        "grad_accum": st.integers(1, 64),
        "tokens_per_step": st.none() | st.integers(1, 1000).map(lambda k: 64 * k),
        "memory_limit": st.none()
        | st.integers(1, 2**50)
        | st.sampled_from(["4GB", "512MiB", "1.5G", "100", "2 kb"]),
        "max_steps": POSITIVE,
        "eval_interval": POSITIVE,
        "eval_steps": POSITIVE,
        "log_interval": POSITIVE,
        # lr >= 1e-4 >= min_lr, and the default min_lr is 1e-4. YAML 1.1 reads 1e-3 as text.
        "lr": reals(1e-4, 1) | st.sampled_from(["1e-3", "3e-4"]),
        "min_lr": reals(0, 1e-4),
        "warmup_steps": st.integers(0, 10**4),
        "weight_decay": reals(0, 10) | st.integers(0, 10),
        "beta1": UNIT,
        "beta2": UNIT,
        "grad_clip": reals(0, 100) | st.integers(0, 10),
        "seed": st.integers(0, 2**63 - 1),
        "out_dir": st.none() | NAMES,
        "muon_lr": reals(1e-4, 1),
        "muon_momentum": UNIT,
        "decay_fraction": reals(0, 1, exclude_min=True),
        "init_from": st.none() | NAMES,
        # dpo needs data.format preference and init_from together: tests/test_config.py's
        "objective": st.just("next_token"),
        "dpo_beta": reals(0, 100, exclude_min=True) | st.integers(1, 10),
        "group_size": st.integers(2, 64),
        "reward": st.sampled_from(
            ["exact", "number", "contains", "rewards.py:score", "r/x.py:f_2"]
        ),
        "reward_timeout": st.none() | reals(1e-3, 1e5) | st.integers(1, 3600),
        "scale_rewards": st.booleans(),
        "grpo_beta": reals(0, 10) | st.integers(0, 3),
        # the objective is next_token: num_iterations stays 1 (tests/test_grpo_loss.py has GRPO's)
        "num_iterations": st.just(1),
        "reward_weights": st.none(),  # GRPO's: tests/test_grpo_loss.py
        "epsilon": reals(0, 1, exclude_min=True, exclude_max=True),
        "epsilon_high": st.none() | reals(0, 2, exclude_min=True),
        # the objective is next_token, which takes none: tests/test_grpo_loss.py has the others
        "loss_type": st.none(),
        # DPO's alone: tests/test_config.py's
        "loss_weights": st.none(),
        "label_smoothing": st.just(0.0),
        # rank at most the smallest n_embed; fix_up gives it an init_from
        "lora": st.none()
        | st.fixed_dictionaries(
            {},
            optional={
                "rank": st.integers(1, 32),
                "alpha": reals(0, 100, exclude_min=True) | st.integers(1, 64),
                "dropout": UNIT,
                "targets": st.lists(st.sampled_from(LORA_TARGETS), min_size=1, unique=True),
            },
        ),
        "logger": st.sampled_from([*TRACKERS, "tensorboard, wandb"])
        | st.lists(st.sampled_from(TRACKERS), max_size=3),
        "wandb_project": st.none() | WORD,
        "wandb_name": st.none() | WORD,
        "save_interval": st.none() | POSITIVE,
        "save_interval_s": st.none() | reals(0.1, 1e5),
        "spike_factor": reals(1, 100, exclude_min=True),
        "spike_margin": reals(0, 100),
        "spike_window": st.integers(1, 1000),
        "spike_skips": st.integers(1, 100),
        "spike_lr_factor": reals(0, 1, exclude_min=True),
        "spike_lr_steps": st.integers(0, 1000),
        "spike_rollbacks": st.integers(0, 10),
    },
    "sample": {
        "max_new_tokens": st.integers(1, 10**6),
        "temperature": reals(0, 100) | st.integers(0, 10),
        "top_k": st.none() | st.integers(1, 10**6),
        "top_p": reals(0, 1, exclude_min=True),
        "seed": st.integers(0, 2**63 - 1),
        "context_keep": st.none() | st.integers(1, min(CONTEXTS) - 1),
    },
}


def from_hint(hint: Any) -> st.SearchStrategy | None:
    """Every value of a bool, a Literal, None or a union of them; None for any other type."""
    if hint is bool:
        return st.booleans()
    if hint is type(None):
        return st.none()
    if typing.get_origin(hint) is Literal:
        return st.sampled_from(typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = [from_hint(arg) for arg in typing.get_args(hint)]
        return None if any(p is None for p in parts) else st.one_of(parts)
    return None


STRATEGIES = {
    section: {
        key: GOOD[section][key] if key in GOOD[section] else from_hint(hint)
        for key, hint in hints.items()
    }
    for section, hints in FIELDS.items()
}


def fix_up(doc: dict) -> dict:
    """Mend the good values that break a rule together: one data source, a dataset to stream;
    a number of tokens per step for batch_size: auto."""
    data, train = doc.get("data"), doc.get("train")
    if isinstance(data, dict) and data.get("dataset") is not None:
        data["path"] = None
    if isinstance(data, dict) and data.get("streaming") and data.get("dataset") is None:
        data["streaming"] = False
    if isinstance(data, dict) and data.get("chat_template") is not None:
        data["format"] = "chat"
    if isinstance(data, dict) and data.get("format") == "chat" and data.get("streaming"):
        data["streaming"] = False
    if isinstance(train, dict) and train.get("lora") is not None and not train.get("init_from"):
        train["init_from"] = "base"
    if isinstance(train, dict) and train.get("batch_size") == "auto":
        train["tokens_per_step"] = train.get("tokens_per_step") or 64 * 4
    return doc


@st.composite
def good_documents(draw: st.DrawFn, keys_per_section: int = 12) -> dict:
    """Sections of known keys with good values; an empty section is {} or null."""
    doc = {}
    for section in draw(st.lists(st.sampled_from(list(SECTIONS)), unique=True)):
        fields = sorted(STRATEGIES[section])
        chosen = draw(st.lists(st.sampled_from(fields), unique=True, max_size=keys_per_section))
        body = {key: draw(STRATEGIES[section][key]) for key in chosen}
        doc[section] = body or draw(st.sampled_from([{}, None]))
    return fix_up(doc)


def printed(section: str, key: str, value: Any) -> Any:
    """What the printed config shows for `value` set on `section.key`: a float field's integer
    or numeric text as a float."""
    hint = FIELDS[section][key]
    if float in (hint, *typing.get_args(hint)) and type(value) in (int, str):
        return float(value)
    if LoraConfig in typing.get_args(hint) and isinstance(value, dict):  # defaults filled in
        floats = {k: float(v) for k, v in value.items() if k in ("alpha", "dropout")}
        return {**dataclasses.asdict(LoraConfig()), **value, **floats}
    return value


def settings_of(doc: dict) -> dict[tuple[str, str], Any]:
    """{(section, key): value} of what a document sets."""
    return {(s, k): v for s, body in doc.items() for k, v in (body or {}).items()}


def assert_prints(resolved: dict, expected: dict[tuple[str, str], Any]) -> None:
    """The printed config `resolved` shows each value set, {(section, key): value}."""
    for (section, key), value in expected.items():
        assert resolved[section][key] == printed(section, key, value), (section, key, value)


# --- the rules, and how to break each --------------------------------------------------------

ALL = "*"  # a break's keys: (section, ALL) for a whole section, (ALL, ALL) the whole document


@dataclass(frozen=True)
class Rule:
    """A rule a config can break, the message that says it is broken, and a way to break it:
    `breaks` sets values in a document (returning it and the keys it set), or `text` is a
    `--set` string that breaks it."""

    name: str
    pattern: str  # matches this rule's message and no other rule's
    breaks: Callable[[st.DrawFn, Any], tuple[Any, set]] | None = None
    text: st.SearchStrategy[str] | None = None


def body(doc: dict, section: Any) -> dict:
    """`doc[section]`, made a mapping when it is absent or null."""
    if not isinstance(doc.get(section), dict):
        doc[section] = {}
    return doc[section]


def setting(section: str, key: str, bad: st.SearchStrategy, rule: str) -> Rule:
    """A range rule: `section.key` set to a value of `bad` breaks it; the message is
    `section.key (value) rule...` (a sample setting's is preceded by its option)."""

    def breaks(draw: st.DrawFn, doc: dict) -> tuple[dict, set]:
        body(doc, section)[key] = draw(bad)
        return doc, {(section, key)}

    option = r"--[\w-]+ / " if section == "sample" else ""
    pattern = rf"^error: {option}{section}\.{key} \(.*\) {re.escape(rule)}"
    return Rule(f"{section}.{key} {rule}", pattern, breaks)


def together(name: str, pattern: str, breaking: st.SearchStrategy[dict]) -> Rule:
    """A rule that the values of `breaking` ({(section, key): value}) break together."""

    def breaks(draw: st.DrawFn, doc: dict) -> tuple[dict, set]:
        drawn = draw(breaking)
        for (section, key), value in drawn.items():
            body(doc, section)[key] = value
        return doc, set(drawn)

    return Rule(name, rf"^error: {pattern}", breaks)


def keyed(**settings: Any) -> dict:
    """{(section, key): value} from `section__key=value`."""
    return {tuple(name.split("__")): value for name, value in settings.items()}


NOT_POSITIVE = reals(hi=0) | st.integers(-(10**9), 0)
NEGATIVE = reals(hi=-1e-9) | st.integers(-(10**9), -1)  # (not -0.0, which is >= 0)
OUT_OF_UNIT = NEGATIVE | reals(lo=1) | st.integers(1, 10**9)  # outside [0, 1)
OUT_OF_OPEN_UNIT = NOT_POSITIVE | reals(lo=1) | st.integers(1, 10**9)  # outside (0, 1)
OUT_OF_HALF_OPEN = NOT_POSITIVE | reals(lo=1, exclude_min=True) | st.integers(2, 10**9)  # (0, 1]
COUNT_NOT_POSITIVE = st.integers(max_value=0)
SEED_OUT = st.integers(max_value=-1) | st.integers(min_value=2**63)

RANGE_RULES = [
    *[
        setting("model", key, COUNT_NOT_POSITIVE, "must be positive")
        for key in ("n_layer", "n_head", "n_embed", "context_length")
    ],
    setting("model", "dropout", OUT_OF_UNIT, "must be in [0, 1)"),
    setting("model", "attn_dropout", OUT_OF_UNIT, "must be in [0, 1), or null"),
    setting("model", "rope_base", NOT_POSITIVE, "must be positive"),
    setting("data", "vocab_size", COUNT_NOT_POSITIVE, "must be positive"),
    setting(
        "data",
        "tokenizer_sample",
        COUNT_NOT_POSITIVE | st.sampled_from(["all", "0MB", "-1GB", "", "1.5.2G", "12 XB"]),
        "must be a positive number of bytes or a size",
    ),
    setting("data", "val_fraction", OUT_OF_OPEN_UNIT, "must be between 0 and 1 (exclusive)"),
    setting("data", "tokenizer", st.just(""), "must be 'char', 'bpe', a tokenizer.json"),
    setting(
        "data",
        "format",
        WORD.filter(lambda w: w not in ("text", "chat", "preference")),
        "must be 'text' (plain text), 'chat'",
    ),
    *[
        setting("train", key, COUNT_NOT_POSITIVE, "must be positive")
        for key in ("batch_size", "grad_accum", "max_steps", "eval_interval", "eval_steps")
    ],
    setting("train", "log_interval", COUNT_NOT_POSITIVE, "must be positive"),
    setting("train", "tokens_per_step", COUNT_NOT_POSITIVE, "must be positive, or null"),
    setting(
        "train",
        "memory_limit",
        COUNT_NOT_POSITIVE | st.sampled_from(["lots", "4 XB", "-1GB", "", "GB", "1.5.2G", "0GB"]),
        "must be a positive number of bytes or a size",
    ),
    setting("train", "lr", NOT_POSITIVE, "must be > 0"),
    setting("train", "muon_lr", NOT_POSITIVE, "must be > 0"),
    setting("train", "dpo_beta", NOT_POSITIVE, "must be > 0"),
    setting("train", "group_size", st.integers(max_value=1), "must be >= 2"),
    setting("train", "grpo_beta", NEGATIVE, "must be >= 0"),
    setting("train", "epsilon", OUT_OF_OPEN_UNIT, "must be in (0, 1)"),
    setting("train", "reward_timeout", NOT_POSITIVE, "must be a number of seconds > 0"),
    setting("train", "muon_momentum", OUT_OF_UNIT, "must be in [0, 1)"),
    setting("train", "min_lr", NEGATIVE, "must be >= 0"),
    setting("train", "warmup_steps", st.integers(max_value=-1), "must be >= 0"),
    setting("train", "weight_decay", NEGATIVE, "must be >= 0"),
    setting("train", "beta1", OUT_OF_UNIT, "must be in [0, 1)"),
    setting("train", "beta2", OUT_OF_UNIT, "must be in [0, 1)"),
    setting("train", "grad_clip", NEGATIVE, "must be >= 0 (0 turns clipping off)"),
    setting("train", "decay_fraction", OUT_OF_HALF_OPEN, "must be in (0, 1]"),
    setting("train", "seed", SEED_OUT, "must be in 0..2**63-1"),
    setting("train", "threads", COUNT_NOT_POSITIVE, "must be a number of CPU threads >= 1"),
    setting("train", "save_interval", COUNT_NOT_POSITIVE, "must be positive, or null to save"),
    setting("train", "save_interval_s", NOT_POSITIVE, "must be positive, or null to save"),
    setting(
        "train", "spike_factor", reals(hi=1) | st.integers(-(10**9), 1), "must be a number > 1"
    ),
    setting("train", "spike_margin", NEGATIVE, "must be a number >= 0"),
    setting("train", "spike_window", COUNT_NOT_POSITIVE, "must be >= 1 (steps)"),
    setting("train", "spike_skips", COUNT_NOT_POSITIVE, "must be >= 1 (skipped steps)"),
    setting("train", "spike_lr_factor", OUT_OF_HALF_OPEN, "must be in (0, 1]"),
    setting("train", "spike_lr_steps", st.integers(max_value=-1), "must be >= 0 (steps)"),
    setting("train", "spike_rollbacks", st.integers(max_value=-1), "must be >= 0 (0: stop"),
    setting("sample", "max_new_tokens", COUNT_NOT_POSITIVE, "must be an integer >= 1"),
    setting("sample", "temperature", NEGATIVE, "must be a number >= 0"),
    setting("sample", "top_k", COUNT_NOT_POSITIVE, "must be an integer >= 1"),
    setting("sample", "top_p", OUT_OF_HALF_OPEN, "must be in (0, 1]"),
    setting("sample", "seed", SEED_OUT, "must be an integer in 0..2**63-1"),
]


@st.composite
def odd_heads(draw: st.DrawFn) -> dict:
    n_head = draw(st.sampled_from([1, 2, 4, 8]))
    head_size = 2 * draw(st.integers(0, 40)) + 1
    return keyed(model__pos_emb="rope", model__n_head=n_head, model__n_embed=n_head * head_size)


@st.composite
def indivisible_heads(draw: st.DrawFn) -> dict:
    n_head = draw(st.integers(2, 64))
    n_embed = n_head * draw(st.integers(0, 64)) + draw(st.integers(1, n_head - 1))
    return keyed(model__n_head=n_head, model__n_embed=n_embed)


@st.composite
def partial_sequences(draw: st.DrawFn) -> dict:
    T = draw(st.sampled_from(CONTEXTS))
    tokens = T * draw(st.integers(0, 1000)) + draw(st.integers(1, T - 1))
    return keyed(model__context_length=T, train__tokens_per_step=tokens)


@st.composite
def rates_rising(draw: st.DrawFn) -> dict:
    lr = draw(reals(1e-6, 1))
    return keyed(train__lr=lr, train__min_lr=draw(reals(lr, 10, exclude_min=True)))


@st.composite
def keeps_outside(draw: st.DrawFn) -> dict:
    T = draw(st.sampled_from(CONTEXTS))
    keep = draw(st.integers(-(10**6), 0) | st.integers(T, 10**6))
    return keyed(model__context_length=T, sample__context_keep=keep)


def unknown_trackers(name: str) -> bool:
    """Whether a train.logger names something other than a tracker."""
    return any(n.strip() not in TRACKERS for n in name.split(",") if n.strip())


CROSS_RULES = [
    together(
        "model.n_embed divisible by model.n_head",
        r"model\.n_embed \(\d+\) must be divisible by model\.n_head",
        indivisible_heads(),
    ),
    together(
        "model.pos_emb: rope needs an even head size",
        r"model\.pos_emb \('rope'\) needs an even head size",
        odd_heads(),
    ),
    together(
        "data.path or data.dataset",
        r"data: give either data\.path",
        st.just(keyed(data__path=None, data__dataset=None)),
    ),
    together(
        "data.path and data.dataset not both",
        r"data: data\.path \(.*\) and data\.dataset \(.*\) are both set",
        st.builds(lambda p, d: keyed(data__path=p, data__dataset=d), NAMES, NAMES),
    ),
    together(
        "data.streaming needs data.dataset",
        r"data\.streaming \(True\) needs data\.dataset",
        NAMES.map(lambda path: keyed(data__streaming=True, data__dataset=None, data__path=path)),
    ),
    together(
        "data.chat_template needs data.format: chat",
        r"data\.chat_template \(.*\) is read only with data\.format: chat",
        NAMES.map(lambda name: keyed(data__chat_template=name, data__format="text")),
    ),
    together(
        "data.streaming is for plain text",
        r"data\.streaming \(True\) is for plain text",
        NAMES.map(
            lambda name: keyed(
                data__streaming=True, data__dataset=name, data__path=None, data__format="chat"
            )
        ),
    ),
    together(
        "train.batch_size: auto needs train.tokens_per_step",
        r"train\.batch_size \('auto'\) needs train\.tokens_per_step",
        st.just(keyed(train__batch_size="auto", train__tokens_per_step=None)),
    ),
    together(
        "train.min_lr <= train.lr",
        r"train\.min_lr \(.*\) must be <= train\.lr",
        rates_rising(),
    ),
    together(
        "train.tokens_per_step a multiple of model.context_length",
        r"train\.tokens_per_step \(\d+\) must be a multiple of model\.context_length",
        partial_sequences(),
    ),
    together(
        "sample.context_keep within model.context_length",
        r"--context-keep / sample\.context_keep \(-?\d+\) must be in 1\.\.",
        keeps_outside(),
    ),
    together(
        "train.logger names trackers",
        r"train\.logger \(.*\): .* is not a tracker",
        (st.sampled_from(["mlflow", "tensorboard,comet", "wandb, x", "None"]) | WORD)
        .filter(unknown_trackers)
        .map(lambda name: keyed(train__logger=name)),
    ),
]


def _unknown_section(draw: st.DrawFn, doc: dict) -> tuple[dict, set]:
    name = draw(
        (WORD | st.integers() | st.booleans() | st.none()).filter(lambda n: n not in SECTIONS)
    )
    doc[name] = draw(st.sampled_from([{}, None, {"n_layer": 2}]))
    return doc, {(name, ALL)}


def _unknown_key(draw: st.DrawFn, doc: dict) -> tuple[dict, set]:
    section = draw(st.sampled_from(list(SECTIONS)))
    key = draw(
        (st.sampled_from(ALL_KEYS) | WORD | st.integers()).filter(
            lambda k: k not in FIELDS[section]
        )
    )
    body(doc, section)[key] = draw(st.integers(0, 9))
    return doc, {(section, key)}


# Values of every YAML type, each with one of its values: `wrong_type` draws, for a key, from
# those whose example `type_ok` refuses (so that few draws are of the right type after all).
SCALAR_PROBES = [
    (None, st.none()),
    (True, st.booleans()),
    (7, st.integers() | st.integers(2**1100, 2**1200)),  # (beyond a float's range too)
    (0.5, st.floats()),
    (math.nan, st.sampled_from([math.nan, math.inf, -math.inf])),
    ("word", st.text(max_size=12) | st.sampled_from(WORDS)),
    (datetime.date(2024, 1, 1), st.dates()),
]
PROBES = SCALAR_PROBES + [
    ([1], st.lists(values, max_size=3)),
    ({"a": 1}, st.dictionaries(keys, values, max_size=3)),
]


def wrong_type(probes: list[tuple[Any, st.SearchStrategy]]) -> Rule:
    """A value not of its key's type (`type_ok`), from one of `probes`, is refused."""
    wrong = {
        (section, key): st.one_of([p for sample, p in probes if type_ok(hint, sample) is False])
        for section, hints in FIELDS.items()
        for key, hint in hints.items()
    }

    def breaks(draw: st.DrawFn, doc: dict) -> tuple[dict, set]:
        section, key = draw(st.sampled_from(sorted(wrong)))
        hint = FIELDS[section][key]
        body(doc, section)[key] = draw(wrong[section, key].filter(lambda v: not type_ok(hint, v)))
        return doc, {(section, key)}

    pattern = r"^error: (model|data|train|sample)\.\w+ must be .*, got "
    return Rule("a value of its key's type", pattern, breaks)


NOT_MAPPINGS = not_null | st.lists(values, max_size=3)


def _section_not_a_mapping(draw: st.DrawFn, doc: dict) -> tuple[dict, set]:
    section = draw(st.sampled_from(list(SECTIONS)))
    doc[section] = draw(NOT_MAPPINGS)
    return doc, {(section, ALL)}


def _document_not_a_mapping(draw: st.DrawFn, doc: dict) -> tuple[Any, set]:
    return draw(NOT_MAPPINGS), {(ALL, ALL)}


UNKNOWN_KEY = Rule("a known key", r"^error: unknown key '", _unknown_key)
LOADER_RULES = [
    Rule("a known section", r"^error: unknown config section ", _unknown_section),
    UNKNOWN_KEY,
    wrong_type(PROBES),
    Rule(
        "a section is a mapping",
        r"^error: config section '\w+' must be a mapping",
        _section_not_a_mapping,
    ),
    Rule("a document is a mapping", r"^error: a config must be a mapping", _document_not_a_mapping),
]
RULES = RANGE_RULES + CROSS_RULES + LOADER_RULES


def clash(a: set, b: set) -> bool:
    """Whether two breaks set the same key (a whole section or document counts as all)."""
    return any(
        ALL in (s1, s2) or (s1 == s2 and (k1 == k2 or ALL in (k1, k2)))
        for s1, k1 in a
        for s2, k2 in b
    )


def carry(keys: set, source: Any, target: Any) -> Any:
    """`target` with what a break set in `source` (at `keys`) copied into it."""
    for section, key in keys:
        if section == ALL:
            return copy.deepcopy(source)
        if key == ALL:
            target[section] = copy.deepcopy(source[section])
        else:
            body(target, section)[key] = copy.deepcopy(source[section][key])
    return target


def break_together(rules: list[Rule], draw: st.DrawFn, doc: dict) -> tuple[Any, list[str]]:
    """`doc` with each of `rules` broken that sets no key an earlier one set, and their names."""
    every, touched, applied = copy.deepcopy(doc), set(), []
    for rule in rules:
        broken, set_keys = rule.breaks(draw, copy.deepcopy(doc))
        if not clash(set_keys, touched):
            every, touched = carry(set_keys, broken, every), touched | set_keys
            applied.append(rule.name)
    return every, applied


# --- --set ---------------------------------------------------------------------------------------

SET_BASE = {"model": {"n_layer": 2, "n_head": 2, "n_embed": 32}}  # the file the --sets apply to
KNOWN = st.sampled_from([(s, k) for s, hints in FIELDS.items() for k in hints])
NOT_YAML = ["'open", "[", "{a: ", "*x", "!!python/name:os.system", "%TAG", "[" * 600, '"q']
NOT_YAML += ["a: b: c", ": :", "{", "]", "!!binary x", "@x", "`x"]


def render(value: Any) -> str:
    """`value` as the text of a `--set` that YAML reads back as `value`."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6)
    return text.removesuffix("\n...\n").removesuffix("\n")


def is_scalar(value: Any) -> bool:
    """Whether `--set` can set `value` (not a list or mapping)."""
    return not isinstance(value, (list, dict))


def set_texts(settings: dict[tuple[str, str], Any]) -> list[str]:
    """`--set`s of {(section, key): value}."""
    return [f"{section}.{key}={render(value)}" for (section, key), value in settings.items()]


SYNTAX_RULES = [
    Rule(
        "--set section.key=value",
        r"^error: --set .*: expected section\.key=value",
        text=st.text(string.ascii_letters + string.digits + "._ -:", max_size=20),
    ),
    Rule(
        "--set a key of two parts",
        r"^error: --set .*: the key must be section\.key",
        text=st.builds(
            "{}={}".format,
            st.sampled_from(["model", ".n_layer", "model.", "train.lora.rank.x", "", " "]),
            WORD,
        ),
    ),
    Rule(
        "--set into a mapping only",
        r"^error: --set .*: 'model\.n_layer' is not a mapping with keys of its own",
        text=st.builds("model.n_layer.{}={}".format, WORD, WORD),
    ),
    Rule(
        "--set a known section",
        r"^error: --set .*: unknown section",
        text=st.builds("{}.n_layer={}".format, WORD.filter(lambda w: w not in SECTIONS), WORD),
    ),
    Rule(
        "--set a single scalar",
        r"^error: --set .*: the value must be a single scalar",
        text=st.builds(
            lambda sk, v: f"{sk[0]}.{sk[1]}={v}",
            KNOWN,
            st.sampled_from(["[1, 2]", "{a: 1}", "- 1", "a: b", "[]", "{}", "? k"]),
        ),
    ),
    Rule(
        "--set a YAML scalar",
        r"^error: --set .*: the value is not a YAML scalar",
        text=st.builds(lambda sk, v: f"{sk[0]}.{sk[1]}={v}", KNOWN, st.sampled_from(NOT_YAML)),
    ),
]
SET_RULES = RANGE_RULES + CROSS_RULES + [UNKNOWN_KEY, wrong_type(SCALAR_PROBES)] + SYNTAX_RULES


def broken_sets(rule: Rule, draw: st.DrawFn, doc: dict) -> tuple[list[str], set]:
    """The `--set`s that break `rule` on top of `doc`'s, and the keys they set."""
    if rule.text is not None:
        return [draw(rule.text)], {("--set", rule.name)}
    broken, set_keys = rule.breaks(draw, copy.deepcopy(doc))
    return set_texts({(s, k): broken[s][k] for s, k in sorted(set_keys, key=str)}), set_keys


def sets_together(rules: list[Rule], draw: st.DrawFn, doc: dict) -> tuple[list[str], list[str]]:
    """`--set`s breaking each of `rules` that sets no key an earlier one set, and their names."""
    texts, touched, applied = [], set(), []
    for rule in rules:
        bad, set_keys = broken_sets(rule, draw, doc)
        if not clash(set_keys, touched):
            texts, touched = texts + bad, touched | set_keys
            applied.append(rule.name)
    return texts, applied


@st.composite
def good_set_lists(draw: st.DrawFn, keys_per_section: int = 12) -> tuple[list[str], dict]:
    """`--set`s of good values in any order, some keys set twice (the last wins), and the
    values they leave."""
    doc = draw(good_documents(keys_per_section))
    left = {sk: v for sk, v in settings_of(doc).items() if is_scalar(v)}
    texts = draw(st.permutations(set_texts(left)))
    twice = draw(st.lists(st.sampled_from(sorted(left)), max_size=3)) if left else []
    for section, key in twice:
        earlier = draw(STRATEGIES[section][key])
        if is_scalar(earlier):
            texts.insert(0, f"{section}.{key}={render(earlier)}")
    return texts, left
