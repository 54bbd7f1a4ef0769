"""The local replacement model of one prompt: a run whose MLPs are its transcoders plus error
terms, with attention patterns and norm denominators frozen at their values on the prompt.

As circuit-tracer builds it (Ameisen et al. 2025, "Circuit Tracing"; `ReplacementModel.
setup_attribution`): one clean forward reads every layer's MLP input and output
(`blocks.{l}.mlp_in`, `blocks.{l}.mlp_out`), each attention pattern and each norm's denominator.
The transcoders encode the inputs; the first position's features are set to 0 (see
`prompt_tokens`); the error of a layer is its MLP's output less the transcoder's prediction, 0 at
the first position. Frozen, the model is affine in what its nodes write: the token embeddings,
each active feature's `activation * W_dec row` and each error, all into the residual stream, and
through it into what the nodes read (a feature's `W_enc row . mlp_in`, a logit's demeaned
unembedding `. final_norm`). What is not a node is a constant: position embeddings, biases
(`b_dec` included), and the first position's MLP output.

`frozen_hooks` makes that model out of the run's own forward, at its hook points: the norms'
outputs (`attn_in`, `mlp_in`, `final_norm`) recomputed from their inputs with the clean
denominators, the patterns replaced by the clean ones, each MLP's output replaced by its skip
path plus a constant (circuit-tracer's `skip + (out - skip).detach()`), so the gradient of a
read with respect to a write is the direct effect of one node on another.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from llmcli.errors import InputError
from llmcli.inspection.sae.transcoder import TranscoderSet
from llmcli.model.hooks import HookFn
from llmcli.model.layers import RMSNorm


def norm_scale(norm: nn.Module, x: Tensor) -> Tensor:
    """The denominator of `norm` on `x` `(..., C)`: `sqrt(var + eps)` (LayerNorm) or
    `sqrt(mean square + eps)` (RMSNorm), `(..., 1)`."""
    if isinstance(norm, nn.LayerNorm):
        return (x.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
    if isinstance(norm, RMSNorm):
        return (x.square().mean(-1, keepdim=True) + norm.eps).sqrt()
    raise InputError(f"attribution graphs know LayerNorm and RMSNorm, not {norm!r}")


def frozen_norm(norm: nn.Module, x: Tensor, scale: Tensor) -> Tensor:
    """`norm(x)` with the denominator `scale` given (a constant): linear in `x`."""
    if isinstance(norm, nn.LayerNorm):
        x = x - x.mean(-1, keepdim=True)
    y = x / scale
    if getattr(norm, "weight", None) is not None:
        y = y * norm.weight
    if getattr(norm, "bias", None) is not None:
        y = y + norm.bias
    return y


@dataclass
class PromptState:
    """What the clean forward of one prompt leaves for the frozen model (`read_prompt`).

    Shapes: `L` layers, `T` positions, `C` channels, `H` heads, `F` features.

    Attributes:
        tokens: `(T,)` the prompt's ids, the special token first.
        logits: `(T, V)` the model's logits.
        mlp_in, mlp_out: `(L, T, C)` each layer's MLP input and output.
        patterns: per layer `(1, H, T, T)`.
        scales: per norm name (`ln1.{l}`, `ln2.{l}`, `ln_f`) its denominators `(1, T, 1)`.
        acts: `(L, T, F)` the features' activations (0 at the first position).
        errors: `(L, T, C)` MLP output less the transcoder's prediction (0 at the first position).
        final: `(T, C)` the final norm's output.
    """

    tokens: Tensor
    logits: Tensor
    mlp_in: Tensor
    mlp_out: Tensor
    patterns: list[Tensor]
    scales: dict[str, Tensor]
    acts: Tensor
    errors: Tensor
    final: Tensor
    zero_positions: slice = field(default_factory=lambda: slice(0, 1))


@torch.no_grad()
def read_prompt(model: nn.Module, transcoders: TranscoderSet, tokens: Tensor) -> PromptState:
    """The clean forward of `tokens` `(T,)` through `model`, and the transcoders on it."""
    L = model.n_layer
    seen: dict[str, Tensor] = {}

    def keep(name: str) -> HookFn:
        return lambda x: seen.__setitem__(name, x[0])

    names = ["final_norm", f"blocks.{L - 1}.resid_post"]
    for layer in range(L):
        names += [f"blocks.{layer}.{p}" for p in ("resid_pre", "attn.pattern", "resid_mid")]
        names += [f"blocks.{layer}.mlp_in", f"blocks.{layer}.mlp_out"]
    with model.hooks({name: keep(name) for name in names}):
        logits, _ = model(tokens[None])
    scales = {"ln_f": norm_scale(model.ln_f, seen[f"blocks.{L - 1}.resid_post"])[None]}
    for layer, block in enumerate(model.blocks):
        scales[f"ln1.{layer}"] = norm_scale(block.ln1, seen[f"blocks.{layer}.resid_pre"])[None]
        scales[f"ln2.{layer}"] = norm_scale(block.ln2, seen[f"blocks.{layer}.resid_mid"])[None]
    mlp_in = torch.stack([seen[f"blocks.{layer}.mlp_in"] for layer in range(L)])  # (L, T, C)
    mlp_out = torch.stack([seen[f"blocks.{layer}.mlp_out"] for layer in range(L)])  # (L, T, C)
    acts = torch.stack([transcoders[i].encode(mlp_in[i]) for i in range(L)])  # (L, T, F)
    first = slice(0, 1)
    acts[:, first] = 0
    predicted = torch.stack(
        [transcoders[layer].decode(acts[layer], mlp_in[layer]) for layer in range(L)]
    )  # (L, T, C)
    errors = mlp_out - predicted
    errors[:, first] = 0
    return PromptState(
        tokens=tokens,
        logits=logits[0],
        mlp_in=mlp_in,
        mlp_out=mlp_out,
        patterns=[seen[f"blocks.{layer}.attn.pattern"][None] for layer in range(L)],
        scales=scales,
        acts=acts,
        errors=errors,
        final=seen["final_norm"],
        zero_positions=first,
    )


@dataclass
class FrozenRun:
    """What a forward under `frozen_hooks` leaves: the tensors the nodes write into and read.

    Attributes:
        embed: `(B, T, C)` the embedding (a leaf: the token nodes write here).
        writes: per layer `(B, T, C)`, the MLP's output (features and errors write here).
        reads: per layer `(B, T, C)`, the MLP's input (features read here).
        final: `(B, T, C)` the final norm's output (logits read here).
    """

    embed: Tensor | None = None
    writes: list[Tensor] = field(default_factory=list)
    reads: list[Tensor] = field(default_factory=list)
    final: Tensor | None = None


def frozen_hooks(
    model: nn.Module,
    transcoders: TranscoderSet,
    state: PromptState,
    out: FrozenRun,
    *,
    without_nodes: bool = False,
) -> dict[str, HookFn]:
    """Hook functions that run `model` as the frozen local replacement model (module doc).

    Args:
        out: filled as the forward runs.
        without_nodes: every node at 0 (no token embedding, features or errors: the constants
            alone), for the exactness checks.
    """
    tokens = state.tokens
    captured: dict[str, Tensor] = {}

    def capture(name: str) -> HookFn:
        return lambda x: captured.__setitem__(name, x)

    def embed(x: Tensor) -> Tensor:
        if without_nodes:
            x = x - model.wte.weight[tokens]  # the position embeddings alone
        out.embed = x.detach().requires_grad_(True)
        return out.embed

    def normed(norm: nn.Module, source: str, scale: str, reads: list[Tensor] | None) -> HookFn:
        def hook(x: Tensor) -> Tensor:
            y = frozen_norm(norm, captured[source], state.scales[scale])
            if reads is not None:
                reads.append(y)
            return y

        return hook

    hooks: dict[str, HookFn] = {"embed": embed}
    for layer, block in enumerate(model.blocks):
        pattern = state.patterns[layer]
        hooks |= {
            f"blocks.{layer}.resid_pre": capture(f"pre.{layer}"),
            f"blocks.{layer}.attn_in": normed(block.ln1, f"pre.{layer}", f"ln1.{layer}", None),
            f"blocks.{layer}.attn.pattern": lambda p, pattern=pattern: pattern.expand_as(p),
            f"blocks.{layer}.resid_mid": capture(f"mid.{layer}"),
            f"blocks.{layer}.mlp_in": normed(block.ln2, f"mid.{layer}", f"ln2.{layer}", out.reads),
            f"blocks.{layer}.mlp_out": _mlp_out(transcoders, state, out, layer, without_nodes),
        }
    L = len(model.blocks)
    hooks[f"blocks.{L - 1}.resid_post"] = capture("last")

    def final(x: Tensor) -> Tensor:
        out.final = frozen_norm(model.ln_f, captured["last"], state.scales["ln_f"])
        return out.final

    hooks["final_norm"] = final
    return hooks


def _mlp_out(
    transcoders: TranscoderSet, state: PromptState, out: FrozenRun, layer: int, without_nodes: bool
) -> HookFn:
    """The hook function of `blocks.{layer}.mlp_out` in the frozen model: the skip path (linear
    in the MLP's input) plus a constant, the MLP's own output less the skip (circuit-tracer's
    `skip + (out - skip).detach()`), or with the nodes at 0 the decoder bias (the first
    position keeps its MLP's output, a constant)."""
    tc = transcoders[layer]

    def hook(x: Tensor) -> Tensor:
        skip = tc.skip_out(out.reads[layer])  # (B, T, C)
        if without_nodes:
            rest = tc.b_dec.expand_as(x).clone()
            first = state.zero_positions
            rest[:, first] = state.mlp_out[layer, first] - tc.skip_out(state.mlp_in[layer, first])
        else:
            rest = x - skip
        w = skip + rest.detach()
        if not w.requires_grad:  # no skip: the write is a leaf of its own
            w.requires_grad_(True)
        out.writes.append(w)
        return w

    return hook


@torch.no_grad()
def replacement_logits(model: nn.Module, transcoders: TranscoderSet, state: PromptState) -> Tensor:
    """The logits `(T, V)` of the replacement model with its error nodes, unfrozen: each MLP's
    output replaced by its transcoder's prediction from the MLP's input of this forward plus the
    error (the first position keeps the MLP's own output). Equal to the model's logits.

    The prediction and the error are added in float64, the error taken there too: in float32 a
    poor transcoder's large prediction and error would cancel to the MLP's output only to their
    rounding, which the layers above amplify (2e-5 of the logits after 2 training steps)."""
    first = state.zero_positions

    def predict(layer: int, x: Tensor) -> Tensor:  # (T, C) input -> (T, C), first position 0
        acts = transcoders[layer].encode(x)  # (T, F)
        acts[first] = 0
        return transcoders[layer].decode(acts, x).double()

    def replace(layer: int) -> HookFn:
        def hook(x: Tensor) -> Tensor:
            error = state.mlp_out[layer].double() - predict(layer, state.mlp_in[layer])
            y = (predict(layer, seen[layer][0]) + error).to(x.dtype)  # (T, C)
            y[first] = x[0, first]
            return y[None]

        return hook

    seen: dict[int, Tensor] = {}
    hooks: dict[str, HookFn] = {}
    for layer in range(len(model.blocks)):
        # A function at the pattern takes attention down the explicit path, as `read_prompt`'s
        # forward went (SDPA's sums differ in the last bits).
        hooks[f"blocks.{layer}.attn.pattern"] = lambda p: None
        hooks[f"blocks.{layer}.mlp_in"] = lambda x, layer=layer: seen.__setitem__(layer, x)
        hooks[f"blocks.{layer}.mlp_out"] = replace(layer)
    with model.hooks(hooks):
        logits, _ = model(state.tokens[None])
    return logits[0]


def demeaned_unembedding(model: nn.Module, token_ids: Tensor) -> Tensor:
    """`(k,)` ids -> `(k, C)`: each one's LM-head row less the mean row (circuit-tracer's logit
    vectors: a logit less the mean logit, as the softmax sees it)."""
    W = model.lm_head.weight  # (V, C)
    return (W[token_ids] - W.mean(0, keepdim=True)).detach()


def check_logits(expected: Tensor, got: Tensor, what: str, tol: float = 1e-5) -> float:
    """The largest difference of two logit tensors, scaled by the largest logit; raises a
    RuntimeError (an internal error) above `tol`."""
    scale = max(float(expected.abs().max()), 1.0)
    diff = float((expected - got).abs().max()) / scale
    if diff > tol:
        raise RuntimeError(f"exactness check failed: {what} differ by {diff:.2e} (> {tol})")
    return diff
