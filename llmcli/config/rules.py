"""How a config section states a broken rule: one message naming the key, the value and the rule.

Every section (`model`, `data`, `train`, `sample`) checks its values with these, so that a
message reads the same wherever it comes from: `model.n_head (3) must be positive.`
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from typing import Any, Literal

from llmcli.errors import ConfigError


def require(ok: bool, section: str, key: str, value: Any, rule: str) -> None:
    """Raise `ConfigError` "`section.key (value) rule.`" unless `ok`."""
    if not ok:
        raise ConfigError(f"{section}.{key} ({value!r}) {rule}.")


def check_choices(section: str, values: Any) -> None:
    """Raise `ConfigError` for a field whose annotation is a `Literal` (possibly among other
    types) and whose value is a string outside its choices: the check a YAML file gets when it
    is read, here for a section built in Python."""
    hints = typing.get_type_hints(type(values))
    for f in dataclasses.fields(values):
        choices = _literal_choices(hints[f.name])
        value = getattr(values, f.name)
        if choices and isinstance(value, str) and value not in choices:
            require(False, section, f.name, value, f"must be one of {', '.join(choices)}")


def _literal_choices(tp: Any) -> tuple[str, ...]:
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return tuple(c for arg in typing.get_args(tp) for c in _literal_choices(arg))


def is_int(value: Any) -> bool:
    """An integer, not a bool (YAML's `true` is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def divisors(n: int, limit: int | None = None) -> list[int]:
    """The divisors of `n`, in increasing order (up to `limit`, for a message that suggests one)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    every = small + [n // d for d in reversed(small) if d * d != n]
    return every if limit is None else [d for d in every if d <= limit]


_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(?:i?b)?\s*", re.IGNORECASE)


def parse_size(text: str) -> int | None:
    """A memory size as bytes: "4GB", "4G" and "4GiB" are all 4 * 1024**3, as memory is sold and
    reported in powers of 1024; a bare number is bytes. None if `text` is not a size."""
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        return None
    number, unit = match.groups()
    return int(float(number) * 1024 ** " kmgt".index(unit.lower() or " "))


def size_bytes(value: int | str | None) -> int | None:
    """A size setting in bytes: a number as it is, a size string parsed (None if it is not one,
    which `require_size` refuses), None as None."""
    return parse_size(value) if isinstance(value, str) else value


def require_size(section: str, key: str, value: int | str | None, null: str) -> None:
    """Refuse a size setting that is not a positive number of bytes, a size string or null
    (`null` says what null means)."""
    n = size_bytes(value)
    require(
        value is None or (n is not None and n > 0),
        section,
        key,
        value,
        'must be a positive number of bytes or a size such as "128MB", "4GB" or "1.5G" (powers '
        f"of 1024), or null for {null}",
    )
