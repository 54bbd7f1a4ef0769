"""`SparseAutoencoder`: an activation as a sparse sum of learned directions, and back.

With `x` a row of activations at a hook point (`d_in` channels) and `F` features:

    pre  = (x - b_dec) @ W_enc + b_enc          # (N, F)  pre-activations
    acts = sparsify(pre)                        # (N, F)  at most k non-zero per row (topk)
    x̂    = acts @ W_dec + b_dec                 # (N, d_in)

`W_enc` is `(d_in, F)`, `W_dec` `(F, d_in)` with unit-norm rows (each feature's direction; a
feature's activation is then its size along that direction), as SAELens stores them, so a
saved SAE is SAELens's TopK (or JumpReLU) SAE as it is (`llmcli.inspection.sae.folder`).

`sparsify` is one of:
- topk: per row, the `k` largest pre-activations, through a ReLU; the rest 0 (Gao et al. 2024);
- batchtopk: in training, the `k * N` largest of the whole batch of `N` rows, through a ReLU
  (Bussmann et al. 2024: the same mean L0, spread where it is needed); in inference, a JumpReLU
  `pre * (pre > threshold)` with the threshold learned in training (a running mean of the
  smallest activation kept), so that a token's features do not depend on the batch it is in.

Training decodes from the kept (index, value) pairs (`decode_sparse`) rather than the dense
`(N, F)` activations: with k = 32 of 2,048 features that is 64 times less arithmetic than
`acts @ W_dec`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# How fast BatchTopK's inference threshold follows the smallest activation a batch keeps (an
# exponential moving average, as SAELens's BatchTopK trainer keeps it).
THRESHOLD_RATE = 0.01


class SparseAutoencoder(nn.Module):
    """A TopK (or BatchTopK) sparse autoencoder.

    Args:
        d_in: the width of the activations (`C` for the residual stream; `H * hs` for attn.z).
        d_sae: the number of features `F`.
        k: features kept per row (topk), or per row on average over a batch (batchtopk).
        activation: "topk" or "batchtopk".
        generator: for the initial weights: random unit decoder rows, the encoder their
            transpose (Gao et al.: dead features are rarer), both biases 0.

    Attributes:
        W_enc `(d_in, F)`, b_enc `(F,)`, W_dec `(F, d_in)`, b_dec `(d_in,)`: the parameters.
        threshold: `(F,)` the JumpReLU thresholds of BatchTopK's inference (one value, learned
            in training, for every feature; unused by topk).
    """

    def __init__(
        self,
        d_in: int,
        d_sae: int,
        k: int,
        activation: str = "topk",
        *,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        self.d_in, self.d_sae, self.k, self.activation = d_in, d_sae, k, activation
        W_dec = torch.randn(d_sae, d_in, generator=generator)
        W_dec /= W_dec.norm(dim=1, keepdim=True)
        self.W_dec = nn.Parameter(W_dec)  # (F, d_in)
        self.W_enc = nn.Parameter(W_dec.T.clone())  # (d_in, F)
        self.b_enc = nn.Parameter(torch.zeros(d_sae))  # (F,)
        self.b_dec = nn.Parameter(torch.zeros(d_in))  # (d_in,)
        self.register_buffer("threshold", torch.zeros(d_sae))  # (F,)

    def pre_acts(self, x: Tensor) -> Tensor:
        """`(N, d_in)` -> `(N, F)`: the pre-activations `(x - b_dec) @ W_enc + b_enc`.

        Computed as `x @ W_enc + (b_enc - b_dec @ W_enc)`, the same sum: so the decoder bias's
        gradient through the encoder costs a `(1, d_in) x (d_in, F)` product, not a third
        `(N, F) x (F, d_in)` one in each training step.
        """
        return x @ self.W_enc + (self.b_enc - self.b_dec @ self.W_enc)  # (N, F)

    def select(self, pre: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The features each row keeps, as (row, feature, value) triples, values >= 0.

        Topk keeps each row's `k` largest (in training and inference alike); batchtopk keeps
        the batch's `k * N` largest in training and those above `threshold` in inference.

        Shape:
            pre `(N, F)` -> rows `(M,)`, features `(M,)` long, values `(M,)`.
        """
        N, n_features = pre.shape
        if self.activation == "topk":
            values, features = pre.topk(self.k, dim=-1)  # (N, k)
            rows = torch.arange(N, device=pre.device).repeat_interleave(self.k)
            return rows, features.flatten(), values.flatten().relu()
        if self.training:
            values, flat = pre.flatten().topk(min(self.k * N, N * n_features))  # (k N,)
            return flat // n_features, flat % n_features, values.relu()
        rows, features = (pre > self.threshold).nonzero(as_tuple=True)
        return rows, features, pre[rows, features].relu()

    def encode(self, x: Tensor) -> Tensor:
        """`(N, d_in)` -> `(N, F)` activations, at most `k` non-zero per row under topk."""
        pre = self.pre_acts(x)  # (N, F)
        rows, features, values = self.select(pre)
        return torch.zeros_like(pre).index_put_((rows, features), values)

    def decode(self, acts: Tensor) -> Tensor:
        """`(N, F)` activations -> `(N, d_in)`: `acts @ W_dec + b_dec`."""
        return acts @ self.W_dec + self.b_dec  # (N, F) @ (F, d_in)

    def decode_sparse(self, rows: Tensor, features: Tensor, values: Tensor, n: int) -> Tensor:
        """`decode` from `select`'s triples, without the dense `(n, F)` activations.

        Shape:
            rows, features, values `(M,)` -> `(n, d_in)`
        """
        return bag_sum(self.W_dec, rows, features, values, n) + self.b_dec

    def forward(self, x: Tensor) -> Tensor:
        """`(N, d_in)` -> `(N, d_in)`: the reconstruction `decode(encode(x))`."""
        return self.decode(self.encode(x))

    @torch.no_grad()
    def update_threshold(self, values: Tensor) -> None:
        """BatchTopK: move the inference threshold towards the smallest positive activation
        that training kept in this batch (`values`, `(M,)`)."""
        positive = values[values > 0]
        if positive.numel():
            low = positive.min()
            self.threshold.mul_(1 - THRESHOLD_RATE).add_(THRESHOLD_RATE * low)

    @torch.no_grad()
    def normalize_decoder_(self) -> None:
        """Scale every decoder row back to unit norm (after an optimizer step)."""
        self.W_dec /= self.W_dec.norm(dim=1, keepdim=True).clamp_min(1e-12)

    @torch.no_grad()
    def remove_parallel_grad_(self) -> None:
        """Drop the part of each decoder row's gradient along the row itself (before a step):
        with unit-norm rows it would only change their length, which `normalize_decoder_`
        undoes (Bricken et al. 2023)."""
        if self.W_dec.grad is None:
            return
        W, g = self.W_dec, self.W_dec.grad  # (F, d_in) each
        g -= (g * W).sum(dim=1, keepdim=True) * W


def aux_reconstruction(
    sae: SparseAutoencoder, pre: Tensor, dead: Tensor, residual: Tensor, k_aux: int
) -> Tensor:
    """AuxK (Gao et al. 2024): the dead features' reconstruction of what the live ones missed.

    Each row keeps its `k_aux` largest pre-activations among the dead features, and decodes them
    without the decoder bias: a loss on `residual - this` gives dead features a gradient
    towards directions that are still unexplained, so they come back to life.

    Shape:
        pre `(N, F)`, dead `(F,)` bool, residual `(N, d_in)` -> `(N, d_in)`
    """
    dead_ids = dead.nonzero().squeeze(1)  # (D,)
    values, among = pre[:, dead_ids].topk(k_aux, dim=-1)  # (N, k_aux): only the dead compete
    features = dead_ids[among.flatten()]  # (N k_aux,)
    rows = torch.arange(pre.shape[0], device=pre.device).repeat_interleave(k_aux)
    return bag_sum(sae.W_dec, rows, features, F.relu(values.flatten()), len(residual))


def auxk_loss(
    sae: SparseAutoencoder, pre: Tensor, dead: Tensor, residual: Tensor
) -> tuple[Tensor, float]:
    """AuxK's loss (Gao et al. 2024, appendix B.1): the squared error, summed over channels
    and averaged over rows, with which the `d / 2` largest dead features (`d` the residual's
    width, `dead` some) reconstruct `residual` (`aux_reconstruction`), and its scale, smaller
    when fewer features are dead (taken before `k_aux` is cut to their count)."""
    n_dead = int(dead.sum())
    k_aux = max(1, residual.shape[-1] // 2)
    aux_hat = aux_reconstruction(sae, pre, dead, residual, min(k_aux, n_dead))  # (N, d)
    return (aux_hat - residual).pow(2).sum(-1).mean(), min(n_dead / k_aux, 1.0)


def bag_sum(W: Tensor, rows: Tensor, features: Tensor, values: Tensor, n: int) -> Tensor:
    """`out[r] = sum of values[i] * W[features[i]] over the i with rows[i] == r`.

    One `embedding_bag` (its weighted sum, in one kernel): gathering the `(M, d_in)` rows of `W`
    and adding them up was six times slower on the CPU (131K triples, 128 channels).

    Shape:
        W `(F, d_in)`; rows, features, values `(M,)` -> `(n, d_in)`
    """
    order = torch.argsort(rows, stable=True)  # embedding_bag sums runs of consecutive entries
    counts = torch.bincount(rows, minlength=n)  # (n,)
    offsets = torch.cumsum(counts, 0) - counts  # (n,): where each row's run starts
    return F.embedding_bag(
        features[order], W, offsets, mode="sum", per_sample_weights=values[order]
    )  # (n, d_in)
