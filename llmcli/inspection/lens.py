"""The logit lens (nostalgebraist 2020): what the model would predict if it stopped early.

At every layer boundary, the embedding (the input of block 0) and the output of each block
(`blocks.{l}.resid_post`), the residual stream goes through the final norm and the LM head
(`Transformer.to_logits`), as if the blocks above it were not there. The log-prob each boundary
gives the prompt's actual next token shows where along the depth a prediction forms; the last
boundary's read-out is the model's own output.

`logit_lens` computes it for a prompt, `run_lens` is `llmcli lens`: a run and a prompt in,
`lens.json` and `lens.png` out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmcli.errors import InputError
from llmcli.inspection import answers
from llmcli.inspection.pictures import Grid, plot_grids, token_label

log = logging.getLogger(__name__)


@dataclass
class LensResult:
    """The lens of one prompt of `T` tokens through `L` blocks.

    Attributes:
        layers: the `L + 1` boundaries: "embed", "0", ..., "L-1" (after block l).
        tokens: the prompt's `T` tokens, as text.
        logprobs: `(L + 1, T - 1)`: `[i, t]` is the log-prob of token `t + 1` read at boundary
            `i` from position `t`.
        top_tokens: `(L + 1) x T` texts: each position's most likely next token at each boundary
            (the last column predicts the token after the prompt).
        prompt: the prompt's text.
    """

    layers: list[str]
    tokens: list[str]
    logprobs: np.ndarray
    top_tokens: list[list[str]]
    prompt: str = ""

    @property
    def loss(self) -> np.ndarray:
        """`(L + 1,)` mean loss on the prompt's next tokens at each boundary, nats per token."""
        return -self.logprobs.mean(axis=1)

    def to_dict(self) -> dict[str, Any]:
        return {
            "layers": self.layers,
            "tokens": self.tokens,
            "logprobs": self.logprobs.tolist(),
            "top_tokens": self.top_tokens,
            "loss": self.loss.tolist(),
            "prompt": self.prompt,
        }


def boundary_names(n_layer: int) -> list[str]:
    """The hook points of the lens's boundaries: the embedding, then each block's output."""
    return ["embed"] + [f"blocks.{i}.resid_post" for i in range(n_layer)]


@torch.no_grad()
def logit_lens(model: torch.nn.Module, tokenizer: Any, ids: Sequence[int]) -> LensResult:
    """Read the prompt `ids` (at least 2 tokens) at every layer boundary of `model`.

    The residual streams of every boundary are recorded in one forward, then all go through
    `model.to_logits` together.

    Raises:
        InputError: a prompt of fewer than 2 tokens (nothing to predict inside it).
    """
    if len(ids) < 2:
        raise InputError(
            f"the prompt is {len(ids)} token long: the lens reads the prompt's own next tokens, "
            "so give at least 2 tokens."
        )
    x = torch.tensor([list(ids)], device=answers.model_device(model))  # (1, T)
    names = boundary_names(model.n_layer)
    acts, _ = answers.record(model, x, names)
    streams = torch.cat([acts[name] for name in names])  # (L + 1, T, C)
    logp = torch.log_softmax(model.to_logits(streams).float(), dim=-1)  # (L + 1, T, V)
    nxt = x[0, 1:].expand(len(names), -1)  # (L + 1, T - 1)
    read = logp[:, :-1].gather(-1, nxt[..., None])[..., 0]  # (L + 1, T - 1)
    top = logp.argmax(dim=-1).cpu().tolist()  # (L + 1, T)
    texts = {t: tokenizer.decode([t]) for row in top for t in row}
    return LensResult(
        layers=["embed"] + [str(i) for i in range(model.n_layer)],
        tokens=answers.token_texts(tokenizer, ids),
        logprobs=read.double().cpu().numpy(),
        top_tokens=[[texts[t] for t in row] for row in top],
        prompt=tokenizer.decode(list(ids)),
    )


def plot_lens(result: LensResult, path: str | Path) -> Path:
    """The lens as a heat map: boundary x position, the log-prob of the actual next token;
    each position's token below, the token it should predict above."""
    grid = Grid(
        values=result.logprobs,
        rows=result.layers,
        cols=result.tokens[:-1],
        top_cols=result.tokens[1:],
        xlabel="position (its token below, the next token above)",
        ylabel="read after",
    )
    title = "logit lens: log-prob of the next token at each layer boundary"
    return plot_grids([grid], path, title=title, colour_label="log-prob", centre=None)


def format_lens(result: LensResult) -> str:
    """What `llmcli lens` prints: per boundary the mean loss and each position's top token, in
    columns under the prompt's tokens."""
    cells = [[token_label(t) for t in row] for row in [result.tokens, *result.top_tokens]]
    width = max(len(c) for row in cells for c in row)
    name_width = max(5, *(len(n) for n in result.layers))

    def line(name: str, loss: str, row: list[str]) -> str:
        return f"{name:<{name_width}} {loss:>6}  " + " ".join(c.ljust(width) for c in row).rstrip()

    lines = [
        f"logit lens of {len(result.tokens)} tokens: per layer boundary, the mean loss on the "
        "next tokens (nats) and the top token at each position, under the prompt's tokens",
        line("layer", "loss", cells[0]),
    ]
    for name, loss, row in zip(result.layers, result.loss, cells[1:], strict=True):
        lines.append(line(name, f"{loss:.3f}", row))
    return "".join(f"{text}\n" for text in lines)


def run_lens(
    options: answers.RunOptions, prompt: str, *, notify: Callable[[str], Any] = log.warning
) -> tuple[LensResult, list[Path]]:
    """`llmcli lens`: load the run, read the prompt at every boundary, write `lens.json` and
    `lens.png` into `options.out_dir` (default `<run>/lens/`).

    Returns:
        The lens and the files written.

    Raises:
        InputError: no run, an empty prompt or one longer than the context, an unwritable folder.
    """
    run = answers.open_run(options, notify)
    ids = answers.encode_text(run.tokenizer, prompt, run.model.context_length, "--prompt")
    result = logit_lens(run.model, run.tokenizer, ids)
    plot = partial(plot_lens, result)
    return result, answers.write_result(
        options, run, "lens", "lens", result.to_dict(), plot, notify
    )
