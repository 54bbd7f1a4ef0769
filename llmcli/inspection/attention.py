"""The `inspect-attention` command's library function: a run and prompts in, files out.

`inspect_attention` loads a run, takes the prompts (or the start of the run's validation text),
captures and scores every head (`build_dumps`) and writes, for each prompt, the dump, one PNG
per layer and the offline HTML viewer (`write_outputs`). With an ablation method, every head's
loss increase when it is removed is measured on validation batches (`measure_heads`) and added as
a metric column, drawn as a heat map (`ablation.png`) and listed, top heads first; with
`ablation_data`, on a text file instead (read as `llmcli eval --data` reads it). The command's
settings travel whole as one `InspectOptions`, checked as it is made.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmcli import __version__
from llmcli.data.tokens import prepare_data
from llmcli.device import check_threads, resolve_device, torch_threads
from llmcli.errors import InputError, describe_os_error
from llmcli.evaluation.heads import check_method
from llmcli.evaluation.probe import make_probe, probe_scores
from llmcli.evaluation.repeats import earlier_occurrences
from llmcli.evaluation.text import eval_tokens, window_batches, window_starts
from llmcli.generation.prompts import encode_prompt, read_prompt_file
from llmcli.inspection.ablation import HeadDeltas, format_top_heads, head_deltas
from llmcli.inspection.capture import capture_prompts
from llmcli.inspection.dump import FORMATS, AttentionDump, format_metrics_table, save_dump
from llmcli.inspection.metrics import (
    INDUCTION,
    METRIC_NAMES,
    PROBE_INDUCTION,
    head_metrics,
    induction_score,
)
from llmcli.inspection.pictures import plot_head_deltas, plot_layers
from llmcli.inspection.viewer import write_run_page, write_viewer
from llmcli.runs.loading import load_run

log = logging.getLogger(__name__)

#: Validation batches `--ablation` measures on by default: the tiny model (4 x 4 heads, batches
#: of 12 x 64 tokens) measures both methods in well under a minute on 2 CPU cores.
ABLATION_STEPS = 20
#: What `inspect-attention --ablation` takes: one method or both.
INSPECT_METHODS: tuple[str, ...] = ("zero", "mean", "both")


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def select_indices(chosen: Sequence[int] | None, n: int, what: str) -> list[int]:
    """Validate `--layer`/`--head` choices against `n`; None or empty means all. Sorted, unique."""
    if not chosen:
        return list(range(n))
    bad = [i for i in chosen if not 0 <= i < n]
    if bad:
        raise InputError(
            f"--{what} {bad[0]} is out of range: the model has {n} {what}s, numbered 0 to {n - 1}."
        )
    return sorted(set(int(i) for i in chosen))


# --------------------------------------------------------------------------------------------
# Prompts.
# --------------------------------------------------------------------------------------------


#: How `--prompt-file` is read: a `.json` file or a text starting with "[" must be a JSON list
#: of strings; in the line form, blank lines are skipped.
PROMPT_FILE = {
    "what": "--prompt-file",
    "hint": "check the path",
    "strict_json": True,
    "skip_blank": True,
}


#: The prompt used when the run's validation text cannot be read (Shakespeare, as the corpus).
FALLBACK_PROMPT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
)


def default_prompt_ids(run: Any, cache_dir: str | Path | None = None) -> tuple[list[int], str]:
    """The default prompt: the first context_length tokens of the run's validation split.

    The run's `config.data` says where the corpus is; `data.prepare_data` reads it through the
    token cache (tokenized once at training time). Where that fails (the corpus moved, a
    dataset that is not cached), the prompt is `FALLBACK_PROMPT`, and the returned note says so.

    Returns:
        `(token ids, a one-line note saying where the prompt came from)`.
    """
    ctx = run.model.context_length
    data_cfg = run.config.data
    where = data_cfg.path if data_cfg.path is not None else f"dataset {data_cfg.dataset}"
    try:
        val = prepare_data(data_cfg, ctx, tokenizer=run.tokenizer, cache_dir=cache_dir).val
        ids = [int(i) for i in val[:ctx]]
        return ids, (
            f"prompt: the first {len(ids)} tokens of the validation split of {where} "
            "(pass --prompt TEXT to choose one)"
        )
    except InputError as exc:
        reason = str(exc)
    try:
        ids = list(run.tokenizer.encode(FALLBACK_PROMPT))[:ctx]
    except InputError as exc:
        raise InputError(
            f"no default prompt: the run's validation text ({where}) cannot be read ({reason}), "
            f"and the built-in fallback prompt does not encode ({exc}). Pass --prompt TEXT."
        ) from None
    note = (
        f"prompt: the run's validation text ({where}) cannot be read ({reason}); using a "
        "built-in fallback prompt instead (pass --prompt TEXT to choose one)"
    )
    log.warning(note)
    return ids, note


# --------------------------------------------------------------------------------------------
# Head ablation.
# --------------------------------------------------------------------------------------------


def measure_heads(
    run: Any,
    ablation: str,
    steps: int,
    device: torch.device | str = "cpu",
    data: str | Path | None = None,
    progress: bool = False,
) -> tuple[HeadDeltas, dict[str, Any]]:
    """Every head's Δloss on the first `steps` batches of a text: the run's validation split,
    or the file `data`, in the windows `llmcli eval` scores.

    Args:
        run: a loaded run; its `train.batch_size` windows of `context_length` tokens per batch.
        ablation: "zero", "mean" or "both".
        steps: batches to measure on.
        device: where the model is.
        data: a UTF-8 text file (None: the validation split; see `evaluate.eval_tokens`).
        progress: show progress (a bar on a terminal, plain lines elsewhere).

    Returns:
        The `HeadDeltas` and a JSON-ready note for the dumps' meta (the result, its data and,
        with `data`, the file's path under "data_file").
    """
    methods = ("zero", "mean") if ablation == "both" else (ablation,)
    hint = "--ablation measures the heads on it; or pass --data PATH."
    tokens, label = eval_tokens(run, data, hint=hint)
    ctx, batch_size = run.config.model.context_length, run.config.train.batch_size
    starts = window_starts(len(tokens), ctx, batch_size, steps)
    batches = window_batches(tokens, ctx, starts, device)
    result = head_deltas(run.model, batches, methods, progress=progress)
    note = {**result.to_dict(), "data": label, "steps": steps, "batch_size": batch_size}
    note["data_file"] = None if data is None else str(data)
    return result, note


def add_ablation(dumps: Sequence[AttentionDump], result: HeadDeltas, note: dict[str, Any]) -> None:
    """Append a `dloss_<method>` metric column per method to each dump (following its layer and
    head selection) and the full result to its meta, under "ablation"."""
    names = [f"dloss_{method}" for method in result.delta]
    for dump in dumps:
        li, hi = np.array(dump.layers), np.array(dump.heads)
        cols = np.stack([d[li][:, hi] for d in result.delta.values()], axis=-1)  # (L', H', M')
        dump.metrics = np.concatenate([dump.metrics, cols.astype(np.float32)], axis=-1)
        dump.metric_names = dump.metric_names + names  # a new list: dumps may share the old one
        dump.meta = {**dump.meta, "metric_names": dump.metric_names, "ablation": note}


# --------------------------------------------------------------------------------------------
# The command's library function.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class InspectOptions:
    """What `llmcli inspect-attention` keeps, adds and writes, and which weights it loads where.
    Checked as it is made, where a check needs no run (`layers` and `heads` are checked against
    the model by `select_indices`).

    Attributes:
        layers, heads: the model indices to keep in the dumps (empty: all); metrics follow the
            selection.
        fmt: the dump's format: "npz", "safetensors" or "json".
        induction: add two induction score columns: `induction`, on the prompt's own repeats
            (NaN for a prompt whose tokens never repeat), and `probe_induction`, on the fixed
            probe of repeated random tokens (`llmcli.evaluation.probe`; the same for every
            prompt, described in meta).
        truncate: keep the last context_length tokens of a too-long prompt instead of failing.
        pictures, viewer: write the PNGs and the HTML viewer.
        ablation: "zero", "mean" or "both": add each head's Δloss (see `measure_heads`); None:
            no ablation.
        ablation_steps: batches the ablation measures on (None: `ABLATION_STEPS`).
        ablation_data: a UTF-8 text file the ablation measures on (None: the validation split).
        weights: the weights `inspect_attention` loads, "best" or "last" (see
            `llmcli.runs.loading.load_run`).
        device: where `inspect_attention` runs the model: "cpu", "cuda", "mps" or "auto".
        threads: CPU threads (None: the run's `train.threads`).

    Raises:
        InputError: an unknown format or ablation method, `ablation_steps` or `ablation_data`
            without `ablation`, `ablation_steps` < 1, `threads` outside 1..the CPUs.
    """

    layers: Sequence[int] = ()
    heads: Sequence[int] = ()
    fmt: str = "npz"
    induction: bool = False
    truncate: bool = False
    pictures: bool = True
    viewer: bool = True
    ablation: str | None = None
    ablation_steps: int | None = None
    ablation_data: str | Path | None = None
    weights: str = "best"
    device: str = "cpu"
    threads: int | None = None

    def __post_init__(self) -> None:
        check_threads(self.threads)
        if self.fmt not in FORMATS:
            raise InputError(
                f"--format {self.fmt!r} is not known: choose one of {', '.join(FORMATS)}."
            )
        if self.ablation is not None:
            check_method(self.ablation, INSPECT_METHODS)
        steps = self.ablation_steps
        if steps is not None and self.ablation is None:
            raise InputError(
                "--ablation-steps says how many batches --ablation measures on: give --ablation "
                "too."
            )
        if steps is not None and steps < 1:
            raise InputError(f"--ablation-steps ({steps}) must be a positive number.")
        if self.ablation_data is not None and self.ablation is None:
            raise InputError(
                "--data PATH is the text --ablation measures the heads on: give --ablation too."
            )


def run_meta(run: Any) -> dict[str, Any]:
    """What every dump records about its run: where, which weights (and their sha256), step,
    config, llmcli version."""
    weights_path = Path(run.weights_path) if run.weights_path else None
    return {
        "checkpoint": str(Path(run.run_dir).resolve()),
        "weights_file": str(weights_path.resolve()) if weights_path else None,
        "weights_sha256": sha256_file(weights_path) if weights_path else None,
        "step": run.step,
        "config": run.config.to_dict(),
        "llmcli_version": __version__,
    }


@dataclass
class InspectResult:
    """What `inspect_attention` did: one dump and one output folder per prompt."""

    run_dir: Path
    dumps: list[AttentionDump]
    out_dirs: list[Path]
    files: list[list[Path]]
    ablation: HeadDeltas | None = None


def _encode(
    tokenizer: Any,
    prompts: Sequence[str],
    prompts_ids: Sequence[Sequence[int]] | None,
    context_length: int,
    truncate: bool,
) -> list[tuple[list[int], bool]]:
    """(token ids, whether they were cropped to the context) of every prompt; `prompts_ids`,
    where given, are used as they are, once checked to fit."""
    if prompts_ids is not None:
        for ids in prompts_ids:
            if not 0 < len(ids) <= context_length:
                raise InputError(
                    f"a prompt must be 1 to {context_length} tokens long, got {len(ids)}."
                )
        return [(list(ids), False) for ids in prompts_ids]
    if not prompts:
        raise InputError("no prompt given: pass --prompt TEXT or --prompt-file FILE.")
    return [
        encode_prompt(
            tokenizer,
            p,
            context_length,
            empty="error",
            too_long="crop" if truncate else "error",
            label=f"prompt #{i + 1}" if len(prompts) > 1 else "the prompt",
        )
        for i, p in enumerate(prompts)
    ]


def build_dumps(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    options: InspectOptions = InspectOptions(),
    *,
    prompts_ids: Sequence[Sequence[int]] | None = None,
    meta: dict[str, Any] | None = None,
) -> list[AttentionDump]:
    """Capture, score and select: one `AttentionDump` per prompt (nothing written to disk).

    Args:
        model: a `Transformer`.
        tokenizer: encodes the prompts and decodes each token for the labels.
        prompts: the prompt texts (ignored where `prompts_ids` is given).
        options: the layers and heads to keep, the induction score, truncation (the rest of
            `InspectOptions` is not used here).
        prompts_ids: token ids to use directly (e.g. the default validation slice).
        meta: common metadata merged into every dump's meta.
    """
    layer_sel = select_indices(options.layers, model.n_layer, "layer")
    head_sel = select_indices(options.heads, model.n_head, "head")
    encoded = _encode(tokenizer, prompts, prompts_ids, model.context_length, options.truncate)
    names = list(METRIC_NAMES)
    extra: dict[str, Any] = {}
    probe = None
    if options.induction:
        names += [INDUCTION, PROBE_INDUCTION]
        probe_def = make_probe(tokenizer, model.context_length)
        probe = probe_scores(model, probe_def).induction  # (L, H)
        extra["probe"] = probe_def.describe()
    captured = capture_prompts(model, [ids for ids, _ in encoded])
    li, hi = np.array(layer_sel), np.array(head_sel)
    dumps = []
    for i, ((ids, truncated), (_, attn_t)) in enumerate(zip(encoded, captured, strict=True)):
        attn = attn_t.numpy()  # (L, H, T, T)
        metrics = head_metrics(attn)  # (L, H, 4)
        if probe is not None:
            own = induction_score(attn, np.array(ids))  # (L, H), NaN without repeats
            metrics = np.concatenate([metrics, own[..., None], probe[..., None]], axis=-1)
            # How many of the prompt's tokens occurred before: the queries `induction` scores.
            extra["induction_queries"] = int(earlier_occurrences(np.array(ids)).any(-1).sum())
        text = tokenizer.decode(ids)
        dump_meta = {
            **(meta or {}),
            **extra,
            "prompt": text,
            "prompt_index": i,
            "n_tokens": len(ids),
            "truncated": truncated,
            "layers": layer_sel,
            "heads": head_sel,
            "metric_names": names,
        }
        dumps.append(
            AttentionDump(
                attn=attn[li][:, hi].astype(np.float32),  # (L', H', T, T)
                tokens=[tokenizer.decode([t]) for t in ids],
                token_ids=np.array(ids, dtype=np.int64),
                metrics=metrics[li][:, hi].astype(np.float32),  # (L', H', M)
                metric_names=names,
                layers=layer_sel,
                heads=head_sel,
                meta=dump_meta,
            )
        )
    return dumps


def write_outputs(
    dump: AttentionDump,
    out_dir: str | Path,
    fmt: str = "npz",
    *,
    pictures: bool = True,
    viewer: bool = True,
    run_dir: str | Path | None = None,
    notify: Callable[[str], Any] = log.warning,
) -> list[Path]:
    """Write `attention.<fmt>`, `layer-<L>.png` per layer and `attention.html` into `out_dir`;
    with a head ablation in the dump's meta, also its heat map `ablation.png`. The page shows
    the lens, patching and attribution results in `run_dir` too (`notify` hears of those it
    skips)."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(
            f"cannot create output folder {str(out_dir)!r}: {exc.strerror}; choose --out DIR."
        ) from None
    if not out_dir.is_dir():
        raise InputError(f"--out {str(out_dir)!r} is not a folder: choose another --out DIR.")
    try:
        files = [save_dump(dump, out_dir / f"attention{FORMATS[fmt]}", fmt)]
        if pictures:
            files += plot_layers(dump, out_dir)
        if pictures and "ablation" in dump.meta:
            note = dump.meta["ablation"]
            data_file = note.get("data_file")
            where = f"tokens of {Path(data_file).name}" if data_file else "validation tokens"
            title = (
                f"loss increase when one head is removed (clean loss {note['base_loss']:.3f}, "
                f"{note['tokens']:,} {where})"
            )
            delta = {method: np.array(d) for method, d in note["delta"].items()}
            files.append(plot_head_deltas(delta, out_dir / "ablation.png", title))
        if viewer:
            page = out_dir / "attention.html"
            if run_dir is None:
                files.append(write_viewer(dump, page))
            else:
                files.append(write_run_page(run_dir, page, dump, notify))
    except OSError as exc:  # every file is written atomically: earlier ones stay whole
        raise InputError(
            f"cannot write into {str(out_dir)!r}: {describe_os_error(exc)}; or choose --out DIR."
        ) from None
    return files


def prompt_dir(out_dir: Path, index: int, n_prompts: int) -> Path:
    """Where prompt `index`'s files go: `out_dir` itself for one prompt, else
    `out_dir/prompt-000/`, `out_dir/prompt-001/`, ... in the order the prompts were given."""
    return out_dir if n_prompts == 1 else out_dir / f"prompt-{index:03d}"


def inspect_attention(
    checkpoint: str | Path | None = None,
    prompts: Sequence[str] = (),
    options: InspectOptions = InspectOptions(),
    *,
    prompt_file: str | Path | None = None,
    out_dir: str | Path | None = None,
    notify: Callable[[str], Any] = log.warning,
    progress: bool = False,
) -> InspectResult:
    """`llmcli inspect-attention`: load a run, capture each prompt, write dumps, PNGs, viewer.

    Args:
        checkpoint: a run directory; None takes the latest run under `checkpoints/`.
        prompts: prompt texts; with none (and no `prompt_file`) the first context_length tokens
            of the run's validation text are used.
        options: what to keep, add and write, which weights and the device (see
            `InspectOptions`, checked as it was made).
        prompt_file: more prompts (see `PROMPT_FILE`); they follow `prompts`.
        out_dir: default `<run>/attention/`. One prompt writes there; several write
            `prompt-000/`, `prompt-001/`, ... (see `prompt_dir`).
        notify: receives one-line notices as they come (the run used, version differences,
            the default prompt).
        progress: show the progress of the ablation's passes (a bar on a terminal, plain
            lines elsewhere).

    Raises:
        InputError: no run, bad prompt, layer or head out of range.
    """
    prompts = list(prompts)
    if prompt_file is not None:
        prompts += read_prompt_file(prompt_file, **PROMPT_FILE)
    device = resolve_device(options.device, what="--device")
    run = load_run(checkpoint, weights=options.weights, device=device, notify=notify)
    model = run.model
    # Check the selection before any work, with the model's own sizes in the message.
    select_indices(options.layers, model.n_layer, "layer")
    select_indices(options.heads, model.n_head, "head")
    prompts_ids = None
    if not prompts:
        ids, default_note = default_prompt_ids(run)
        prompts_ids = [ids]
        notify(default_note)
    meta = run_meta(run)
    if prompts_ids is not None:
        meta["default_prompt"] = default_note
    with torch_threads(options.threads or run.config.train.threads):
        dumps = build_dumps(
            model, run.tokenizer, prompts, options, prompts_ids=prompts_ids, meta=meta
        )
        deltas = None
        if options.ablation is not None:
            steps = options.ablation_steps or ABLATION_STEPS
            deltas, note = measure_heads(
                run, options.ablation, steps, device, options.ablation_data, progress=progress
            )
            add_ablation(dumps, deltas, note)
    root = Path(out_dir) if out_dir is not None else Path(run.run_dir) / "attention"
    out_dirs, files = [], []
    for i, dump in enumerate(dumps):
        folder = prompt_dir(root, i, len(dumps))
        out_dirs.append(folder)
        files.append(
            write_outputs(
                dump,
                folder,
                options.fmt,
                pictures=options.pictures,
                viewer=options.viewer,
                run_dir=run.run_dir,
                notify=notify,
            )
        )
    return InspectResult(Path(run.run_dir), dumps, out_dirs, files, ablation=deltas)


def induction_note(meta: dict[str, Any]) -> str:
    """What the two induction columns measured, under a prompt's table."""
    probe, queries = meta["probe"], meta["induction_queries"]
    own = (
        f"on this prompt's own repeats ({queries} of its {meta['n_tokens']} tokens occurred "
        "before: the weight on the tokens after their earlier occurrences)"
        if queries
        else "- : no token of this prompt occurred before in it"
    )
    return (
        f"induction: {own}\n"
        f"probe_induction: on a fixed probe, the same for every prompt: {probe['sequences']} "
        f"sequences of {probe['period']} random tokens, each repeated once (seed "
        f"{probe['seed']}, no whitespace or special tokens)"
    )


def format_report(result: InspectResult) -> str:
    """What `llmcli inspect-attention` prints: for each prompt, its length and (shortened) text,
    the head metrics table and the files written, then a blank line; every line ends in a newline.
    """
    lines: list[str] = []
    for i, (dump, folder) in enumerate(zip(result.dumps, result.out_dirs, strict=True)):
        text = dump.meta["prompt"]
        shown = repr(text if len(text) <= 60 else text[:57] + "...")
        cut = ", truncated to the last tokens" if dump.meta["truncated"] else ""
        lines.append(f"prompt {i} ({len(dump.tokens)} tokens{cut}): {shown}")
        lines.append(format_metrics_table(dump))
        if "probe" in dump.meta:
            lines.append(induction_note(dump.meta))
        lines.append(f"wrote {folder}/: " + ", ".join(p.name for p in result.files[i]))
        lines.append("")
    if result.ablation is not None:
        data_file = result.dumps[0].meta["ablation"].get("data_file") if result.dumps else None
        lines += [format_top_heads(result.ablation, data=data_file), ""]
    return "".join(f"{line}\n" for line in lines)
