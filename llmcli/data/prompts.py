"""Prompts with answers (`data.format: prompts`), what GRPO samples completions for and rewards.

A row is `{"prompt": ..., "answer": ...}`, one per line of a `.jsonl` file (or a folder or a
glob of them): the prompt is text, or a conversation (a list of `{role, content}` messages
ending with the user's turn) rendered through the `train.init_from` run's chat template with
the start of the assistant's reply, as `llmcli chat` renders it. The answer is what a built-in
verifier checks a completion against (`llmcli.objectives.rewards`); a reward function of your own
may do without it (`null`, or no `answer` key). Other keys are kept out of the way.

The prompts are encoded once, in memory, like preference pairs: a prompt that leaves no room
for a completion in the context (`model.context_length` tokens) is skipped and counted.
`PromptSampler` draws `train.batch_size` prompts a micro-batch, with its own generator, and a
seed for the completions' draws: both are in its state, so a resumed run samples the
completions an uninterrupted one would.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from llmcli.data.chat_template import ChatTemplate
from llmcli.data.conversations import ConversationEncoder, Messages, check_messages, read_jsonl_rows
from llmcli.data.corpus import resolve_files, rows_to_train, skipped_rows_note
from llmcli.data.prepared import PromptData, PromptSplit, TokenData
from llmcli.data.row_sampler import RowSampler
from llmcli.data.tokenizer import Tokenizer
from llmcli.errors import InputError
from llmcli.progress import counted

if TYPE_CHECKING:
    from pathlib import Path

    from llmcli.config import DataConfig

log = logging.getLogger(__name__)

SHAPE = '"prompt" (text, or a list of {role, content} messages) and "answer"'


@dataclass(frozen=True)
class PromptRow:
    """One checked row; `where` names it ("prompts.jsonl line 4")."""

    prompt: str | Messages
    answer: str | None
    where: str


def check_prompt_row(row: Mapping[str, Any], where: str) -> PromptRow:
    """A row's prompt (text, or messages that end with the user's turn) and answer (text, a
    number written as text, or None).

    Raises:
        InputError: a prompt that is neither, or an answer that is not text or a number.
    """
    prompt, answer = row["prompt"], row.get("answer")
    if isinstance(prompt, list):
        prompt = check_messages(prompt, where, complete=False, field="prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise InputError(f"{where}: a row's prompt must be text or a list of messages.")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float | type(None)):
        raise InputError(f"{where}: a row's answer must be text, a number or null.")
    return PromptRow(prompt, None if answer is None else str(answer), where)


def read_prompt_rows(path: Path) -> Iterator[PromptRow]:
    """Each row of a JSONL file of prompts, checked.

    Raises:
        InputError: a line that is not such a row, naming the file and line.
    """
    for row, where in read_jsonl_rows(path, ("prompt",), SHAPE):
        yield check_prompt_row(row, where)


class PromptEncoder:
    """Encodes prompts with a run's tokenizer, and its chat template for conversations.

    Args:
        tokenizer: the run's (with the chat tokens, when there is a template).
        template: the run's chat template; None: text prompts only.

    Raises (at construction):
        InputError: a tokenizer without an end-of-text token for text prompts and no template.
    """

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate | None) -> None:
        self.tokenizer = tokenizer
        self.chat = ConversationEncoder(template, tokenizer) if template is not None else None
        end_id = self.chat.end_id if self.chat is not None else tokenizer.eot_id
        if end_id is None:
            raise InputError(
                "the run's tokenizer has no end-of-text token to end a completion with: start "
                "GRPO from a run trained since llmcli added one, or from a chat run."
            )
        self.end_id: int = end_id
        # every token that ends a completion (the first, `end_id`, also pads the rows)
        self.end_ids = self.chat.reply_end_ids if self.chat is not None else (end_id,)

    def encode(self, row: PromptRow) -> tuple[list[int], str]:
        """A prompt's ids and its text as a reward function reads it."""
        if isinstance(row.prompt, str):
            return self.tokenizer.encode(row.prompt), row.prompt
        if self.chat is None:
            raise InputError(
                f"{row.where}: a conversational prompt needs a chat template, and the run it is "
                "encoded for (GRPO's train.init_from) has none: use a chat run, or give text "
                "prompts."
            )
        return self.chat.prompt(row.prompt), self.chat.render(row.prompt, True).text


def encode_prompts(
    rows: list[PromptRow], encoder: PromptEncoder, context_length: int
) -> PromptSplit:
    """The rows encoded, those whose prompt leaves at least one token of the context for a
    completion kept (the others counted as skipped)."""
    ids, answers, texts, where, skipped_at = [], [], [], [], []
    for row in rows:
        tokens, text = encoder.encode(row)
        if len(tokens) >= context_length:
            skipped_at.append(row.where)
            continue
        ids.append(np.asarray(tokens, dtype=np.int64))
        answers.append(row.answer)
        texts.append(text)
        where.append(row.where)
    counts = {"prompts": len(rows), "kept": len(ids), "skipped": len(rows) - len(ids)}
    return PromptSplit(ids, answers, texts, where, counts, skipped_at)


def _read(spec: str, key: str) -> list[PromptRow]:
    files = resolve_files(spec, key, suffix=".jsonl", what="JSONL")
    rows = [row for path in files for row in read_prompt_rows(path)]
    if not rows:
        raise InputError(f"{key} ({spec!r}) holds no prompts: add some.")
    return rows


def prepare_prompt_data(
    data_cfg: DataConfig, context_length: int, tokenizer: Tokenizer, template: ChatTemplate | None
) -> PromptData:
    """Read the prompts of `data.path` (and `data.val_path`, else the last `data.val_fraction`
    of them), encode them with the run's tokenizer and template and keep those that fit.

    Raises:
        InputError: a missing or empty source, a malformed row (file and line), too few prompts
            to hold some out, a split whose prompts were all skipped.
    """
    if data_cfg.path is None:
        raise InputError(
            "data.format prompts reads .jsonl files: set data.path (data.dataset is not read "
            "for prompts yet)."
        )
    encoder = PromptEncoder(tokenizer, template)
    train_rows = _read(data_cfg.path, "data.path")
    if data_cfg.val_path is not None:
        val_rows = _read(data_cfg.val_path, "data.val_path")
    else:
        label = f"data.path ({data_cfg.path!r})"
        n_train = rows_to_train(len(train_rows), data_cfg.val_fraction, label, "prompts")
        train_rows, val_rows = train_rows[:n_train], train_rows[n_train:]
    splits = [encode_prompts(rows, encoder, context_length) for rows in (train_rows, val_rows)]
    why = (
        f"they fill model.context_length ({counted(context_length, 'token')}), leaving no "
        "room for a completion"
    )
    fix = "To learn from them, raise model.context_length or shorten them."
    for name, split in zip(("train", "validation"), splits, strict=True):
        note = skipped_rows_note(name, ("prompt", "prompts"), split.skipped_at, why, fix)
        if len(split) == 0:
            raise InputError(f"nothing left to learn from: {note}")
        if note:
            log.warning("%s", note)
    train, val = splits
    log.info("prompts: %s to train on, %s to validate on", f"{len(train):,}", f"{len(val):,}")
    return PromptData(train, val, encoder.end_ids, template)


def prompt_token_data(
    data_cfg: DataConfig, context_length: int, tokenizer: Tokenizer, template: ChatTemplate | None
) -> TokenData:
    """`prepare_prompt_data`'s prompts as the run's `TokenData` (its `prompts`; no token
    stream), their `source_hash` the sha256 of both splits' prompt ids and answers."""
    prompts = prepare_prompt_data(data_cfg, context_length, tokenizer, template)
    digest = hashlib.sha256()
    for split in (prompts.train, prompts.val):
        for ids, answer in zip(split.ids, split.answers, strict=True):
            digest.update(ids.tobytes())
            digest.update(repr(answer).encode("utf-8"))
    empty = np.zeros(0, dtype=np.int64)
    return TokenData(tokenizer, empty, empty, digest.hexdigest(), prompts=prompts)


@dataclass(frozen=True)
class PromptBatch:
    """What a GRPO micro-batch works on: B prompts of a split (`picks`), and the seed of their
    completions' draws."""

    split: PromptSplit
    picks: list[int]
    seed: int

    @property
    def prompts(self) -> list[list[int]]:
        return [self.split.ids[k].tolist() for k in self.picks]


class PromptSampler(RowSampler):
    """Random batches of prompts, drawn with the sampler's own generator, each with a seed for
    its completions (drawn from the same generator, so both are in the saved state).

    Args:
        split: the split's prompts.
        batch_size: B, prompts per batch.
        seed, rank, world_size: as `BatchSampler`'s.
    """

    def __init__(
        self, split: PromptSplit, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        if len(split) == 0:
            raise InputError("the split has no prompt to draw from.")
        super().__init__(batch_size, seed, rank, world_size)
        self.split = split

    def next(self) -> PromptBatch:
        picks = self.draw(len(self.split))
        seed = int(torch.randint(2**62, (1,), generator=self.generator))
        self.batches += 1
        return PromptBatch(self.split, picks, seed)
