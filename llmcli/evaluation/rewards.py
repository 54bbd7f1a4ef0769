"""GRPO's rewards (`train.reward`): built-in verifiers, or a function of the user's own file.

A reward scores one completion of one prompt: `reward(prompt, completion, answer) -> number`,
where `prompt` is the prompt's text as the model read it (a conversation rendered by the chat
template), `completion` the text the model wrote (without the end-of-turn token) and `answer`
the row's answer (None where it has none). The built-in verifiers give 1.0 or 0.0:

- `exact`: the completion is the answer, spaces around either aside;
- `number`: the last number in the completion equals the answer's (`"x = 42."` for `42`);
- `contains`: the answer appears in the completion.

`FILE.py:FUNCTION` loads FUNCTION from the user's FILE with `importlib`, which runs that file's
code, as running a test script would: name only files you trust. It is loaded once, at the
start of the run, by its path relative to the working folder.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import re
import sys
from collections.abc import Callable
from pathlib import Path

from llmcli.config.train import VERIFIERS
from llmcli.errors import InputError

Reward = Callable[[str, str, "str | None"], float]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact(prompt: str, completion: str, answer: str | None) -> float:
    return float(answer is not None and completion.strip() == answer.strip())


def number(prompt: str, completion: str, answer: str | None) -> float:
    found = _NUMBER.findall(completion.replace(",", ""))
    if answer is None or not found:
        return 0.0
    try:
        return float(math.isclose(float(found[-1]), float(answer.replace(",", ""))))
    except ValueError:  # an answer that is not a number: checked when the run starts
        return 0.0


def contains(prompt: str, completion: str, answer: str | None) -> float:
    return float(answer is not None and answer.strip() in completion)


BUILT_IN: dict[str, Reward] = {"exact": exact, "number": number, "contains": contains}
assert tuple(BUILT_IN) == VERIFIERS


def load_reward(spec: str) -> Reward:
    """The reward `train.reward` names: a built-in verifier, or FUNCTION of FILE.py (which this
    imports, running its code).

    Raises:
        InputError: a file that is missing or fails to import (its error named), or a name that
            is not a function of it.
    """
    if spec in BUILT_IN:
        return BUILT_IN[spec]
    file, _, name = spec.rpartition(":")
    path = Path(file).expanduser()
    if not path.is_file():
        raise InputError(
            f"train.reward: the file '{file}' does not exist (from {Path.cwd()}): give the path "
            "of your .py file, then ':' and the function's name (rewards.py:score)."
        )
    module_name = f"llmcli_reward_{path.stem}"
    loader = importlib.util.spec_from_file_location(module_name, path)
    assert loader is not None and loader.loader is not None
    module = importlib.util.module_from_spec(loader)
    try:
        sys.modules[module_name] = module  # dataclasses and pickling look a module up there
        loader.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 (the user's code: any error is theirs to fix)
        raise InputError(
            f"train.reward: importing '{file}' failed: {type(exc).__name__}: {exc}"
        ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        defined = sorted(
            n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
        )
        raise InputError(
            f"train.reward: '{file}' has no function {name!r} (it defines: "
            f"{', '.join(defined) or 'none'})."
        )
    return fn


def score(reward: Reward, prompt: str, completion: str, answer: str | None, where: str) -> float:
    """`reward`'s score of one completion, as a float.

    Raises:
        InputError: the reward raised, or gave something that is not a finite number; the
            message names the prompt's row and the completion.
    """
    try:
        value = reward(prompt, completion, answer)
    except Exception as exc:  # noqa: BLE001 (the user's code)
        raise InputError(
            f"train.reward raised {type(exc).__name__}: {exc}, scoring the completion "
            f"{completion!r} of the prompt at {where}."
        ) from None
    if not isinstance(value, numbers.Real) or not math.isfinite(value):  # True counts as 1
        raise InputError(
            f"train.reward gave {value!r}, not a finite number, for the completion "
            f"{completion!r} of the prompt at {where}: return an int or a float."
        )
    return float(value)
