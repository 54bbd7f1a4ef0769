"""Sampling maths: from one step's logits to the next token of every row.

`sample_next(logits, generator, temperature, top_k, top_p)` is a pure function from logits
`(B, V)` to ids `(B,)`: temperature, top-k (exactly k tokens, lowest ids winning ties), top-p
(nucleus), and one seeded draw per row by inverse-CDF sampling, so that a row draws the same
numbers from its own `torch.Generator` whatever batch it is in; `make_generators` makes the
per-row generators. The settings are checked where they are made, in
`llmcli.config.SampleConfig`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from llmcli.errors import InputError

GeneratorArg = torch.Generator | Sequence[torch.Generator] | None


def sample_next(
    logits: Tensor,
    generator: GeneratorArg = None,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float = 1.0,
) -> Tensor:
    """Pick the next token of every row from its logits.

    Temperature 0 is greedy (argmax, first index on ties) and ignores the generator, `top_k` and
    `top_p`. Otherwise the logits are divided by the temperature, filtered, and one token is drawn
    per row by inverse-CDF sampling from one uniform number of that row's generator:

    - `top_k` keeps exactly `k` tokens, the lowest ids winning ties (nanoGPT's
      `logits < v[:, [-1]]` would keep every token tied with the k-th);
    - `top_p` keeps the smallest set of most likely tokens whose probability reaches `top_p`
      (after `top_k`), always at least one.

    Args:
        logits: `(B, V)` scores of the next token.
        generator: one `torch.Generator` for the whole batch, one per row (a row then draws the
            same numbers whatever the batch it is in), or None for torch's global generator.
        temperature: >= 0.
        top_k: None or >= 1.
        top_p: in (0, 1].

    Returns:
        `(B,)` long token ids, on `logits.device`.
    """
    if logits.ndim != 2:
        raise InputError(f"logits must have shape (B, V), got {tuple(logits.shape)}")
    if temperature == 0:
        return logits.argmax(dim=-1)  # (B,)
    probs, ids = _filtered(logits, temperature, top_k, top_p)  # (B, V') each
    choice = _inverse_cdf(probs, _uniform(logits.shape[0], generator, logits.device))  # (B,)
    if ids is None:
        return choice
    return ids.gather(-1, choice[:, None]).squeeze(-1)  # (B, V') -> (B,)


def _filtered(
    logits: Tensor, temperature: float, top_k: int | None, top_p: float
) -> tuple[Tensor, Tensor | None]:
    """Probabilities after temperature, top-k and top-p, in the sorted space when filtering.

    Returns:
        `(probs (B, V'), ids (B, V') or None)`: `probs[b, j]` belongs to token `ids[b, j]`
        (to token `j` when `ids` is None). Dropped tokens have probability 0 (top-p) or are
        left out (top-k: `V' = k`); the kept ones are not renormalised.
    """
    V = logits.shape[-1]
    if logits.dtype != torch.float32:
        logits = logits.float()
    scores = logits / temperature  # (B, V)
    ids = None
    use_k = top_k is not None and top_k < V
    if use_k or top_p < 1.0:
        # A stable descending sort ranks tied tokens by id, so top-k keeps exactly k of them.
        scores, ids = torch.sort(scores, dim=-1, descending=True, stable=True)  # (B, V) each
        if use_k:
            scores, ids = scores[:, :top_k], ids[:, :top_k]  # (B, k) each
    probs = torch.softmax(scores, dim=-1)  # (B, V')
    if top_p < 1.0:
        # A token is needed while the more likely ones have not yet reached top_p.
        mass_before = probs.cumsum(dim=-1) - probs  # (B, V'), exactly 0 for the first token
        probs = probs.masked_fill(mass_before >= top_p, 0.0)  # (B, V')
    return probs, ids


def _uniform(B: int, generator: GeneratorArg, device: torch.device) -> Tensor:
    """`(B, 1)` float64 uniform numbers in [0, 1): one per row, from the row's own generator."""
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = generator.device if generator is not None else device
        u = torch.rand(B, 1, generator=generator, dtype=torch.float64, device=gen_device)
    else:
        if len(generator) != B:
            raise InputError(f"got {len(generator)} generators for a batch of {B} rows")
        u = torch.cat([torch.rand(1, 1, generator=g, dtype=torch.float64) for g in generator])
    return u if u.device == device else u.to(device, non_blocking=True)  # (B, 1)


def _inverse_cdf(probs: Tensor, u: Tensor) -> Tensor:
    """Index of the first token whose cumulative probability exceeds `u * total`.

    A token with probability 0 never is: its cumulative equals its predecessor's.

    Args:
        probs: `(B, V)` non-negative, need not sum to 1.
        u: `(B, 1)` float64 in [0, 1).

    Returns:
        `(B,)` long indices into the last dimension.
    """
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)  # (B, V); so that u * total < total
    target = cdf[:, -1:] * u  # (B, 1)
    choice = torch.searchsorted(cdf, target, right=True).view(-1)  # (B,)
    return choice.clamp_(max=probs.shape[-1] - 1)


def make_generators(n: int, seed: int | None) -> list[torch.Generator]:
    """One CPU `torch.Generator` per row, seeded `seed, seed + 1, ...` (a fresh seed if None).

    CPU generators give the same random numbers whatever device the model runs on.
    """
    if seed is None:
        seed = int(torch.Generator().seed()) % (2**62)
    # torch seeds are 64-bit (a negative seed s is 2**64 + s): wrap any Python int the same way.
    return [torch.Generator().manual_seed((seed + i) % 2**64) for i in range(n)]
