"""`llmcli plan`: what a config's training run needs and how long it takes, before it starts.

`make_plan` counts the parameters (on the meta device), the FLOPs per token, the tokens per
optimizer step and the memory a step needs (`llmcli.training.memory.estimate_memory`) at the
micro-batch the run would train with (`train.batch_size: auto` resolved as `train` resolves it),
compares it with the free memory, and times a few warm training steps of the real model and
optimizer on random tokens (`measure_step`, at most `MEASURE_S` seconds). A config whose data is
missing is still planned: the vocabulary then comes from the tokenizer's settings, or is
assumed, and the plan says so.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from llmcli.config import Config
from llmcli.data.tokenizer import load_tokenizer
from llmcli.device import resolve_device, timed
from llmcli.errors import InputError
from llmcli.model.gpt import Transformer
from llmcli.objectives import objective_for
from llmcli.progress import format_bytes, format_count
from llmcli.training.batch import resolve_batch
from llmcli.training.distributed import dist_from_env
from llmcli.training.init_from import resolve_init_from
from llmcli.training.lora import adapt_model
from llmcli.training.memory import MemoryEstimate, device_free_bytes, estimate_memory
from llmcli.training.precision import Precision
from llmcli.training.step import make_trainer, train_step

logger = logging.getLogger(__name__)

MEASURE_S = 10.0  # the most seconds `plan` spends timing steps
TIMED_STEPS = 5  # timed steps after the warm-up one, when they fit in MEASURE_S
ASSUMED_VOCAB = 256  # a character vocabulary whose corpus cannot be read: one per byte value


@dataclass(frozen=True)
class StepTiming:
    """Seconds per training step, measured on warm steps.

    Attributes:
        step_s: one optimizer step at the run's micro-batch and accumulation: `grad_accum`
            micro-batches (a smaller one's time scaled up) and one update.
        forward_s: one evaluation forward (no gradients) at the run's micro-batch.
        steps: timed rounds, each a step of one and one of two micro-batches (0: only the cold
            warm-up step was measured, an overestimate).
        batch: the micro-batch measured; a smaller one than the run's when a step of the
            run's would not fit `MEASURE_S` (times are scaled up by the ratio).
        seconds: time spent measuring, warm-up included.
    """

    step_s: float
    forward_s: float
    steps: int
    batch: int
    seconds: float


@dataclass(frozen=True)
class Plan:
    """What `llmcli plan` reports (`to_json` for the issue's fields, `format_plan` for people)."""

    config: Config  # with the micro-batch and accumulation the run would train with
    device: str
    dtype: str
    world_size: int
    vocab_size: int
    missing: str | None  # what could not be read (the data), and what was assumed instead
    memory: MemoryEstimate
    device_free: int | None  # train.memory_limit, else the device's free memory; None: unknown
    timing: StepTiming | None  # None: not measured (the run does not fit)
    # A LoRA run's: the same run training every weight, for what LoRA saves; else None.
    full_memory: MemoryEstimate | None = None

    @property
    def flops_per_token(self) -> int:
        return flops_per_token(self.config, self.memory)

    @property
    def flops_formula(self) -> str:
        return "4 N + 6 N_lora + 12 L T C" if self.memory.adapters else "6 N + 12 L T C"

    @property
    def tokens_per_step(self) -> int:
        tc = self.config.train
        assert isinstance(tc.batch_size, int)
        return tc.batch_size * self.config.example_tokens * tc.grad_accum * self.world_size

    @property
    def fits(self) -> bool | None:
        return None if self.device_free is None else self.memory.peak <= self.device_free

    @property
    def evaluations(self) -> int:
        """Evaluations in a run from step 0: every `eval_interval` steps and at the end."""
        tc = self.config.train
        return math.ceil(tc.max_steps / tc.eval_interval)

    @property
    def eval_s(self) -> float | None:
        """Seconds the evaluations take: `eval_steps` forwards on each of the two splits."""
        if self.timing is None:
            return None
        return self.evaluations * 2 * self.config.train.eval_steps * self.timing.forward_s

    @property
    def eta_s(self) -> float | None:
        """Seconds from step 0 to `max_steps`, evaluations included."""
        if self.timing is None or self.eval_s is None:
            return None
        return self.timing.step_s * self.config.train.max_steps + self.eval_s

    def to_json(self) -> dict[str, Any]:
        """The fields of `llmcli plan --json` (memory in bytes, times in seconds)."""
        return {
            "params": self.memory.params,
            "params_non_embedding": self.memory.params_non_embedding,
            "params_trainable": self.memory.trainable,
            "flops_per_token": self.flops_per_token,
            "tokens_per_step": self.tokens_per_step,
            "memory": self.memory.as_dict(),
            "memory_full_finetune": None
            if self.full_memory is None
            else self.full_memory.as_dict(),
            "device_free": self.device_free,
            "fits": self.fits,
            "step_s": None if self.timing is None else round(self.timing.step_s, 6),
            "eta_s": None if self.eta_s is None else round(self.eta_s, 3),
        }


def make_plan(config: Config, device_name: str | None = None, measure_s: float = MEASURE_S) -> Plan:
    """Plan `config`'s training run on `device_name` (default: `train.device`).

    Raises:
        InputError: an unavailable device or precision, or a `batch_size: auto` that cannot
            fit (as `train` would refuse them). Missing data is not an error (see `Plan.missing`).
    """
    info = dist_from_env()
    what = "train.device" if device_name is None else "--device"
    device = resolve_device(device_name or config.train.device, info.local_rank, what=what)
    precision = Precision.resolve(device, config.train.dtype)
    if config.train.init_from:  # a run or a Hugging Face folder sets the shape and the tokenizer
        config = resolve_init_from(config)
    vocab, missing = plan_vocab(config)
    config = resolve_batch(config, vocab, device, precision.name, info.world_size)
    memory = estimate_memory(config, vocab, device.type, precision.name, info.world_size)
    full_memory = None
    if memory.adapters:  # LoRA's saving: the same run training every weight
        full = dataclasses.replace(config, train=dataclasses.replace(config.train, lora=None))
        full_memory = estimate_memory(full, vocab, device.type, precision.name, info.world_size)
    limit = config.train.memory_limit_bytes
    free = limit if limit is not None else device_free_bytes(device)
    timing = None
    if free is None or memory.peak <= free:
        timing = measure_step(config, vocab, precision, measure_s)
    return Plan(
        config=config,
        device=str(device),
        dtype=precision.name,
        world_size=info.world_size,
        vocab_size=vocab,
        missing=missing,
        memory=memory,
        device_free=free,
        timing=timing,
        full_memory=full_memory,
    )


def flops_per_token(config: Config, memory: MemoryEstimate) -> int:
    """Training FLOPs per token, `6 N + 12 L T C` (N: non-embedding parameters; Kaplan et al.
    2020, PaLM's appendix B): the forward's 2 N, the backward's 2 N for the inputs' gradients
    and 2 N for the weights'. A LoRA run computes no weight gradient for its frozen base:
    `4 N + 6 N_lora`, its adapters' `N_lora` costing all three."""
    m = config.model
    attention = 12 * m.n_layer * m.context_length * m.n_embed
    if memory.adapters:  # the frozen base's weights get no gradient
        return 4 * memory.params_non_embedding + 6 * memory.adapters + attention
    return 6 * memory.params_non_embedding + attention


def plan_vocab(config: Config) -> tuple[int, str | None]:
    """(the vocabulary, None) from the data as `train` prepares it (tokenized into the cache,
    which `train` then reuses); or, when the data cannot be read, (the vocabulary the tokenizer's
    settings give or an assumed one, a note saying what is missing and what was assumed)."""
    objective = objective_for(config)
    if objective.encodes_with_init_from:  # its rows are read by the run, with the base's
        return int(load_tokenizer(config.data.tokenizer).vocab_size), None
    try:
        data = objective.read_data(None)
        return int(data.tokenizer.vocab_size), None
    except InputError as exc:
        missing = f"the data: {exc}"
    tokenizer = config.data.tokenizer
    if tokenizer == "bpe":
        return config.data.vocab_size, f"{missing} Vocabulary: data.vocab_size."
    if tokenizer != "char":
        try:
            return int(load_tokenizer(tokenizer).vocab_size), f"{missing} Vocabulary: {tokenizer}."
        except InputError:
            pass
    return ASSUMED_VOCAB, f"{missing} Vocabulary assumed: {ASSUMED_VOCAB} tokens."


def measure_step(
    config: Config, vocab_size: int, precision: Precision, budget_s: float = MEASURE_S
) -> StepTiming:
    """Time training steps (`llmcli.training.step.train_step`) of the config's model and
    optimizer on random tokens.

    A warm-up step of one sequence comes first (kernels chosen, optimizer state allocated); its
    time picks the micro-batch measured: the run's, unless a step of it would take more than a
    quarter of `budget_s`. Then, while the time spent stays within `budget_s` (at most
    `TIMED_STEPS` rounds), steps of one and of two micro-batches in turn: their difference is a
    micro-batch, the rest the update (clip, optimizer step). A step of the run is `grad_accum`
    micro-batches, scaled to the run's micro-batch, and one update. With DPO a sequence is a
    pair: two rows through the model, and two through a frozen reference (a run that draws its
    pairs more than once reads the reference's scores instead, `score_pairs_once`: its steps
    take about 0.7 of the time measured here).
    """
    tc, T, device = config.train, config.model.context_length, precision.device
    assert isinstance(tc.batch_size, int)
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(tc.seed)
    model = Transformer(config.model, vocab_size, generator=gen).to(device)
    no_decay = adapt_model(model, tc)  # as the run: adapters, the base frozen (but new rows)
    objective = objective_for(config)
    # A GRPO update is a next-token-sized step on its prompts' group_size completions each;
    # the sampling before it is not timed (see `Objective.plan_rows`).
    per_example = objective.rows_per_example
    rows = per_example * tc.batch_size
    tokens = torch.randint(0, vocab_size, (rows, T + 1), generator=gen).to(device)
    batches = SameBatch(objective.timing_batch(tokens, 1))
    trainer = make_trainer(model, tc, precision, batches, no_decay)
    trainer.grad_accum = 1
    loss = objective.timing_loss(  # DPO's, with its reference: the same shape, frozen
        lambda: Transformer(config.model, vocab_size).to(device).eval().requires_grad_(False)
    )
    trainer.loss_fn = loss or trainer.loss_fn

    def step(micro_batches: int) -> float:
        trainer.grad_accum = micro_batches
        return timed(lambda: train_step(trainer), device)

    cold = step(1)  # one sequence, one update
    batch = max(1, min(tc.batch_size, math.floor(budget_s / 4 / max(cold, 1e-9))))
    batches.batch = objective.timing_batch(tokens, batch)
    ones, twos = [], []
    while len(ones) < TIMED_STEPS and time.perf_counter() - start + 3 * cold * batch <= budget_s:
        ones.append(step(1))
        twos.append(step(2))
    one, two = (statistics.median(t) for t in (ones, twos)) if ones else (cold * batch,) * 2
    micro, update = (max(two - one, 0.0), max(2 * one - two, 0.0)) if ones else (one, 0.0)
    model.eval()
    with torch.no_grad():
        forward_s = timed(
            lambda: micro_forward(model, tokens[: batch * per_example], precision), device
        )
    scale = tc.batch_size / batch
    return StepTiming(
        step_s=tc.grad_accum * micro * scale + update,
        forward_s=forward_s * scale,
        steps=len(ones),
        batch=batch,
        seconds=time.perf_counter() - start,
    )


@dataclass
class SameBatch:
    """A batch stream that gives the same batch at every step (for timing)."""

    batch: tuple[torch.Tensor, torch.Tensor]

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batch


def micro_forward(model: Transformer, tokens: torch.Tensor, precision: Precision) -> None:
    """One evaluation forward: the loss of `tokens` `(B, T + 1)`."""
    with precision.autocast():
        model(tokens[:, :-1], tokens[:, 1:])


def format_plan(plan: Plan) -> str:
    """The plan as a table for people."""
    config, tc, mem = plan.config, plan.config.train, plan.memory
    ranks = f" x {plan.world_size} processes" if plan.world_size > 1 else ""
    objective = objective_for(config)
    examples = objective.examples
    rows = [
        ("run", f"{plan.config.name} on {plan.device}, {plan.dtype}{ranks}"),
        (
            "parameters",
            f"{mem.params:,} ({mem.params_non_embedding:,} without embeddings; "
            f"vocabulary {plan.vocab_size:,})" + _lora_text(plan),
        ),
        ("FLOPs per token", f"{format_count(plan.flops_per_token)} ({plan.flops_formula})"),
        (
            "tokens per step",
            f"{plan.tokens_per_step:,} ({tc.batch_size} {examples} x {config.example_tokens} "
            f"tokens x grad_accum {tc.grad_accum}{ranks})",
        ),
        (
            "schedule",
            f"lr {tc.lr:g} to {tc.min_lr:g} ({tc.schedule}), warmup {tc.warmup} steps, "
            f"evaluation every {tc.eval_interval} steps",
        ),
        ("memory per step", f"{format_bytes(mem.peak)} at most{_full_text(plan)}, of which"),
        (
            "",
            f"weights {format_bytes(mem.weights)}, gradients {format_bytes(mem.grads)}, "
            f"optimizer {format_bytes(mem.optimizer)}, activations "
            f"{format_bytes(mem.activations)}, runtime {format_bytes(mem.runtime)}"
            + (f", reference model {format_bytes(mem.reference)}" if mem.reference else ""),
        ),
        ("memory free", _fits_line(plan)),
        ("step time", _timing_line(plan)),
        ("time to max_steps", _eta_line(plan)),
    ]
    rows += objective.plan_rows()
    if plan.missing:
        rows.append(("missing", plan.missing))
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def _full_text(plan: Plan) -> str:
    """What a LoRA run's step would hold training every weight: LoRA's saving, shown."""
    if plan.full_memory is None:
        return ""
    return f" (training every weight: {format_bytes(plan.full_memory.peak)})"


def _lora_text(plan: Plan) -> str:
    """What trains of a LoRA run's model, which its gradients and optimizer state hold."""
    lora, mem = plan.config.train.lora, plan.memory
    if lora is None:
        return ""
    rows = mem.trainable - mem.adapters  # the matrices of new tokens' rows
    return (
        f"; {mem.trainable:,} train: {mem.adapters:,} in LoRA adapters (rank {lora.rank} on "
        f"{', '.join(lora.targets)})"
        + (f", {rows:,} in the token matrices, for the new tokens' rows" if rows else "")
    )


def _fits_line(plan: Plan) -> str:
    source = "train.memory_limit" if plan.config.train.memory_limit is not None else "free"
    if plan.device_free is None:
        return f"unknown on {plan.device} (set train.memory_limit)"
    verdict = "fits" if plan.fits else "does NOT fit: lower train.batch_size or the model"
    return f"{format_bytes(plan.device_free)} ({source}): {verdict}"


def _timing_line(plan: Plan) -> str:
    timing = plan.timing
    if timing is None:
        return "not measured (the step does not fit)"
    how = (
        f"median of {timing.steps} warm steps"
        if timing.steps
        else "one cold step (an overestimate)"
    )
    if timing.batch != plan.config.train.batch_size:
        how += f" at {timing.batch} sequences, scaled"
    return f"{timing.step_s:.3g} s ({how}; {timing.seconds:.1f} s spent measuring)"


def _eta_line(plan: Plan) -> str:
    if plan.eta_s is None or plan.timing is None or plan.eval_s is None:
        return "unknown"
    steps = plan.config.train.max_steps
    return (
        f"{_duration(plan.eta_s)} ({steps:,} steps {_duration(plan.timing.step_s * steps)} + "
        f"{plan.evaluations} evaluations {_duration(plan.eval_s)})"
    )


def _duration(seconds: float) -> str:
    """3 s, 4 min 10 s, 2 h 5 min."""
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    minutes, s = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {s} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"
