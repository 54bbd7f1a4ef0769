"""Direct Preference Optimization (Rafailov et al. 2023) as a training objective: TRL's
`DPOTrainer` losses on preference pairs (`train.loss_type`, sigmoid by default).

The policy learns to raise the chosen reply's score (its completion tokens' summed
log-probability) over the rejected one's, each measured against a frozen reference model (the
run it started from). The scores are `llmcli.objectives.preference_scores`'s and the losses
`llmcli.objectives.dpo_losses`', which `llmcli eval` reports on a file of pairs too.

`dpo_step` scores one batch of `llmcli.data.preference_data.PreferenceSampler` under the policy
and the reference. With `train.objective: dpo` the run's step takes its loss from
`dpo_objective` (the trainer's `loss_fn`), and the reference is `reference_model`: the
`train.init_from` weights, frozen. The loop itself is the same as next-token training's. When
the run draws each pair more than once, the reference scores every pair once before the first
step (`score_pairs_once`) and the steps read its scores: a step without the reference's
forward takes about 0.69 of one with it (benchmarks/dpo_reference.py, tiny's shape).

A batch of B pairs is 2B rows, as `train.batch_size`, the memory estimate, `llmcli plan` and
the tokens a step counts take it (`Config.example_tokens`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from llmcli.config import Config, TrainConfig
from llmcli.data.preference_data import PreferenceSampler, preference_token_data
from llmcli.data.prepared import PreferenceData, TokenData
from llmcli.data.tokenizer import Tokenizer
from llmcli.objectives.base import MemoryTerms, Objective, SumRanks, read_with_init_encoding
from llmcli.objectives.dpo_losses import DPOLoss, dpo_loss
from llmcli.objectives.packing import packing_for
from llmcli.objectives.preference_scores import completion_logps, completion_scores, score_pairs


def dpo_step(
    policy: nn.Module,
    reference: nn.Module | Tensor,
    ids: Tensor,
    completion_mask: Tensor,
    loss: DPOLoss,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The DPO loss of one batch of pairs, and its metrics (`dpo_loss`'s).

    The models read the first `T` tokens of each row and their logits score the next ones, as
    a chat batch is scored: rows of `T + 1` tokens fill a `T`-token context. The reference runs
    under `torch.no_grad`, so only the policy gets gradients (and no activations of the
    reference are kept).

    Args:
        policy: the model being trained, `model(idx) -> (logits, loss)`.
        reference: the frozen model it started as, or its scores of the rows, `(2B,)`
            (`score_pairs_once`'s, read by the sampler).
        ids: `(2B, T+1)` int64, the chosen sequences then the rejected ones (pair i is rows
            i and B + i), padded after their ends.
        completion_mask: `(2B, T+1)` bool, True on the completions' tokens.
        loss: the loss types, their weights and beta (`DPOLoss.from_config`).
    """
    B = ids.shape[0] // 2
    packing = packing_for(policy, completion_mask)  # the rows' packing, for both models
    chosen, rejected = completion_scores(policy, ids, completion_mask, packing).halves()
    if isinstance(reference, Tensor):
        ref_logps = reference
    else:
        with torch.no_grad():
            ref_logps = completion_logps(reference, ids, completion_mask, packing)  # (2B,)
    return dpo_loss(chosen, rejected, ref_logps[:B], ref_logps[B:], loss)


def score_pairs_once(
    reference: nn.Module, pairs: PreferenceData, config: Config, world_size: int
) -> bool:
    """Score both splits' pairs with the reference once (`PreferenceSplit.reference_logps`, by
    `llmcli.objectives.preference_scores.score_pairs`), when training
    draws more pairs than the training split holds: each step then reads its batch's scores
    instead of running the reference. A run that draws each pair about once keeps scoring
    them in its steps, which costs no more. Returns whether it scored them."""
    tc = config.train
    draws = tc.max_steps * tc.batch_size * tc.grad_accum * world_size
    if draws <= len(pairs.train):
        return False
    for split in (pairs.train, pairs.val):  # in order, as `llmcli eval` scores pairs
        scores = score_pairs(reference, None, split, pairs.pad_id, tc.batch_size)
        both = [scores.chosen.logps, scores.rejected.logps]
        split.reference_logps = torch.stack(both, dim=1).numpy()
    return True


def dpo_batch_loss(
    reference: nn.Module, loss: DPOLoss, policy: nn.Module, batch: tuple[Tensor, ...]
) -> tuple[Tensor, dict[str, Tensor]]:
    """`dpo_step` on a `PreferenceSampler` batch `(ids, completion_mask)`, each `(2B, T+1)`,
    followed by the reference's scores of its rows when the split holds them."""
    ids, completion_mask, *scored = batch
    return dpo_step(policy, scored[0] if scored else reference, ids, completion_mask, loss)


def dpo_objective(reference: nn.Module, train: TrainConfig) -> partial:
    """The step's `loss_fn` for `train.objective: dpo`, `loss_fn(policy, batch)`: the loss
    `train` sets (`train.loss_type`, `loss_weights`, `label_smoothing`, `dpo_beta`)."""
    return partial(dpo_batch_loss, reference, DPOLoss.from_config(train))


class DPO(Objective):
    """`train.objective: dpo`: preference pairs (`data.format: preference`) encoded with the
    `train.init_from` run's tokenizer and template, each pair two rows, scored against that
    run's frozen weights (the reference, which training builds and passes to `wire`)."""

    name = "dpo"
    full_rows = False
    has_perplexity = False  # DPO's loss is no next-token loss
    head_metrics = False  # a preference loss says nothing of the induction heads
    by_position = False
    templated = True
    encodes_with_init_from = True
    eval_data = "pairs"
    examples = "pairs (2 rows each)"
    figures = ("val_rewards/accuracies", "val_rewards/margins", "val_loss")
    bar_figures = ("rewards/accuracies", "rewards/margins")

    @property
    def needs_reference(self) -> bool:
        return True

    def read_data(self, tokenizer: Tokenizer | None) -> TokenData:
        return read_with_init_encoding(self.config, self.name, tokenizer, preference_token_data)

    def sampler(
        self,
        data: TokenData,
        split: str,
        seed: int,
        rank: int,
        world_size: int,
        device: torch.device,
        training: bool = False,
    ) -> PreferenceSampler:
        assert data.preference is not None
        pairs = data.preference.train if split == "train" else data.preference.val
        batch, context = self.config.train.batch_size, self.config.model.context_length
        pad_id = data.preference.pad_id
        return PreferenceSampler(pairs, pad_id, batch, context, seed, rank, world_size, device)

    def wire(
        self,
        trainer: Any,
        model: nn.Module,
        data: TokenData,
        reference: nn.Module | None,
        world_size: int,
        sum_ranks: SumRanks | None,
    ) -> None:
        assert data.preference is not None and reference is not None
        score_pairs_once(reference, data.preference, self.config, world_size)
        trainer.loss_fn = dpo_objective(reference, self.config.train)

    def memory_terms(self, vocab_size: int) -> MemoryTerms:
        # the reference's fp32 logits, alive while the policy's activations are kept
        return MemoryTerms(rows=self.rows_per_example, values_per_token=vocab_size, reference=True)

    def timing_batch(self, tokens: Tensor, n: int) -> tuple[Tensor, ...]:
        """`n` pairs `(ids, completion_mask)`, each `(2n, T + 1)`, every token a completion's."""
        half = tokens.shape[0] // 2  # chosen rows, then rejected ones
        ids = torch.cat([tokens[:n], tokens[half : half + n]])
        return ids, torch.ones_like(ids, dtype=torch.bool)

    def timing_loss(self, make_reference: Callable[[], nn.Module]) -> Callable | None:
        """DPO's loss against a reference of the same shape, frozen."""
        return dpo_objective(make_reference(), self.config.train)

    def meta_rows(self, data: TokenData) -> dict[str, Any]:
        assert data.preference is not None
        return super().meta_rows(data) | {"preference_data": data.preference.counts()}

    def eval_text(self, summary: dict[str, float], data: TokenData) -> str | None:
        """TRL's reward accuracy and margin, and how many pairs they are over: the loop's
        evaluation draws `eval_steps x batch_size` of the validation pairs (`llmcli eval`
        scores them all)."""
        assert data.preference is not None
        tc, total = self.config.train, len(data.preference.val)
        drawn = tc.eval_steps * tc.batch_size
        return (
            f", val reward accuracy {summary['val_rewards/accuracies']:.3f}, margin "
            f"{summary['val_rewards/margins']:.3f} (on {drawn:,} pairs drawn from the "
            f"{total:,} validation pairs)"
        )
