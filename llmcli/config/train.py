"""The `train:` section: the optimisation, evaluation and checkpointing schedule."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from llmcli.config.lists import names, numbers
from llmcli.config.lora import LoraConfig
from llmcli.config.objective_settings import (
    LOSS_TYPES,
    check_iterations,
    check_loss_type,
    check_rewards,
)
from llmcli.config.rules import check_choices, require, require_size, size_bytes
from llmcli.errors import ConfigError

# The experiment trackers train.logger may name (llmcli.runs.trackers runs them).
TRACKERS = ("none", "tensorboard", "wandb")


@dataclass
class TrainConfig:
    """The optimisation, evaluation and checkpointing schedule."""

    # auto picks CUDA, then MPS, then the CPU
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    # CPU threads for training, and for `eval` and `inspect-attention` on the run: a number,
    # "auto" (of the CPUs this process may use, by affinity and cgroup quota, those nothing else
    # is using when the run starts; OMP_NUM_THREADS where it is set) or null (torch's own count,
    # one per core). Threads on a busy core cost far more than they bring: 30 steps of `tiny` on
    # 2 shared cores took 9-10 s on 1 thread and 61-88 s on 2; on 2 idle cores 2 threads are
    # faster (docs/training.md, "Threads").
    threads: int | Literal["auto"] | None = "auto"
    # auto: fp32 on CPU and MPS, bf16 autocast on CUDA (else fp16 with loss scaling)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Sequences per micro-batch, or "auto": the largest that fits the memory (`memory_limit`,
    # else the device's free memory) with headroom, and the grad_accum that reaches
    # `tokens_per_step` (llmcli.training.batch). A run's config.yaml records the numbers chosen.
    batch_size: int | Literal["auto"] = 12
    grad_accum: int = 1  # micro-batches per optimizer step
    # Tokens per optimizer step over all ranks (batch_size x context_length x grad_accum x
    # ranks): needed by batch_size: auto; with a number as batch_size it sets grad_accum.
    tokens_per_step: int | None = None
    # The memory a run may use, in bytes or as a size ("4GB", "512MiB"); null: the device's.
    memory_limit: int | str | None = None
    max_steps: int = 2000  # optimizer steps
    # peak learning rate (AdamW's; under Muon, the non-matrix groups'). DPO's and GRPO's own
    # defaults differ: lr 5e-5 and 1e-4, min_lr 5e-6 and 1e-5, warmup_steps 20 and 10,
    # eval_interval 50 (llmcli.config.objective_defaults; `llmcli config` shows them)
    lr: float = 1e-3
    min_lr: float = 1e-4  # the rate at the end of the schedule
    warmup_steps: int = 100  # linear warmup (cut to max_steps in a shorter run)
    weight_decay: float = 0.1  # AdamW's decoupled weight decay, on matrices and embeddings
    beta1: float = 0.9  # Adam's first-moment decay
    beta2: float = 0.99  # Adam's second-moment decay
    grad_clip: float = 1.0  # the global gradient norm clipped to (0: off)
    eval_interval: int = 250  # steps between evaluations (each also saves)
    eval_steps: int = 20  # batches per split in an evaluation's loss estimate
    # At every evaluation, each head's previous-token, induction and duplicate-token scores on a
    # fixed probe of repeated random tokens, and the in-context learning score
    # (llmcli.evaluation.probe, llmcli.runs.head_metrics): about 0.1% of the tiny config's time.
    head_metrics: bool = True
    log_interval: int = 10  # steps between log records and progress lines
    seed: int = 1337  # one seed for weights, batches and dropout
    # torch.compile the model: true, false, or auto: where the time it saves (measured) is more
    # than its warm-up (llmcli.training.compiling; inductor's cache is kept on disk)
    compile: bool | Literal["auto"] = False
    out_dir: str | None = None  # the run directory (default: checkpoints/<config name>)
    # AdamW, or Muon for the matrices and AdamW for the rest
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: float = 0.02  # Muon's rate for the matrices
    muon_momentum: float = 0.95  # Muon's momentum
    schedule: Literal["cosine", "wsd"] = "cosine"  # cosine decay, or warmup-stable-decay
    decay_fraction: float = 0.2  # the part of the run a wsd schedule decays over
    # start from an llmcli run directory (its weights, tokenizer and model shape; fine-tuning)
    # or a Hugging Face folder or Hub name (nanoGPT's init_from)
    init_from: str | None = None
    # next_token: the language-model loss on every token (or the replies, for chat data); dpo:
    # Direct Preference Optimization on data.format preference pairs, from the init_from run,
    # which stays the frozen reference (llmcli.objectives.dpo); grpo: learning from rewards on
    # data.format prompts, completions sampled from the model as it trains (llmcli.objectives.grpo)
    objective: Literal["next_token", "dpo", "grpo"] = "next_token"
    # DPO's beta (TRL's default): how far the policy may move from the reference; larger keeps
    # it closer
    dpo_beta: float = 0.1
    # GRPO: completions sampled for each prompt (TRL's num_generations); each is rewarded
    # against the others of its group, so at least 2. The sampling settings are the sample
    # section's (temperature, top_k, top_p, max_new_tokens).
    group_size: int = 8
    # GRPO's reward of a completion: a built-in verifier against the prompt's answer (exact:
    # the same text, spaces around it aside; number: its number equals the answer's, each read
    # from a \boxed{}, else after GSM8K's ####, else the last number; contains: the answer
    # appears in it), each 1.0 or 0.0, or FILE.py:FUNCTION, a function of your own file called
    # as FUNCTION(prompt, completion, answer) -> a number (this runs that file's code, as a
    # test script would); or a list of them (or "number,rewards.py:brief"), summed with
    # reward_weights (TRL's reward_funcs)
    reward: str | list[str] = "exact"
    # GRPO: one weight per reward (TRL's reward_weights; a list, or "1.0,0.5"); null: 1.0 each
    reward_weights: list[float] | str | None = None
    # GRPO: seconds a call of a reward function of your own may take before the run stops,
    # naming the prompt (null: no limit; the built-in verifiers take microseconds). The call
    # runs in a thread, which a timeout cannot kill: it is abandoned as the run exits. A
    # function that sets signal handlers (math_verify's timeouts) needs null: docs/grpo.md.
    reward_timeout: float | None = 60.0
    # GRPO: divide each advantage (reward less its group's mean) by its group's standard
    # deviation (TRL's default); false keeps the difference as it is (Dr. GRPO, nanochat)
    scale_rewards: bool = True
    # GRPO: the weight of a KL penalty to the init_from model, per token (TRL's beta; 0: none,
    # and no reference model is kept)
    grpo_beta: float = 0.0
    # GRPO: optimizer steps each sample of completions serves (TRL's num_iterations); above 1,
    # each update after the first is measured against the policy that sampled them, its ratio
    # clipped to [1 - epsilon, 1 + epsilon_high] (PPO's clip, TRL's epsilon and epsilon_high;
    # epsilon_high null: epsilon). TRL turns dropout off for GRPO: set model.dropout 0 too, or
    # the ratio also measures dropout's noise.
    num_iterations: int = 1
    epsilon: float = 0.2  # GRPO: the clip's bound below 1 (TRL's epsilon)
    epsilon_high: float | None = None  # GRPO: its bound above 1 (null: epsilon; DAPO: 0.28)
    # The objective's loss, TRL's loss_type; null: the objective's default. GRPO, how the loss
    # sums over tokens: dapo (TRL's default: over every completion token of the step, on every
    # rank), bnpo (each micro-batch's tokens), grpo (each completion's mean), dr_grpo (over
    # max_new_tokens per completion). DPO: sigmoid (the default), hinge, ipo, exo_pair,
    # nca_pair, robust, bco_pair, sppo_hard, aot, aot_unpaired, apo_zero, apo_down, sft,
    # sigmoid_norm, or a list of them (or "sigmoid,sft"), summed with loss_weights
    # (docs/dpo.md, "Loss types"). Next-token training has one loss and takes none.
    loss_type: str | list[str] | None = None
    # DPO: one weight per loss type (TRL's loss_weights; a list, or "1.0,0.5"); null: 1.0 each
    loss_weights: list[float] | str | None = None
    # DPO: TRL's label_smoothing, the share of flipped labels the robust loss assumes (in
    # [0, 0.5)), EXO's epsilon (exo_pair needs one > 0) and the aot losses' smoothing
    label_smoothing: float = 0.0
    # Low-rank adapters on the frozen init_from model instead of a full fine-tune, for any
    # objective: a mapping of rank, alpha, dropout and targets (llmcli.config.lora), or null
    lora: LoraConfig | None = None
    # Experiment trackers besides metrics.jsonl: none, tensorboard, wandb, or a list of them.
    logger: str | list[str] = "none"
    wandb_project: str | None = None  # default: the config's name
    wandb_name: str | None = None  # default: the run directory's name
    # Resume state also between evaluations, so that a kill loses little work: every
    # `save_interval` steps and/or once `save_interval_s` seconds passed since the last save.
    save_interval: int | None = None
    # seconds since the last save before the next one (null: off)
    save_interval_s: float | None = 300.0
    # false: start (a run already there is an error); true: continue the run there; auto:
    # continue it if there is one, else start (one command for a first start and a restart).
    resume: bool | Literal["auto"] = False
    # The spike guard (llmcli.training.guard): a step whose loss or gradient is not finite, or
    # whose loss is above spike_factor x the median of the last spike_window losses (and
    # spike_margin above it), is not applied; spike_skips of them within spike_window steps roll
    # the run back to its last save, with the lr times spike_lr_factor for spike_lr_steps steps;
    # after spike_rollbacks rollbacks in a row the run stops. Its cost: benchmarks/RESULTS.md
    # (spike_guard_cost.py).
    spike_guard: bool = True
    spike_factor: float = 2.0  # a loss above this times the window's median is skipped
    # a skipped loss is also at least this many nats above the median: near 0 (a fine-tune that
    # has learnt its task) a batch's loss varies by multiples of the median, harmlessly
    spike_margin: float = 0.5
    spike_window: int = 50  # steps in the median's window, and in which skips count
    spike_skips: int = 3  # skips within spike_window steps that roll the run back
    spike_lr_factor: float = 0.5  # the rate's factor after a rollback
    spike_lr_steps: int = 100  # steps at the lowered rate after a rollback
    spike_rollbacks: int = 3  # rollbacks in a row before the run stops
    # At log steps, each layer's gradient norm and update-to-weight ratio (llmcli.training.layers).
    log_layers: bool = False

    @property
    def reward_specs(self) -> list[str]:
        """The rewards `reward` names, in order."""
        return names(self.reward)

    @property
    def reward_weight_values(self) -> list[float] | None:
        """`reward_weights` as numbers (a text "1.0,0.5" split; None for null)."""
        return numbers(self.reward_weights, "train", "reward_weights", "one per reward")

    @property
    def loss_types(self) -> list[str]:
        """The loss types `loss_type` names, in order (empty for null: the objective's own)."""
        return names(self.loss_type)

    @property
    def loss_weight_values(self) -> list[float] | None:
        """`loss_weights` as numbers (a text "1.0,0.5" split; None for null). Raises
        `ConfigError` for a text with something other than numbers in it."""
        return numbers(self.loss_weights, "train", "loss_weights", "one per loss type")

    @property
    def loggers(self) -> list[str]:
        """The trackers `logger` names, in order, without "none" and repeats."""
        return list(dict.fromkeys(n for n in names(self.logger) if n and n != "none"))

    def validate(self) -> None:
        check_choices("train", self)
        for key in (
            "grad_accum",
            "max_steps",
            "eval_interval",
            "eval_steps",
            "log_interval",
        ):
            require(getattr(self, key) > 0, "train", key, getattr(self, key), "must be positive")
        self._validate_batch()
        require(self.lr > 0, "train", "lr", self.lr, "must be > 0")
        require(self.muon_lr > 0, "train", "muon_lr", self.muon_lr, "must be > 0")
        require(
            0 <= self.muon_momentum < 1,
            "train",
            "muon_momentum",
            self.muon_momentum,
            "must be in [0, 1)",
        )
        require(self.min_lr >= 0, "train", "min_lr", self.min_lr, "must be >= 0")
        if self.min_lr > self.lr:
            raise ConfigError(
                f"train.min_lr ({self.min_lr}) must be <= train.lr ({self.lr}): the schedule "
                "decays from lr down to min_lr."
            )
        require(self.warmup_steps >= 0, "train", "warmup_steps", self.warmup_steps, "must be >= 0")
        require(self.weight_decay >= 0, "train", "weight_decay", self.weight_decay, "must be >= 0")
        for key in ("beta1", "beta2"):
            require(
                0 <= getattr(self, key) < 1, "train", key, getattr(self, key), "must be in [0, 1)"
            )
        require(
            self.grad_clip >= 0,
            "train",
            "grad_clip",
            self.grad_clip,
            "must be >= 0 (0 turns clipping off)",
        )
        require(
            0 < self.decay_fraction <= 1,
            "train",
            "decay_fraction",
            self.decay_fraction,
            "must be in (0, 1]",
        )
        require(
            0 <= self.seed < 2**63,
            "train",
            "seed",
            self.seed,
            "must be in 0..2**63-1 (torch's seed range)",
        )
        require(
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
            require(
                value is None or value > 0,
                "train",
                key,
                value,
                "must be positive, or null to save only at evaluations",
            )
        self._validate_objective()
        self._validate_loggers()
        self._validate_guard()

    def _validate_objective(self) -> None:
        """DPO's beta and its reference, and LoRA's settings: both start from a trained run."""
        require(
            math.isfinite(self.dpo_beta) and self.dpo_beta > 0,
            "train",
            "dpo_beta",
            self.dpo_beta,
            "must be > 0",
        )
        require(
            self.objective != "dpo" or self.init_from is not None,
            "train",
            "objective",
            self.objective,
            "starts from a trained run, which stays the frozen reference: set train.init_from "
            "to a run directory (a chat run, for conversational pairs)",
        )
        require(
            self.objective != "grpo" or self.init_from is not None,
            "train",
            "objective",
            self.objective,
            "samples completions from a model that can already answer: set train.init_from to "
            "a run directory (a chat run, for conversational prompts)",
        )
        require(
            self.group_size >= 2,
            "train",
            "group_size",
            self.group_size,
            "must be >= 2: each completion is rewarded against the mean of its group, which a "
            "group of 1 equals (8 is TRL's default)",
        )
        require(
            math.isfinite(self.grpo_beta) and self.grpo_beta >= 0,
            "train",
            "grpo_beta",
            self.grpo_beta,
            "must be >= 0 (0: no KL penalty)",
        )
        check_rewards(self.objective, self.reward, self.reward_weights)
        check_loss_type(self.objective, self.loss_type, self.loss_weights, self.label_smoothing)
        check_iterations(self.objective, self.num_iterations, self.epsilon, self.epsilon_high)
        require(
            self.reward_timeout is None
            or (math.isfinite(self.reward_timeout) and self.reward_timeout > 0),
            "train",
            "reward_timeout",
            self.reward_timeout,
            "must be a number of seconds > 0, or null for no limit",
        )
        if self.lora is not None:
            self.lora.validate()
            if self.init_from is None:
                raise ConfigError(
                    "train.lora trains adapters on a trained model: set train.init_from to the "
                    "run directory or Hugging Face model to adapt (or remove train.lora to "
                    "train from scratch)."
                )

    @property
    def resolved_loss_types(self) -> list[str]:
        """The loss types `loss_type` names, or the objective's default (none for next-token
        training)."""
        choices = LOSS_TYPES.get(self.objective)
        return self.loss_types or ([choices[0]] if choices else [])

    @property
    def resolved_loss_type(self) -> str | None:
        """GRPO's one loss type: `loss_type`, or the objective's default (None for next-token
        training; DPO's may be several, `resolved_loss_types`)."""
        types = self.resolved_loss_types
        return types[0] if types else None

    def _validate_guard(self) -> None:
        for key, ok, rule in (
            (
                "spike_factor",
                math.isfinite(self.spike_factor) and self.spike_factor > 1,
                "must be a number > 1: a step is skipped when its loss is above spike_factor "
                "x the median of recent losses",
            ),
            (
                "spike_margin",
                math.isfinite(self.spike_margin) and self.spike_margin >= 0,
                "must be a number >= 0 (nats above the median before a loss counts as a spike)",
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
            require(ok, "train", key, getattr(self, key), rule)

    def _validate_batch(self) -> None:
        if self.batch_size == "auto":
            require(
                self.tokens_per_step is not None,
                "train",
                "batch_size",
                "auto",
                "needs train.tokens_per_step, the tokens per optimizer step to reach (a "
                "multiple of model.context_length; for example --set train.tokens_per_step=49152)",
            )
        else:
            require(self.batch_size > 0, "train", "batch_size", self.batch_size, "must be positive")
        require(
            self.tokens_per_step is None or self.tokens_per_step > 0,
            "train",
            "tokens_per_step",
            self.tokens_per_step,
            "must be positive, or null",
        )
        require_size("train", "memory_limit", self.memory_limit, "the device's memory")

    @property
    def memory_limit_bytes(self) -> int | None:
        """`memory_limit` in bytes; None for the device's memory (or a string that is not a
        size, which `validate` refuses)."""
        return size_bytes(self.memory_limit)

    def _validate_loggers(self) -> None:
        unknown = [n for n in names(self.logger) if n and n not in TRACKERS]
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
