"""The training loop: optimizer, schedule, evaluation, logging, checkpoints, exact resume, DDP.

`train(config)` trains the model `config.model` describes on the corpus `config.data` names and
writes a run directory (layout in `llmcli.checkpoint`). One optimizer step is `grad_accum`
micro-batches of `batch_size` sequences of `context_length` tokens on every rank.

What a step does not do: read a value back from the device. Losses go into a small on-device
buffer that is read once per log step (every `log_interval` steps), where a NaN or inf is found
and named by its step; nothing else synchronises the host with the device between log steps.

Exact resume. A save records the model, the optimizer, the step (the schedule is a function of
it), the torch / CUDA / NumPy / Python RNG states of every rank and the batch sampler's position.
Evaluation draws from its own samplers, re-seeded at every evaluation, so it never moves the
training stream. A run resumed from a save therefore replays the same batches with the same
random numbers and, on CPU, ends with bitwise-identical weights. `metrics.jsonl` is cut back to
what it held at that save, and the resumed run writes the same records again (only `elapsed_s`
and `tok_per_s` differ).

Distributed. Under `torchrun --nproc_per_node=N -m llmcli train CONFIG` each process reads
RANK / WORLD_SIZE / LOCAL_RANK, joins a process group (gloo on CPU, nccl on CUDA) and wraps the
model in DDP. Rank r draws its own stream: its `BatchSampler(rank=r, world_size=N)`. Gradient
accumulation skips the all-reduce (`no_sync`) on every micro-step but the last. Rank 0 alone
writes files and shows the progress bar; logged losses are averaged over ranks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from llmcli import checkpoint as ckpt
from llmcli.config import Config
from llmcli.device import (
    check_memory,
    format_count,
    is_out_of_memory,
    resolve_device,
    resolve_precision,
)
from llmcli.errors import CheckpointError, InputError, describe_os_error
from llmcli.fileio import atomic_write_bytes, remove_stale_temp_files
from llmcli.optim import apply_lr, build_optimizer
from llmcli.progress import Progress

logger = logging.getLogger(__name__)

# Evaluation batches come from their own samplers with this seed offset, re-created at every
# evaluation: the same batches each time, and the training stream is never touched.
EVAL_SEED_OFFSET = 1_000_003


class DivergenceError(InputError):
    """The loss became NaN or infinite (too high a learning rate, usually)."""


@dataclass
class TrainSummary:
    """What a finished (or already complete) run reports."""

    run_dir: Path
    step: int
    max_steps: int
    tokens: int
    elapsed_s: float
    train_loss: float | None
    val_loss: float | None
    val_ppl: float | None
    best_val_loss: float | None
    tokens_per_s: float | None
    n_params: int
    device: str
    dtype: str
    world_size: int
    rank: int
    resumed_from: int | None


# ---------------------------------------------------------------------------------------------
# Devices, precision, processes
# ---------------------------------------------------------------------------------------------


@dataclass
class DistInfo:
    """This process's place in a torchrun job (rank 0 of 1 when run alone)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def dist_from_env(env: dict[str, str] | None = None) -> DistInfo:
    """Read RANK, LOCAL_RANK and WORLD_SIZE (set by torchrun); absent means a single process."""
    env = dict(os.environ) if env is None else env
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        rank = int(env.get("RANK", "0"))
        local = int(env.get("LOCAL_RANK", str(rank)))
    except ValueError:
        raise InputError(
            "RANK, LOCAL_RANK and WORLD_SIZE must be integers (torchrun sets them): got "
            f"{env.get('RANK')!r}, {env.get('LOCAL_RANK')!r}, {env.get('WORLD_SIZE')!r}."
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise InputError(f"RANK ({rank}) must be in 0..WORLD_SIZE-1 (WORLD_SIZE={world}).")
    return DistInfo(rank=rank, local_rank=local, world_size=world)


def _all_ok(ok: bool, info: DistInfo, device: torch.device) -> bool:
    """True when every rank is ok (a collective: every rank must call it)."""
    if not info.enabled:
        return ok
    flag = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(flag)
    return flag.item() == 0.0


@contextlib.contextmanager
def _agreed(info: DistInfo, device: torch.device) -> Iterator[None]:
    """Run a block that may raise InputError on some ranks; then make every rank agree.

    A rank whose block failed raises its error; the others raise one that points at it, instead
    of waiting forever for a collective the failed rank never joins.
    """
    error: InputError | None = None
    try:
        yield
    except InputError as exc:
        error = exc
    if not _all_ok(error is None, info, device):
        raise error or InputError("another rank failed during set-up; see its error message.")


# ---------------------------------------------------------------------------------------------
# RNG state
# ---------------------------------------------------------------------------------------------


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed % 2**32)


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every RNG state this process uses, as tensors and plain data (weights_only-loadable)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": (
            name,
            torch.from_numpy(keys.astype(np.int64)),
            int(pos),
            int(has_gauss),
            float(cached),
        ),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    """Restore what `rng_state` returned."""
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------------------------


class StopRequest:
    """Turns SIGINT (Ctrl-C) and SIGTERM into a request to save and stop after the current step.

    Alone, a second signal raises KeyboardInterrupt at once (every file is written atomically,
    so even that leaves a loadable run). Under torchrun (`escalate=False`) a second signal is
    expected, since torchrun forwards the terminal's Ctrl-C to workers that got it already, and
    only repeats the request. Installed only in the main thread, where signals arrive.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, escalate: bool = True) -> None:
        self.requested = False
        self.escalate = escalate
        self._previous: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.requested:
            if self.escalate:
                raise KeyboardInterrupt
            return
        self.requested = True
        logger.warning(
            "%s: saving a checkpoint after this step%s",
            signal.Signals(signum).name,
            " (press Ctrl-C again to quit at once)" if self.escalate else "",
        )

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handler)
        return self

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()


# ---------------------------------------------------------------------------------------------
# Metrics and the loss curve
# ---------------------------------------------------------------------------------------------


class MetricsLog:
    """Appends JSON records to `metrics.jsonl` (rank 0), knowing its size at each save."""

    def __init__(self, path: Path, keep_bytes: int | None) -> None:
        self.path = path
        if keep_bytes is not None and path.exists() and path.stat().st_size > keep_bytes:
            # Records written after the save we resume from are written again by this run.
            atomic_write_bytes(path, path.read_bytes()[:keep_bytes])
        elif keep_bytes is None and path.exists():
            path.unlink()
        self._fh = open(path, "ab")  # noqa: SIM115 - closed by close()
        self.size = self._fh.tell()

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, allow_nan=True) + "\n").encode("utf-8")
        try:
            self._fh.write(line)
            self._fh.flush()
        except OSError as exc:
            raise CheckpointError(
                f"cannot write '{self.path}': {describe_os_error(exc)}. The last saved "
                "checkpoint is intact: fix the problem and continue with --resume."
            ) from None
        self.size += len(line)

    def close(self) -> None:
        self._fh.close()


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a `metrics.jsonl` (a torn last line, from a crash, is skipped)."""
    records = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return records
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def plot_losses(metrics_path: Path, out_path: Path) -> None:
    """Draw train and val loss against steps from `metrics.jsonl` into a PNG (atomically)."""
    import io

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path)
    train = [(r["step"], r["train_loss"]) for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig = Figure(figsize=(7, 4.2), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if train:
        ax.plot(
            *zip(*train, strict=True), color="tab:blue", alpha=0.45, lw=1, label="train (batch)"
        )
    if evals:
        steps = [r["step"] for r in evals]
        ax.plot(
            steps,
            [r["train_loss"] for r in evals],
            "o-",
            color="tab:blue",
            ms=3,
            label="train (eval)",
        )
        ax.plot(steps, [r["val_loss"] for r in evals], "o-", color="tab:orange", ms=3, label="val")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.set_title(metrics_path.parent.name)
    ax.grid(alpha=0.3)
    if train or evals:
        ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    atomic_write_bytes(out_path, buffer.getvalue())


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(
    model: nn.Module,
    samplers: dict[str, Any],
    eval_steps: int,
    autocast: Callable[[], contextlib.AbstractContextManager],
    info: DistInfo,
    device: torch.device,
) -> dict[str, float]:
    """Mean loss over `eval_steps` batches of each sampler (averaged over ranks).

    Args:
        model: the model to evaluate (put in eval mode here, back to train mode after).
        samplers: split name -> a fresh sampler whose `next()` gives `(x, y)`, each `(B, T)`.

    Returns:
        split name -> mean loss.
    """
    was_training = model.training
    model.eval()
    totals = torch.zeros(len(samplers), device=device)
    for i, sampler in enumerate(samplers.values()):
        for _ in range(eval_steps):
            x, y = sampler.next()  # (B, T), (B, T)
            with autocast():
                _, loss = model(x, y)
            totals[i] += loss.float()
    totals /= eval_steps
    if info.enabled:
        dist.all_reduce(totals)
        totals /= info.world_size
    model.train(was_training)
    return dict(zip(samplers, totals.tolist(), strict=True))


def _ppl(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


# ---------------------------------------------------------------------------------------------
# The run directory
# ---------------------------------------------------------------------------------------------

_RUN_FILES = (
    ckpt.MODEL_FILE,
    ckpt.BEST_FILE,
    ckpt.STATE_FILE,
    ckpt.META_FILE,
    ckpt.METRICS_FILE,
    ckpt.PLOT_FILE,
)


def default_run_dir(config: Config) -> Path:
    """`train.out_dir`, else `checkpoints/<config file stem>`."""
    return Path(config.train.out_dir) if config.train.out_dir else Path("checkpoints") / config.name


def _prepare_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Check the run directory can be written and holds what `resume` / `overwrite` expect."""
    state = run_dir / ckpt.STATE_FILE
    if resume:
        if not state.is_file():
            raise CheckpointError(
                f"--resume: nothing to resume in '{run_dir}' (no {ckpt.STATE_FILE}; a run saves "
                "one at its first evaluation). Start it without --resume."
            )
        ckpt.ensure_run_dir(run_dir)
        return
    ckpt.ensure_run_dir(run_dir)
    if not overwrite and (state.exists() or (run_dir / ckpt.MODEL_FILE).exists()):
        meta = ckpt.read_meta(run_dir)
        at = f" (step {meta['step']})" if "step" in meta else ""
        raise CheckpointError(
            f"'{run_dir}' already holds a run{at}: continue it with --resume, start it afresh "
            "with --overwrite, or write elsewhere with --out DIR."
        )
    for name in _RUN_FILES:
        with contextlib.suppress(FileNotFoundError):
            (run_dir / name).unlink()


# What `save` writes into the resume state, by type: checked before any of it is used.
_STATE_LAYOUT: dict[str, type | tuple[type, ...]] = {
    "config": dict,
    "model": dict,
    "optimizer": dict,
    "rng": list,
    "sampler": list,
    "step": int,
    "tokens": int,
    "elapsed_s": (int, float),
    "metrics_bytes": int,
}


def _check_resumable(state: dict[str, Any], config: Config, run_dir: Path, vocab: int) -> None:
    bad = [k for k, kind in _STATE_LAYOUT.items() if not isinstance(state.get(k), kind)]
    if not bad and not (
        state["rng"]
        and len(state["rng"]) == len(state["sampler"])
        and all(isinstance(x, dict) for x in state["rng"] + state["sampler"])
    ):
        bad = ["rng", "sampler"]
    if bad:
        raise CheckpointError(
            f"resume state '{run_dir / ckpt.STATE_FILE}' is incomplete or malformed (missing or "
            f"wrong: {', '.join(bad)}); it was not written by this version of llmcli. Remove "
            "it to start afresh, or restore it from a backup."
        )
    saved_optimizer = state["config"].get("train", {}).get("optimizer", "adamw")
    if saved_optimizer != config.train.optimizer:
        raise CheckpointError(
            f"cannot resume '{run_dir}' with train.optimizer={config.train.optimizer!r}: it was "
            f"trained with {saved_optimizer!r}, whose saved state does not carry over. Resume "
            f"with --set train.optimizer={saved_optimizer}, or start a new run with --out DIR."
        )
    saved = state["config"].get("model", {})
    now = config.to_dict()["model"]
    diff = [
        f"model.{k}: saved {saved.get(k)!r}, config {v!r}"
        for k, v in now.items()
        if saved.get(k) != v
    ]
    if diff:
        raise CheckpointError(
            f"cannot resume '{run_dir}': the config's model differs from the saved one "
            f"({'; '.join(diff)}). Resume with the run's own config ({run_dir / ckpt.CONFIG_FILE}) "
            "or start a new run with --out DIR."
        )
    if state.get("vocab_size") != vocab:
        raise CheckpointError(
            f"cannot resume '{run_dir}': its tokenizer has {vocab} tokens but the saved model "
            f"has {state.get('vocab_size')}; the run's files come from different runs."
        )


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def train(
    config: Config,
    *,
    out_dir: str | Path | None = None,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    on_step: Callable[[int], None] | None = None,
) -> TrainSummary:
    """Train `config`'s model on its corpus, writing a run directory; resumable, DDP-aware.

    Args:
        config: a validated config.
        out_dir: the run directory (default `train.out_dir`, else `checkpoints/<config name>`).
        resume: continue the run saved in the run directory exactly where it was saved.
        overwrite: start afresh even if the run directory already holds a run.
        progress: show the tqdm bar (rank 0).
        on_step: called with the step number after every optimizer step (for tests: it may
            raise or send a signal to simulate a crash or Ctrl-C at a chosen step).

    Returns:
        A `TrainSummary` (on every rank; only rank 0 wrote files).

    Raises:
        InputError: bad config, data, device or run directory, or a diverging loss
            (`DivergenceError`); each message says what to change.
        KeyboardInterrupt: after Ctrl-C, once the checkpoint is saved.
    """
    t_start = time.perf_counter()
    info = dist_from_env()
    tc = config.train
    device = resolve_device(tc.device, info.local_rank)
    dtype_name, amp_dtype, use_scaler = resolve_precision(device, tc.dtype)
    run_dir = Path(out_dir) if out_dir is not None else default_run_dir(config)

    started_pg = False
    if info.enabled and not dist.is_initialized():
        if device.type == "mps":
            raise InputError("distributed training needs CUDA or the CPU, not MPS.")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo", rank=info.rank, world_size=info.world_size
        )
        started_pg = True
    try:
        return _train(
            config,
            info,
            device,
            dtype_name,
            amp_dtype,
            use_scaler,
            run_dir,
            resume,
            overwrite,
            progress,
            on_step,
            t_start,
        )
    except (MemoryError, RuntimeError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        if not is_out_of_memory(exc):
            raise
        raise InputError(
            f"out of memory on {device} ({str(exc).strip().splitlines()[0][:200]}): lower "
            "train.batch_size (raise train.grad_accum to keep the tokens per step), the model "
            f"size or model.context_length. Any checkpoint saved in '{run_dir}' is intact."
        ) from None
    finally:
        if started_pg:
            dist.destroy_process_group()


def _train(
    config: Config,
    info: DistInfo,
    device: torch.device,
    dtype_name: str,
    amp_dtype: torch.dtype | None,
    use_scaler: bool,
    run_dir: Path,
    resume: bool,
    overwrite: bool,
    progress: bool,
    on_step: Callable[[int], None] | None,
    t_start: float,
) -> TrainSummary:
    from tqdm.contrib.logging import logging_redirect_tqdm

    from llmcli.data import BatchSampler, prepare_data
    from llmcli.model import Transformer

    tc = config.train
    if tc.init_from:  # a Hugging Face GPT-2 folder sets the model's shape and the tokenizer
        from llmcli.hf import resolve_init_from

        config = resolve_init_from(config)
    ctx = config.model.context_length

    # --- run directory, resume state, data: every rank agrees before going on ---------------
    state: dict[str, Any] | None = None
    with _agreed(info, device):
        if info.main:
            _prepare_run_dir(run_dir, resume, overwrite)
    with _agreed(info, device):
        if resume:
            state = ckpt.load_state(run_dir)
    tokenizer = ckpt.load_tokenizer_file(run_dir) if resume else None
    # Rank 0 tokenizes first and fills the cache; the others then read it.
    data = None
    with _agreed(info, device):
        if info.main:
            data = prepare_data(config.data, ctx, tokenizer=tokenizer)
    with _agreed(info, device):
        if not info.main:
            data = prepare_data(config.data, ctx, tokenizer=tokenizer)
    assert data is not None
    tokenizer = data.tokenizer
    vocab = int(tokenizer.vocab_size)
    if state is not None:
        _check_resumable(state, config, run_dir, vocab)
        if state.get("source_hash") not in (None, data.source_hash) and info.main:
            logger.warning(
                "the corpus changed since this run was saved: the resumed run will "
                "not match an uninterrupted one"
            )

    # --- model, optimizer, samplers ------------------------------------------------------------
    check_memory(config, vocab, device)
    model = Transformer.from_config(
        config.model, vocab, generator=torch.Generator().manual_seed(tc.seed)
    )
    if tc.init_from and state is None:  # a resumed run's weights come from its state
        from llmcli.hf import load_gpt2_weights

        load_gpt2_weights(model, tc.init_from)
    model.to(device)
    optimizer = build_optimizer(model, tc, device.type)
    scaler = torch.amp.GradScaler(device.type) if use_scaler else None
    _seed_everything(tc.seed + info.rank)
    with _agreed(info, device):
        sampler = BatchSampler(
            data.train,
            tc.batch_size,
            ctx,
            seed=tc.seed,
            rank=info.rank,
            world_size=info.world_size,
            device=device,
        )

    def eval_samplers() -> dict[str, Any]:
        return {
            split: BatchSampler(
                tokens,
                tc.batch_size,
                ctx,
                seed=tc.seed + EVAL_SEED_OFFSET,
                rank=info.rank,
                world_size=info.world_size,
                device=device,
            )
            for split, tokens in (("train", data.train), ("val", data.val))
        }

    with _agreed(info, device):
        eval_samplers()  # a corpus too small for the batch and context fails here, not later

    step, tokens, elapsed_base, best_val = 0, 0, 0.0, math.inf
    best_step: int | None = None
    last_eval: dict[str, float] = {}
    if state is not None:
        model.load_state_dict(state["model"])
        # Moments and step counts from the save; hyperparameters from today's config.
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        optimizer.load_state_dict(state["optimizer"])
        for group, values in zip(optimizer.param_groups, fresh, strict=True):
            group.update(values)
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        saved_world = len(state["rng"])
        if saved_world != info.world_size and info.main:
            logger.warning(
                "resuming a %d-process run with %d processes: batches and random "
                "numbers will differ from an uninterrupted run",
                saved_world,
                info.world_size,
            )
        own = min(info.rank, saved_world - 1)
        set_rng_state(state["rng"][own], device)
        sampler.load_state_dict(state["sampler"][own])
        step, tokens = int(state["step"]), int(state["tokens"])
        elapsed_base = float(state["elapsed_s"])
        best_val = float(state.get("best_val_loss", math.inf))
        best_step = state.get("best_step")
        last_eval = dict(state.get("last_eval", {}))
    resumed_from = step if state is not None else None

    fwd_model: nn.Module = torch.compile(model) if tc.compile else model
    train_model: nn.Module = fwd_model
    if info.enabled:
        from torch.nn.parallel import DistributedDataParallel

        train_model = DistributedDataParallel(
            fwd_model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    def autocast() -> contextlib.AbstractContextManager:
        if amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=amp_dtype)

    n_params = model.num_parameters()
    params = list(model.parameters())
    tokens_per_step = tc.batch_size * ctx * tc.grad_accum * info.world_size
    summary_args = dict(
        run_dir=run_dir,
        max_steps=tc.max_steps,
        n_params=n_params,
        device=str(device),
        dtype=dtype_name,
        world_size=info.world_size,
        rank=info.rank,
        resumed_from=resumed_from,
    )

    if step >= tc.max_steps:
        if info.main:
            logger.info(
                "'%s' already finished at step %d (train.max_steps = %d): raise "
                "train.max_steps to train further",
                run_dir,
                step,
                tc.max_steps,
            )
        return _summary(summary_args, step, tokens, elapsed_base, last_eval, best_val, None)

    metrics: MetricsLog | None = None
    if info.main:
        remove_stale_temp_files(run_dir)
        try:
            ckpt.write_config_and_tokenizer(run_dir, config, tokenizer)
            metrics = MetricsLog(
                run_dir / ckpt.METRICS_FILE,
                int(state["metrics_bytes"]) if state is not None else None,
            )
        except OSError as exc:
            raise CheckpointError(
                f"cannot write the run files in '{run_dir}': {describe_os_error(exc)}. "
                "Any checkpoint saved there is intact; fix the problem and run again."
            ) from None
        for note in tc.short_run_notes():
            logger.warning(note)
        logger.info(
            "%s run '%s': %s parameters, %s on %s%s, %d tokens per step, steps %d..%d",
            "resuming" if state is not None else "starting",
            run_dir,
            format_count(n_params),
            dtype_name,
            device,
            f" x{info.world_size}" if info.enabled else "",
            tokens_per_step,
            step + 1,
            tc.max_steps,
        )
    state = None  # the saved weights and moments are in the model and optimizer now

    # On-device per-step losses since the last log step; the extra slot carries the
    # Ctrl-C flag through the same all-reduce under DDP.
    loss_buf = torch.zeros(tc.log_interval + 1, device=device)
    n_buf = 0
    last_saved = step if resumed_from is not None else -1
    session_start, session_step = time.perf_counter(), step
    last_log_time, last_log_tokens = session_start, tokens
    lr = 0.0

    def elapsed() -> float:
        return elapsed_base + time.perf_counter() - t_start

    def save(at_step: int, best: bool) -> None:
        nonlocal last_saved
        rng = rng_state(device)
        sampler_state = sampler.state_dict()
        if info.enabled:
            gathered: list[Any] = [None] * info.world_size
            dist.all_gather_object(gathered, (rng, sampler_state))
            rngs, samplers = [g[0] for g in gathered], [g[1] for g in gathered]
        else:
            rngs, samplers = [rng], [sampler_state]
        if info.main:
            assert metrics is not None
            meta = {
                "step": at_step,
                "max_steps": tc.max_steps,
                "tokens": tokens,
                "elapsed_s": round(elapsed(), 3),
                "best_val_loss": _finite(best_val),
                "best_step": best_step,
                "last_eval": last_eval,
                "vocab_size": vocab,
                "n_params": n_params,
                "device": str(device),
                "dtype": dtype_name,
                "world_size": info.world_size,
                "versions": ckpt.versions(),
            }
            train_state = {
                "step": at_step,
                "tokens": tokens,
                "elapsed_s": elapsed(),
                "best_val_loss": best_val,
                "best_step": best_step,
                "last_eval": last_eval,
                "metrics_bytes": metrics.size,
                "vocab_size": vocab,
                "source_hash": data.source_hash,
                "config": config.to_dict(),
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scaler": scaler.state_dict() if scaler is not None else {},
                "rng": rngs,
                "sampler": samplers,
            }
            try:
                ckpt.save_checkpoint(run_dir, model, train_state, meta, best=best)
            except OSError as exc:
                previous = f"step {last_saved}" if last_saved >= 0 else "none yet"
                raise CheckpointError(
                    f"could not save the checkpoint of step {at_step} in '{run_dir}': "
                    f"{describe_os_error(exc)}. The previous checkpoint ({previous}) is "
                    "intact; fix the problem and continue with --resume."
                ) from None
        last_saved = at_step

    def diverged(at_step: int, value: float) -> DivergenceError:
        kept = (
            f"the last good checkpoint (step {last_saved}) in '{run_dir}' is intact"
            if last_saved >= 0
            else "no checkpoint was saved before it"
        )
        return DivergenceError(
            f"the loss became {value} at step {at_step}: training diverged, {kept}. Lower "
            f"the learning rate (train.lr = {tc.lr:g}; try --set train.lr={tc.lr / 3:.3g}), "
            "or raise train.warmup_steps or lower train.grad_clip."
        )

    bar = Progress(
        tc.max_steps, desc="train", unit="step", initial=step, enabled=progress and info.main
    )
    with (
        StopRequest(escalate=not info.enabled) as stop,
        logging_redirect_tqdm(),
        bar,
    ):
        try:
            while step < tc.max_steps:
                lr = apply_lr(optimizer, step, tc)
                for micro in range(tc.grad_accum):
                    x, y = sampler.next()  # (B, T), (B, T) on device
                    sync = (
                        train_model.no_sync()
                        if info.enabled and micro < tc.grad_accum - 1
                        else contextlib.nullcontext()
                    )
                    with sync:
                        with autocast():
                            _, loss = train_model(x, y)
                        loss = loss / tc.grad_accum  # the micro-batches' mean, summed below
                        (scaler.scale(loss) if scaler is not None else loss).backward()
                    loss_buf[n_buf] += loss.detach()
                if tc.grad_clip > 0:
                    if scaler is not None:
                        scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(params, tc.grad_clip, foreach=True)
                if scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                n_buf += 1
                tokens += tokens_per_step
                bar.update(1)
                if on_step is not None:
                    on_step(step)

                is_eval = step % tc.eval_interval == 0 or step == tc.max_steps
                local_stop = stop.requested
                is_log = step % tc.log_interval == 0 or is_eval
                if not (is_log or (local_stop and not info.enabled)):
                    continue

                # --- log step: the one place the host reads the device ----------------------
                loss_buf[-1] = 1.0 if local_stop else 0.0
                if info.enabled:
                    dist.all_reduce(loss_buf)
                    loss_buf[:-1] /= info.world_size
                values = loss_buf.tolist()
                loss_buf.zero_()
                stopping = values[-1] > 0
                losses = values[:n_buf]
                first = step - n_buf + 1
                n_buf = 0
                for i, value in enumerate(losses):
                    if not math.isfinite(value):
                        raise diverged(first + i, value)
                now = time.perf_counter()
                tok_s = (tokens - last_log_tokens) / max(now - last_log_time, 1e-9)
                last_log_time, last_log_tokens = now, tokens
                if info.main and is_log:  # (a stop between log steps writes no record)
                    assert metrics is not None
                    metrics.write(
                        {
                            "kind": "train",
                            "step": step,
                            "tokens": tokens,
                            "elapsed_s": round(elapsed(), 3),
                            "lr": lr,
                            "train_loss": losses[-1],
                            "tok_per_s": round(tok_s, 1),
                        }
                    )
                    bar.report(
                        {"loss": f"{losses[-1]:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tok_s:,.0f}"}
                    )

                if is_eval:
                    last_eval = evaluate(
                        fwd_model, eval_samplers(), tc.eval_steps, autocast, info, device
                    )
                    val = last_eval["val"]
                    if not math.isfinite(val):
                        raise diverged(step, val)
                    best = val < best_val
                    if best:
                        best_val, best_step = val, step
                    if info.main:
                        assert metrics is not None
                        metrics.write(
                            {
                                "kind": "eval",
                                "step": step,
                                "tokens": tokens,
                                "elapsed_s": round(elapsed(), 3),
                                "lr": lr,
                                "train_loss": last_eval["train"],
                                "val_loss": val,
                                "val_ppl": _ppl(val),
                            }
                        )
                        logger.info(
                            "step %d: train loss %.4f, val loss %.4f (ppl %.2f)%s",
                            step,
                            last_eval["train"],
                            val,
                            _ppl(val),
                            ", best so far" if best else "",
                        )
                        try:
                            plot_losses(run_dir / ckpt.METRICS_FILE, run_dir / ckpt.PLOT_FILE)
                        except OSError as exc:
                            logger.warning(
                                "could not draw %s: %s", ckpt.PLOT_FILE, describe_os_error(exc)
                            )
                    save(step, best)
                    last_log_time = time.perf_counter()  # tok/s measures training steps only
                if stopping:
                    if last_saved != step:
                        save(step, False)
                    if info.main:
                        logger.warning(
                            "stopped at step %d; the checkpoint in '%s' is saved: "
                            "continue with the same command and --resume",
                            step,
                            run_dir,
                        )
                    raise KeyboardInterrupt
        finally:
            if metrics is not None:
                metrics.close()

    session_s = time.perf_counter() - session_start
    tok_rate = (step - session_step) * tokens_per_step / session_s if session_s > 0 else None
    return _summary(summary_args, step, tokens, elapsed(), last_eval, best_val, tok_rate)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _summary(
    args: dict[str, Any],
    step: int,
    tokens: int,
    elapsed_s: float,
    last_eval: dict[str, float],
    best_val: float,
    tok_rate: float | None,
) -> TrainSummary:
    val = last_eval.get("val")
    return TrainSummary(
        step=step,
        tokens=tokens,
        elapsed_s=elapsed_s,
        train_loss=last_eval.get("train"),
        val_loss=val,
        val_ppl=_ppl(val) if val is not None else None,
        best_val_loss=_finite(best_val),
        tokens_per_s=tok_rate,
        **args,
    )
