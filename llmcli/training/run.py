"""A run: what the training loop works with, and how it is built, or restored from a save.

A `Run` holds what a step needs (its `Trainer`: the model as steps run it, the optimizer, the
precision, the batch stream) apart from the run's bookkeeping: the counters, the run directory
and the files rank 0 writes as it goes (`RunLog`), the save clock, the spike guard.

`build_run` tokenizes the corpus and makes the run directory ready (a fresh start reads all its
input first, so that bad data or a bad `train.init_from` leaves the folder as it was; a resume
first reads the run's state and tokenizer), settles the micro-batch (`train.batch_size: auto`,
`llmcli.training.batch`), builds the model (from `train.init_from`'s weights,
`llmcli.training.init_from`), optimizer and batch sampler (conversations' for chat data),
loads the resume state into them when resuming, and wraps the model for `train.compile` and DDP.
Every rank checks each stage with the others (`agreed`) before going on, so that a bad input on
one rank stops them all with its message. `open_run_files` then writes the run's config and
tokenizer (and a chat run's `chat_template.jinja`) and opens `metrics.jsonl`, cut back to what
it held at the save a run resumes from (and, with `train.head_metrics`, `head_metrics.jsonl` and
the probe its heads are scored on).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from llmcli.config import Config
from llmcli.data.batches import BatchSampler
from llmcli.data.chat_batches import ChatSampler
from llmcli.data.chat_template import ChatTemplate
from llmcli.data.tokenizer import Tokenizer
from llmcli.data.tokens import TokenData, prepare_data
from llmcli.errors import CheckpointError, describe_os_error
from llmcli.evaluation.probe import Probe, make_probe
from llmcli.fileio import remove_stale_temp_files
from llmcli.model.gpt import Transformer
from llmcli.progress import format_count
from llmcli.runs.directory import (
    HEAD_METRICS_FILE,
    META_FILE,
    METRICS_FILE,
    STATE_FILE,
    check_fresh_start,
    prepare_run_dir,
    resumes,
    write_config_and_tokenizer,
)
from llmcli.runs.formats import load_weights, read_meta
from llmcli.runs.head_metrics import HeadMetricsLog
from llmcli.runs.loading import load_tokenizer_file
from llmcli.runs.metrics import MetricsLog
from llmcli.runs.trackers import open_trackers
from llmcli.training.batch import (
    OOM_RETRY_STEPS,
    resolve_batch,
    smaller_micro_batch,
    with_micro_batch,
)
from llmcli.training.compiling import (
    MEASURE_S,
    choose,
    compile_key,
    compiled,
    inductor_cache,
)
from llmcli.training.distributed import DistInfo, agreed, gather
from llmcli.training.guard import SpikeGuard
from llmcli.training.init_from import load_init_weights, resolve_init_from
from llmcli.training.memory import check_memory
from llmcli.training.optim import build_optimizer
from llmcli.training.precision import Precision
from llmcli.training.state import ResumeState, TrainState, seed_everything, set_rng_state
from llmcli.training.step import Trainer

logger = logging.getLogger(__name__)

# Evaluation batches come from their own samplers with this seed offset, re-created at every
# evaluation: the same batches each time, and the training stream is never touched.
EVAL_SEED_OFFSET = 1_000_003


@dataclass
class RunLog:
    """What rank 0 writes as the run goes, besides its checkpoints."""

    metrics: MetricsLog  # metrics.jsonl, and the trackers
    probe: Probe | None = None  # with train.head_metrics: what each head is scored on
    head_log: HeadMetricsLog | None = None  # ... and where the scores go

    def close(self) -> None:
        self.metrics.close()
        if self.head_log is not None:
            self.head_log.close()

    def __enter__(self) -> RunLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class Run:
    """Everything the loop works with, built by `build_run`."""

    config: Config
    info: DistInfo
    run_dir: Path
    data: TokenData
    tokenizer: Tokenizer
    model: Transformer  # the weights, unwrapped: what is saved
    trainer: Trainer  # what a step needs: the model as steps run it, optimizer, batches
    state: TrainState  # the counters
    guard: SpikeGuard | None = None  # with train.spike_guard
    auto_batch: bool = False  # train.batch_size was auto: running out of memory early shrinks it
    resumed_from: int | None = None  # the step a resumed run started from
    metrics_bytes: int | None = None  # metrics.jsonl's size at the save resumed from
    log: RunLog | None = None  # rank 0 only
    tokenizer_training: dict | None = None  # how the tokenizer was made, for meta.json
    compiled: bool = False  # whether the step runs torch.compile's graphs (train.compile)
    saved_at: float = 0.0  # perf_counter() at the end of the last save (or the loop's start)
    save_seconds: list[float] = dataclasses.field(default_factory=list)  # this session's saves

    @property
    def precision(self) -> Precision:
        return self.trainer.precision

    @property
    def template(self) -> ChatTemplate | None:
        """A chat run's template (written into the run), None for plain text."""
        return self.data.chat.template if self.data.chat is not None else None

    @property
    def evaluated(self) -> nn.Module:
        """What evaluation runs: the model as steps run it (compiled with `train.compile`),
        without the DDP wrapper, whose forward would synchronise the ranks' buffers."""
        model = self.trainer.model
        return model.module if isinstance(model, DistributedDataParallel) else model

    @property
    def device(self) -> torch.device:
        return self.precision.device

    @property
    def tokens_per_step(self) -> int:
        tc = self.config.train
        return (
            tc.batch_size * self.config.model.context_length * tc.grad_accum * self.info.world_size
        )

    def can_shrink_batch(self) -> bool:
        """Whether running out of memory in this step may shrink the micro-batch: an automatic
        one, in the first `OOM_RETRY_STEPS` steps of a fresh run in one process (under DDP one
        rank alone cannot change the batch), and not yet down to one sequence."""
        return (
            self.auto_batch
            and not self.info.enabled
            and self.resumed_from is None
            and self.state.step < OOM_RETRY_STEPS
            and smaller_micro_batch(self.config) is not None
        )

    def shrink_micro_batch(self) -> None:
        """Go on with a smaller micro-batch (`smaller_micro_batch`) and more accumulation, the
        tokens per step unchanged: drop the failed step's gradients, tell the sampler, record
        the numbers in config.yaml, and say so in one line."""
        old = self.config.train.batch_size
        batch = smaller_micro_batch(self.config)
        assert batch is not None
        self.trainer.optimizer.zero_grad(set_to_none=True)
        self.precision.forget_step()  # fp16: the failed step may have unscaled its gradients
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the failed step's blocks back before the smaller one
        self.config = with_micro_batch(self.config, batch)
        self.trainer.batches.batch_size = batch
        self.trainer.grad_accum = self.config.train.grad_accum
        if self.info.main:
            write_config_and_tokenizer(self.run_dir, self.config, self.tokenizer, self.template)
        logger.warning(
            "note: out of memory at step %d with %d sequences per micro-batch: going on with %d "
            "x grad_accum %d (the same %d tokens per step)",
            self.state.step + 1,
            old,
            batch,
            self.config.train.grad_accum,
            self.tokens_per_step,
        )

    def resume_state(self, rngs_and_samplers: list[tuple[Any, Any]]) -> ResumeState:
        """What a save writes: the counters, weights, optimizer and precision state, and every
        rank's RNG and sampler states (`rngs_and_samplers`, gathered from the ranks in rank
        order). Rank 0 saves: it holds the metrics log, whose size the state records."""
        assert self.log is not None, "only rank 0, which writes metrics.jsonl, saves"
        return ResumeState(
            counters=self.state,
            metrics_bytes=self.log.metrics.size,
            vocab_size=int(self.tokenizer.vocab_size),
            source_hash=self.data.source_hash,
            config=self.config.to_dict(),
            model=self.model.state_dict(),
            optimizer=self.trainer.optimizer.state_dict(),
            scaler=self.precision.scaler.state_dict(),
            rng=[rng for rng, _ in rngs_and_samplers],
            sampler=[sampler for _, sampler in rngs_and_samplers],
            guard=self.guard.state_dict() if self.guard is not None else None,
        )

    def restore(self, saved: ResumeState) -> None:
        """Put a save back: weights, optimizer moments (with today's hyperparameters), precision
        scaler, this rank's RNG and sampler states, counters.

        Raises:
            CheckpointError: a part that does not fit this run (a damaged or foreign file),
                naming the file and the part.
        """
        saved.check_parts(self.model, self.trainer.optimizer)  # all of it, before any is loaded
        self._restore_training(saved)
        guard = self.guard
        if guard is not None and saved.guard is not None:  # else a fresh guard: an empty window
            saved.load_part("guard", lambda: guard.load_state_dict(saved.guard))
        info, saved_world = self.info, len(saved.rng)
        if saved_world != info.world_size and info.main:
            logger.warning(
                "resuming a %d-process run with %d processes: batches and random "
                "numbers will differ from an uninterrupted run",
                saved_world,
                info.world_size,
            )
        own = min(info.rank, saved_world - 1)
        saved.load_part("rng", lambda: set_rng_state(saved.rng[own], self.device))
        batches = self.trainer.batches
        saved.load_part("sampler", lambda: batches.load_state_dict(saved.sampler[own]))
        # The saved counters, with this session's time counted from its start.
        self.state = dataclasses.replace(saved.counters, session_start=self.state.session_start)
        self.resumed_from = self.state.step
        self.metrics_bytes = saved.metrics_bytes

    def _restore_training(self, saved: ResumeState) -> None:
        """Put back what a step changes: the weights, the optimizer's moments and step counts
        (with today's hyperparameters) and the precision scaler."""
        load_weights(self.model, saved.model, saved.path or STATE_FILE)
        optimizer = self.trainer.optimizer
        fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        saved.load_part("optimizer", lambda: optimizer.load_state_dict(saved.optimizer))
        for group, values in zip(optimizer.param_groups, fresh, strict=True):
            group.update(values)
        if saved.scaler:  # {}: saved without loss scaling (fp32, bf16); a fresh scale here
            saved.load_part("scaler", lambda: self.precision.scaler.load_state_dict(saved.scaler))

    def rollback(self, step: int, loss: float) -> dict[str, Any]:
        """The spike guard's rollback (`llmcli.training.guard`) at step `step`: back to the last
        save, read as a resume reads it, with the sampler and the random streams left where they
        are (past the batches that caused it) and the clock still running; `metrics.jsonl` is
        cut back to the save, keeping its event records. Returns the rollback's event record.
        """
        assert self.guard is not None
        with agreed(self.info, self.device):
            saved = ResumeState.load(self.run_dir)
        self._restore_training(saved)
        for counter in dataclasses.fields(TrainState):  # in place: the loop holds `self.state`
            if counter.name not in ("elapsed_base", "session_start"):  # the clock runs on
                setattr(self.state, counter.name, getattr(saved.counters, counter.name))
        if self.log is not None:
            self.log.metrics.rewind(saved.metrics_bytes)
        guard, to_step, events = self.guard, self.state.step, []
        saved.load_part(
            "guard", lambda: events.append(guard.rolled_back(step, to_step, loss, saved.guard))
        )
        return events[0]


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
    saved, data = _prepare(config, info, device, run_dir, resume, overwrite)
    vocab = int(data.tokenizer.vocab_size)
    auto_batch = tc.batch_size == "auto"
    config = _resolve_batch(config, vocab, precision, info, saved)
    tc = config.train
    check_memory(config, vocab, device, precision.name, info.world_size)
    model = Transformer(config.model, vocab, generator=torch.Generator().manual_seed(tc.seed))
    if tc.init_from and saved is None:  # a resumed run's weights come from its state
        load_init_weights(model, tc.init_from)
    model.to(device)
    optimizer = build_optimizer(model, tc, device.type)
    seed_everything(tc.seed + info.rank)
    with agreed(info, device):
        sampler = _sampler(data, "train", config, tc.seed, info, device)
    trainer = Trainer(
        model=model,
        params=list(model.parameters()),
        optimizer=optimizer,
        precision=precision,
        batches=sampler,
        grad_accum=tc.grad_accum,
        grad_clip=tc.grad_clip,
    )
    run = Run(
        config=config,
        info=info,
        run_dir=run_dir,
        data=data,
        tokenizer=data.tokenizer,
        model=model,
        trainer=trainer,
        state=TrainState(session_start=session_start),
        guard=SpikeGuard(tc) if tc.spike_guard else None,
        auto_batch=auto_batch,
        # A resumed run's tokenizer comes from the run: how it was made, from its meta.json.
        tokenizer_training=read_meta(run_dir / META_FILE).get("tokenizer_training")
        if saved is not None
        else data.tokenizer_training,
    )
    with agreed(info, device):
        eval_samplers(run)  # a corpus too small for the batch and context fails here, not later
    if saved is not None:
        run.restore(saved)
    trainer.model = _compiled(run, model, saved is not None)
    if info.enabled:
        device_ids = [device.index] if device.type == "cuda" else None
        trainer.model = DistributedDataParallel(trainer.model, device_ids=device_ids)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return run


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
) -> tuple[ResumeState | None, TokenData]:
    """Check the run directory, load the resume state, tokenize the data: (saved state, data).

    A fresh start only checks the folder before reading the data, and prepares it (made, an
    earlier run's files removed) once the data is read: bad input changes nothing there.
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
            data = prepare_data(config.data, config.model.context_length, tokenizer=tokenizer)
    with agreed(info, device):
        if not info.main:
            data = prepare_data(config.data, config.model.context_length, tokenizer=tokenizer)
    assert data is not None
    with agreed(info, device):
        if info.main and not resume:
            prepare_run_dir(run_dir, resume, overwrite)
    if saved is not None:
        saved.check_fits(config, run_dir, int(data.tokenizer.vocab_size))
        if saved.source_hash not in (None, data.source_hash) and info.main:
            logger.warning(
                "the corpus changed since this run was saved: the resumed run will "
                "not match an uninterrupted one"
            )
    return saved, data


def _check_same_save(saved: ResumeState | None, run_dir: Path, info: DistInfo) -> None:
    """Every rank starts from the same save (or none): a restarted group must agree on the
    step, or the ranks' weights would differ from the first step on."""
    steps = gather(None if saved is None else saved.counters.step, info)
    if len(set(steps)) > 1:
        raise CheckpointError(
            f"the ranks read different resume states from '{run_dir}' (steps by rank: "
            f"{steps}): every rank must see the same run directory, on a shared file system."
        )


def _compiled(run: Run, model: Transformer, resumed: bool) -> nn.Module:
    """The model the step runs: compiled or not by `train.compile` (`llmcli.training.compiling`);
    a resumed run keeps the choice its `meta.json` records."""
    from llmcli.training.plan import measure_step

    config, vocab = run.config, int(run.tokenizer.vocab_size)
    recorded = read_meta(run.run_dir / META_FILE).get("compiled") if resumed else None
    key = compile_key(config, vocab, run.device)
    choice = choose(
        config.train.compile,
        key,
        config.train.max_steps - run.state.step,
        lambda: measure_step(config, vocab, run.precision, MEASURE_S).step_s,
        device=run.device.type,
        resumed=recorded if isinstance(recorded, bool) else None,
    )
    run.compiled = choice.compile
    return compiled(model, choice, key)


def eval_samplers(run: Run) -> dict[str, BatchSampler | ChatSampler]:
    """Fresh samplers over both splits, seeded apart from the training stream."""
    tc, info = run.config.train, run.info
    return {
        split: _sampler(run.data, split, run.config, tc.seed + EVAL_SEED_OFFSET, info, run.device)
        for split in ("train", "val")
    }


def _sampler(
    data: TokenData, split: str, config: Config, seed: int, info: DistInfo, device: torch.device
) -> BatchSampler | ChatSampler:
    """The sampler of `data`'s split ("train" or "val"): conversation windows for chat data,
    else windows of the token stream; this rank's, seeded with `seed`."""
    batch, context = config.train.batch_size, config.model.context_length
    if data.chat is not None:
        chat = data.chat.train if split == "train" else data.chat.val
        return ChatSampler(
            chat, data.chat.pad_id, batch, context, seed, info.rank, info.world_size, device
        )
    tokens = data.train if split == "train" else data.val
    return BatchSampler(
        tokens, batch, context, seed=seed, rank=info.rank, world_size=info.world_size, device=device
    )


def open_run_files(run: Run) -> None:
    """Rank 0: write config.yaml and tokenizer.json, open metrics.jsonl (and head_metrics.jsonl),
    say what starts."""
    if not run.info.main:
        return
    tc, state, info = run.config.train, run.state, run.info
    remove_stale_temp_files(run.run_dir)
    keep = run.metrics_bytes if run.resumed_from is not None else None
    try:
        write_config_and_tokenizer(run.run_dir, run.config, run.tokenizer, run.template)
        trackers = open_trackers(run.config, run.run_dir, run.resumed_from)
        run.log = RunLog(MetricsLog(run.run_dir / METRICS_FILE, keep, trackers))
        if tc.head_metrics:
            run.log.probe = make_probe(run.tokenizer, run.config.model.context_length)
            run.log.head_log = HeadMetricsLog(run.run_dir / HEAD_METRICS_FILE, run.resumed_from)
    except OSError as exc:
        raise CheckpointError(
            f"cannot write the run files in '{run.run_dir}': {describe_os_error(exc)}. "
            "Any checkpoint saved there is intact; fix the problem and run again."
        ) from None
    for note in tc.short_run_notes():
        logger.warning(note)
    logger.info(
        "%s run '%s': %s parameters, %s on %s%s, %d tokens per step, steps %d..%d",
        "resuming" if run.resumed_from is not None else "starting",
        run.run_dir,
        format_count(run.model.num_parameters()),
        run.precision.name,
        run.device,
        f" x{info.world_size}" if info.enabled else "",
        run.tokens_per_step,
        state.step + 1,
        tc.max_steps,
    )
