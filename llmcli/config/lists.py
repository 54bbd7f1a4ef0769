"""Settings a config may give as a list or as one comma-separated text ("sigmoid,sft")."""

from __future__ import annotations

import math

from llmcli.config.rules import require


def names(value: str | list[str] | None) -> list[str]:
    """The names `value` holds, in order, each stripped: a list's items, or a text split at its
    commas (empty names kept, for the caller's rule to refuse); none for null."""
    items = value.split(",") if isinstance(value, str) else value or []
    return [str(item).strip() for item in items]


def numbers(
    value: list[float] | str | None, section: str, key: str, what: str
) -> list[float] | None:
    """A list of weights as numbers: a list as it is, a text "1.0,0.5" split, None for null.
    Raises `ConfigError` naming `section.key` for a text with something else in it, or a
    number that is not finite."""
    if value is None:
        return None
    try:
        values = [float(w) for w in (value.split(",") if isinstance(value, str) else value)]
    except (TypeError, ValueError):
        values = [math.nan]
    require(
        all(math.isfinite(v) for v in values),
        section,
        key,
        value,
        f"must be numbers, {what}: a list, or a text like 1.0,0.5",
    )
    return values
