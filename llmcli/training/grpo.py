"""Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath") as a training objective:
learning from rewards on completions the model samples itself.

For each prompt of a micro-batch the policy samples `train.group_size` completions (the `sample`
section's temperature, top-k, top-p and `max_new_tokens`, each cut to the room the context
leaves); each completion gets a reward (`llmcli.evaluation.rewards`), and its advantage is its
reward less the mean of its group's, divided by the group's standard deviation when
`train.scale_rewards` (TRL's default). The loss raises the log-probability of every token of a
completion in proportion to its advantage, normalised by the batch's completion tokens:

    loss = -sum_i sum_t A_i log p(c_i,t | prompt_i, c_i,<t) / sum_i |c_i|

the on-policy policy gradient (one update per batch of samples, so PPO's ratio is 1 and its clip
never acts; as nanochat's `chat_rl` and TRL's `GRPOTrainer` with one iteration compute it).
With `train.grpo_beta` > 0 a KL penalty to the `train.init_from` model is added per token, as
TRL estimates it: `exp(ref - logp) - (ref - logp) - 1`.

`GRPOObjective` is the trainer's `loss_fn` (`loss_fn(policy, batch)`, the batch a
`llmcli.data.prompts.PromptBatch`); the training loop is next-token training's. Completions are
drawn with generators seeded from the batch's seed, which the prompt sampler draws and saves,
so a resumed run samples what an uninterrupted one would. Each evaluation answers held-out
prompts greedily (`GRPOObjective.evaluate`): pass@1 is the share whose completion the run's
reward passes (gives 1 or more).
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from llmcli.config import SampleConfig
from llmcli.data.prepared import PromptData, PromptSplit
from llmcli.data.prompts import PromptBatch
from llmcli.errors import InputError
from llmcli.evaluation.prompts import greedy_figures, reply_budgets
from llmcli.evaluation.rewards import BUILT_IN, Reward, parse_number, score
from llmcli.generation.replies import replies
from llmcli.generation.sampling import make_generators


@dataclass
class Completions:
    """A micro-batch's sampled completions, group by group: rows `g * G .. (g + 1) * G - 1` are
    prompt g's. `ids` `(R, L)` holds each prompt then its completion (and its end token when it
    ended), padded after; `mask` `(R, L)` is True on the completion's tokens and the end
    token; `rewards` `(R,)`."""

    ids: Tensor
    mask: Tensor
    rewards: Tensor
    ended: Tensor  # (R,) bool: ended with the end token (False: cut at its budget)
    texts: list[str]

    @property
    def lengths(self) -> Tensor:
        """`(R,)` each completion's tokens, the end token included."""
        return self.mask.sum(dim=1)


def advantages(rewards: Tensor, group_size: int, scale: bool) -> Tensor:
    """Each reward less its group's mean (rows in groups of `group_size`), divided by the
    group's standard deviation (+ 1e-4, as TRL) when `scale`. `(R,)` -> `(R,)`."""
    groups = rewards.view(-1, group_size)  # (P, G)
    centred = groups - groups.mean(dim=1, keepdim=True)
    if scale:
        centred = centred / (groups.std(dim=1, keepdim=True) + 1e-4)
    return centred.reshape(-1)


def token_logps(model: nn.Module, ids: Tensor) -> Tensor:
    """Each token's log-probability under `model` given the tokens before it: `(R, L)` ids ->
    `(R, L - 1)` float32, position t scoring token t + 1."""
    logits, _ = model(ids[:, :-1])  # (R, L - 1, V)
    logps = F.log_softmax(logits.float(), dim=-1)
    return logps.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (R, L - 1)


def grpo_loss(
    logps: Tensor,
    mask: Tensor,
    advantage: Tensor,
    ref_logps: Tensor | None = None,
    beta: float = 0.0,
) -> tuple[Tensor, Tensor | None]:
    """The policy-gradient loss normalised by the completion tokens, and the mean per-token KL
    to the reference (None without one).

    Args:
        logps: `(R, L-1)` the policy's log-probability of each next token.
        mask: `(R, L-1)` bool, True where the next token is a completion token.
        advantage: `(R,)`.
        ref_logps: `(R, L-1)` the reference's, for the KL penalty; None: none.
        beta: the KL penalty's weight.
    """
    m = mask.float()
    tokens = m.sum().clamp(min=1.0)
    loss = -(advantage[:, None] * logps * m).sum() / tokens
    if ref_logps is None:
        return loss, None
    diff = ref_logps - logps
    kl = ((torch.exp(diff) - diff - 1) * m).sum() / tokens
    return loss + beta * kl, kl


def check_reward(reward: Reward, spec: str, data: PromptData) -> None:
    """Before the first step: a built-in verifier has an answer to check every prompt against
    (`number`: an answer that `parse_number` reads), and the reward scores an empty completion
    of the first prompt (a function that raises, hangs or gives no number is found now, not
    after minutes of training).

    Raises:
        InputError: a prompt without an answer, or with no number for `number` (the first such
            row named, and their count), or the reward's failure.
    """
    if spec in BUILT_IN:
        for split in (data.train, data.val):
            pairs = zip(split.where, split.answers, strict=True)
            missing = [where for where, answer in pairs if answer is None]
            if missing:
                raise InputError(
                    f"{missing[0]}: the prompt has no answer for train.reward {spec!r} to check "
                    f'completions against ({len(missing)} such rows): add an "answer", or '
                    "name a reward function of your own (FILE.py:FUNCTION) that needs none."
                )
    if spec == "number":
        for split in (data.train, data.val):
            pairs = zip(split.where, split.answers, strict=True)
            bad = [(where, answer) for where, answer in pairs if parse_number(answer) is None]
            if bad:
                where, answer = bad[0]
                raise InputError(
                    f"{where}: the answer {reprlib.repr(answer)} holds no number for "
                    f"train.reward 'number' to compare replies with ({len(bad)} such rows): "
                    'give the number ("72", "1,234", "-3.5", or GSM8K\'s "... #### 72"), or '
                    "choose train.reward: exact or contains for answers that are text."
                )
    split = data.train
    score(reward, split.texts[0], "", split.answers[0], split.where[0])


class GRPOObjective:
    """The step's `loss_fn` for `train.objective: grpo`: sample, reward, and the loss.

    Args:
        policy: the model being trained (unwrapped: generation runs on it directly).
        data: the run's prompts (their end token).
        config: the run's config (`train.group_size`, `scale_rewards`, `grpo_beta`, `sample`).
        reward: the reward function (`llmcli.evaluation.rewards.load_reward`).
        decode_text: the tokenizer's `decode`.
        reference: the frozen `init_from` model, for the KL penalty; None without one.
    """

    def __init__(
        self,
        policy: nn.Module,
        data: PromptData,
        config: Any,
        reward: Reward,
        decode_text: Any,
        reference: nn.Module | None = None,
    ) -> None:
        self.policy, self.reward, self.decode_text = policy, reward, decode_text
        tc = config.train
        self.group_size, self.scale, self.beta = tc.group_size, tc.scale_rewards, tc.grpo_beta
        self.sampling, self.context_length = config.sample, config.model.context_length
        self.end_id, self.reference = data.end_id, reference
        self.eval_batch = tc.batch_size * tc.group_size
        check_reward(reward, tc.reward, data)

    def __call__(self, model: nn.Module, batch: PromptBatch) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of a micro-batch of prompts and its metrics: their completions sampled
        from the policy, then `loss` on them under `model` (the step's: DDP, compiled)."""
        return self.loss(model, self.sample(batch))

    def loss(self, model: nn.Module, done: Completions) -> tuple[Tensor, dict[str, Tensor]]:
        """`grpo_loss` of sampled completions under `model`, and TRL's metrics of them."""
        device = next(self.policy.parameters()).device
        ids, mask = done.ids.to(device), done.mask[:, 1:].to(device)
        advantage = advantages(done.rewards, self.group_size, self.scale).to(device)
        logps = token_logps(model, ids)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = token_logps(self.reference, ids)
        loss, kl = grpo_loss(logps, mask, advantage, ref, self.beta)
        return loss, self._metrics(done, kl, device)

    def sample(self, batch: PromptBatch) -> Completions:
        """`train.group_size` completions of each prompt of `batch`, drawn from the policy (in
        eval mode, without gradients) with generators seeded `batch.seed, batch.seed + 1, ...`,
        and rewarded. A completion is cut where its row would pass `context_length + 1` tokens
        (the model reads `context_length` of them), and at `sample.max_new_tokens`."""
        G, split = self.group_size, batch.split
        prompts = [ids for ids in batch.prompts for _ in range(G)]
        drawn = self._replies(prompts, self.sampling, make_generators(len(prompts), batch.seed))
        rows = [p + c + [self.end_id] * ended for p, (c, ended) in zip(prompts, drawn, strict=True)]
        ids = torch.full((len(rows), max(map(len, rows))), self.end_id, dtype=torch.long)
        mask = torch.zeros(ids.shape, dtype=torch.bool)  # (R, L)
        texts, rewards = [], []
        for i, (row, prompt, (completion, _)) in enumerate(zip(rows, prompts, drawn, strict=True)):
            ids[i, : len(row)] = torch.tensor(row)
            mask[i, len(prompt) : len(row)] = True
            k, text = batch.picks[i // G], self.decode_text(completion)
            texts.append(text)
            rewards.append(
                score(self.reward, split.texts[k], text, split.answers[k], split.where[k])
            )
        ended = torch.tensor([e for _, e in drawn])
        return Completions(ids, mask, torch.tensor(rewards), ended, texts)

    def _replies(
        self, prompts: list[list[int]], sample: SampleConfig, generators: list | None = None
    ) -> list[tuple[list[int], bool]]:
        """Each prompt's reply from the policy in eval mode, without gradients, within the
        room its row has (`context_length + 1` tokens) and `sample.max_new_tokens`."""
        budgets = reply_budgets(prompts, sample.max_new_tokens, self.context_length)
        with self._generating():
            return replies(
                self.policy,
                prompts,
                budgets,
                self.end_id,
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
        (`llmcli.evaluation.prompts.greedy_figures`)."""
        with self._generating():
            figures = greedy_figures(
                self.policy,
                split.first(limit),
                self.end_id,
                self.sampling,
                self.reward,
                self.decode_text,
                self.eval_batch,
            )
        return {"reward": figures["reward"], "pass@1": figures["pass@1"]}

    def _metrics(self, done: Completions, kl: Tensor | None, device: torch.device) -> dict:
        """TRL's GRPO metrics of the micro-batch: `reward`, `reward_std` (the groups' mean
        standard deviation), `frac_reward_zero_std`, `completions/mean_length` and
        `completions/clipped_ratio` (the share cut at their budget), and `kl`."""
        groups = done.rewards.view(-1, self.group_size)
        stds = groups.std(dim=1)
        lengths = done.lengths.float()
        metrics = {
            "reward": done.rewards.mean(),
            "reward_std": stds.mean(),
            "frac_reward_zero_std": (stds == 0).float().mean(),
            "completions/mean_length": lengths.mean(),
            "completions/clipped_ratio": (~done.ended).float().mean(),
        }
        if kl is not None:
            metrics["kl"] = kl.detach()
        return {name: value.to(device) for name, value in metrics.items()}
