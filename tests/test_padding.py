"""Left padding for batched prompts (llmcli/generation/padding.py): `padded_mask` and
`padded_positions` against their definitions written out, and the model under them: a padded
batch row computes what that prompt computes alone, and nothing is NaN."""

from __future__ import annotations

import pytest
import torch
from model_helpers import RECIPE_OPTIONS, assert_close, gen, left_padded, randomize_, tiny_model

from llmcli.generation.padding import padded_mask, padded_positions

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [  # (pads, T, T_k): a prefill, a chunk after cached columns, a decode column
    ([0, 3, 7], 8, 8),
    ([2, 0, 5], 3, 9),
    ([4, 0, 9], 1, 10),
]


def reference_mask(pads: list[int], T: int, T_k: int) -> torch.Tensor:
    """`(B, 1, T, T_k)`, entry by entry: query i sits at column `T_k - T + i`; it may see a key
    at or before it that is not padding, and a padding query sees its own column alone."""
    mask = torch.zeros(len(pads), 1, T, T_k, dtype=torch.bool)
    for b, pad in enumerate(pads):
        for i in range(T):
            col = T_k - T + i
            for j in range(T_k):
                mask[b, 0, i, j] = (pad <= j <= col) if col >= pad else j == col
    return mask


@pytest.mark.parametrize(("pads", "T", "T_k"), CASES)
def test_padded_mask_is_causal_hides_padding_and_a_padding_query_sees_itself(pads, T, T_k) -> None:
    mask = padded_mask(torch.tensor(pads), T, T_k)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, reference_mask(pads, T, T_k))
    assert mask.any(dim=-1).all()  # no empty row: every query has a key


@pytest.mark.parametrize(("pads", "T", "T_k"), CASES)
def test_padded_positions_count_the_real_tokens_before(pads, T, T_k) -> None:
    expected = [[max(0, T_k - T + i - pad) for i in range(T)] for pad in pads]
    assert padded_positions(torch.tensor(pads), T, T_k).tolist() == expected


def padded_forward(model, rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits `(B, T, V)` of `rows` as one left-padded batch, and the pads `(B,)`."""
    idx, pads = left_padded(rows)
    T = idx.shape[1]
    mask, pos = padded_mask(pads, T, T), padded_positions(pads, T, T)
    with torch.no_grad():
        logits, _ = model(idx, mask=mask, input_pos=pos)
    return logits, pads


@pytest.mark.parametrize("opts", RECIPE_OPTIONS.values(), ids=RECIPE_OPTIONS.keys())
def test_a_padded_batch_row_equals_that_prompt_alone(opts) -> None:
    model = randomize_(tiny_model(**opts))
    rows = [torch.randint(37, (n,), generator=gen(n)) for n in (3, 16, 7, 1)]
    logits, pads = padded_forward(model, rows)
    tag = ",".join(opts) or "default"
    for b, row in enumerate(rows):
        with torch.no_grad():
            alone, _ = model(row[None])  # (1, n, V), the model's causal defaults
        real = logits[b, pads[b] :]  # (n, V)
        if pads[b] == 0:  # the same keys, the same sums: bit for bit
            assert torch.equal(real, alone[0]), f"row {b} without padding [{tag}]"
        else:  # softmax and weighted sums over more (masked) keys: rounding only
            assert_close(real, alone[0], f"padded row {b} vs alone [{tag}]", atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("opts", RECIPE_OPTIONS.values(), ids=RECIPE_OPTIONS.keys())
def test_what_the_padding_holds_changes_no_bit_of_the_real_positions(opts) -> None:
    """Masked keys get weight exactly 0: other tokens in the padding columns leave every logit
    of a real position the same, bit for bit (and a row alone with its padding equals it in
    the batch)."""
    model = randomize_(tiny_model(**opts))
    rows = [torch.randint(37, (n,), generator=gen(n)) for n in (3, 11, 6)]
    idx, pads = left_padded(rows)
    T = idx.shape[1]
    mask, pos = padded_mask(pads, T, T), padded_positions(pads, T, T)
    other = idx.clone()
    real = torch.arange(T)[None, :] >= pads[:, None]  # (B, T)
    other[~real] = torch.randint(37, (int((~real).sum()),), generator=gen(9))
    with torch.no_grad():
        logits, _ = model(idx, mask=mask, input_pos=pos)
        changed, _ = model(other, mask=mask, input_pos=pos)
        single, _ = model(idx[:1], mask=mask[:1], input_pos=pos[:1])
    assert torch.equal(changed[real], logits[real])
    assert not torch.equal(changed[~real], logits[~real])  # the padding columns themselves did
    assert torch.equal(single[0], logits[0])


def test_a_row_of_padding_only_gives_finite_logits_and_gradients() -> None:
    model = randomize_(tiny_model())
    model.train()  # dropout is 0: the forward of training, for the gradients
    idx = torch.randint(37, (2, 8), generator=gen(1))
    pads = torch.tensor([8, 3])  # row 0: nothing but padding
    logits, _ = model(idx, mask=padded_mask(pads, 8, 8), input_pos=padded_positions(pads, 8, 8))
    assert torch.isfinite(logits).all()
    logits.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
