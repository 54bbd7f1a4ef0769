"""Greedy answers to prompts, scored by a reward: what GRPO's evaluations and `llmcli eval` on a
prompt file measure (the mean reward, and pass@1: the share of answers the reward passes)."""

from __future__ import annotations

import dataclasses
from typing import Any

from llmcli.data.prepared import PromptSplit
from llmcli.generation.replies import replies
from llmcli.objectives.rewards import Rewards
from llmcli.progress import Progress


def reply_budgets(prompts: list[list[int]], max_new_tokens: int, context_length: int) -> list[int]:
    """Each prompt's most reply tokens: `max_new_tokens`, or the room its row has (the model
    reads `context_length` tokens, so a row holds at most `context_length + 1`)."""
    return [min(max_new_tokens, context_length + 1 - len(p)) for p in prompts]


def greedy_figures(
    model: Any,
    split: PromptSplit,
    end_ids: tuple[int, ...],
    sample: Any,
    reward: Rewards,
    decode_text: Any,
    batch_size: int,
    *,
    progress: bool = False,
) -> dict[str, Any]:
    """Greedy replies to the prompts of `split`: their mean `reward`, `pass@1` (NaN when there
    are none) of the `answered` prompts (those with an answer, for a built-in verifier; every
    prompt, for a function of the user's), `passed` of them (reward 1 or more), and each
    prompt's `replies` (text, whether it ended, reward). The model must be in eval mode."""
    picks = list(range(len(split)))
    greedy = dataclasses.replace(sample, temperature=0.0)
    bar = Progress(len(picks), desc="answers", unit="prompt", enabled=progress, tenths=True)
    rows = []
    for lo in range(0, len(picks), batch_size):
        batch = picks[lo : lo + batch_size]
        prompts = [split.ids[k].tolist() for k in batch]
        budgets = reply_budgets(prompts, sample.max_new_tokens, model.context_length)
        got = replies(model, prompts, budgets, end_ids, greedy, model.vocab_size)
        for k, (ids, end) in zip(batch, got, strict=True):
            text = decode_text(ids)
            value = reward.total(split.texts[k], text, split.answers[k], split.where[k])
            ended = end is not None
            rows.append({"where": split.where[k], "reply": text, "ended": ended, "reward": value})
        bar.update(len(batch))
    bar.close()
    answered = [  # built-in verifiers judge only a prompt with an answer
        float(r["reward"] >= 1.0)
        for k, r in zip(picks, rows, strict=True)
        if split.answers[k] is not None or not reward.needs_answer
    ]
    return {
        "reward": sum(r["reward"] for r in rows) / len(rows),
        "pass@1": sum(answered) / len(answered) if answered else float("nan"),
        "passed": int(sum(answered)),
        "answered": len(answered),
        "replies": rows,
    }
