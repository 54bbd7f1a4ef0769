"""The typed config: one dataclass per section (`model`, `data`, `train`, `sample`) and `Config`.

Every key has a default. Each section checks its values against its rules (`validate`;
`SampleConfig` as it is made), and a broken rule is a `ConfigError` whose message names the key,
the value and the rule. How YAML and `--set` become these sections: `llmcli.config.loading`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from llmcli.errors import ConfigError


@dataclass
class ModelConfig:
    """The network's shape and architecture options (a GPT-2-style model by default)."""

    n_layer: int = 4
    n_head: int = 4
    n_embed: int = 128
    context_length: int = 64
    dropout: float = 0.0
    # Dropout on the attention weights; null: `dropout`. On the CPU, attention with dropout
    # leaves the fused kernel for one that writes out the weights (about 2.5x its time), so a
    # recipe can keep dropout on the residual stream and turn this one off.
    attn_dropout: float | None = None
    bias: bool = True
    # Recipe options (all off by default, so the default model is GPT-2's architecture).
    pos_emb: Literal["learned", "rope"] = "learned"
    rope_base: float = 10000.0
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    qk_norm: bool = False
    mlp: Literal["gelu", "relu2"] = "gelu"
    tie_embeddings: bool = True

    @property
    def attention_dropout(self) -> float:
        """The dropout on the attention weights: `attn_dropout`, else `dropout`."""
        return self.dropout if self.attn_dropout is None else self.attn_dropout

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
        _require(
            self.attn_dropout is None or 0 <= self.attn_dropout < 1,
            "model",
            "attn_dropout",
            self.attn_dropout,
            "must be in [0, 1), or null for model.dropout",
        )
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
    # CPU threads for training, and for `eval` and `inspect-attention` on the run: a number,
    # "auto" (the CPUs nothing else is using when the run starts; torch's count where
    # OMP_NUM_THREADS is set) or null (torch's own count, one per core). Threads on a busy core
    # cost far more than they bring: 30 steps of `tiny` on 2 shared cores took 9-10 s on 1
    # thread and 61-88 s on 2; on 2 idle cores 2 threads are faster (README, "Threads").
    threads: int | Literal["auto"] | None = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Sequences per micro-batch, or "auto": the largest that fits the memory (`memory_limit`,
    # else the device's free memory) with headroom, and the grad_accum that reaches
    # `tokens_per_step` (llmcli.training.batch). A run's config.yaml records the numbers chosen.
    batch_size: int | Literal["auto"] = 12
    grad_accum: int = 1
    # Tokens per optimizer step over all ranks (batch_size x context_length x grad_accum x
    # ranks): needed by batch_size: auto; with a number as batch_size it sets grad_accum.
    tokens_per_step: int | None = None
    # The memory a run may use, in bytes or as a size ("4GB", "512MiB"); null: the device's.
    memory_limit: int | str | None = None
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
    # At every evaluation, each head's previous-token, induction and duplicate-token scores on a
    # fixed probe of repeated random tokens, and the in-context learning score
    # (llmcli.inspection.probe, llmcli.runs.head_metrics): about 0.1% of the tiny config's time.
    head_metrics: bool = True
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
    # The spike guard (llmcli.training.guard): a step whose loss or gradient is not finite, or
    # whose loss is above spike_factor x the median of the last spike_window losses, is not
    # applied; spike_skips of them within spike_window steps roll the run back to its last save,
    # with the lr times spike_lr_factor for spike_lr_steps steps; after spike_rollbacks
    # rollbacks in a row the run stops. Its cost: benchmarks/RESULTS.md (spike_guard_cost.py).
    spike_guard: bool = True
    spike_factor: float = 2.0
    spike_window: int = 50
    spike_skips: int = 3
    spike_lr_factor: float = 0.5
    spike_lr_steps: int = 100
    spike_rollbacks: int = 3
    # At log steps, each layer's gradient norm and update-to-weight ratio (llmcli.training.layers).
    log_layers: bool = False

    @property
    def loggers(self) -> list[str]:
        """The trackers `logger` names, in order, without "none" and repeats."""
        return list(dict.fromkeys(n for n in self._logger_names() if n != "none"))

    def _logger_names(self) -> list[str]:
        names = self.logger if isinstance(self.logger, list) else self.logger.split(",")
        return [n.strip() for n in names if n.strip()]

    def validate(self) -> None:
        for key in (
            "grad_accum",
            "max_steps",
            "eval_interval",
            "eval_steps",
            "log_interval",
        ):
            _require(getattr(self, key) > 0, "train", key, getattr(self, key), "must be positive")
        self._validate_batch()
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
        _require(
            self.threads is None
            or self.threads == "auto"
            or (isinstance(self.threads, int) and not isinstance(self.threads, bool))
            and self.threads >= 1,
            "train",
            "threads",
            self.threads,
            "must be a number of CPU threads >= 1, auto (the CPUs nothing else is using) or null "
            "for torch's own count",
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
        self._validate_guard()

    def _validate_guard(self) -> None:
        for key, ok, rule in (
            (
                "spike_factor",
                math.isfinite(self.spike_factor) and self.spike_factor > 1,
                "must be a number > 1: a step is skipped when its loss is above spike_factor "
                "x the median of recent losses",
            ),
            ("spike_window", self.spike_window >= 1, "must be >= 1 (steps)"),
            ("spike_skips", self.spike_skips >= 1, "must be >= 1 (skipped steps)"),
            (
                "spike_lr_factor",
                0 < self.spike_lr_factor <= 1,
                "must be in (0, 1]: the learning rate is multiplied by it after a rollback",
            ),
            ("spike_lr_steps", self.spike_lr_steps >= 0, "must be >= 0 (steps)"),
            (
                "spike_rollbacks",
                self.spike_rollbacks >= 0,
                "must be >= 0 (0: stop instead of rolling back)",
            ),
        ):
            _require(ok, "train", key, getattr(self, key), rule)

    def _validate_batch(self) -> None:
        if self.batch_size == "auto":
            _require(
                self.tokens_per_step is not None,
                "train",
                "batch_size",
                "auto",
                "needs train.tokens_per_step, the tokens per optimizer step to reach (a "
                "multiple of model.context_length; for example --set train.tokens_per_step=49152)",
            )
        else:
            _require(
                self.batch_size > 0, "train", "batch_size", self.batch_size, "must be positive"
            )
        _require(
            self.tokens_per_step is None or self.tokens_per_step > 0,
            "train",
            "tokens_per_step",
            self.tokens_per_step,
            "must be positive, or null",
        )
        limit = self.memory_limit_bytes
        _require(
            self.memory_limit is None or (limit is not None and limit > 0),
            "train",
            "memory_limit",
            self.memory_limit,
            'must be a positive number of bytes or a size such as "4GB", "512MiB" or "1.5G" '
            "(powers of 1024), or null for the device's memory",
        )

    @property
    def memory_limit_bytes(self) -> int | None:
        """`memory_limit` in bytes; None for the device's memory (or a string that is not a
        size, which `validate` refuses)."""
        limit = self.memory_limit
        return parse_size(limit) if isinstance(limit, str) else limit

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


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int | None:
    """A memory size as bytes: "4GB", "4G" and "4GiB" are all 4 * 1024**3, as memory is sold and
    reported in powers of 1024; a bare number is bytes. None if `text` is not a size."""
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        return None
    number, unit = match.groups()
    return int(float(number) * 1024 ** " kmgt".index(unit.lower() or " "))


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
    # A sample ends at the end-of-text token unless this is true (then it goes on past it to
    # max_new_tokens, and the token shows in the text as <|endoftext|>).
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` for a setting outside its range (`context_keep`: `keep_for`)."""
        for key, ok, rule in self._rules():
            if not ok:
                raise _sample_error(key, getattr(self, key), rule)

    def _rules(self) -> list[tuple[str, bool, str]]:
        """(key, whether its value keeps the rule, the rule) for every setting."""
        t, k, p, keep = self.temperature, self.top_k, self.top_p, self.context_keep
        return [
            (
                "max_new_tokens",
                _is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
                "must be an integer >= 1: the most tokens each sample generates",
            ),
            (
                "temperature",
                _is_number(t) and math.isfinite(t) and t >= 0,
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
                _is_number(p) and 0 < p <= 1,
                "must be in (0, 1]: the probability mass of the most likely tokens kept "
                "(nucleus sampling); 1 keeps every token",
            ),
            (
                "seed",
                _is_int(self.seed) and 0 <= self.seed < 2**63,
                "must be an integer in 0..2**63-1 (torch's seed range; row b of a batch is "
                "seeded seed + b)",
            ),
            (
                "context_policy",
                self.context_policy in CONTEXT_POLICIES,
                f"must be one of {', '.join(CONTEXT_POLICIES)}: exact recomputes the last "
                "context_length tokens every step past the context, shift keeps the last tokens "
                "and goes on with the KV cache",
            ),
            (
                "ignore_eos",
                isinstance(self.ignore_eos, bool),
                "must be true or false: false ends a sample at the end-of-text token, true "
                "generates past it",
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


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
        tokens, T = self.train.tokens_per_step, self.model.context_length
        if tokens is not None and tokens % T:
            raise ConfigError(
                f"train.tokens_per_step ({tokens}) must be a multiple of model.context_length "
                f"({T}): a step is whole sequences; for example {max(T, tokens // T * T)} or "
                f"{(tokens // T + 1) * T}."
            )

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
