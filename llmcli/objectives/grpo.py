"""Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath") as a training objective:
learning from rewards on completions the model samples itself, as TRL 1.16's `GRPOTrainer`
computes it (`trl/trainer/grpo_trainer.py`, `_compute_loss`).

A step draws `train.batch_size x train.grad_accum` prompts at once (`GRPOStream`), and for each
the policy samples `train.group_size` completions (the `sample` section's temperature, top-k,
top-p and `max_new_tokens`, each cut to the room the context leaves; GRPO's defaults are TRL's:
temperature 1, no top-k or top-p). Each completion gets a reward (`llmcli.objectives.rewards`),
and its advantage is its reward less the mean of its group's, divided by the group's standard
deviation when `train.scale_rewards` (TRL's default). The step then hands the completions to the
training step a micro-batch at a time: `grad_accum` is a memory knob, and a step's prompts,
completions and gradient do not depend on how it is split.

Each token's log-probability comes from the logits divided by the sampling temperature (the
distribution the completion was drawn from; TRL's PR #3029). Per token, the loss is PPO's
clipped surrogate `-min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)` with `r` the ratio of
the policy's probability to the sampling policy's; with one update per sample (TRL's default
`num_iterations: 1`) `r` is 1 with the gradient of the log-probability, so the gradient is the
plain policy gradient. `train.loss_type` sums it over the tokens as TRL's does:

- `dapo` (default): over every completion token of the step, on every rank;
- `bnpo`: over each micro-batch's tokens, the micro-batches averaged;
- `grpo`: each completion's mean over its tokens, averaged over completions;
- `dr_grpo`: over each micro-batch's tokens, divided by its completions x `max_new_tokens`.

With `train.grpo_beta` > 0 a KL penalty to the `train.init_from` model is added per token, as
TRL estimates it: `exp(ref - logp) - (ref - logp) - 1`.

Completions are drawn with generators seeded from the step's seed, which the prompt sampler
draws and saves, so a resumed run samples what an uninterrupted one would. Each evaluation
answers held-out prompts greedily (`GRPOObjective.evaluate`): pass@1 is the share whose
completion the run's reward passes (gives 1 or more).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from llmcli.config import SampleConfig
from llmcli.data.prepared import PromptData, PromptSplit, TokenData
from llmcli.data.prompts import PromptBatch, PromptSampler, prompt_token_data
from llmcli.data.tokenizer import Tokenizer
from llmcli.generation.replies import replies
from llmcli.generation.sampling import make_generators
from llmcli.objectives.base import MemoryTerms, Objective, SumRanks, read_with_init_encoding
from llmcli.objectives.greedy_answers import greedy_figures, reply_budgets
from llmcli.objectives.grpo_loss import (
    advantages,
    aggregate,
    kl_per_token,
    masked_mean,
    per_token_loss,
    token_logps,
)
from llmcli.objectives.grpo_samples import Completions, GRPOStream, StepShare
from llmcli.objectives.packing import packing_for
from llmcli.objectives.rewards import Rewards, check_rewards_on_prompts, load_rewards


class GRPOObjective:
    """The step's `loss_fn` for `train.objective: grpo`: sample, reward, and the loss.

    Args:
        policy: the model being trained (unwrapped: generation runs on it directly).
        data: the run's prompts (their end token).
        config: the run's config (`train.group_size`, `scale_rewards`, `grpo_beta`, `sample`).
        reward: the run's rewards and their weights (`llmcli.objectives.rewards.load_rewards`).
        decode_text: the tokenizer's `decode`.
        reference: the frozen `init_from` model, for the KL penalty; None without one.
    """

    def __init__(
        self,
        policy: nn.Module,
        data: PromptData,
        config: Any,
        reward: Rewards,
        decode_text: Any,
        reference: nn.Module | None = None,
        world_size: int = 1,
        sum_ranks: Callable[[Tensor], None] | None = None,
    ) -> None:
        self.policy, self.reward, self.decode_text = policy, reward, decode_text
        tc = config.train
        self.group_size, self.scale, self.beta = tc.group_size, tc.scale_rewards, tc.grpo_beta
        self.loss_type = tc.resolved_loss_type
        self.iterations, self.epsilon = tc.num_iterations, tc.epsilon
        self.epsilon_high = tc.epsilon if tc.epsilon_high is None else tc.epsilon_high
        self.sampling, self.context_length = config.sample, config.model.context_length
        self.end_ids, self.reference = data.end_ids, reference
        self.eval_batch = tc.batch_size * tc.group_size
        self.world_size, self.sum_ranks = world_size, sum_ranks
        # The step's autocast (`Precision.autocast`), set by `GRPO.wire`: sampling and the
        # sampling policy's log-probabilities run in the precision the step's forwards do.
        self.autocast: Callable[[], AbstractContextManager] = nullcontext
        check_rewards_on_prompts(reward, tc.reward_specs, data)

    def __call__(self, model: nn.Module, share: StepShare) -> tuple[Tensor, dict[str, Tensor]]:
        """The step's `loss_fn`: a micro-batch's share of the step (`GRPOStream`), its loss
        under `model` (the step's: DDP, compiled) and its figures."""
        return self.loss(model, share)

    def loss(self, model: nn.Module, share: StepShare) -> tuple[Tensor, dict[str, Tensor]]:
        """`train.loss_type`'s sum of the per-token losses of a share's completions, and TRL's
        figures: the step's, and this share's `kl` against the reference."""
        device = next(self.policy.parameters()).device
        done = share.completions
        ids, rows = done.ids.to(device), done.mask.to(device)
        mask, temperature = rows[:, 1:], self.sampling.temperature
        packing = packing_for(model, rows)  # planned once, for the policy and the reference
        logps = token_logps(model, ids, temperature, packing)
        old = None if share.old_logps is None else share.old_logps.to(device)
        per_token, low, high = per_token_loss(
            logps, share.advantages.to(device), old, self.epsilon, self.epsilon_high
        )
        figures = {name: value.to(device) for name, value in share.figures.items()}
        if old is not None:  # TRL's clip figures: the share of tokens the clip held
            figures["clip_ratio/low_mean"] = masked_mean(low.float(), mask)
            figures["clip_ratio/high_mean"] = masked_mean(high.float(), mask)
            figures["clip_ratio/region_mean"] = masked_mean((low | high).float(), mask)
        if self.reference is not None:
            with torch.no_grad():
                ref = token_logps(self.reference, ids, temperature, packing)
            kl = kl_per_token(logps, ref)
            per_token = per_token + self.beta * kl
            figures["kl"] = masked_mean(kl, mask).detach()
        loss = aggregate(
            per_token, mask, self.loss_type, share.step_tokens, self.sampling.max_new_tokens
        )
        return loss, figures

    def shares(self, batch: PromptBatch, parts: int) -> list[StepShare]:
        """A step's completions, sampled and rewarded at once (`sample`), then cut into `parts`
        shares of whole groups, one a micro-batch."""
        done = self.sample(batch)
        advantage = advantages(done.rewards, self.group_size, self.scale)
        tokens = done.mask[:, 1:].sum().double()
        if self.sum_ranks is not None:  # dapo's normaliser: the step's tokens on every rank
            tokens = tokens.to(next(self.policy.parameters()).device)
            self.sum_ranks(tokens)
        dapo_tokens = float(tokens) / (self.world_size * parts)
        figures = self._figures(done)
        rows = len(done.rewards) // parts
        shares = [
            StepShare(
                done.rows(slice(i * rows, (i + 1) * rows)),
                advantage[i * rows : (i + 1) * rows],
                dapo_tokens,
                figures,
            )
            for i in range(parts)
        ]
        if self.iterations > 1:  # the ratio's denominator: the policy that sampled them
            device = next(self.policy.parameters()).device
            with self._generating(), self.autocast():
                for share in shares:
                    ids, rows = share.completions.ids.to(device), share.completions.mask.to(device)
                    temperature = self.sampling.temperature
                    packing = packing_for(self.policy, rows)
                    share.old_logps = token_logps(self.policy, ids, temperature, packing)
        return shares

    def sample(self, batch: PromptBatch) -> Completions:
        """`train.group_size` completions of each prompt of `batch`, drawn from the policy (in
        eval mode, without gradients) with generators seeded `batch.seed, batch.seed + 1, ...`,
        and rewarded. A completion is cut where its row would pass `context_length + 1` tokens
        (the model reads `context_length` of them), and at `sample.max_new_tokens`."""
        G, split = self.group_size, batch.split
        prompts = [ids for ids in batch.prompts for _ in range(G)]
        drawn = self._replies(prompts, self.sampling, make_generators(len(prompts), batch.seed))
        # each row: its prompt, the completion, and the end token it ended with (if it did)
        rows = [
            p + c + ([e] if e is not None else []) for p, (c, e) in zip(prompts, drawn, strict=True)
        ]
        ids = torch.full((len(rows), max(map(len, rows))), self.end_ids[0], dtype=torch.long)
        mask = torch.zeros(ids.shape, dtype=torch.bool)  # (R, L)
        texts, scores = [], []
        for i, (row, prompt, (completion, _)) in enumerate(zip(rows, prompts, drawn, strict=True)):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, len(prompt) : len(row)] = True
            k, text = batch.picks[i // G], self.decode_text(completion)
            texts.append(text)
            scores.append(
                self.reward.scores(split.texts[k], text, split.answers[k], split.where[k])
            )
        per_reward = torch.tensor(scores, dtype=torch.float32)  # (R, F)
        rewards = per_reward @ torch.tensor(self.reward.weights, dtype=torch.float32)  # (R,)
        ended = torch.tensor([e is not None for _, e in drawn])
        return Completions(ids, mask, rewards, ended, texts, per_reward)

    def _replies(
        self, prompts: list[list[int]], sample: SampleConfig, generators: list | None = None
    ) -> list[tuple[list[int], bool]]:
        """Each prompt's reply from the policy in eval mode, without gradients, within the
        room its row has (`context_length + 1` tokens) and `sample.max_new_tokens`."""
        budgets = reply_budgets(prompts, sample.max_new_tokens, self.context_length)
        with self._generating(), self.autocast():
            return replies(
                self.policy,
                prompts,
                budgets,
                self.end_ids,
                sample,
                self.policy.vocab_size,
                generators=generators,
            )

    @contextmanager
    def _generating(self) -> Iterator[None]:
        """The policy in eval mode (no dropout), without gradients, then as it was."""
        was_training = self.policy.training
        self.policy.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            self.policy.train(was_training)

    def evaluate(self, split: PromptSplit, limit: int) -> dict[str, float]:
        """Greedy replies to the first `limit` prompts of `split`: their mean `reward` and
        `pass@1`, the share whose reply the run's reward gives 1 or more
        (`greedy_figures`)."""
        with self._generating():
            figures = greedy_figures(
                self.policy,
                split.first(limit),
                self.end_ids,
                self.sampling,
                self.reward,
                self.decode_text,
                self.eval_batch,
            )
        return {"reward": figures["reward"], "pass@1": figures["pass@1"]}

    def _figures(self, done: Completions) -> dict[str, Tensor]:
        """TRL's figures of a step's completions, under its names: `reward` and `reward_std`
        (the mean and standard deviation of the step's rewards), `frac_reward_zero_std` (the
        share of groups whose replies all scored the same: nothing to learn from them), and
        the completions' lengths (`completions/mean_length`, `min_length`, `max_length`,
        `mean_terminated_length` of those that ended) and `completions/clipped_ratio` (the
        share cut at their budget)."""
        stds = done.rewards.view(-1, self.group_size).std(dim=1)
        lengths = done.lengths.float()
        ended = lengths[done.ended]
        return {
            "reward": done.rewards.mean(),
            "reward_std": done.rewards.std() if len(done.rewards) > 1 else torch.tensor(0.0),
            "frac_reward_zero_std": (stds == 0).float().mean(),
            "completions/mean_length": lengths.mean(),
            "completions/min_length": lengths.min(),
            "completions/max_length": lengths.max(),
            "completions/mean_terminated_length": ended.mean() if len(ended) else torch.tensor(0.0),
            "completions/clipped_ratio": (~done.ended).float().mean(),
            **self._reward_figures(done),
        }

    def _reward_figures(self, done: Completions) -> dict[str, Tensor]:
        """TRL's `rewards/NAME/mean` and `rewards/NAME/std` of each reward function, unweighted."""
        if done.per_reward is None or len(done.per_reward) < 2:
            return {}
        figures = {}
        for j, name in enumerate(self.reward.names):
            figures[f"rewards/{name}/mean"] = done.per_reward[:, j].mean()
            figures[f"rewards/{name}/std"] = done.per_reward[:, j].std()
        return figures


class GRPO(Objective):
    """`train.objective: grpo`: prompts with answers (`data.format: prompts`) encoded with the
    `train.init_from` run's tokenizer and template; a step samples `train.group_size`
    completions of each prompt (`GRPOObjective`, `GRPOStream`), and with `train.grpo_beta` > 0
    holds the frozen `init_from` model for its KL penalty. Its evaluation answers held-out
    prompts greedily: reward and pass@1, its loss the negated mean reward."""

    name = "grpo"
    full_rows = False
    has_perplexity = False  # the loss is a policy gradient's, no next-token loss
    head_metrics = False  # rewards say nothing of the induction heads
    by_position = False
    templated = True
    encodes_with_init_from = True
    eval_data = "prompts"
    memory_knobs = "train.group_size, "
    figures = ("val_reward", "val_pass@1")  # its loss is the negated reward
    bar_figures = ("reward", "frac_reward_zero_std")

    @property
    def examples(self) -> str:  # type: ignore[override]
        return f"prompts ({self.config.train.group_size:,} completions each)"

    @property
    def reward_specs(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(self.config.train.reward_specs)

    @property
    def reward_weights(self) -> list[float] | None:  # type: ignore[override]
        return self.config.train.reward_weight_values

    @property
    def needs_reference(self) -> bool:
        return self.config.train.grpo_beta > 0  # the KL penalty's reference

    def read_data(self, tokenizer: Tokenizer | None) -> TokenData:
        return read_with_init_encoding(self.config, self.name, tokenizer, prompt_token_data)

    def sampler(
        self,
        data: TokenData,
        split: str,
        seed: int,
        rank: int,
        world_size: int,
        device: torch.device,
        training: bool = False,
    ) -> PromptSampler:
        """A step draws all its prompts at once (`batch_size x grad_accum`)."""
        assert data.prompts is not None
        prompts = data.prompts.train if split == "train" else data.prompts.val
        step = self.config.train.batch_size * self.config.train.grad_accum
        return PromptSampler(prompts, step, seed, rank, world_size)

    def wire(
        self,
        trainer: Any,
        model: nn.Module,
        data: TokenData,
        reference: nn.Module | None,
        world_size: int,
        sum_ranks: SumRanks | None,
    ) -> None:
        """Completions sampled from the model as it trains, rewarded, then the loss."""
        assert data.prompts is not None
        tc = self.config.train
        objective = GRPOObjective(
            model,
            data.prompts,
            self.config,
            load_rewards(tc.reward_specs, tc.reward_weight_values, tc.reward_timeout),
            data.tokenizer.decode,
            reference,
            world_size,
            sum_ranks,
        )
        objective.autocast = trainer.precision.autocast
        trainer.loss_fn = objective
        trainer.batches = GRPOStream(objective, trainer.batches, tc.grad_accum)

    def evaluate(self, loss_fn: Any, data: TokenData, limit: int) -> tuple[dict, dict] | None:
        """Greedy completions of the first `limit` prompts of each split: each split's loss is
        its negated mean reward (what GRPO lowers; the best weights are those with the highest
        held-out reward), its figures `reward` and `pass@1`."""
        assert data.prompts is not None
        losses, summary = {}, {}
        for name, split in (("train", data.prompts.train), ("val", data.prompts.val)):
            figures = loss_fn.evaluate(split, limit)
            losses[name] = -figures["reward"]
            summary.update({f"{name}_{key}": value for key, value in figures.items()})
        return losses, summary

    def memory_terms(self, vocab_size: int) -> MemoryTerms:
        """`batch_size x group_size` rows a micro-batch, and the reference with a KL penalty."""
        tc = self.config.train
        return MemoryTerms(
            rows=self.rows_per_example,
            reference=self.needs_reference,
            sampled_rows=tc.grad_accum * tc.group_size,  # a step's completions, drawn at once
        )

    def plan_rows(self) -> list[tuple[str, str]]:
        G = self.config.train.group_size
        return [
            (
                "not timed",
                f"sampling: before each update GRPO generates train.group_size ({G}) "
                "completions of each prompt, which the times above leave out",
            )
        ]

    def meta_rows(self, data: TokenData) -> dict[str, Any]:
        assert data.prompts is not None
        return super().meta_rows(data) | {"prompt_data": data.prompts.counts()}

    def eval_text(self, summary: dict[str, float], data: TokenData) -> str | None:
        """The greedy replies' reward and pass@1, and how many prompts they are over."""
        assert data.prompts is not None
        tc, total = self.config.train, len(data.prompts.val)
        answered = min(total, tc.eval_steps * tc.batch_size)
        scope = "all" if answered == total else f"the first {answered:,} of"
        return (
            f" (greedy on {scope} {total:,} validation prompts: val reward "
            f"{summary['val_reward']:.3f}, pass@1 {summary['val_pass@1']:.1%})"
        )

    def stalled(self, metrics: dict[str, float]) -> bool:
        """Every group's completions got the same reward: every advantage is 0."""
        return metrics.get("frac_reward_zero_std", 0.0) >= 1.0

    def stall_advice(self, metrics: dict[str, float]) -> str:
        tc = self.config.train
        if not self.stalled(metrics):
            return super().stall_advice(metrics)
        return (
            f"every group's {tc.group_size} completions got the same reward "
            f"(frac_reward_zero_std 1.0, reward {metrics.get('reward', float('nan')):.3f}), so "
            "every advantage is 0 and nothing is learned. Raise sample.temperature or "
            "train.group_size so that completions differ, give partial credit in train.reward, "
            "or start from a model that sometimes gets the answer (train.init_from)."
        )
