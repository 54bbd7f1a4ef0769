"""Errors the user can fix.

Library code raises `InputError` (or a subclass) for bad input: a wrong config value, a missing
file, a prompt the tokenizer cannot encode. The CLI prints the message and exits with status 2,
never a traceback. Anything else is an internal error (exit status 1).
"""

import difflib
import errno
from collections.abc import Iterable


class InputError(ValueError):
    """Bad input, with a message that names what to fix."""


class ConfigError(InputError):
    """A config file or `--set` override that does not validate."""


class CheckpointError(InputError):
    """A run directory that is missing, incomplete, corrupt or unsafe to load."""


def describe_os_error(exc: OSError) -> str:
    """A short human reason for a failed write (ENOSPC and permissions get a hint)."""
    if exc.errno == errno.ENOSPC:
        return "no space left on device (free some disk space)"
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"{exc.strerror or 'permission denied'} (check the folder's permissions)"
    return exc.strerror or str(exc)


def did_you_mean(
    word: str,
    choices: Iterable[str],
    form: str = " Did you mean '{}'?",
    n: int = 1,
    cutoff: float = 0.5,
) -> str:
    """The hint of a message that names an unknown `word`: `form` holding the choices that
    `word` begins (`/temp` for `/temperature`; several joined by " or ": `/top_k or /top_p`),
    else the `n` closest of `choices` (joined by ", "; `difflib`'s similarity at least
    `cutoff`), or "" when none is close enough."""
    choices = list(choices)
    started = [choice for choice in choices if word and choice.startswith(word)]
    if started:
        return form.format(" or ".join(started))
    close = difflib.get_close_matches(word, choices, n, cutoff)
    return form.format(", ".join(close)) if close else ""
