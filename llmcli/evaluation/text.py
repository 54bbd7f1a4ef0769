"""Scoring a token stream: consecutive windows, the loss of every predicted token, and the
tokens a run is scored on.

The token stream `t_0 .. t_{n-1}` is cut into consecutive windows of `context_length` inputs,
window `k` predicting `t_{kT+1} .. t_{kT+T}` from `t_{kT} .. t_{kT+T-1}`, so that every token
after the first is predicted exactly once (the last window may be shorter): `window_starts`,
`window_batches`. `score_tokens` sums the model's negative log-likelihood over them (keeping each
window's losses for `--per-token`, `per_token_records`); `eval_tokens` finds the tokens to score,
a text file or a run's validation split; `text_bytes` counts the bytes bits per byte divide by.
`token_losses` is every predicted token's loss, the one per-token loss of llmcli: training's
loss by position, conversations' assistant tokens and head ablation use it too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.config.shipped import shipped_data
from llmcli.data.chat_batches import IGNORE
from llmcli.data.tokens import prepare_data
from llmcli.errors import InputError
from llmcli.fileio import read_user_text
from llmcli.progress import Progress

DECODE_CHUNK = 1 << 16  # tokens decoded at a time to count bytes


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
    p = shipped_data(path)
    text = read_user_text(p, "--data", hint="give a UTF-8 text file")
    if not text:
        raise InputError(f"--data {str(p)!r} is empty: give a file with text in it.")
    return text


def text_bytes(tokenizer: Any, ids: np.ndarray) -> int:
    """UTF-8 bytes of the text of `ids` (special tokens left out), decoded in chunks.

    A chunk whose text ends inside a character (byte-level BPE spells a rare one in up to 4 byte
    tokens) takes up to 3 more tokens: cut there, each part would decode to a replacement
    character of 3 bytes.
    """
    eot = getattr(tokenizer, "eot_id", None)
    if eot is not None:
        ids = ids[ids != eot]
    total, start = 0, 0
    while start < len(ids):
        end = min(start + DECODE_CHUNK, len(ids))
        text = tokenizer.decode(ids[start:end].tolist())
        for _ in range(3):
            if end == len(ids) or not text.endswith("\ufffd"):
                break
            end += 1
            text = tokenizer.decode(ids[start:end].tolist())
        total += len(text.encode("utf-8"))
        start = end
    return total


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


def token_losses(logits: Tensor, targets: Tensor) -> Tensor:
    """Each target's negative log-likelihood, in float32; 0 where the target is `IGNORE` (-1: a
    conversation's token the model does not write), as the model's own loss leaves those out.

    Shape:
        logits `(..., V)`, targets `(...)` -> `(...)`
    """
    nll = F.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), reduction="none", ignore_index=IGNORE
    )  # (N,)
    return nll.view(targets.shape)


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
        nll = token_losses(logits, y)  # (B, L)
        if totals.losses is not None:
            rows = nll.cpu().numpy()  # (B, L)
            totals.losses += [(start, row) for start, row in zip(batch, rows, strict=True)]
        nll = nll.flatten()  # (B * L,)
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
