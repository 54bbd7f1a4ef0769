"""Evaluating a model: `llmcli eval` on a whole text.

`evaluate_run` scores a run's model on its own validation split (the same split training reports,
rebuilt from the run's config and tokenizer) or on any UTF-8 text file. Unlike the training loop's
estimate (`llmcli.training.evaluate`), which averages `eval_steps` random batches, this is a
deterministic pass: the token stream `t_0 .. t_{n-1}` is cut into consecutive windows of
`context_length` inputs, window `k` predicting `t_{kT+1} .. t_{kT+T}` from `t_{kT} .. t_{kT+T-1}`,
so that every token after the first is predicted exactly once (the last window may be shorter). The
command's settings travel whole as one `EvalOptions`, checked as it is made: with `steps=N` only the
first `N` batches of `batch_size` windows are scored; `ablate` scores the model with heads removed
(`llmcli.inspection.ablation`).

Figures, over the predicted tokens:
- `loss`: mean cross-entropy in nats per token; `perplexity = exp(loss)`;
- `bits_per_byte`: total nats / ln 2 / total UTF-8 bytes of the predicted text. Unlike the
  loss, it does not depend on the tokenizer, so a char run and a BPE run compare. Special tokens
  (a BPE run's end-of-text separator) are no text: they are left out of both sums, as in
  nanochat's `evaluate_bpb`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.data.tokens import prepare_data
from llmcli.device import check_threads, resolve_device, torch_threads
from llmcli.errors import InputError
from llmcli.fileio import read_user_text
from llmcli.inspection.ablation import ablation_hooks, check_method, head_means, parse_ablate
from llmcli.progress import Progress
from llmcli.runs.loading import load_run
from llmcli.training.evaluate import perplexity

logger = logging.getLogger(__name__)

DECODE_CHUNK = 1 << 16  # tokens decoded at a time to count bytes


@dataclass
class EvalResult:
    """What `evaluate_run` measured (JSON-ready through `to_dict`)."""

    run_dir: str
    weights: str
    step: int
    data: str
    tokens: int
    bytes: int
    windows: int
    loss: float
    perplexity: float
    bits_per_token: float
    bits_per_byte: float
    elapsed_s: float
    ablate: list[str] = field(default_factory=list)  # the `--ablate` specs: heads removed
    ablation: str | None = None  # how they were removed, with `ablate`
    per_token: list[dict[str, Any]] | None = None  # with `--per-token`: `per_token_records`

    def to_dict(self) -> dict[str, Any]:
        """The summary (every field but `per_token`)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "per_token"}


@dataclass
class Totals:
    """Sums over the scored tokens."""

    nats: float = 0.0  # every predicted token
    tokens: int = 0
    text_nats: float = 0.0  # tokens that are text (not special tokens)
    bytes: int = 0
    windows: int = 0
    losses: list[tuple[int, np.ndarray]] | None = None  # (window start, its (L,) losses)


def read_text(path: str | Path) -> str:
    """A text file as strict UTF-8.

    Raises:
        InputError: missing, a directory, unreadable, not UTF-8 (names the byte offset), empty.
    """
    p = Path(path)
    text = read_user_text(p, "--data", hint="give a UTF-8 text file")
    if not text:
        raise InputError(f"--data {str(p)!r} is empty: give a file with text in it.")
    return text


def _text_bytes(tokenizer: Any, ids: np.ndarray) -> int:
    """UTF-8 bytes of the text of `ids` (special tokens left out), decoded in chunks."""
    eot = getattr(tokenizer, "eot_id", None)
    if eot is not None:
        ids = ids[ids != eot]
    return sum(
        len(tokenizer.decode(ids[i : i + DECODE_CHUNK].tolist()).encode("utf-8"))
        for i in range(0, len(ids), DECODE_CHUNK)
    )


def window_starts(
    n: int, context_length: int, batch_size: int, steps: int | None = None
) -> list[list[int]]:
    """The first token of each window, grouped into batches (see the module doc).

    Window k has inputs `[s, s + T)` and targets `[s + 1, s + T + 1)`; full windows come in
    batches of `batch_size`, then the shorter last window alone, if any. With `steps`, only the
    first `steps` batches.
    """
    T = context_length
    starts = list(range(0, n - 1, T))
    full = [s for s in starts if s + T + 1 <= n]
    partial = [s for s in starts if s + T + 1 > n]  # at most one, the shorter last window
    batches = [full[i : i + batch_size] for i in range(0, len(full), batch_size)]
    batches += [partial] if partial else []
    return batches if steps is None else batches[:steps]


def window_batches(
    tokens: np.ndarray, context_length: int, starts: list[list[int]], device: torch.device | str
) -> Iterator[tuple[Tensor, Tensor]]:
    """The `(x, y)` windows of each batch of `window_starts`, each `(B, L)` long on `device`."""
    n = len(tokens)
    for batch in starts:
        length = min(context_length, n - 1 - batch[0])  # a batch's windows have one length
        index = np.asarray(batch)[:, None] + np.arange(length + 1)  # (B, L+1)
        windows = torch.from_numpy(np.asarray(tokens[index], dtype=np.int64)).to(device)
        yield windows[:, :-1], windows[:, 1:]  # (B, L), (B, L)


@torch.no_grad()
def score_tokens(
    model: nn.Module,
    tokens: np.ndarray,
    context_length: int,
    batch_size: int,
    *,
    steps: int | None = None,
    special_id: int | None = None,
    progress: bool = False,
    per_token: bool = False,
) -> Totals:
    """Sum the model's negative log-likelihood over consecutive windows of `tokens`.

    Args:
        model: a causal LM whose `forward(idx)` returns `(logits (B, T, V), _)`; the windows
            go to the device of its parameters.
        tokens: `(n,)` token ids, n >= 2.
        context_length: `T`, the window length.
        batch_size: windows per forward pass.
        steps: score only the first `steps` batches (None: the whole stream).
        special_id: a token id that is not text (left out of `text_nats`).
        progress: show progress (a bar on a terminal, plain lines elsewhere).
        per_token: also keep each window's losses, in `Totals.losses`.

    Returns:
        `Totals` (bytes left at 0: the caller counts them from the tokens scored).
    """
    starts = window_starts(len(tokens), context_length, batch_size, steps)
    device = next(model.parameters()).device
    totals = Totals(losses=[] if per_token else None)
    model.eval()
    bar = Progress(len(starts), desc="eval", unit="batch", enabled=progress, tenths=True)
    for (x, y), batch in zip(
        window_batches(tokens, context_length, starts, device), starts, strict=True
    ):
        logits, _ = model(x)  # (B, L, V)
        nll = F.cross_entropy(
            logits.float().flatten(0, 1), y.flatten(), reduction="none"
        )  # (B * L,)
        if totals.losses is not None:
            rows = nll.view(y.shape).cpu().numpy()  # (B, L)
            totals.losses += [(start, row) for start, row in zip(batch, rows, strict=True)]
        totals.nats += nll.sum().item()
        totals.tokens += nll.numel()
        if special_id is not None:
            nll = nll[y.flatten() != special_id]
        totals.text_nats += nll.sum().item()
        totals.windows += len(batch)
        bar.update()
    bar.close()
    return totals


def per_token_records(
    tokenizer: Any, tokens: np.ndarray, losses: Sequence[tuple[int, np.ndarray]]
) -> list[dict[str, Any]]:
    """`eval --per-token`'s JSON lines: one object per window, in the order of the text.

    Window k starting at token `s` predicts tokens `s + 1 .. s + L` of the text; its object is
    `{"window": k, "start": s, "ids": [L ints], "tokens": [L strs], "losses": [L floats]}`:
    `tokens[i]` (decoded alone) is predicted from tokens `s .. s + i` with loss `losses[i]`
    (nats, rounded to 1e-6).
    """
    decoded: dict[int, str] = {}
    records = []
    for k, (start, row) in enumerate(losses):
        ids = [int(i) for i in tokens[start + 1 : start + 1 + len(row)]]
        for i in ids:
            if i not in decoded:
                decoded[i] = tokenizer.decode([i])
        records.append(
            {
                "window": k,
                "start": int(start),
                "ids": ids,
                "tokens": [decoded[i] for i in ids],
                "losses": np.round(row.astype(np.float64), 6).tolist(),
            }
        )
    return records


def eval_tokens(
    run: Any,
    data: str | Path | None = None,
    hint: str = "Or pass --data PATH to score a text file.",
) -> tuple[np.ndarray, str]:
    """The tokens to score and a label for them: a text file, or the run's validation split.

    Args:
        run: a loaded run (`llmcli.runs.loading.load_run`).
        data: a UTF-8 text file (None: the validation split, rebuilt from the run's config:
            the same corpus path must still be readable).
        hint: ends the message when the validation split cannot be rebuilt.

    Raises:
        InputError: a bad data file or an unreadable corpus; a text with characters the run's
            tokenizer cannot encode, or fewer than 2 tokens.
    """
    if data is not None:
        text = read_text(data)
        tokens = np.asarray(run.tokenizer.encode(text), dtype=np.int64)
        label = str(data)
    else:
        ctx = run.config.model.context_length
        try:
            tokens = prepare_data(run.config.data, ctx, tokenizer=run.tokenizer).val
        except InputError as exc:
            raise InputError(
                f"cannot rebuild the validation split of '{run.run_dir}': {exc} {hint}"
            ) from None
        source = run.config.data.val_path or run.config.data.path or run.config.data.dataset
        label = f"validation split of {source}"
    if len(tokens) < 2:
        raise InputError(
            f"{label} has {len(tokens)} token(s): at least 2 are needed (one to predict from)."
        )
    return tokens, label


@dataclass(frozen=True)
class EvalOptions:
    """What `llmcli eval` scores, with which heads removed, and which weights it loads where.
    Checked as it is made, where a check needs no run (the heads in `ablate` are checked against
    the model by `ablation.parse_ablate`).

    Attributes:
        steps: score only the first `steps` batches (None: all of the text).
        batch_size: windows per batch (None: the run's `train.batch_size`).
        ablate: heads to remove, `"L.H"` or `"L"` each (see `ablation.parse_ablate`).
        ablation: "zero" (None means it too) or "mean": a removed head outputs zeros, or its
            mean output over the scored batches (computed in a first pass over them); only
            with `ablate`.
        weights: "best" or "last" weights of the run.
        device: "auto", "cpu", "cuda" or "mps".
        per_token: also keep each scored token's loss (`EvalResult.per_token`).
        threads: CPU threads (None: the run's `train.threads`).

    Raises:
        InputError: `steps` or `batch_size` below 1, an unknown `ablation`, or one without
            `ablate`; `threads` outside 1..this machine's CPUs.
    """

    steps: int | None = None
    batch_size: int | None = None
    ablate: Sequence[str] = ()
    ablation: str | None = None
    weights: str = "best"
    device: str = "auto"
    per_token: bool = False
    threads: int | None = None

    def __post_init__(self) -> None:
        check_threads(self.threads)
        if self.steps is not None and self.steps < 1:
            raise InputError(f"--steps ({self.steps}) must be a positive number of batches.")
        if self.batch_size is not None and self.batch_size < 1:
            raise InputError(f"--batch-size ({self.batch_size}) must be positive.")
        if self.ablation is not None:
            check_method(self.ablation)
        if self.ablation is not None and not self.ablate:
            raise InputError(
                f"--ablation {self.ablation} says how --ablate removes heads: give --ablate L.H "
                "(or L) too."
            )

    @property
    def method(self) -> str | None:
        """How the heads in `ablate` are removed ("zero" unless `ablation` says "mean"); None
        when no head is."""
        return (self.ablation or "zero") if self.ablate else None


def evaluate_run(
    checkpoint: str | Path | None = None,
    data: str | Path | None = None,
    options: EvalOptions = EvalOptions(),
    *,
    progress: bool = False,
    notify: Callable[[str], None] | None = None,
) -> EvalResult:
    """Mean loss, perplexity and bits per byte of a run's model on a text.

    Args:
        checkpoint: a run directory (None: the latest run under `checkpoints/`).
        data: a UTF-8 text file to score (None: the run's validation split, see `eval_tokens`).
        options: how many batches of what size, the heads to remove and how, which weights and
            the device (see `EvalOptions`, checked as it was made).
        progress: show progress (a bar on a terminal, plain lines elsewhere): of the scoring
            pass, and of the first pass that mean ablation needs.
        notify: called with one line per warning (installed versions differ from the run's).

    Raises:
        InputError: a bad run directory or data file, a head of `options.ablate` the model does
            not have (see `eval_tokens`, `ablation.parse_ablate`).
    """
    t0 = time.perf_counter()
    dev = resolve_device(options.device, what="--device")
    run = load_run(checkpoint, weights=options.weights, device=dev, notify=notify)
    with torch_threads(options.threads or run.config.train.threads):
        return _evaluate(run, data, options, t0, progress=progress)


def _evaluate(
    run: Any, data: str | Path | None, options: EvalOptions, t0: float, *, progress: bool
) -> EvalResult:
    """`evaluate_run` on a loaded run; `t0` is when the command began."""
    dev = next(run.model.parameters()).device
    ablate, steps = options.ablate, options.steps
    head_mask = None
    if ablate:
        head_mask = parse_ablate(ablate, run.model.n_layer, run.model.n_head).to(dev)
    tokens, label = eval_tokens(run, data)
    ctx = run.config.model.context_length
    batch_size = options.batch_size or run.config.train.batch_size
    head_mean = None
    if options.method == "mean":
        starts = window_starts(len(tokens), ctx, batch_size, steps)
        batches = window_batches(tokens, ctx, starts, dev)
        head_mean = head_means(run.model, batches, progress=progress, total=len(starts))
    hooks = {} if head_mask is None else ablation_hooks(head_mask, head_mean)
    with run.model.hooks(hooks):
        totals = score_tokens(
            run.model,
            tokens,
            ctx,
            batch_size,
            steps=steps,
            special_id=getattr(run.tokenizer, "eot_id", None),
            progress=progress,
            per_token=options.per_token,
        )
    scored = np.asarray(tokens[1 : 1 + totals.tokens], dtype=np.int64)  # the predicted tokens
    n_bytes = _text_bytes(run.tokenizer, scored)
    loss = totals.nats / totals.tokens
    return EvalResult(
        run_dir=str(run.run_dir),
        weights=str(run.weights_path),
        step=run.step,
        data=label,
        tokens=totals.tokens,
        bytes=n_bytes,
        windows=totals.windows,
        loss=loss,
        perplexity=perplexity(loss),
        bits_per_token=loss / math.log(2),
        bits_per_byte=totals.text_nats / math.log(2) / n_bytes if n_bytes else math.nan,
        elapsed_s=time.perf_counter() - t0,
        ablate=list(ablate),
        ablation=options.method,
        per_token=None
        if totals.losses is None
        else per_token_records(run.tokenizer, tokens, totals.losses),
    )


def format_result(result: EvalResult) -> str:
    """A few human-readable lines."""
    text = (
        f"run {result.run_dir} (step {result.step}, {Path(result.weights).name})\n"
        f"data: {result.data}: {result.tokens:,} tokens predicted, {result.bytes:,} bytes, "
        f"{result.windows:,} windows\n"
        f"loss {result.loss:.4f} nats/token, perplexity {result.perplexity:.3f}, "
        f"{result.bits_per_token:.4f} bits/token, {result.bits_per_byte:.4f} bits/byte"
    )
    if result.ablate:
        text += f"\nheads removed ({result.ablation} ablation): {', '.join(result.ablate)}"
    return text
