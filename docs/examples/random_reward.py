"""A control reward for the GRPO example (docs/grpo.md): 1 or 0 at random, whatever the reply.

It rewards as often as the exact-match reward does at the start (about a quarter of the chat
run's sampled replies are right), but carries no information about the reply, so GRPO has
nothing to learn from it: a run with it shows what the training alone does to pass@1.

    llmcli train grpo --out checkpoints/grpo-control \
        --set train.reward=docs/examples/random_reward.py:score
"""

import random

RATE = 0.25
_draws = random.Random(0)  # seeded: the control run is reproducible


def score(prompt: str, completion: str, answer: str | None) -> float:
    return float(_draws.random() < RATE)
