"""Training objectives, one module each: what differs between next-token on text
(`base.Objective`), conversations (`chat`), DPO (`dpo`, its scores `preference_scores` and losses
`dpo_losses`) and GRPO (`grpo`, its rewards `rewards`). `objective_for` is the one place that
reads `train.objective` and `data.format` to choose one; everything else asks the objective.

Objectives sit above generation (GRPO samples) and below evaluation and training, which ask
them and pass in what they need from above (the reference model, summing over ranks).
"""

from __future__ import annotations

from llmcli.config import Config
from llmcli.objectives.base import Objective
from llmcli.objectives.chat import Chat
from llmcli.objectives.dpo import DPO
from llmcli.objectives.grpo import GRPO

# By train.objective; next-token training by data.format (conversations or text).
_BY_OBJECTIVE: dict[str, type[Objective]] = {"dpo": DPO, "grpo": GRPO}
_BY_FORMAT: dict[str, type[Objective]] = {"chat": Chat}


def objective_for(config: Config) -> Objective:
    """The objective `config` trains with (`train.objective`, and for next-token training
    `data.format`), bound to `config` (ask again once the micro-batch is settled)."""
    kind = _BY_OBJECTIVE.get(config.train.objective) or _BY_FORMAT.get(config.data.format)
    return (kind or Objective)(config)


__all__ = ["Objective", "objective_for"]
