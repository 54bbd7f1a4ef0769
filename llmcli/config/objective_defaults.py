"""The defaults that depend on the objective: a key a config leaves out takes its objective's
value here (before its section's own default), and `llmcli config` prints it as any other.

GRPO learns from the distribution it samples, so it samples as TRL's `GRPOConfig` does by
default: temperature 1, every token kept (no top-k; top-p is 1 for every objective).

DPO and GRPO fine-tune a trained run: pretraining's rate (1e-3, a warmup of 100 steps) would
wreck it in a few steps, and its evaluation every 250 steps is longer than such a run. Their
rates are the shipped examples' (configs/dpo.yaml, configs/grpo.yaml), which also raised
held-out pass@1 on a task they were not tuned on (docs/grpo.md, "Choosing the settings").
TRL's default rate, 1e-6, is for models of billions of parameters: on a model of a million it
moves nothing in a few hundred steps.
"""

from __future__ import annotations

from typing import Any

_FINE_TUNE = {"warmup_steps": 10, "eval_interval": 50}
OBJECTIVE_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "dpo": {"train": {"lr": 5e-5, "min_lr": 5e-6, **_FINE_TUNE, "warmup_steps": 20}},
    "grpo": {
        "train": {"lr": 1e-4, "min_lr": 1e-5, **_FINE_TUNE},
        "sample": {"temperature": 1.0, "top_k": None},
    },
}


def with_objective_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` (a config's sections, as parsed) with its objective's defaults under the keys it
    leaves out. A section that is not a mapping is left for its own check to refuse."""
    train = raw.get("train")
    objective = train.get("objective") if isinstance(train, dict) else None
    defaults = OBJECTIVE_DEFAULTS.get(objective) if isinstance(objective, str) else None
    if not defaults:
        return raw
    merged = dict(raw)
    for section, values in defaults.items():
        given = raw.get(section)
        if given is None or isinstance(given, dict):
            merged[section] = {**values, **(given or {})}
    return merged
