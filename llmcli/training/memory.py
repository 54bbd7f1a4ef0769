"""Memory: refuse a model and batch that cannot fit, and explain running out of memory.

`estimate_memory` says what one training step needs (weights, gradients, optimizer state,
activations); `check_memory` compares it with the device's memory (`device_memory_bytes`) or
`train.memory_limit` before anything is allocated, and `device_free_bytes` says what is free now;
`out_of_memory_is_bad_input` turns an out-of-memory error during training into a message that
says what to lower.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch

from llmcli.errors import CheckpointError, InputError
from llmcli.objectives import objective_for
from llmcli.progress import format_bytes, format_count
from llmcli.training.lora import base_vocab_size

if TYPE_CHECKING:
    from llmcli.config import Config


# The framework's own working memory on the first training steps, beyond the tensors below:
# on the CPU, the allocator's cached pages, oneDNN's kernels and scratch (60-90 MiB measured on
# the tiny and small configs, benchmarks/plan_memory.py); on CUDA, cuBLAS's workspaces.
RUNTIME_BYTES = {"cpu": 80 * 2**20, "cuda": 32 * 2**20}


@dataclass(frozen=True)
class MemoryEstimate:
    """The bytes one training step needs, by what holds them.

    Attributes:
        params: the model's parameters (a tied weight counts once), a LoRA run's adapters too.
        params_non_embedding: without position embeddings, and without the token embedding
            unless it is tied to the LM head (as `Transformer.num_parameters` counts), nor
            adapters: what the forward's FLOPs scale with.
        weights: fp32 weights, plus autocast's half-precision copies of them.
        grads: fp32 gradients of what trains (twice under DDP, whose buckets hold a copy).
        optimizer: the optimizer's state (AdamW: two moments; Muon: one momentum per matrix).
        activations: what the forward keeps for the backward pass, at the micro-batch (with
            DPO, two rows per pair, and the reference's logits beside them).
        runtime: the framework's own working memory (`RUNTIME_BYTES`).
        reference: with DPO (and GRPO with `train.grpo_beta` > 0), the frozen reference
            model's fp32 weights.
        trainable: the parameters that train, whose gradients and optimizer state are held:
            all of them, but a LoRA run's adapters (and the token embedding when it adds
            tokens) alone.
        adapters: a LoRA run's adapter parameters (in `params` and `trainable`).
        sampling: with GRPO, what sampling a step's completions holds (without gradients):
            each row's keys and values (`2 L C` per token) and logits, fp32; it comes before
            the step's forwards, so the peak holds it or the activations.
    """

    params: int
    params_non_embedding: int
    weights: int
    grads: int
    optimizer: int
    activations: int
    runtime: int
    reference: int = 0
    trainable: int = 0
    adapters: int = 0
    sampling: int = 0

    @property
    def peak(self) -> int:
        """All of it at once: what a micro-step of accumulation holds at its forward's end, or
        (GRPO) what sampling a step's completions holds, whichever is more."""
        held = self.weights + self.grads + self.optimizer + self.reference
        return held + max(self.activations, self.sampling) + self.runtime

    def as_dict(self) -> dict[str, int]:
        """The parts `llmcli plan --json` prints, in bytes."""
        return {
            "weights": self.weights,
            "grads": self.grads,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "reference": self.reference,
            "sampling": self.sampling,
            "peak": self.peak,
        }


def estimate_memory(
    config: Config,
    vocab_size: int,
    device_type: str = "cpu",
    dtype: str = "float32",
    world_size: int = 1,
    batch_size: int | None = None,
) -> MemoryEstimate:
    """An estimate of the memory one training step needs, before allocating any of it.

    The parameters are counted on a model built on the meta device (no memory). Activations,
    in values per token: `L (20 C + 2 C [dropout]) + 4 C + 4 V`, 4 bytes each in fp32 and 2 under
    autocast (whose residual stream, 2 C per layer, stays fp32), plus `5 L nh T` fp32 values
    where SDPA falls back to its explicit path and keeps the attention weights `(B, nh, T, T)`:
    on the CPU with attention dropout or in half precision, and on MPS (CUDA's fused kernels
    keep none).
    Autocast also holds half-precision copies of the weights. About 30% above what autograd
    saves, for the backward pass's temporaries; fitted to measured peaks and checked within 25%
    (benchmarks/plan_memory.py).

    Args:
        config: the config; `train.batch_size` must be a number unless `batch_size` is given.
        vocab_size: the tokenizer's vocabulary.
        device_type: "cpu", "cuda" or "mps".
        dtype: the precision the step computes in (`Precision.name`).
        world_size: DDP processes.
        batch_size: the micro-batch (default: `train.batch_size`).
    """
    m, tc = config.model, config.train
    B = tc.batch_size if batch_size is None else batch_size
    assert isinstance(B, int), "resolve train.batch_size: auto first (llmcli.training.batch)"
    counts = _count_parameters(config, vocab_size)
    params, trainable = counts.base + counts.adapters, counts.trainable
    C, L, T, nh = m.n_embed, m.n_layer, m.context_length, m.n_head
    half = dtype in ("bfloat16", "float16")
    keeps_weights = device_type == "mps" or (
        device_type == "cpu" and (half or m.attention_dropout > 0)
    )
    values = L * (20 * C + (2 * C if m.dropout > 0 else 0)) + 4 * C + 4 * vocab_size
    per_token = (2 if half else 4) * values
    if half:  # the residual stream stays fp32: the norms keep their inputs in it
        per_token += 2 * L * 2 * C
    if keeps_weights:  # in fp32 also under autocast, which runs softmax in fp32
        per_token += 4 * L * 5 * nh * T
    # The objective's rows per example (a DPO pair 2, a GRPO prompt group_size), what it keeps
    # beside the activations (DPO: the reference's logits) and whether it holds a reference.
    terms = objective_for(config).memory_terms(vocab_size)
    rows = terms.rows * B
    per_token += 4 * terms.values_per_token
    # Sampling (GRPO) holds each sampled row's keys and values and a prompt's logits, in fp32.
    sampling = B * terms.sampled_rows * T * (2 * L * C + vocab_size) * 4
    return MemoryEstimate(
        params=params,
        params_non_embedding=counts.non_embedding,
        weights=4 * params + (2 * params if half else 0),
        grads=4 * trainable * (2 if world_size > 1 else 1),
        optimizer=4 * counts.momenta,
        activations=rows * T * per_token,
        runtime=RUNTIME_BYTES.get(device_type, 0),
        reference=4 * counts.base if terms.reference else 0,  # the model without adapters
        sampling=sampling,
        trainable=trainable,
        adapters=counts.adapters,
    )


class _Counts(NamedTuple):
    base: int  # the model's parameters, adapters aside
    adapters: int  # a LoRA run's A and B
    non_embedding: int  # as `Transformer.num_parameters(non_embedding=True)`
    trainable: int
    momenta: int  # the optimizer's state, in values


def _count_parameters(config: Config, vocab_size: int) -> _Counts:
    """The parameters of the config's model, by kind, and the optimizer's state.

    One `Block` and the final norm are built on the meta device, which allocates nothing; the
    embeddings are counted from their shapes. Neither the whole `Transformer` nor the rotary
    embedding (buffers, no parameters) is built there: their `arange`s on the meta device import
    torch's compiler, most of a second of every `train` and `plan`.
    """
    from llmcli.model.gpt import Block
    from llmcli.model.layers import make_norm

    m, lora = config.model, config.train.lora
    with torch.device("meta"):
        block = Block(dataclasses.replace(m, pos_emb="learned"))  # no parameters in the rotation
        final_norm = make_norm(m)
    per_block = sum(p.numel() for p in block.parameters())
    matrices = m.n_layer * sum(p.numel() for p in block.parameters() if p.dim() == 2)
    token = vocab_size * m.n_embed  # the token embedding, also the LM head when tied
    position = m.context_length * m.n_embed if m.pos_emb == "learned" else 0
    head = 0 if m.tie_embeddings else vocab_size * m.n_embed
    body = m.n_layer * per_block + sum(p.numel() for p in final_norm.parameters())
    params = body + token + position + head
    # As `Transformer.num_parameters(non_embedding=True)`: a tied token embedding stays.
    non_embedding = body + (token if m.tie_embeddings else head)
    if lora is None:
        momenta = 2 * params  # AdamW: exp_avg and exp_avg_sq
        if config.train.optimizer == "muon":  # the blocks' matrices (see muon.muon_param_groups)
            momenta -= matrices  # one momentum buffer each, instead of two moments
        return _Counts(params, 0, non_embedding, params, momenta)
    # LoRA: r (in + out) for each adapted layer of each block (`llmcli.model.lora`)
    layers = [block.get_submodule(target) for target in lora.targets]
    adapters = m.n_layer * sum(lora.rank * (f.in_features + f.out_features) for f in layers)
    # New tokens' rows train through the whole matrices' gradients and moments.
    rows = token + head if _adds_tokens(config.train.init_from, vocab_size) else 0
    trainable = adapters + rows
    return _Counts(params, adapters, non_embedding, trainable, 2 * trainable)  # AdamW, even Muon


def _adds_tokens(init_from: str | None, vocab_size: int) -> bool:
    """Whether a LoRA run's vocabulary is larger than its base's (the chat tokens), whose rows
    then train; True where the base cannot be read (the estimate stays an upper bound)."""
    if not init_from:
        return True
    try:
        return vocab_size > base_vocab_size(init_from)
    except (InputError, CheckpointError):
        return True


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of the device (for the CPU: RAM, within a cgroup limit); None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type != "cpu":
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    limit = _cgroup_limit()
    return total if limit is None else min(total, limit[0])


def device_free_bytes(device: torch.device) -> int | None:
    """Memory a run can take now: free GPU memory; for the CPU, the kernel's MemAvailable
    (within a cgroup limit); for MPS, Metal's recommended working set less what is in use;
    None if unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type == "mps":
        mps = getattr(torch, "mps", None)
        if mps is None or not hasattr(mps, "recommended_max_memory"):
            return None
        return max(0, int(mps.recommended_max_memory()) - int(mps.driver_allocated_memory()))
    free = _mem_available()
    limit = _cgroup_limit()
    if limit is not None:
        room = limit[0] - limit[1]
        free = room if free is None else min(free, room)
    return free if free is not None else device_memory_bytes(device)


def _mem_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limit() -> tuple[int, int] | None:
    """(this cgroup's memory limit, its usage now), or None where there is no limit."""
    for folder, limit_name, usage_name in (
        ("/sys/fs/cgroup", "memory.max", "memory.current"),
        ("/sys/fs/cgroup/memory", "memory.limit_in_bytes", "memory.usage_in_bytes"),
    ):
        try:
            limit = (Path(folder) / limit_name).read_text().strip()
            usage = (Path(folder) / usage_name).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit():
            return int(limit), int(usage)
    return None


def check_memory(
    config: Config, vocab_size: int, device: torch.device, dtype: str, world_size: int = 1
) -> None:
    """Refuse a model and batch that cannot fit in the device's memory (or
    `train.memory_limit`), before allocating.

    Raises:
        InputError: the estimate exceeds the memory.
    """
    estimate = estimate_memory(config, vocab_size, device.type, dtype, world_size)
    limit = config.train.memory_limit_bytes
    have = limit if limit is not None else device_memory_bytes(device)
    need = estimate.peak
    if have is None or need <= have:
        return
    where = "train.memory_limit allows" if limit is not None else f"the {device.type} has"
    objective = objective_for(config)
    rows = objective.rows_per_example
    shape = f"{config.train.batch_size} {objective.examples}"
    raise InputError(
        f"training this model needs about {format_bytes(need)} ({format_count(estimate.params)} "
        f"parameters, batches of {shape}, {rows * config.train.batch_size:,} rows of "
        f"{config.model.context_length} tokens) but {where} {format_bytes(have)}: lower "
        f"{objective.memory_knobs}model.n_embed, model.n_layer or "
        "train.batch_size (raise train.grad_accum to keep the tokens per step), or use "
        "train.batch_size: auto with train.tokens_per_step."
    )


def is_out_of_memory(exc: BaseException) -> bool:
    """True for the errors torch and the allocator raise when memory runs out."""
    text = str(exc)
    return (
        isinstance(exc, (MemoryError, torch.OutOfMemoryError))
        or "can't allocate memory" in text
        or "out of memory" in text
    )


@contextlib.contextmanager
def out_of_memory_is_bad_input(device: torch.device, run_dir: Path) -> Iterator[None]:
    """Turn running out of memory into a message that says what to lower."""
    try:
        yield
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(exc):
            raise
        raise InputError(
            f"out of memory on {device} ({str(exc).strip().splitlines()[0][:200]}): lower "
            "train.batch_size (raise train.grad_accum to keep the tokens per step), the model "
            f"size or model.context_length. Any checkpoint saved in '{run_dir}' is intact."
        ) from None
