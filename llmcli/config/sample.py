"""The `sample:` section: the generation settings, checked as they are made."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from llmcli.config.rules import is_int, is_number
from llmcli.errors import ConfigError

CONTEXT_POLICIES = ("exact", "shift")


def keep_range(context_length: int) -> tuple[int, int]:
    """The tokens `shift` may keep when the context is full: 1 to `context_length - 1`.

    A one-token context keeps its one token (then `shift` computes what `exact` does).
    """
    return 1, max(1, context_length - 1)


def default_keep(context_length: int) -> int:
    """The tokens `shift` keeps when `sample.context_keep` is null: half the context."""
    return max(1, context_length // 2)


@dataclass(frozen=True)
class SampleConfig:
    """Generation settings: a run's `sample:` section, with `llmcli sample`'s options applied by
    `dataclasses.replace`; what `llmcli.generation.generate` takes.

    Every setting is checked as the config is made (`dataclasses.replace` makes a new one), so a
    `SampleConfig` holds valid settings; `context_keep` also depends on the model's context and
    is checked against it by `keep_for`. A message names the value, the rule, and both the
    command-line option and the config key that set it.
    """

    max_new_tokens: int = 500
    temperature: float = 0.8
    top_k: int | None = 200
    top_p: float = 1.0
    seed: int = 1337
    # Past model.context_length: "shift" keeps the last context_keep tokens (null:
    # context_length // 2) and goes on with the KV cache; "exact" recomputes the last
    # context_length tokens every step (see llmcli.generation.context_window; why shift: README,
    # Sampling).
    context_policy: Literal["exact", "shift"] = "shift"
    context_keep: int | None = None
    # A sample ends at the end-of-text token unless this is true (then it goes on past it to
    # max_new_tokens, and the token shows in the text as <|endoftext|>).
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` for a setting outside its range (`context_keep`: `keep_for`)."""
        for key, ok, rule in self._rules():
            if not ok:
                raise _sample_error(key, getattr(self, key), rule)

    def _rules(self) -> list[tuple[str, bool, str]]:
        """(key, whether its value keeps the rule, the rule) for every setting."""
        t, k, p, keep = self.temperature, self.top_k, self.top_p, self.context_keep
        return [
            (
                "max_new_tokens",
                is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
                "must be an integer >= 1: the most tokens each sample generates",
            ),
            (
                "temperature",
                is_number(t) and math.isfinite(t) and t >= 0,
                "must be a number >= 0: 0 is greedy decoding, 1 samples from the model's "
                "distribution, higher is more random",
            ),
            (
                "top_k",
                k is None or (is_int(k) and k >= 1),
                "must be an integer >= 1 (the number of most likely tokens kept); null in a "
                "config, or a value >= the vocabulary size, keeps every token",
            ),
            (
                "top_p",
                is_number(p) and 0 < p <= 1,
                "must be in (0, 1]: the probability mass of the most likely tokens kept "
                "(nucleus sampling); 1 keeps every token",
            ),
            (
                "seed",
                is_int(self.seed) and 0 <= self.seed < 2**63,
                "must be an integer in 0..2**63-1 (torch's seed range; row b of a batch is "
                "seeded seed + b)",
            ),
            (
                "context_policy",
                self.context_policy in CONTEXT_POLICIES,
                f"must be one of {', '.join(CONTEXT_POLICIES)}: exact recomputes the last "
                "context_length tokens every step past the context, shift keeps the last tokens "
                "and goes on with the KV cache",
            ),
            (
                "ignore_eos",
                isinstance(self.ignore_eos, bool),
                "must be true or false: false ends a sample at the end-of-text token, true "
                "generates past it",
            ),
            (
                "context_keep",
                keep is None or is_int(keep),
                "must be an integer (the tokens shift keeps when the context is full), or null "
                "for context_length // 2",
            ),
        ]

    def keep_for(self, context_length: int) -> int:
        """The tokens `shift` keeps with a model of `context_length`: `context_keep`, or half the
        context when it is null.

        Raises:
            ConfigError: `context_keep` outside `keep_range(context_length)`.
        """
        if self.context_keep is None:
            return default_keep(context_length)
        low, high = keep_range(context_length)
        if not low <= self.context_keep <= high:
            raise _sample_error(
                "context_keep",
                self.context_keep,
                f"must be in {low}..{high} (1 to model.context_length - 1), or null for "
                "context_length // 2: the tokens shift keeps when the context is full",
            )
        return self.context_keep


def _sample_error(key: str, value: Any, rule: str) -> ConfigError:
    """A broken rule of `sample.<key>`, named as `llmcli sample`'s option and as the key."""
    option = "--" + key.replace("_", "-")
    return ConfigError(f"{option} / sample.{key} ({value!r}) {rule}.")
