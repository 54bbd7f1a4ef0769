"""Direct logit attribution: how much each head and each MLP writes the answer directly.

The residual stream at the last position is a sum of what each part of the model wrote into it:
the embedding, each head (its slice of `attn.z` through its columns of `attn.proj`), each
attention layer's output bias, each MLP (its `mlp_out`, its bias included). The logit
difference is `direction . final_norm(stream)` (`AnswerMetric.direction`), and the final norm is
linear in the stream once its scale is frozen at the value it takes on the actual stream (the
usual convention, as TransformerLens's `apply_ln_to_stack`): LayerNorm
`(x - mean(x)) / scale * gain + bias` with `scale = sqrt(var(x) + eps)`, RMSNorm
`x / scale * gain` with `scale = sqrt(mean(x**2) + eps)`. So each part's direct contribution is
`direction . ((part - mean(part)) / scale * gain)` (no centring under RMSNorm), and the parts add
up to the logit difference exactly. "rest" holds the final norm's bias term and every attention
layer's output-projection bias. What a part adds through the layers above it (indirect effects)
is not counted here: activation patching (`llmcli patch`) measures that.

Without `--wrong` the attributed quantity is the logit of `--answer` (its log-prob is not linear
in the stream).

Shapes: `L` layers, `H` heads, `hs` head size, `T` tokens, `C` channels, `V` vocabulary.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from llmcli.errors import InputError
from llmcli.inspection import answers
from llmcli.inspection.pictures import Grid, plot_grids
from llmcli.model.layers import RMSNorm
from llmcli.progress import format_fixed

log = logging.getLogger(__name__)


@dataclass
class Attribution:
    """Each part's direct contribution to the logit difference at the last position.

    Attributes:
        logit_diff: the model's logit difference (the logit of the answer without `wrong`).
        embed: the token (+ position) embedding's part.
        heads: `(L, H)` each head's part.
        mlp: `(L,)` each MLP's part.
        rest: the final norm's bias and the attention output biases.
        metric: what was attributed.
        tokens: the prompt's tokens, as text.
        prompt: its text.
    """

    logit_diff: float
    embed: float
    heads: np.ndarray
    mlp: np.ndarray
    rest: float
    metric: answers.AnswerMetric
    tokens: list[str]
    prompt: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "logit_diff": self.logit_diff,
            "embed": self.embed,
            "heads": self.heads.tolist(),
            "mlp": self.mlp.tolist(),
            "rest": self.rest,
            **self.metric.to_dict(),
            "tokens": self.tokens,
            "prompt": self.prompt,
        }


def _cpu64(t: Tensor) -> Tensor:
    """A float64 copy on the CPU (MPS has no float64; the sums should not lose digits)."""
    return t.detach().to("cpu", torch.float64)


def frozen_norm(norm: nn.Module, x: Tensor) -> tuple[Tensor, Tensor, Tensor | None, bool]:
    """The final norm as a linear map, its scale frozen at its value on the stream `x` `(C,)`.

    Returns:
        `(scale, gain (C,), bias (C,) or None, centre)`, float64 on the CPU: `norm(x)` equals
        `(x - mean(x) if centre else x) / scale * gain + bias`, for `x` and only for `x`.

    Raises:
        InputError: a norm other than LayerNorm or RMSNorm.
    """
    x = _cpu64(x)
    weight = getattr(norm, "weight", None)
    gain = torch.ones_like(x) if weight is None else _cpu64(weight)
    if isinstance(norm, nn.LayerNorm):
        scale = (x.var(unbiased=False) + norm.eps).sqrt()
        return scale, gain, None if norm.bias is None else _cpu64(norm.bias), True
    if isinstance(norm, RMSNorm):
        return (x.square().mean() + norm.eps).sqrt(), gain, None, False
    raise InputError(f"direct logit attribution knows LayerNorm and RMSNorm, not {norm!r}")


def head_outputs(z: Tensor, proj_weight: Tensor) -> Tensor:
    """What each head writes into the stream: its `z` through its columns of the output
    projection, without the bias.

    Shape:
        z `(H, hs)` at one position, proj_weight `(C, C)` -> `(H, C)`.
    """
    H, hs = z.shape
    w = proj_weight.view(-1, H, hs)  # (C, C) -> (C, H, hs): the columns of each head
    return torch.einsum("hk,chk->hc", z, w)  # (H, C)


@torch.no_grad()
def attribute(
    model: torch.nn.Module, tokenizer: Any, ids: list[int], metric: answers.AnswerMetric
) -> Attribution:
    """Direct logit attribution of the prompt `ids` at its last position (see the module doc).

    Computed in float64 from the activations one forward records at the hook points `embed`,
    `blocks.{l}.attn.z`, `blocks.{l}.mlp_out` and the last block's `resid_post`.
    """
    L = model.n_layer
    last = f"blocks.{L - 1}.resid_post" if L else "embed"
    names = ["embed", last] + [f"blocks.{i}.{p}" for i in range(L) for p in ("attn.z", "mlp_out")]
    acts, logits = answers.record(
        model, torch.tensor([ids], device=answers.model_device(model)), names
    )
    at = {name: _cpu64(act[0, -1]) for name, act in acts.items()}  # the last position
    scale, gain, bias, centre = frozen_norm(model.ln_f, at[last])
    direction = _cpu64(metric.direction(model.lm_head.weight))  # (C,)

    def direct(parts: Tensor) -> Tensor:  # (N, C) -> (N,): through the frozen norm
        if centre:
            parts = parts - parts.mean(dim=-1, keepdim=True)
        return (parts / scale * gain) @ direction

    heads = np.zeros((L, model.n_head))
    rest = 0.0 if bias is None else float(bias @ direction)
    for i, block in enumerate(model.blocks):
        outputs = head_outputs(at[f"blocks.{i}.attn.z"], _cpu64(block.attn.proj.weight))
        heads[i] = direct(outputs).numpy()
        if block.attn.proj.bias is not None:
            rest += float(direct(_cpu64(block.attn.proj.bias)[None])[0])
    mlp = [float(direct(at[f"blocks.{i}.mlp_out"][None])[0]) for i in range(L)]
    return Attribution(
        logit_diff=float(metric.logit_value(_cpu64(logits[:, -1]))[0]),
        embed=float(direct(at["embed"][None])[0]),
        heads=heads,
        mlp=np.array(mlp),
        rest=rest,
        metric=metric,
        tokens=answers.token_texts(tokenizer, ids),
        prompt=tokenizer.decode(ids),
    )


def plot_attribution(result: Attribution, path: str | Path) -> Path:
    """Each head's and each MLP's part as a layer x (heads, mlp) heat map centred on 0."""
    H = result.heads.shape[1]
    values = np.concatenate([result.heads, result.mlp[:, None]], axis=1)  # (L, H + 1)
    grid = Grid(
        values,
        rows=[str(i) for i in range(len(result.mlp))],
        cols=[str(h) for h in range(H)] + ["mlp"],
        xlabel="head",
        ylabel="layer",
    )
    title = (
        f"direct logit attribution of {result.metric.describe_linear()} = "
        f"{result.logit_diff:.3f}\n(embed {result.embed:+.3f}, rest {result.rest:+.3f})"
    )
    return plot_grids([grid], path, title=title, colour_label="direct contribution (logits)")


def format_attribution(result: Attribution) -> str:
    """What `llmcli attribute` prints: the logit difference, then each part, as a table of
    layer x (heads, mlp), and the check that the parts add up."""
    H = result.heads.shape[1]
    total = result.embed + result.heads.sum() + result.mlp.sum() + result.rest
    lines = [
        f"direct logit attribution of {result.metric.describe_linear()} at the last position: "
        f"{result.logit_diff:.4f}",
        f"embed {result.embed:+.4f}",
        "layer " + " ".join(f"{'head ' + str(h):>8}" for h in range(H)) + f" {'mlp':>8}",
    ]
    for i, row in enumerate(result.heads):
        cells = " ".join(format_fixed(v, ">+8.4f") for v in [*row, result.mlp[i]])
        lines.append(f"{i:>5} {cells}")
    lines += [
        f"rest  {result.rest:+.4f} (final norm bias, attention output biases)",
        f"sum of the parts {total:.4f} (the logit difference {result.logit_diff:.4f})",
    ]
    return "".join(f"{text}\n" for text in lines)


def run_attribution(
    options: answers.RunOptions,
    prompt: str,
    metric_texts: tuple[str, str | None],
    *,
    notify: Callable[[str], Any] = log.warning,
) -> tuple[Attribution, list[Path]]:
    """`llmcli attribute`: load the run, attribute the answer at the prompt's last position,
    write `attribution.json` and `attribution.png` into `options.out_dir` (default
    `<run>/attribute/`).

    Args:
        options: the run and the output folder.
        prompt: the prompt.
        metric_texts: `(--answer, --wrong)` texts, one token each (`--wrong` may be None).
        notify: receives the notices (the run used).

    Raises:
        InputError: an empty prompt or one longer than the context, an answer that is not one
            token, an unwritable folder.
    """
    run = answers.open_run(options, notify)
    metric = answers.AnswerMetric.from_texts(run.tokenizer, *metric_texts)
    ids = answers.encode_text(run.tokenizer, prompt, run.model.context_length, "--prompt")
    result = attribute(run.model, run.tokenizer, ids, metric)
    plot = partial(plot_attribution, result)
    files = answers.write_result(
        options, run, "attribute", "attribution", result.to_dict(), plot, notify
    )
    return result, files
