"""Building a training run: everything the loop works with, fresh or restored from a save.

`build_run` tokenizes the corpus and makes the run directory ready (a fresh start reads all its
input first, so that bad data or a bad `train.init_from` leaves the folder as it was; a resume
first reads the run's state and tokenizer), settles the micro-batch (`train.batch_size: auto`,
`llmcli.training.batch`), builds the model (from `train.init_from`'s weights,
`llmcli.training.init_from`), optimizer and batch sampler (conversations' for chat data, packed
with `data.packing` and scored by their own loss function), puts the save back when resuming
(`llmcli.training.checkpoint.restore`), and wraps the model for `train.compile` and DDP. Every
rank checks each stage with the others (`agreed`) before going on, so that a bad input on one
rank stops them all with its message.

What it builds is a `Run`: a record of the parts, each with a narrow job, that the loop
(`llmcli.training.loop.fit`) hands to the helpers that use them. `started` builds it inside what
a run trains within (its threads, the process group, out-of-memory messages).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from llmcli.config import Config
from llmcli.data.prepared import TokenData
from llmcli.data.tokenizer import Tokenizer
from llmcli.device import resolve_device, torch_threads
from llmcli.errors import CheckpointError, InputError
from llmcli.evaluation.probe import make_probe
from llmcli.model.gpt import Transformer
from llmcli.objectives import objective_for
from llmcli.runs.directory import (
    META_FILE,
    check_fresh_start,
    claim_run_dir,
    default_run_dir,
    prepare_run_dir,
    resumes,
)
from llmcli.runs.formats import read_meta
from llmcli.runs.loading import load_tokenizer_file
from llmcli.runs.trackers import check_available
from llmcli.training.batch import resolve_batch, with_micro_batch
from llmcli.training.checkpoint import Checkpointer, restore
from llmcli.training.compiling import MEASURE_S, choose, compiled, inductor_cache, step_key
from llmcli.training.counters import TrainState
from llmcli.training.distributed import (
    DistInfo,
    agreed,
    dist_from_env,
    gather,
    process_group,
    sum_over_ranks,
)
from llmcli.training.evaluate import EVAL_SEED_OFFSET, Evaluator, split_sampler
from llmcli.training.guard import Divergence, SpikeGuard
from llmcli.training.init_from import load_init_weights, reference_model, resolve_init_from
from llmcli.training.lora import adapt_model, lora_meta, trains_base
from llmcli.training.memory import check_memory, estimate_memory, out_of_memory_is_bad_input
from llmcli.training.mfu import peak_flops
from llmcli.training.plan import flops_per_token, measure_step
from llmcli.training.precision import Precision
from llmcli.training.rng import seed_everything
from llmcli.training.run_facts import RunFacts
from llmcli.training.state import ResumeState, describe_changes
from llmcli.training.step import Trainer, make_trainer

logger = logging.getLogger(__name__)


@dataclass
class Run:
    """What the training loop works with, built by `build_run`: a record of parts, each with a
    narrow job, and no behaviour of its own.

    Attributes:
        config: the run's config, the micro-batch settled (`train.batch_size` a number).
        info: this process's place under torchrun.
        data: the corpus's token data and tokenizer.
        model: the model, unwrapped: what is saved and scored.
        trainer: what a step needs: the model as steps run it, optimizer, batches.
        state: the loop's counters.
        facts: what the run is (its folder, size, device), fixed when it is built.
        checkpoints: saves the run and rolls it back.
        evaluate: the loop's evaluation.
        guard: the spike guard (`train.spike_guard`), the step's `before_update`; else None.
        divergence: stops the run when its loss is not finite.
        shrinks: whether running out of memory in the first steps may shrink the micro-batch
            (an automatic one, in a fresh run in one process: under DDP one rank alone cannot
            change the batch).
    """

    config: Config
    info: DistInfo
    data: TokenData
    model: Transformer
    trainer: Trainer
    state: TrainState
    facts: RunFacts
    checkpoints: Checkpointer
    evaluate: Evaluator
    guard: SpikeGuard | None
    divergence: Divergence
    shrinks: bool


@contextlib.contextmanager
def started(
    config: Config, out_dir: str | Path | None, resume: bool | str, overwrite: bool
) -> Iterator[Run]:
    """The run `build_run` builds, inside what it trains within: its CPU threads (`train.threads`),
    the process group under torchrun, and out-of-memory errors turned into messages.

    Args:
        config: a validated config.
        out_dir: the run directory (None: `train.out_dir`, else `checkpoints/<config name>`).
        resume: continue the run saved there; "auto": if there is one.
        overwrite: start afresh over a run (or files that are not a run's, which are kept).

    Raises:
        InputError: both `resume` and `overwrite`, a missing tracker package, a bad device,
            another process writing the run directory (`claim_run_dir`); and whatever
            building the run refuses.
    """
    session_start = time.perf_counter()
    if resume and overwrite:
        raise InputError(
            f"--resume{' auto' if resume == 'auto' else ''} and --overwrite contradict each "
            "other: continue the run in the folder, or start it afresh; give one of them."
        )
    check_available(config.train.loggers)  # a missing tracker package: before any work
    info = dist_from_env()
    device = resolve_device(config.train.device, info.local_rank)
    precision = Precision.resolve(device, config.train.dtype)
    run_dir = Path(out_dir) if out_dir is not None else default_run_dir(config)
    with (
        torch_threads(config.train.threads),
        process_group(info, device),
        contextlib.ExitStack() as claim,
        out_of_memory_is_bad_input(device, run_dir),
    ):
        with agreed(info, device):  # rank 0 writes the run; refused, it stops every rank
            if info.main:
                claim.enter_context(claim_run_dir(run_dir))
        yield build_run(config, info, precision, run_dir, resume, overwrite, session_start)


def build_run(
    config: Config,
    info: DistInfo,
    precision: Precision,
    run_dir: Path,
    resume: bool | str,
    overwrite: bool,
    session_start: float,
) -> Run:
    """The run directory, data, model, optimizer and samplers, restored from a save if resuming.

    Every rank checks each stage with the others (`agreed`) before going on, so that a bad
    input on one rank stops them all with its message.
    """
    tc, device = config.train, precision.device
    if tc.compile is not False:  # before torch looks for its cache folder, which it then keeps
        inductor_cache()
    if tc.init_from:  # a run or a Hugging Face folder sets the model's shape and the tokenizer
        config = resolve_init_from(config)
    saved, data, resumed = _prepare(config, info, device, run_dir, resume, overwrite)
    vocab = int(data.tokenizer.vocab_size)
    auto_batch = tc.batch_size == "auto"
    config = _resolve_batch(config, vocab, precision, info, saved)
    tc = config.train
    if saved is not None and info.main:  # resolved as the saved run's: batch_size auto is a number
        changes = saved.changed_settings(config)
        if changes:
            logger.warning("%s", describe_changes(changes))
    with agreed(info, device):  # a step that cannot fit: refused before the folder is made
        check_memory(config, vocab, device, precision.name, info.world_size)
    with agreed(info, device):
        if info.main and not resumed:
            prepare_run_dir(run_dir, resumed, overwrite)
    model, trainer = _model_and_trainer(config, data, precision, info, fresh=saved is None)
    state = TrainState(session_start=session_start)
    guard = None
    if tc.spike_guard:  # under fp16 the GradScaler judges the gradients
        guard = SpikeGuard(tc, state, info, judge_norm=not precision.scales_loss)
    with agreed(info, device):  # a corpus too small for the batch and context fails here
        for split in ("train", "val"):
            split_sampler(data, split, config, tc.seed + EVAL_SEED_OFFSET, info, device)
    if saved is not None:
        restore(saved, state, model, trainer, guard, info)
    meta = read_meta(run_dir / META_FILE) if saved is not None else {}
    trainer.model = _compiled(model, config, vocab, precision, state.step, meta.get("compiled"))
    facts = _facts(config, data, model, trainer, info, run_dir, saved, meta)
    if info.enabled:
        device_ids = [device.index] if device.type == "cuda" else None
        trainer.model = DistributedDataParallel(trainer.model, device_ids=device_ids)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    probe = None
    # Rank 0 scores the heads, where their scores mean something: not on a preference or reward
    # loss, nor on a LoRA run's frozen base (its adapters leave the heads the base's).
    objective = objective_for(config)
    if tc.head_metrics and info.main and objective.head_metrics and trains_base(model):
        probe = make_probe(data.tokenizer, config.model.context_length)
    evaluated = trainer.model.module if info.enabled else trainer.model  # no DDP forward
    return Run(
        config=config,
        info=info,
        data=data,
        model=model,
        trainer=trainer,
        state=state,
        facts=facts,
        checkpoints=Checkpointer(facts, info, model, trainer, guard),
        evaluate=Evaluator(
            evaluated, model, data, precision, info, probe, trainer.loss_fn, objective
        ),
        guard=guard,
        divergence=Divergence(tc, run_dir, guarded=guard is not None),
        shrinks=auto_batch and not info.enabled and saved is None,
    )


def _model_and_trainer(
    config: Config, data: TokenData, precision: Precision, info: DistInfo, fresh: bool
) -> tuple[Transformer, Trainer]:
    """The model (a fresh run's from `train.init_from`'s weights, if any), its optimizer and
    the training batches, seeded by `train.seed` (each rank's stream its own)."""
    tc, device = config.train, precision.device
    vocab = int(data.tokenizer.vocab_size)
    model = Transformer(config.model, vocab, generator=torch.Generator().manual_seed(tc.seed))
    if tc.init_from and fresh:  # a resumed run's weights come from its state
        load_init_weights(model, tc.init_from)
    no_decay = adapt_model(model, tc)  # LoRA's adapters (a resumed run's from its state)
    model.to(device)
    seed_everything(tc.seed + info.rank)
    objective = objective_for(config)
    with agreed(info, device):
        sampler = split_sampler(data, "train", config, tc.seed, info, device, training=True)
    trainer = make_trainer(model, tc, precision, sampler, no_decay)
    reference = reference_model(config, vocab, device) if objective.needs_reference else None
    sum_ranks = sum_over_ranks if info.enabled else None
    objective.wire(trainer, model, data, reference, info.world_size, sum_ranks)
    return model, trainer


def _facts(
    config: Config,
    data: TokenData,
    model: Transformer,
    trainer: Trainer,
    info: DistInfo,
    run_dir: Path,
    saved: ResumeState | None,
    meta: dict,
) -> RunFacts:
    """What the run is, for its `meta.json`, log lines and summary (before the DDP wrapper:
    `trainer.model` is `model` unless compiled); a resumed run's tokenizer comes from the run,
    and how it was made from its `meta.json`."""
    tc, precision = config.train, trainer.precision
    vocab = int(data.tokenizer.vocab_size)
    memory = estimate_memory(config, vocab, precision.device.type, precision.name, info.world_size)
    return RunFacts(
        run_dir=run_dir,
        n_params=model.num_parameters(),
        vocab_size=vocab,
        device=str(trainer.precision.device),
        dtype=trainer.precision.name,
        world_size=info.world_size,
        rank=info.rank,
        tokens_per_step=tc.batch_size * config.example_tokens * tc.grad_accum * info.world_size,
        resumed_from=saved.counters.step if saved is not None else None,
        config_name=config.name,
        compiled=trainer.model is not model,
        source_hash=data.source_hash,
        tokenizer_training=meta.get("tokenizer_training")
        if saved is not None
        else data.tokenizer_training,
        meta_rows=objective_for(config).meta_rows(data) | lora_meta(model, tc.init_from),
        metrics_bytes=saved.metrics_bytes if saved is not None else None,
        head_metrics_bytes=saved.head_metrics_bytes if saved is not None else None,
        flops_per_token=flops_per_token(config, memory),
        peak_flops=peak_flops(precision.device, getattr(torch, precision.name)),
    )


def _resolve_batch(
    config: Config, vocab: int, precision: Precision, info: DistInfo, saved: ResumeState | None
) -> Config:
    """The config with the micro-batch and accumulation the run trains with (see
    `llmcli.training.batch.resolve_batch`), the same on every rank."""
    auto = config.train.batch_size == "auto"
    with agreed(info, precision.device):  # a rank whose memory is too small stops them all
        config = resolve_batch(
            config,
            vocab,
            precision.device,
            precision.name,
            info.world_size,
            None if saved is None else saved.config,
        )
    if auto and info.enabled:  # GPUs' free memory differs: all take the smallest choice
        config = with_micro_batch(config, min(gather(config.train.batch_size, info)))
    return config


def _prepare(
    config: Config,
    info: DistInfo,
    device: torch.device,
    run_dir: Path,
    resume: bool | str,
    overwrite: bool,
) -> tuple[ResumeState | None, TokenData, bool]:
    """Check the run directory, load the resume state, tokenize the data: (saved state, data,
    whether the run resumes).

    A fresh start only checks the folder here; `build_run` prepares it (made, an earlier run's
    files removed) once the data is read and the step fits: bad input changes nothing there.
    """
    saved: ResumeState | None = None
    resume = resumes(run_dir, resume)  # before rank 0 prepares the folder
    with agreed(info, device):
        if info.main:
            if resume:
                prepare_run_dir(run_dir, resume, overwrite)
            elif not overwrite:
                check_fresh_start(run_dir)
    with agreed(info, device):
        if resume:
            saved = ResumeState.load(run_dir)
    with agreed(info, device):
        _check_same_save(saved, run_dir, info)
    tokenizer = load_tokenizer_file(run_dir) if resume else None
    # Rank 0 tokenizes first and fills the cache; the others then read it.
    data = None
    with agreed(info, device):
        if info.main:
            data = _read_data(config, tokenizer)
    with agreed(info, device):
        if not info.main:
            data = _read_data(config, tokenizer)
    assert data is not None
    if saved is not None:
        saved.check_fits(config, run_dir, int(data.tokenizer.vocab_size))
        if saved.source_hash not in (None, data.source_hash) and info.main:
            logger.warning(
                "the corpus changed since this run was saved: the resumed run will "
                "not match an uninterrupted one"
            )
    return saved, data, bool(resume)


def _read_data(config: Config, tokenizer: Tokenizer | None) -> TokenData:
    """The run's data, as its objective reads them (`Objective.read_data`; `tokenizer`: a
    resumed run's own)."""
    return objective_for(config).read_data(tokenizer)


def _check_same_save(saved: ResumeState | None, run_dir: Path, info: DistInfo) -> None:
    """Every rank starts from the same save (or none): a restarted group must agree on the
    step, or the ranks' weights would differ from the first step on."""
    steps = gather(None if saved is None else saved.counters.step, info)
    if len(set(steps)) > 1:
        raise CheckpointError(
            f"the ranks read different resume states from '{run_dir}' (steps by rank: "
            f"{steps}): every rank must see the same run directory, on a shared file system."
        )


def _compiled(
    model: Transformer,
    config: Config,
    vocab: int,
    precision: Precision,
    step: int,
    recorded: object,
) -> nn.Module:
    """The model the step runs: compiled or not by `train.compile` (`llmcli.training.compiling`);
    a resumed run keeps the choice its `meta.json` records (`recorded`)."""
    key = step_key(config, vocab, precision.device)
    choice = choose(
        config.train.compile,
        key,
        config.train.max_steps - step,
        lambda: measure_step(config, vocab, precision, MEASURE_S).step_s,
        device=precision.device.type,
        resumed=recorded if isinstance(recorded, bool) else None,
    )
    return compiled(model, choice, key, objective_for(config).full_rows)
