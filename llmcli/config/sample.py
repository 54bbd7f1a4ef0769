"""The `sample:` section: the generation settings, checked as they are made."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
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


def _setting(
    default: Any,
    *,
    help: str,
    check: Callable[[Any], bool],
    rule: str,
    metavar: str | None = None,
    off_option: str | None = None,
) -> Any:
    """A `SampleConfig` field, with what each surface that sets it takes from it (`setting_info`).

    Args:
        default: the value when neither the config nor an option gives one.
        help: what it does, one sentence: `llmcli sample`'s option help and the interactive
            prompt's `/help`.
        check: whether a value keeps the rule.
        rule: the rule ("must be ..."), after `key (value)` in every message that refuses a value:
            the config's, `llmcli sample`'s, the server's and the interactive prompt's.
        metavar: the option's value in `llmcli sample --help` (default: its type).
        off_option: a switch's option that sets it to false (default: `--no-<key>`).
    """
    metadata = dict(help=help, check=check, rule=rule, metavar=metavar, off_option=off_option)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class SampleConfig:
    """Generation settings: a run's `sample:` section, with `llmcli sample`'s options applied by
    `dataclasses.replace`; what `llmcli.generation.engine` takes.

    Every setting is checked as the config is made (`dataclasses.replace` makes a new one), so a
    `SampleConfig` holds valid settings; `context_keep` also depends on the model's context and
    is checked against it by `keep_for`. A message names the value, the rule, and both the
    command-line option and the config key that set it.

    Each field is declared once, with its help and its rule (`_setting`): `llmcli sample`'s
    options, the server's request fields and the interactive prompt's `/` commands are made from
    these fields (`llmcli.cli.generation`, `llmcli.serve.request`,
    `llmcli.generation.interactive`).
    """

    max_new_tokens: int = _setting(
        500,
        help="Tokens to generate per sample.",
        check=lambda n: is_int(n) and n >= 1,
        rule="must be an integer >= 1: the most tokens each sample generates",
    )
    temperature: float = _setting(
        0.8,
        help="Sampling temperature, >= 0; 0 is greedy.",
        check=lambda t: is_number(t) and math.isfinite(t) and t >= 0,
        rule="must be a number >= 0: 0 is greedy decoding, 1 samples from the model's "
        "distribution, higher is more random",
    )
    top_k: int | None = _setting(
        200,
        help="Keep the k most likely tokens (>= 1; >= vocab size keeps all).",
        check=lambda k: k is None or (is_int(k) and k >= 1),
        rule="must be an integer >= 1 (the number of most likely tokens kept); null, or a "
        "value >= the vocabulary size, keeps every token",
    )
    top_p: float = _setting(
        1.0,
        help="Nucleus sampling mass in (0, 1]; 1 keeps all.",
        check=lambda p: is_number(p) and 0 < p <= 1,
        rule="must be in (0, 1]: the probability mass of the most likely tokens kept "
        "(nucleus sampling); 1 keeps every token",
    )
    seed: int = _setting(
        1337,
        help="Random seed; sample r uses seed + r.",
        check=lambda s: is_int(s) and 0 <= s < 2**63,
        rule="must be an integer in 0..2**63-1 (torch's seed range; row b of a batch is "
        "seeded seed + b)",
    )
    # Past model.context_length (see llmcli.generation.engine; why shift:
    # docs/sampling.md).
    context_policy: Literal["exact", "shift"] = _setting(
        "shift",
        help="Past the context: exact (the last context_length tokens, recomputed each step) "
        "or shift (keep the last tokens, go on with the KV cache).",
        check=lambda policy: policy in CONTEXT_POLICIES,
        rule=f"must be one of {', '.join(CONTEXT_POLICIES)}: exact recomputes the last "
        "context_length tokens every step past the context, shift keeps the last tokens and "
        "goes on with the KV cache",
        metavar="POLICY",
    )
    # Its range depends on the model: `keep_for` checks it against model.context_length.
    context_keep: int | None = _setting(
        None,
        help="Tokens shift keeps when the context is full, 1..context_length-1; unset, half the "
        "context.",
        check=lambda keep: keep is None or is_int(keep),
        rule="must be an integer (the tokens shift keeps when the context is full), or null "
        "for context_length // 2",
        metavar="N",
    )
    ignore_eos: bool = _setting(
        False,
        help="Go on past the end-of-text token (shown as <|endoftext|>) to max_new_tokens; by "
        "default a sample ends there.",
        check=lambda value: isinstance(value, bool),
        rule="must be true or false: false ends a sample at the end-of-text token, true "
        "generates past it",
        off_option="--stop-at-eos",
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ConfigError` for a setting outside its range (`context_keep`: `keep_for`)."""
        for key in SETTING_KEYS:
            value = getattr(self, key)
            rule = broken_rule(key, value)
            if rule is not None:
                raise _sample_error(key, value, rule)

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


# The settings in their order, each a field of `SampleConfig` made by `_setting`.
SETTING_KEYS = tuple(f.name for f in fields(SampleConfig))
_FIELDS = {f.name: f for f in fields(SampleConfig)}


def setting_info(key: str) -> Mapping[str, Any]:
    """What `_setting` holds for the setting `key`: `help`, `check`, `rule`, `metavar`,
    `off_option`."""
    return _FIELDS[key].metadata


def broken_rule(key: str, value: Any) -> str | None:
    """The rule of setting `key` that `value` breaks ("must be ..."), or None if it keeps it.

    What `SampleConfig` checks as it is made, for a caller that names the value its own way
    (the server: a request's field).
    """
    info = setting_info(key)
    return None if info["check"](value) else info["rule"]


def option_name(key: str) -> str:
    """`llmcli sample`'s option for the setting `key`: `--max-new-tokens`."""
    return "--" + key.replace("_", "-")


def _sample_error(key: str, value: Any, rule: str) -> ConfigError:
    """A broken rule of `sample.<key>`, named as `llmcli sample`'s option and as the key."""
    return ConfigError(f"{option_name(key)} / sample.{key} ({value!r}) {rule}.")
