"""`SAEConfig`: how `llmcli sae train` trains a sparse autoencoder, checked once, as it is made.

The settings are the command's options, and their messages name the options (`--k (0) must be
at least 1.`). What depends on the run (the hook point exists, `features` and `k` against its
width) is checked by `llmcli.inspection.sae.train` once the run is loaded. The same settings are
saved with the SAE (`cfg.json`'s metadata) and a resume checks the run's against them
(`resumable`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from llmcli.config.rules import is_int, is_number
from llmcli.errors import InputError

#: How the features are made sparse: the `k` largest of each token's pre-activations (`topk`),
#: or the `k x N` largest of a batch of N tokens' (`batchtopk`, Bussmann et al. 2024; it runs
#: as a JumpReLU with the threshold it learned, and is saved as SAELens's `jumprelu`).
ACTIVATIONS = ("topk", "batchtopk")
#: What is trained: an SAE on one hook point, or transcoders (`--kind transcoder`) that read
#: `blocks.{l}.mlp_in` and predict `blocks.{l}.mlp_out`, which may also use relu (an L1 penalty)
#: or tanh (Anthropic's tanh penalty) (`llmcli.inspection.sae.transcoder`).
KINDS = ("sae", "transcoder")
TRANSCODER_ACTIVATIONS = ("topk", "batchtopk", "relu", "tanh")

# The settings a resumed training must share with the one saved: all but how long it runs and
# how often it logs and saves.
_FIXED = (
    "kind",
    "hook",
    "layers",
    "features",
    "k",
    "activation",
    "skip",
    "sparsity_coef",
    "batch_tokens",
    "lr",
    "aux_coef",
    "dead_tokens",
)


def _require(ok: bool, option: str, value: Any, rule: str) -> None:
    if not ok:
        raise InputError(f"{option} ({value!r}) {rule}.")


@dataclass(frozen=True)
class SAEConfig:
    """The training settings of a sparse autoencoder.

    Attributes:
        hook: the hook point it reads and rewrites (`blocks.1.resid_post`; `model.hook_names()`);
            unused by transcoders.
        kind: "sae" or "transcoder" (see `KINDS`).
        layers: the transcoders' layers: "all" (their default), or indices joined by commas.
        skip: whether each transcoder has a linear skip `W_skip`.
        sparsity_coef: the weight of relu's and tanh's sparsity penalty.
        features: its number of features (None: 16 x the hook point's width).
        k: features active per token (topk), or on average per token (batchtopk).
        activation: "topk" or "batchtopk" (see `ACTIVATIONS`).
        steps: optimizer steps to train for, in all (a resume goes on up to it).
        batch_tokens: activations per step, rounded up to whole windows of `context_length`.
        lr: Adam's learning rate; it decays linearly over the last fifth of the steps, to 0 at
            the last step.
        aux_coef: weight of the auxiliary loss that gives dead features a gradient (AuxK).
        dead_tokens: a feature that has not fired for this many tokens counts as dead.
        seed: seeds the initial weights and the order of the training windows.
        log_interval: steps between the lines of `metrics.jsonl` and the progress figures.
        save_interval: steps between checkpoints (one is also written at the end, and at
            Ctrl-C).
    """

    hook: str = ""
    kind: Literal["sae", "transcoder"] = "sae"
    layers: str | None = None
    skip: bool = False
    sparsity_coef: float = 0.1
    features: int | None = None
    k: int = 32
    activation: Literal["topk", "batchtopk"] = "topk"
    steps: int = 1500
    batch_tokens: int = 4096
    lr: float = 1e-3
    aux_coef: float = 1 / 32
    dead_tokens: int = 1_000_000
    seed: int = 0
    log_interval: int = 50
    save_interval: int = 500

    def __post_init__(self) -> None:
        _require(self.kind in KINDS, "--kind", self.kind, f"must be one of {', '.join(KINDS)}")
        if self.kind == "sae":
            _require(
                isinstance(self.hook, str) and self.hook != "",
                "--hook",
                self.hook,
                "must name a hook point, e.g. blocks.1.resid_post",
            )
            for option, value, default in (
                ("--layers", self.layers, None),
                ("--skip", self.skip, False),
            ):
                _require(value == default, option, value, "applies to --kind transcoder only")
        else:
            _require(
                self.hook == "",
                "--hook",
                self.hook,
                "is for SAEs: transcoders read blocks.L.mlp_in and predict blocks.L.mlp_out of "
                "the --layers given",
            )
            if self.layers is None:  # every layer: what a graph needs
                object.__setattr__(self, "layers", "all")
        if self.features is not None:
            _require(
                is_int(self.features) and self.features >= 1,
                "--features",
                self.features,
                "must be a whole number of features, at least 1",
            )
        _require(is_int(self.k) and self.k >= 1, "--k", self.k, "must be at least 1")
        if self.features is not None:
            _require(
                self.k <= self.features,
                "--k",
                self.k,
                f"must be at most --features ({self.features})",
            )
        choices = ACTIVATIONS if self.kind == "sae" else TRANSCODER_ACTIVATIONS
        _require(
            self.activation in choices,
            "--activation",
            self.activation,
            f"must be one of {', '.join(choices)} for --kind {self.kind}",
        )
        _require(
            is_number(self.sparsity_coef)
            and math.isfinite(self.sparsity_coef)
            and self.sparsity_coef >= 0,
            "--sparsity-coef",
            self.sparsity_coef,
            "must be 0 or more",
        )
        for option, value in (
            ("--steps", self.steps),
            ("--batch-tokens", self.batch_tokens),
            ("--dead-tokens", self.dead_tokens),
            ("--log-interval", self.log_interval),
            ("--save-interval", self.save_interval),
        ):
            _require(is_int(value) and value >= 1, option, value, "must be at least 1")
        _require(
            is_number(self.lr) and math.isfinite(self.lr) and self.lr > 0,
            "--lr",
            self.lr,
            "must be a positive number",
        )
        _require(
            is_number(self.aux_coef) and math.isfinite(self.aux_coef) and self.aux_coef >= 0,
            "--aux-coef",
            self.aux_coef,
            "must be 0 or more",
        )
        _require(is_int(self.seed), "--seed", self.seed, "must be a whole number")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def resumable(self, saved: dict[str, Any], step: int) -> None:
        """Check that a training saved with the settings `saved` after `step` steps can go on
        with these.

        Raises:
            InputError: naming each setting that differs, its saved value and the option.
        """
        differ = [
            f"--{key.replace('_', '-')} {saved.get(key)!r} (now {getattr(self, key)!r})"
            for key in _FIXED
            if saved.get(key, _DEFAULTS.get(key)) != getattr(self, key)
        ]
        if differ:
            raise InputError(
                "the SAE was trained with other settings: " + ", ".join(differ) + "; give the "
                "saved ones to resume, or --overwrite to start afresh."
            )
        if self.steps < step:
            raise InputError(
                f"--steps ({self.steps}) is below the {step} steps the SAE has "
                "trained: give more to go on."
            )


# What a setting was before it existed, for SAEs saved before it (their settings lack it).
_DEFAULTS = {"kind": "sae", "layers": None, "skip": False, "sparsity_coef": 0.1}
