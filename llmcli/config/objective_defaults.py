"""The defaults that depend on the objective: a key a config leaves out takes its objective's
value here (before its section's own default), and `llmcli config` prints it as any other.

GRPO learns from the distribution it samples, so it samples as TRL's `GRPOConfig` does by
default: temperature 1, every token kept (no top-k; top-p is 1 for every objective).
"""

from __future__ import annotations

from typing import Any

OBJECTIVE_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "grpo": {"sample": {"temperature": 1.0, "top_k": None}},
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
