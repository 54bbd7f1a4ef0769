"""GRPO's rewards (`train.reward`): built-in verifiers, or a function of the user's own file.

A reward scores one completion of one prompt: `reward(prompt, completion, answer) -> number`,
where `prompt` is the prompt's text as the model read it (a conversation rendered by the chat
template), `completion` the text the model wrote (without the end-of-turn token) and `answer`
the row's answer (None where it has none). The built-in verifiers give 1.0 or 0.0:

- `exact`: the completion is the answer, spaces around either aside;
- `number`: the completion's number equals the answer's (`parse_number` reads both: GSM8K's
  `#### 72`, `\\boxed{72}`, else the last number, as in `"x = 1,234."`);
- `contains`: the answer appears in the completion.

`FILE.py:FUNCTION` loads FUNCTION from the user's FILE with `importlib`, which runs that file's
code, as running a test script would: name only files you trust. It is loaded once, at the
start of the run, by its path relative to the working folder. With `train.reward_timeout` each
call runs in a thread of its own that the caller waits for at most that long: a call that runs
past it stops the run (`score` names the prompt), but the thread cannot be killed and is left
behind (a daemon, which ends with the process). A worker process could be killed, but would
import the user's file a second time and lose the state it keeps between calls. A thread costs
0.07-0.1 ms a call on the shared 2-core development machine (up to 0.7 ms under others' load;
a direct call: under 0.003 ms; a round trip to a spawned worker process: 0.04-0.06 ms): 4-7 ms
for the 64 replies of a step of the shipped example, which takes about 0.4 s.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
import re
import reprlib
import sys
import threading
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

from llmcli.config.objective_settings import VERIFIERS
from llmcli.data.prepared import PromptData
from llmcli.errors import InputError

Reward = Callable[[str, str, "str | None"], float]

# A number as people write it: a sign (ASCII or U+2212), digits in groups of three between
# commas or plain, then decimals ("-1,234.5", "7200", ".5"). It starts where no ASCII letter,
# digit or point comes before it, so neither "x2" nor "v1.5.3" is read as a number; a sign after
# a letter or digit is a hyphen or an operation ("a-3", "5-3": 3); a period after it ends a
# sentence ("x = 42.").
_NUMBER = re.compile(
    r"(?<![\w.])[-+\u2212]?(?:(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)", re.ASCII
)
_BOXED = "\\boxed{"


def parse_number(text: str) -> Fraction | None:
    """The number `text` gives as its answer, exactly (a `Fraction` of the decimal written, so
    that "72", "72.0" and "+72" are equal and no float rounding enters), or None.

    The answer is, in order: the last `\\boxed{...}`'s last number (LaTeX's convention; `x = 5`
    gives 5; a `\\frac` is not evaluated); else the first number after the last `####`
    (GSM8K's answer line, which reasoning and a closing sentence may surround); else the last
    number of the text. Commas between groups of three digits are thousands separators.
    """
    start = text.rfind(_BOXED)
    if start >= 0:
        found = _NUMBER.findall(_braced(text, start + len(_BOXED)))[-1:]
    elif "####" in text:
        found = _NUMBER.findall(text.rpartition("####")[2])[:1]
    else:
        found = _NUMBER.findall(text)[-1:]
    if not found:
        return None
    return Fraction(found[0].replace(",", "").replace("\u2212", "-"))


def _braced(text: str, start: int) -> str:
    """The text from `start` to the brace that closes the one before it (nested pairs kept),
    or to the end where it is never closed (a reply cut at its budget)."""
    depth = 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return text[start:]


def exact(prompt: str, completion: str, answer: str | None) -> float:
    return float(answer is not None and completion.strip() == answer.strip())


def number(prompt: str, completion: str, answer: str | None) -> float:
    # An answer that is no number gives 0.0 here; training refuses it before its first step.
    expected = None if answer is None else parse_number(answer)
    return float(expected is not None and parse_number(completion) == expected)


def contains(prompt: str, completion: str, answer: str | None) -> float:
    return float(answer is not None and answer.strip() in completion)


BUILT_IN: dict[str, Reward] = {"exact": exact, "number": number, "contains": contains}
assert tuple(BUILT_IN) == VERIFIERS


def load_reward(spec: str, timeout: float | None = None) -> Reward:
    """The reward `train.reward` names: a built-in verifier, or FUNCTION of FILE.py (which this
    imports, running its code), each call of which may take at most `timeout` seconds (None: no
    limit; built-in verifiers need none). A call past it raises `RewardTimeout`.

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
    except SystemExit as exc:  # a script's `sys.exit()` at import must not end the run
        raise InputError(
            f"train.reward: importing '{file}' called sys.exit({exc.code!r}): a reward file is "
            'imported, not run; put its script part under `if __name__ == "__main__":`.'
        ) from None
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
    return fn if timeout is None else _time_limited(fn, timeout)


class Rewards:
    """Several rewards and their weights, as TRL's `reward_funcs` and `reward_weights`: a
    completion's reward is the weighted sum of each function's (`total`); `scores` gives each
    function's apart, for its figures.

    Args:
        named: each reward's name (a built-in verifier's, or FUNCTION of `FILE.py:FUNCTION`) and
            function.
        weights: one per reward (TRL's default: 1.0 each).
    """

    def __init__(self, named: list[tuple[str, Reward]], weights: list[float]) -> None:
        assert len(named) == len(weights) and named
        self.names = [name for name, _ in named]
        self.functions = [fn for _, fn in named]
        self.weights = weights
        # Built-in verifiers judge only a prompt with an answer; a function of the user's any.
        self.needs_answer = all(fn in BUILT_IN.values() for fn in self.functions)

    def scores(self, prompt: str, completion: str, answer: str | None, where: str) -> list[float]:
        """Each reward's score of one completion (`score`: a failure names the prompt)."""
        return [score(fn, prompt, completion, answer, where) for fn in self.functions]

    def total(self, prompt: str, completion: str, answer: str | None, where: str) -> float:
        """One completion's reward: each function's score (checked, as `scores`), weighted."""
        parts = self.scores(prompt, completion, answer, where)
        return sum(w * part for w, part in zip(self.weights, parts, strict=True))


def load_rewards(
    specs: list[str], weights: list[float] | None = None, timeout: float | None = None
) -> Rewards:
    """The rewards `train.reward` names (one or a list), with `train.reward_weights` (None:
    1.0 each), each loaded by `load_reward`."""
    named = [(spec.rpartition(":")[2] or spec, load_reward(spec, timeout)) for spec in specs]
    return Rewards(named, weights if weights is not None else [1.0] * len(specs))


class RewardTimeout(Exception):
    """A reward call ran past its time limit (`seconds`); it is still running, in its thread."""

    def __init__(self, seconds: float) -> None:
        super().__init__(f"no result within {seconds:g} s")
        self.seconds = seconds


def _time_limited(fn: Reward, seconds: float) -> Reward:
    """`fn` called in a daemon thread that is waited for at most `seconds`: its value, or what
    it raised, or `RewardTimeout`. The thread of a call that timed out is left running (Python
    cannot stop a thread); as a daemon it does not keep the process from exiting."""

    def limited(prompt: str, completion: str, answer: str | None) -> Any:
        outcome: dict[str, Any] = {}

        def call() -> None:
            try:
                outcome["value"] = fn(prompt, completion, answer)
            except BaseException as exc:  # noqa: BLE001 (handed to the caller, which reports it)
                outcome["error"] = exc

        worker = threading.Thread(target=call, name="llmcli-reward", daemon=True)
        worker.start()
        worker.join(seconds)
        if worker.is_alive():
            raise RewardTimeout(seconds)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return limited


def score(reward: Reward, prompt: str, completion: str, answer: str | None, where: str) -> float:
    """`reward`'s score of one completion, as a float.

    Raises:
        InputError: the reward raised, ran past its time limit, or gave something that is not a
            finite number; the message names the prompt's row and the completion.
    """
    try:
        value = reward(prompt, completion, answer)
    except RewardTimeout as exc:
        raise InputError(
            f"train.reward gave no result within train.reward_timeout ({exc.seconds:g} s), "
            f"scoring the completion {completion!r} of the prompt at {where}: fix the function "
            "so that it returns, or raise train.reward_timeout (null: no limit)."
        ) from None
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


def check_rewards_on_prompts(rewards: Rewards, specs: list[str], data: PromptData) -> None:
    """`check_reward_on_prompts` for each of `train.reward`'s rewards."""
    for fn, spec in zip(rewards.functions, specs, strict=True):
        check_reward_on_prompts(fn, spec, data)


def check_reward_on_prompts(reward: Reward, spec: str, data: PromptData) -> None:
    """Before the first step: a built-in verifier has an answer to check every prompt against
    (`number`: an answer that `parse_number` reads), and the reward scores an empty completion
    of the first prompt (a function that raises, hangs or gives no number is found now, not
    after minutes of training).

    Raises:
        InputError: a prompt without an answer, or with no number for `number` (the first such
            row named, and their count), or the reward's failure.
    """
    if spec in BUILT_IN:
        for split in (data.train, data.val):
            pairs = zip(split.where, split.answers, strict=True)
            missing = [where for where, answer in pairs if answer is None]
            if missing:
                raise InputError(
                    f"{missing[0]}: the prompt has no answer for train.reward {spec!r} to check "
                    f'completions against ({len(missing)} such rows): add an "answer", or '
                    "name a reward function of your own (FILE.py:FUNCTION) that needs none."
                )
    if spec == "number":
        for split in (data.train, data.val):
            pairs = zip(split.where, split.answers, strict=True)
            bad = [(where, answer) for where, answer in pairs if parse_number(answer) is None]
            if bad:
                where, answer = bad[0]
                raise InputError(
                    f"{where}: the answer {reprlib.repr(answer)} holds no number for "
                    f"train.reward 'number' to compare replies with ({len(bad)} such rows): "
                    'give the number ("72", "1,234", "-3.5", or GSM8K\'s "... #### 72"), or '
                    "choose train.reward: exact or contains for answers that are text."
                )
    split = data.train
    score(reward, split.texts[0], "", split.answers[0], split.where[0])
