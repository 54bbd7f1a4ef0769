"""A GRPO step's sample: the completions the policy drew, with their rewards (`Completions`),
the share of them each micro-batch takes (`StepShare`), and the training stream that samples
once a step and serves the shares (`GRPOStream`), saved and resumed with them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from llmcli.data.prompts import PromptSampler
from llmcli.objectives.packing import row_ends


@dataclass
class Completions:
    """Sampled completions, group by group: rows `g * G .. (g + 1) * G - 1` are prompt g's.
    `ids` `(R, L)` holds each prompt then its completion (and its end token when it ended),
    padded after; `mask` `(R, L)` is True on the completion's tokens and the end token;
    `rewards` `(R,)`."""

    ids: Tensor
    mask: Tensor
    rewards: Tensor
    ended: Tensor  # (R,) bool: ended with the end token (False: cut at its budget)
    texts: list[str]
    # (R, F) each reward function's score (train.reward's list), weighed into `rewards`
    per_reward: Tensor | None = None

    @property
    def lengths(self) -> Tensor:
        """`(R,)` each completion's tokens, the end token included."""
        return self.mask.sum(dim=1)

    @property
    def positions(self) -> int:
        """The positions the model reads of these rows, padding left out: each row's prompt and
        completion up to its last completion token, which is only a target."""
        return int((row_ends(self.mask) - 1).sum())

    def rows(self, part: slice) -> Completions:
        """The completions of the rows `part`, cut to their longest row (padding after a row's
        end changes none of its tokens' log-probabilities under the causal mask)."""
        mask = self.mask[part]
        width = int(mask.any(dim=0).nonzero().max()) + 1 if mask.any() else 1
        return Completions(
            self.ids[part, :width],
            mask[:, :width],
            self.rewards[part],
            self.ended[part],
            self.texts[part],
            None if self.per_reward is None else self.per_reward[part],
        )


@dataclass
class StepShare:
    """One micro-batch's share of a step: its completions and their advantages, the step's
    completion tokens over every rank (`dapo`'s normaliser) and the step's figures (the same
    in each share, so the step's mean of them is the step's)."""

    completions: Completions
    advantages: Tensor  # (R,)
    step_tokens: float
    figures: dict[str, Tensor]
    # (R, L-1) the sampling policy's log-probabilities, kept when a step's completions serve
    # several updates (`train.num_iterations` > 1); None: the policy's own, detached.
    old_logps: Tensor | None = None

    def state(self) -> dict[str, Any]:
        """What a save keeps of a share still to serve (tensors, numbers, strings)."""
        done = self.completions
        return {
            "ids": done.ids,
            "mask": done.mask,
            "rewards": done.rewards,
            "ended": done.ended,
            "texts": done.texts,
            "advantages": self.advantages,
            "step_tokens": self.step_tokens,
            "figures": self.figures,
            "old_logps": self.old_logps,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> StepShare:
        done = Completions(
            state["ids"], state["mask"], state["rewards"], state["ended"], list(state["texts"])
        )
        return cls(
            done, state["advantages"], state["step_tokens"], state["figures"], state["old_logps"]
        )


class GRPOStream:
    """GRPO's training stream: a step's prompts (`train.batch_size x train.grad_accum`, drawn at
    once) sampled and rewarded together, then handed to the step one micro-batch's share at a
    time (`GRPOObjective.shares`), so that how a step is split changes nothing it computes.
    With `train.num_iterations` > 1 the same shares serve that many steps in a row (TRL's
    `num_iterations`), each update measured against the policy that sampled them.

    Its state is the prompt sampler's, and the shares still to serve: a save between two steps
    of one sample keeps them, so a resumed run goes on with the completions it had.
    """

    def __init__(self, objective: Any, prompts: PromptSampler, parts: int) -> None:
        # objective: the run's `GRPOObjective` (its `shares` and `iterations`)
        self.objective, self.prompts, self.parts = objective, prompts, parts
        self._shares: list[StepShare] = []  # the sample being served
        self._served = 0  # its shares handed out so far, over all its steps
        self.tokens_drawn = 0  # input positions handed out, padding left out (the log's tokens)

    def next(self) -> StepShare:
        if self._served >= len(self._shares) * self.objective.iterations:  # (fewer on resume)
            self._shares = self.objective.shares(self.prompts.next(), self.parts)
            self._served = 0
        share = self._shares[self._served % len(self._shares)]
        self._served += 1
        self.tokens_drawn += share.completions.positions
        return share

    @property
    def batch_size(self) -> int:
        """Prompts a micro-batch takes: the step's, over its micro-batches."""
        return self.prompts.batch_size // self.parts

    @batch_size.setter
    def batch_size(self, batch: int) -> None:
        """A smaller micro-batch after running out of memory (`llmcli.training.batch`): the
        step's prompts split in more parts; the failed step's sample is dropped, as its
        gradients are, and the next step samples afresh."""
        assert self.prompts.batch_size % batch == 0
        self.parts = self.prompts.batch_size // batch
        self._shares, self._served = [], 0

    def state_dict(self) -> dict[str, Any]:
        state = self.prompts.state_dict()
        if self._served < len(self._shares) * self.objective.iterations:
            state["grpo_shares"] = [share.state() for share in self._shares]
            state["grpo_served"] = self._served
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        shares, served = state.pop("grpo_shares", []), state.pop("grpo_served", 0)
        self.prompts.load_state_dict(state)
        self._shares = [StepShare.from_state(share) for share in shares]
        self._served = served

    def close(self) -> None:
        self.prompts.close()
