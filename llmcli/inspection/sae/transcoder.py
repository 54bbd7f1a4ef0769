"""`Transcoder`: sparse features that read an MLP's input and write its output, as circuit-tracer's
`SingleLayerTranscoder` computes them.

With `x` a row of the MLP's input (`blocks.{l}.mlp_in`, the norm's output, `C` channels) and
`F` features:

    pre  = x @ W_enc.T + b_enc                  # (N, F)  pre-activations
    acts = activation(pre)                      # (N, F)  sparse
    ŷ    = acts @ W_dec + b_dec (+ x @ W_skip.T)  # (N, C)  the MLP's output, predicted

`W_enc` and `W_dec` are both `(F, C)`, `W_skip` `(C, C)`, as circuit-tracer stores them (an SAE
of llmcli keeps SAELens's `(C, F)` encoder instead). Unlike the SAE, the encoder subtracts no
decoder bias: the input and the output are different activations.

The activations, each as circuit-tracer runs the saved transcoder:
- topk: per row, the `k` largest pre-activations as they are, the rest 0 (circuit-tracer's
  `TopK`, which has no ReLU: a kept pre-activation below 0 stays negative);
- batchtopk: in training the `k * N` largest of the batch (Bussmann et al. 2024); in inference a
  JumpReLU `pre * (pre > threshold)` with the threshold learned in training (circuit-tracer's
  `JumpReLU`, read from `activation_function.threshold`);
- relu, tanh: `relu(pre)`, made sparse in training by a penalty on `acts * |W_dec row|`: its sum
  (L1), or the sum of `tanh(TANH_SCALE * acts * |W_dec row|)` (Anthropic's "Circuits Updates,
  January 2025"), which stops pushing a feature down once it is clearly on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.inspection.sae.model import THRESHOLD_RATE, bag_sum

#: How the features are made sparse (see the module doc).
TRANSCODER_ACTIVATIONS = ("topk", "batchtopk", "relu", "tanh")
#: `c` in the tanh penalty `tanh(c * acts * |W_dec row|)`.
TANH_SCALE = 4.0


class Transcoder(nn.Module):
    """One layer's transcoder.

    Args:
        d_model: the MLP's input and output width `C`.
        d_transcoder: the number of features `F`.
        k: features kept per row (topk), or per row on average over a batch (batchtopk).
        activation: one of `TRANSCODER_ACTIVATIONS`.
        skip: whether it has the linear skip `W_skip` (Paulo et al. 2025), zero at the start.
        generator: for the initial weights: uniform in `±1/sqrt(C)` for the encoder, the decoder
            its transpose scaled to rows of norm 0.1; biases 0.

    Attributes:
        W_enc `(F, C)`, b_enc `(F,)`, W_dec `(F, C)`, b_dec `(C,)`, W_skip `(C, C)` or None.
        threshold: `(F,)` BatchTopK's inference threshold (one value, learned in training).
    """

    def __init__(
        self,
        d_model: int,
        d_transcoder: int,
        k: int,
        activation: str = "topk",
        skip: bool = False,
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.d_model, self.d_transcoder, self.k, self.activation = (
            d_model,
            d_transcoder,
            k,
            activation,
        )
        bound = d_model**-0.5
        W_enc = (torch.rand(d_transcoder, d_model, generator=generator) * 2 - 1) * bound
        self.W_enc = nn.Parameter(W_enc)  # (F, C)
        self.b_enc = nn.Parameter(torch.zeros(d_transcoder))  # (F,)
        self.W_dec = nn.Parameter(0.1 * W_enc / W_enc.norm(dim=1, keepdim=True))  # (F, C)
        self.b_dec = nn.Parameter(torch.zeros(d_model))  # (C,)
        self.W_skip = nn.Parameter(torch.zeros(d_model, d_model)) if skip else None  # (C, C)
        self.register_buffer("threshold", torch.zeros(d_transcoder))  # (F,)

    @property
    def d_sae(self) -> int:
        """The number of features, under an SAE's name: `sae features` reads either alike."""
        return self.d_transcoder

    @property
    def d_in(self) -> int:
        return self.d_model

    def pre_acts(self, x: Tensor) -> Tensor:
        """`(N, C)` -> `(N, F)`: `x @ W_enc.T + b_enc`."""
        return F.linear(x, self.W_enc, self.b_enc)

    def activate(self, pre: Tensor) -> Tensor:
        """The activations of inference (what circuit-tracer computes): `(N, F)` -> `(N, F)`."""
        if self.activation == "topk":
            top = pre.topk(self.k, dim=-1).indices  # (N, k)
            return pre * torch.zeros_like(pre).scatter_(-1, top, 1.0)
        if self.activation == "batchtopk":
            return pre * (pre > self.threshold)
        return F.relu(pre)

    def select(self, pre: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Training's active features as (row, feature, value) triples: topk's `k` per row,
        batchtopk's `k * N` largest of the batch (through a ReLU).

        Shape:
            pre `(N, F)` -> rows, features, values `(M,)`.
        """
        N, n_features = pre.shape
        if self.activation == "topk":
            values, features = pre.topk(self.k, dim=-1)  # (N, k)
            rows = torch.arange(N, device=pre.device).repeat_interleave(self.k)
            return rows, features.flatten(), values.flatten()
        values, flat = pre.flatten().topk(min(self.k * N, N * n_features))  # (k N,)
        return flat // n_features, flat % n_features, values.relu()

    def skip_out(self, x: Tensor) -> Tensor:
        """The skip's part of the output, `x @ W_skip.T` (zeros without a skip): `(N, C)`."""
        return x @ self.W_skip.T if self.W_skip is not None else torch.zeros_like(x)

    def encode(self, x: Tensor) -> Tensor:
        """`(N, C)` -> `(N, F)` activations, as inference computes them."""
        return self.activate(self.pre_acts(x))

    def decode(self, acts: Tensor, x: Tensor) -> Tensor:
        """`(N, F)` activations and the input `x` `(N, C)` -> the output `(N, C)`."""
        return acts @ self.W_dec + self.b_dec + self.skip_out(x)

    def forward(self, x: Tensor) -> Tensor:
        """`(N, C)` -> `(N, C)`: the MLP's output as the transcoder predicts it."""
        return self.decode(self.encode(x), x)

    def training_output(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The prediction of a training step, and what its loss terms need.

        Returns:
            `(ŷ (N, C), pre (N, F), features (M,), values (M,))`: the features active on any row
            and their values (relu and tanh: every non-zero of `relu(pre)`).
        """
        N = x.shape[0]
        pre = self.pre_acts(x)  # (N, F)
        if self.activation in ("relu", "tanh"):
            acts = F.relu(pre)  # (N, F)
            rows, features = acts.nonzero(as_tuple=True)
            out = acts @ self.W_dec + self.b_dec + self.skip_out(x)
            return out, pre, features, acts[rows, features]
        rows, features, values = self.select(pre)
        out = bag_sum(self.W_dec, rows, features, values, N) + self.b_dec + self.skip_out(x)
        return out, pre, features, values

    def penalty(self, pre: Tensor) -> Tensor:
        """The sparsity penalty of relu (L1) or tanh, per row averaged: `(N, F)` -> `()`.
        Zero for topk and batchtopk, whose sparsity is their selection."""
        if self.activation not in ("relu", "tanh"):
            return pre.new_zeros(())
        scaled = F.relu(pre) * self.W_dec.norm(dim=1)  # (N, F)
        if self.activation == "tanh":
            scaled = torch.tanh(TANH_SCALE * scaled)
        return scaled.sum(-1).mean()

    @torch.no_grad()
    def update_threshold(self, values: Tensor) -> None:
        """BatchTopK: move the inference threshold towards the smallest positive activation
        training kept in this batch (as `SparseAutoencoder.update_threshold`). The first batch
        sets it outright, as Bussmann et al.'s trainer does: an average from 0 would leave it
        near 0 for the first hundred steps, and nearly every feature active after a short
        training (thousands of graph nodes per token)."""
        positive = values[values > 0]
        if not positive.numel():
            return
        if not (self.threshold > 0).any():
            self.threshold.fill_(positive.min())
        else:
            self.threshold.mul_(1 - THRESHOLD_RATE).add_(THRESHOLD_RATE * positive.min())


class TranscoderSet(nn.Module):
    """One transcoder per layer of a run, in layer order (the layers it holds: `layers`).

    Args:
        layers: the block indices, ascending.
        transcoders: one `Transcoder` per layer, the same width for all.
    """

    def __init__(self, layers: list[int], transcoders: list[Transcoder]) -> None:
        super().__init__()
        self.layers = list(layers)
        self.transcoders = nn.ModuleList(transcoders)

    def __getitem__(self, layer: int) -> Transcoder:
        return self.transcoders[self.layers.index(layer)]

    @property
    def d_transcoder(self) -> int:
        return self.transcoders[0].d_transcoder
