"""Typed, validated run configuration.

A config is a YAML file with four sections, `model`, `data`, `train` and `sample`, each a
dataclass below. Every key has a default; unknown keys, wrong types and values that break a rule
are `ConfigError`s whose message names the key, the value and the rule. `--set section.key=value`
overrides are parsed as YAML scalars and validated exactly like the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from llmcli.errors import ConfigError, InputError
from llmcli.fileio import read_user_text


@dataclass
class ModelConfig:
    """The network's shape and architecture options (a GPT-2-style model by default)."""

    n_layer: int = 4
    n_head: int = 4
    n_embed: int = 128
    context_length: int = 64
    dropout: float = 0.0
    bias: bool = True
    # Recipe options (all off by default, so the default model is GPT-2's architecture).
    pos_emb: Literal["learned", "rope"] = "learned"
    rope_base: float = 10000.0
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    qk_norm: bool = False
    mlp: Literal["gelu", "relu2"] = "gelu"
    tie_embeddings: bool = True

    def validate(self) -> None:
        for key in ("n_layer", "n_head", "n_embed", "context_length"):
            _require(getattr(self, key) > 0, "model", key, getattr(self, key), "must be positive")
        if self.n_embed % self.n_head != 0:
            raise ConfigError(
                f"model.n_embed ({self.n_embed}) must be divisible by model.n_head "
                f"({self.n_head}): pick n_head among {_divisors(self.n_embed)} "
                f"or change n_embed."
            )
        _require(0 <= self.dropout < 1, "model", "dropout", self.dropout, "must be in [0, 1)")
        _require(self.rope_base > 0, "model", "rope_base", self.rope_base, "must be positive")
        if self.pos_emb == "rope":
            head_size = self.n_embed // self.n_head
            _require(
                head_size % 2 == 0,
                "model",
                "pos_emb",
                self.pos_emb,
                f"needs an even head size (n_embed / n_head = {head_size})",
            )


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes tokens."""

    path: str | None = "data/shakespeare.txt"
    val_path: str | None = None
    dataset: str | None = None
    split: str = "train"
    val_split: str | None = None
    text_column: str = "text"
    tokenizer: str = "char"
    vocab_size: int = 1024
    val_fraction: float = 0.1
    cache_dir: str | None = None

    def validate(self) -> None:
        if self.path is None and self.dataset is None:
            raise ConfigError(
                "data: give either data.path (a file, folder or glob of text) or data.dataset "
                "(a Hugging Face datasets name or local json/csv/parquet files); both are empty."
            )
        if self.path is not None and self.dataset is not None:
            raise ConfigError(
                f"data: data.path ({self.path!r}) and data.dataset ({self.dataset!r}) are both "
                "set; keep one of them (set the other to null)."
            )
        _require(self.vocab_size > 0, "data", "vocab_size", self.vocab_size, "must be positive")
        _require(
            0 < self.val_fraction < 1,
            "data",
            "val_fraction",
            self.val_fraction,
            "must be between 0 and 1 (exclusive)",
        )
        _require(
            self.tokenizer != "",
            "data",
            "tokenizer",
            self.tokenizer,
            "must be 'char', 'bpe', a tokenizer.json (or a folder holding one) or a Hub name",
        )


@dataclass
class TrainConfig:
    """The optimisation, evaluation and checkpointing schedule."""

    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    batch_size: int = 12
    grad_accum: int = 1
    max_steps: int = 2000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    eval_interval: int = 250
    eval_steps: int = 20
    log_interval: int = 10
    seed: int = 1337
    compile: bool = False
    out_dir: str | None = None
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_fraction: float = 0.2
    init_from: str | None = None
    # Experiment trackers besides metrics.jsonl: none, tensorboard, wandb, or a list of them.
    logger: str | list[str] = "none"
    wandb_project: str | None = None  # default: the config's name
    wandb_name: str | None = None  # default: the run directory's name
    # Resume state also between evaluations, so that a kill loses little work: every
    # `save_interval` steps and/or once `save_interval_s` seconds passed since the last save.
    save_interval: int | None = None
    save_interval_s: float | None = 300.0
    # false: start (a run already there is an error); true: continue the run there; auto:
    # continue it if there is one, else start (one command for a first start and a restart).
    resume: bool | Literal["auto"] = False

    @property
    def loggers(self) -> list[str]:
        """The trackers `logger` names, in order, without "none" and repeats."""
        return list(dict.fromkeys(n for n in self._logger_names() if n != "none"))

    def _logger_names(self) -> list[str]:
        names = self.logger if isinstance(self.logger, list) else self.logger.split(",")
        return [n.strip() for n in names if n.strip()]

    def validate(self) -> None:
        for key in (
            "batch_size",
            "grad_accum",
            "max_steps",
            "eval_interval",
            "eval_steps",
            "log_interval",
        ):
            _require(getattr(self, key) > 0, "train", key, getattr(self, key), "must be positive")
        _require(self.lr > 0, "train", "lr", self.lr, "must be > 0")
        _require(self.muon_lr > 0, "train", "muon_lr", self.muon_lr, "must be > 0")
        _require(
            0 <= self.muon_momentum < 1,
            "train",
            "muon_momentum",
            self.muon_momentum,
            "must be in [0, 1)",
        )
        _require(self.min_lr >= 0, "train", "min_lr", self.min_lr, "must be >= 0")
        if self.min_lr > self.lr:
            raise ConfigError(
                f"train.min_lr ({self.min_lr}) must be <= train.lr ({self.lr}): the schedule "
                "decays from lr down to min_lr."
            )
        _require(self.warmup_steps >= 0, "train", "warmup_steps", self.warmup_steps, "must be >= 0")
        _require(self.weight_decay >= 0, "train", "weight_decay", self.weight_decay, "must be >= 0")
        for key in ("beta1", "beta2"):
            _require(
                0 <= getattr(self, key) < 1, "train", key, getattr(self, key), "must be in [0, 1)"
            )
        _require(
            self.grad_clip >= 0,
            "train",
            "grad_clip",
            self.grad_clip,
            "must be >= 0 (0 turns clipping off)",
        )
        _require(
            0 < self.decay_fraction <= 1,
            "train",
            "decay_fraction",
            self.decay_fraction,
            "must be in (0, 1]",
        )
        _require(
            0 <= self.seed < 2**63,
            "train",
            "seed",
            self.seed,
            "must be in 0..2**63-1 (torch's seed range)",
        )
        for key in ("save_interval", "save_interval_s"):
            value = getattr(self, key)
            _require(
                value is None or value > 0,
                "train",
                key,
                value,
                "must be positive, or null to save only at evaluations",
            )
        self._validate_loggers()

    def _validate_loggers(self) -> None:
        unknown = [n for n in self._logger_names() if n not in TRACKERS]
        if unknown:
            raise ConfigError(
                f"train.logger ({self.logger!r}): {', '.join(map(repr, unknown))} is not a "
                f"tracker; the choices are {', '.join(TRACKERS)}, or a list of them."
            )

    @property
    def warmup(self) -> int:
        """The warmup the schedule uses: `warmup_steps`, cut to the run's length."""
        return min(self.warmup_steps, self.max_steps)

    def short_run_notes(self) -> list[str]:
        """One line per setting a short run (small `max_steps`) changes or skips."""
        notes = []
        if self.warmup_steps > self.max_steps:
            notes.append(
                f"note: train.warmup_steps ({self.warmup_steps}) is longer than the run "
                f"({self.max_steps} steps): the rate warms up over all {self.max_steps} steps "
                "and reaches train.lr only at the last one."
            )
        if self.eval_interval > self.max_steps:
            notes.append(
                f"note: train.eval_interval ({self.eval_interval}) is longer than the run "
                f"({self.max_steps} steps): it evaluates and saves once, at the last step."
            )
        return notes


CONTEXT_POLICIES = ("exact", "shift")
# The experiment trackers train.logger may name (llmcli.runs.trackers runs them).
TRACKERS = ("none", "tensorboard", "wandb")


def keep_range(context_length: int) -> tuple[int, int]:
    """The tokens `shift` may keep when the context is full: 1 to `context_length - 1`.

    A one-token context keeps its one token (then `shift` computes what `exact` does).
    """
    return 1, max(1, context_length - 1)


def default_keep(context_length: int) -> int:
    """The tokens `shift` keeps when `sample.context_keep` is null: half the context."""
    return max(1, context_length // 2)


@dataclass(frozen=True)
class SampleConfig:
    """Generation settings: a run's `sample:` section, with `llmcli sample`'s options applied by
    `dataclasses.replace`; what `llmcli.generation.generate` takes.

    Every setting is checked as the config is made (`dataclasses.replace` makes a new one), so a
    `SampleConfig` holds valid settings; `context_keep` also depends on the model's context and
    is checked against it by `keep_for`. A message names the value, the rule, and both the
    command-line option and the config key that set it.
    """

    max_new_tokens: int = 500
    temperature: float = 0.8
    top_k: int | None = 200
    top_p: float = 1.0
    seed: int = 1337
    # Past model.context_length: "shift" keeps the last context_keep tokens (null:
    # context_length // 2) and goes on with the KV cache; "exact" recomputes the last
    # context_length tokens every step (see llmcli.generation.context_window; why shift: README,
    # Sampling).
    context_policy: Literal["exact", "shift"] = "shift"
    context_keep: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` for a setting outside its range (`context_keep`: `keep_for`)."""
        for key, ok, rule in self._rules():
            if not ok:
                raise _sample_error(key, getattr(self, key), rule)

    def _rules(self) -> list[tuple[str, bool, str]]:
        """(key, whether its value keeps the rule, the rule) for every setting but the seed."""
        t, k, p, keep = self.temperature, self.top_k, self.top_p, self.context_keep
        return [
            (
                "max_new_tokens",
                _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
                "must be an integer >= 1: the most tokens each sample generates",
            ),
            (
                "temperature",
                isinstance(t, (int, float)) and math.isfinite(t) and t >= 0,
                "must be a number >= 0: 0 is greedy decoding, 1 samples from the model's "
                "distribution, higher is more random",
            ),
            (
                "top_k",
                k is None or (_is_int(k) and k >= 1),
                "must be an integer >= 1 (the number of most likely tokens kept); null in a "
                "config, or a value >= the vocabulary size, keeps every token",
            ),
            (
                "top_p",
                isinstance(p, (int, float)) and 0 < p <= 1,
                "must be in (0, 1]: the probability mass of the most likely tokens kept "
                "(nucleus sampling); 1 keeps every token",
            ),
            (
                "context_policy",
                self.context_policy in CONTEXT_POLICIES,
                f"must be one of {', '.join(CONTEXT_POLICIES)}: exact recomputes the last "
                "context_length tokens every step past the context, shift keeps the last tokens "
                "and goes on with the KV cache",
            ),
            (
                "context_keep",
                keep is None or _is_int(keep),
                "must be an integer (the tokens shift keeps when the context is full), or null "
                "for context_length // 2",
            ),
        ]

    def keep_for(self, context_length: int) -> int:
        """The tokens `shift` keeps with a model of `context_length`: `context_keep`, or half the
        context when it is null.

        Raises:
            ConfigError: `context_keep` outside `keep_range(context_length)`.
        """
        if self.context_keep is None:
            return default_keep(context_length)
        low, high = keep_range(context_length)
        if not low <= self.context_keep <= high:
            raise _sample_error(
                "context_keep",
                self.context_keep,
                f"must be in {low}..{high} (1 to model.context_length - 1), or null for "
                "context_length // 2: the tokens shift keeps when the context is full",
            )
        return self.context_keep


def _sample_error(key: str, value: Any, rule: str) -> ConfigError:
    """A broken rule of `sample.<key>`, named as `llmcli sample`'s option and as the key."""
    option = "--" + key.replace("_", "-")
    return ConfigError(f"{option} / sample.{key} ({value!r}) {rule}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class Config:
    """A whole run's configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    # Where the config came from (not a YAML key): its file stem names the default run directory.
    name: str = field(default="run", compare=False, repr=False)

    def validate(self) -> None:
        # `sample` checked itself when it was made; its context_keep depends on the model.
        for section in (self.model, self.data, self.train):
            section.validate()
        self.sample.keep_for(self.model.context_length)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The fully resolved config as plain data (what `config.yaml` in a run holds)."""
        return {section: dataclasses.asdict(getattr(self, section)) for section in SECTIONS}


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "sample": SampleConfig,
}


def _require(ok: bool, section: str, key: str, value: Any, rule: str) -> None:
    if not ok:
        raise ConfigError(f"{section}.{key} ({value!r}) {rule}.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, 64) + 1) if n % d == 0]


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"a list of {_type_name(typing.get_args(tp)[0]).removeprefix('a ')}s"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def _coerce(tp: Any, value: Any) -> tuple[bool, Any]:
    """Check `value` against the annotation `tp`; returns (ok, value converted)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            ok, converted = _coerce(arg, value)
            if ok:
                return True, converted
        return False, value
    if origin is Literal:
        return (type(value) is str and value in typing.get_args(tp)), value
    if origin is list:
        (item,) = typing.get_args(tp)
        if type(value) is not list:
            return False, value
        converted = [_coerce(item, v) for v in value]
        return all(ok for ok, _ in converted), [v for _, v in converted]
    if tp is float:
        return _coerce_float(value)
    if tp in (type(None), bool, int, str):  # exactly that type: True is not an int
        return type(value) is tp, value
    raise TypeError(f"unsupported config annotation {tp!r}")


def _coerce_float(value: Any) -> tuple[bool, Any]:
    """A float setting takes a finite int or float, or a number YAML left as a string."""
    # PyYAML reads `1e-3` (no dot) as a string under YAML 1.1: accept such numbers.
    if type(value) is str and _FLOAT_RE.fullmatch(value.strip()):
        value = float(value)
    if type(value) is int and abs(value) > 2**1023:  # beyond any float: not a number here
        return False, value
    if type(value) in (int, float) and math.isfinite(value):
        return True, float(value)
    return False, value


def _build_section(section: str, raw: Any) -> Any:
    cls = SECTIONS[section]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config section '{section}' must be a mapping of keys to values, "
            f"not {type(raw).__name__} ({_short(raw)})."
        )
    hints = typing.get_type_hints(cls)
    known = [f.name for f in dataclasses.fields(cls)]
    values = {}
    for key, value in raw.items():
        if not isinstance(key, str) or key not in known:
            close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.5)
            hint = f" Did you mean '{section}.{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown key '{section}.{key}'.{hint} Known keys in '{section}': "
                f"{', '.join(known)}."
            )
        ok, converted = _coerce(hints[key], value)
        if not ok:
            raise ConfigError(
                f"{section}.{key} must be {_type_name(hints[key])}, got {_short(value)} "
                f"({type(value).__name__})."
            )
        values[key] = converted
    return cls(**values)


def _short(value: Any, limit: int = 60) -> str:
    # reprlib bounds the work: a YAML alias bomb ("billion laughs") has an exponential repr.
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 60


def config_from_dict(raw: Any, name: str = "run") -> Config:
    """Build and validate a `Config` from parsed YAML (a mapping of sections)."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"a config must be a mapping with the sections {', '.join(SECTIONS)}; "
            f"got {type(raw).__name__} ({_short(raw)})."
        )
    for key in raw:
        if key not in SECTIONS:
            close = difflib.get_close_matches(str(key), list(SECTIONS), n=1, cutoff=0.5)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"unknown config section '{key}'.{hint} The sections are {', '.join(SECTIONS)}."
            )
    config = Config(
        **{section: _build_section(section, raw.get(section)) for section in SECTIONS},
        name=name,
    )
    config.validate()
    return config


def parse_override(text: str) -> tuple[str, str, Any]:
    """Parse one `--set section.key=value` into (section, key, YAML scalar value)."""
    if "=" not in text:
        raise ConfigError(
            f"--set {text!r}: expected section.key=value, for example --set train.max_steps=200."
        )
    dotted, _, raw_value = text.partition("=")
    parts = dotted.strip().split(".")
    if len(parts) != 2 or not all(parts):
        raise ConfigError(
            f"--set {text!r}: the key must be section.key with a section among "
            f"{', '.join(SECTIONS)} (for example model.n_head=8)."
        )
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else None
    except (yaml.YAMLError, RecursionError) as exc:
        problem = (
            getattr(exc, "problem", None)
            or getattr(exc, "reason", None)
            or ("nested too deeply" if isinstance(exc, RecursionError) else "invalid YAML")
        )
        raise ConfigError(
            f"--set {text!r}: the value is not a YAML scalar ({problem}); quote it, for "
            f"example --set '{dotted.strip()}=\"...\"'."
        ) from None
    if isinstance(value, (dict, list)):
        raise ConfigError(
            f"--set {text!r}: the value must be a single scalar (number, string, true/false, "
            "null), not a list or mapping."
        )
    return parts[0], parts[1], value


def read_yaml(path: str | Path) -> Any:
    """Read a YAML config file, turning every way it can be unreadable into a `ConfigError`."""
    p = Path(path)
    try:
        text = read_user_text(p, "config file", kind="YAML")
    except InputError as exc:
        raise ConfigError(str(exc)) from None
    if not text.strip():
        raise ConfigError(
            f"config file {str(p)!r} is empty: write at least one section, for example "
            "'model: {n_layer: 4}', or copy configs/tiny.yaml."
        )
    try:
        raw = yaml.safe_load(text)
    except RecursionError:
        raise ConfigError(
            f"config file {str(p)!r} nests lists or mappings too deeply to read: a config is "
            "four sections of plain key: value pairs."
        ) from None
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(
            f"config file {str(p)!r} is not valid YAML{where}: {problem}. Fix the syntax "
            "(indentation, colons, quotes) there."
        ) from None
    if raw is None:
        raise ConfigError(f"config file {str(p)!r} holds no settings (only comments?).")
    return raw


def apply_overrides(raw: Any, overrides: list[str]) -> Any:
    """Return a copy of the parsed YAML with `--set` overrides applied."""
    if not overrides:
        return raw
    if not isinstance(raw, dict):
        return raw  # config_from_dict reports the shape problem
    merged = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    for text in overrides:
        section, key, value = parse_override(text)
        if section not in SECTIONS:
            close = difflib.get_close_matches(section, list(SECTIONS), n=1, cutoff=0.5)
            hint = f" Did you mean '{close[0]}'?" if close else ""
            raise ConfigError(
                f"--set {text!r}: unknown section '{section}'.{hint} The sections are "
                f"{', '.join(SECTIONS)}."
            )
        current = merged.get(section)
        if current is None:
            current = merged[section] = {}
        if not isinstance(current, dict):
            raise ConfigError(f"--set {text!r}: section '{section}' in the file is not a mapping.")
        current[key] = value
    return merged


# ---------------------------------------------------------------------------------------------
# Shipped configs and the corpora they train on
# ---------------------------------------------------------------------------------------------

# In a wheel the shipped configs and corpora are package data (`llmcli/configs/`,
# `llmcli/corpora/`); in a checkout (or an editable install) they are the repository's top-level
# `configs/` and `data/`, the single source the wheel is built from.
_PACKAGE_DIR = Path(__file__).resolve().parent
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
    """(name, the first line of its leading comment) for every shipped config."""
    rows = []
    for name, path in shipped_configs().items():
        first = next(
            (
                line
                for line in path.read_text(encoding="utf-8").splitlines()
                if line.startswith("#")
            ),
            "#",
        )
        rows.append((name, first.lstrip("#").strip()))
    return rows


def find_config(spec: str | Path) -> tuple[Path, bool]:
    """The config file `spec` names, and whether it is a shipped one.

    `spec` is a path to a YAML file, or the name of a shipped config (`tiny`, `tiny.yaml`).
    A file that exists wins over a shipped name.

    Raises:
        ConfigError: `spec` is neither; the message lists the shipped names.
    """
    path = Path(spec)
    shipped = shipped_configs()
    if path.exists():
        folder = shipped_dir("configs").resolve()
        return path, path.is_file() and path.resolve().parent == folder
    name = path.name[: -len(".yaml")] if path.name.endswith(".yaml") else path.name
    if len(path.parts) == 1 and name in shipped:
        return shipped[name], True
    names = ", ".join(shipped) or "none (this installation lacks its configs: reinstall llmcli)"
    raise ConfigError(
        f"config {str(spec)!r} does not exist, as a file or as a shipped config: check the path, "
        f"or give one of the shipped names: {names} (`llmcli config --list` describes them)."
    )


def _bundled_paths(raw: Any, source: Path) -> Any:
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
            if not bundled.exists():
                raise ConfigError(
                    f"the shipped config {str(source)!r} trains on the bundled corpus "
                    f"{str(bundled)!r}, which is missing: this installation of llmcli is "
                    "incomplete, reinstall it (or give data.path with --set)."
                )
            data[key] = str(bundled)
    return {**raw, "data": data}


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    """Load, override and validate a config file or a shipped config by name.

    Args:
        path: a YAML file with any of the sections model, data, train, sample, or the name of
            a shipped config (`tiny`, `speedrun-cpu`, ...; see `shipped_configs`).
        overrides: `section.key=value` strings, applied after the file.

    Raises:
        ConfigError: the file is missing, unreadable, not YAML, or a value breaks a rule.
    """
    file, shipped = find_config(path)
    raw = read_yaml(file)
    if shipped:
        raw = _bundled_paths(raw, file)
    raw = apply_overrides(raw, list(overrides or []))
    return config_from_dict(raw, name=file.stem)


def dump_yaml(config: Config) -> str:
    """The fully resolved config as YAML text, sections in their usual order."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=False)
