"""What the logit lens, activation patching and direct logit attribution share.

Each of them loads a run on its device (`RunOptions`, `open_run`), reads a prompt as one token
sequence that must fit the context as given (`encode_text`), records activations at hook points
in one forward (`record`) and writes a JSON file and pictures into an output folder
(`output_folder`, `writing_into`). Patching and attribution also read the model's answer at the
last position (`AnswerMetric`): the logit of `--answer` minus that of `--wrong`, or, without
`--wrong`, the log-prob of `--answer` (patching) / the logit of `--answer` (attribution, which
needs a quantity linear in the residual stream).

Shapes: `B` batch, `T` tokens, `C` channels, `V` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from llmcli.device import resolve_device
from llmcli.errors import InputError, describe_os_error
from llmcli.fileio import atomic_write_json
from llmcli.generation.prompts import encode_prompt
from llmcli.runs.loading import LoadedRun, load_run


@dataclass(frozen=True)
class RunOptions:
    """Which run a command reads, and where its results go.

    Attributes:
        checkpoint: a run directory (or a weights file in one); None takes the latest run.
        weights: "best" or "last".
        device: "auto", "cpu", "cuda" or "mps".
        out_dir: the output folder; None for the command's folder inside the run.
    """

    checkpoint: Path | None = None
    weights: str = "best"
    device: str = "auto"
    out_dir: Path | None = None


def open_run(options: RunOptions, notify: Callable[[str], Any]) -> LoadedRun:
    """Load the run `options` names on its device (`notify` hears which when none is named)."""
    device = resolve_device(options.device, what="--device")
    run = load_run(options.checkpoint, weights=options.weights, device=device, notify=notify)
    return run


def encode_text(tokenizer: Any, text: str, context_length: int, what: str) -> list[int]:
    """The token ids of `text` as given: neither empty nor longer than the context.

    Args:
        tokenizer: the run's tokenizer.
        text: the prompt.
        context_length: the model's context length.
        what: how messages name the prompt, e.g. "--prompt".

    Raises:
        InputError: an empty prompt, one longer than the context (both lengths named) or one
            with text outside the vocabulary.
    """
    # A lens or a patch of a cropped text would not be of the text given: refused.
    fix = f"shorten it to at most {context_length} tokens."
    ids, _ = encode_prompt(
        tokenizer, text, context_length, empty="error", too_long="error", label=what, fix=fix
    )
    return ids


def token_texts(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """Each token's own text, for labels."""
    return [tokenizer.decode([i]) for i in ids]


def one_token(tokenizer: Any, text: str, what: str) -> int:
    """The id of the one token `text` is.

    Raises:
        InputError: `text` is not exactly one token (its tokens shown).
    """
    ids = list(tokenizer.encode(text))
    if len(ids) != 1:
        shown = ", ".join(repr(t) for t in token_texts(tokenizer, ids)) or "none"
        raise InputError(
            f"{what} must be exactly one token, but {text!r} is {len(ids)} tokens ({shown}): "
            "give the text of one token."
        )
    return ids[0]


@dataclass(frozen=True)
class AnswerMetric:
    """The model's answer at the last position, as one number per row.

    With `wrong`: the logit of `answer` minus the logit of `wrong`. Without: the log-prob of
    `answer` (`__call__`), or its logit where a quantity linear in the residual stream is needed
    (`logit_value`, `direction`).

    Attributes:
        answer, wrong: token ids (`wrong` may be None).
        answer_text, wrong_text: their texts, for messages and files.
    """

    answer: int
    wrong: int | None = None
    answer_text: str = ""
    wrong_text: str | None = None

    @classmethod
    def from_texts(cls, tokenizer: Any, answer: str, wrong: str | None = None) -> AnswerMetric:
        """Read `--answer` and `--wrong` as one token each (see `one_token`).

        Raises:
            InputError: either is not one token, or both are the same token.
        """
        a = one_token(tokenizer, answer, "--answer")
        w = None if wrong is None else one_token(tokenizer, wrong, "--wrong")
        if a == w:
            raise InputError(
                f"--answer and --wrong are the same token ({answer!r}): the logit difference "
                "would be 0 whatever the prompt; give two different tokens."
            )
        return cls(a, w, answer, wrong)

    @property
    def name(self) -> str:
        """What `__call__` measures: "logit_diff" or "logprob"."""
        return "logprob" if self.wrong is None else "logit_diff"

    def describe(self) -> str:
        """The metric in words, e.g. `logit('a') - logit('b')`."""
        if self.wrong is None:
            return f"log p({self.answer_text!r})"
        return self.describe_linear()

    def describe_linear(self) -> str:
        """`logit_value` in words, e.g. `logit('a') - logit('b')` or `logit('a')`."""
        if self.wrong is None:
            return f"logit({self.answer_text!r})"
        return f"logit({self.answer_text!r}) - logit({self.wrong_text!r})"

    def __call__(self, logits: Tensor) -> Tensor:
        """`(B, V)` last-position logits -> `(B,)`: the logit difference, or the log-prob."""
        if self.wrong is None:
            return torch.log_softmax(logits.float(), dim=-1)[:, self.answer]
        return self.logit_value(logits)

    def logit_value(self, logits: Tensor) -> Tensor:
        """`(B, V)` -> `(B,)`: logit of `answer` minus that of `wrong` (or the logit alone)."""
        value = logits[:, self.answer].float()
        return value if self.wrong is None else value - logits[:, self.wrong].float()

    def direction(self, unembed: Tensor) -> Tensor:
        """The LM head's direction for `logit_value`: `(V, C)` weight -> `(C,)`, so that
        `logit_value` = `direction @ final_norm_output`."""
        d = unembed[self.answer]
        return d if self.wrong is None else d - unembed[self.wrong]

    def to_dict(self) -> dict[str, Any]:
        return {"answer": self.answer_text, "wrong": self.wrong_text, "metric": self.name}


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _store(acts: dict[str, Tensor], name: str, act: Tensor) -> None:
    acts[name] = act


@torch.no_grad()
def record(
    model: torch.nn.Module, ids: Tensor, names: Sequence[str]
) -> tuple[dict[str, Tensor], Tensor]:
    """One forward of `ids` `(B, T)`, keeping the activation at each hook point in `names`.

    Returns:
        `(name -> activation, logits (B, T, V))`.
    """
    acts: dict[str, Tensor] = {}
    with model.hooks({name: partial(_store, acts, name) for name in names}):
        logits, _ = model(ids)
    return acts, logits


def output_folder(options: RunOptions, run: LoadedRun, name: str) -> Path:
    """Where a command writes: `--out`, or `<run>/<name>/`."""
    return Path(options.out_dir) if options.out_dir is not None else Path(run.run_dir) / name


def refresh_pages(options: RunOptions, run: LoadedRun, notify: Callable[[str], Any]) -> list[Path]:
    """Rewrite the run's viewer pages with the result just written, where it went into the run
    (with `--out` elsewhere the pages do not see it)."""
    if options.out_dir is not None:
        return []
    from llmcli.inspection.viewer import refresh_run_pages

    return refresh_run_pages(run.run_dir, notify=notify)


@contextmanager
def writing_into(folder: Path) -> Iterator[Path]:
    """Create `folder` and yield it; a failed write becomes an `InputError` naming it (files
    are written atomically, so those written before stay whole)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(
            f"cannot create output folder {str(folder)!r}: {describe_os_error(exc)}; choose "
            "--out DIR."
        ) from None
    if not folder.is_dir():
        raise InputError(f"--out {str(folder)!r} is not a folder: choose another --out DIR.")
    try:
        yield folder
    except OSError as exc:
        raise InputError(
            f"cannot write into {str(folder)!r}: {describe_os_error(exc)}; or choose --out DIR."
        ) from None


def write_result(
    options: RunOptions,
    run: LoadedRun,
    name: str,
    stem: str,
    data: dict[str, Any],
    plot: Callable[[Path], Path],
    notify: Callable[[str], Any],
) -> list[Path]:
    """Write a command's result into its folder (`output_folder(options, run, name)`):
    `<stem>.json` holding `data` and the picture `plot` draws at `<stem>.png`; then refresh the
    run's viewer pages (`refresh_pages`).

    Returns:
        The files written: the JSON, the picture, the pages.

    Raises:
        InputError: the folder cannot be created or written into (see `writing_into`).
    """
    with writing_into(output_folder(options, run, name)) as folder:
        atomic_write_json(folder / f"{stem}.json", data)
        files = [folder / f"{stem}.json", plot(folder / f"{stem}.png")]
        files += refresh_pages(options, run, notify)
    return files
