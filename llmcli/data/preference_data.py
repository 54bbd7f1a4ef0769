"""Preference data (`data.format: preference`): JSONL preference pairs to the padded batches DPO
trains on.

The pairs are read from `data.path` (a `.jsonl` file, a folder of `.jsonl` files or a glob,
resolved as chat data's files are) or `data.dataset` (a `datasets` source with `chosen` and
`rejected` columns, and `prompt` unless it is implicit), and encoded with the tokenizer and chat
template of the run DPO starts from (`llmcli.data.preferences.PreferenceEncoder`). The
validation split is `data.val_path` (or `data.val_split`), else the last `data.val_fraction` of
the pairs.

A pair is two sequences, the prompt then each completion, and both must fit one window of
`context_length + 1` tokens (the model reads the first `context_length`, and each position's
logits score the next token, as chat windows are). A longer pair keeps its prompt whole and has
both completions cut to the room left (truncated, as TRL's `max_completion_length` cuts them);
it is skipped when the prompt leaves no room for a completion token, or when the cut leaves the
two completions the same (no preference left to learn).

The encoded pairs are kept in memory, not in the token cache that chat data writes: preference
sets are small (thousands of pairs) and encoding them takes seconds. A cache like
`llmcli.data.chat`'s is the next step if sets grow.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmcli.cache import default_cache_dir
from llmcli.data.chat_template import ChatTemplate
from llmcli.data.corpus import _load_dataset, resolve_files, rows_to_train, skipped_rows_note
from llmcli.data.preferences import (
    SHAPE,
    EncodedPair,
    Preference,
    PreferenceEncoder,
    check_preference,
    read_preferences,
)
from llmcli.data.prepared import (
    PreferenceData,
    PreferenceSplit,
    TokenData,
    cache_folder,
)
from llmcli.data.row_sampler import RowSampler
from llmcli.data.tokenizer import Tokenizer
from llmcli.errors import InputError
from llmcli.progress import counted

if TYPE_CHECKING:
    from llmcli.config import DataConfig

log = logging.getLogger(__name__)


def fit_pair(pair: EncodedPair, limit: int) -> tuple[EncodedPair | None, str]:
    """`pair` within `limit` tokens per sequence, and what was done: "kept", "truncated" (both
    completions cut to the room the prompt leaves) or "skipped" (None: no room, or the cut
    completions are the same)."""
    room = limit - len(pair.prompt)
    if len(pair.chosen) <= room and len(pair.rejected) <= room:
        return pair, "kept"
    if room < 1:
        return None, "skipped"
    chosen, rejected = pair.chosen[:room], pair.rejected[:room]
    if np.array_equal(chosen, rejected):
        return None, "skipped"
    return EncodedPair(pair.prompt, chosen, rejected), "truncated"


def encode_split(
    pairs: Iterable[Preference], encoder: PreferenceEncoder, context_length: int
) -> PreferenceSplit:
    """The pairs encoded and fitted to windows of `context_length + 1` tokens (`fit_pair`).

    Raises:
        InputError: what `PreferenceEncoder.encode` refuses, naming the row.
    """
    counts = {"pairs": 0, "kept": 0, "truncated": 0, "skipped": 0}
    chosen: list[np.ndarray] = []
    rejected: list[np.ndarray] = []
    prompts: list[int] = []
    where: list[str] = []
    truncated: list[bool] = []
    skipped_at: list[str] = []
    for pair in pairs:
        counts["pairs"] += 1
        fitted, outcome = fit_pair(encoder.encode(pair), context_length + 1)
        counts[outcome] += 1
        if fitted is None:
            skipped_at.append(pair.where)
            continue
        chosen.append(np.concatenate([fitted.prompt, fitted.chosen]))
        rejected.append(np.concatenate([fitted.prompt, fitted.rejected]))
        prompts.append(len(fitted.prompt))
        where.append(pair.where)
        truncated.append(outcome == "truncated")
    return PreferenceSplit(
        *_flat(chosen),
        *_flat(rejected),
        np.asarray(prompts, dtype=np.int64),
        counts,
        where,
        np.asarray(truncated, dtype=bool),
        skipped_at,
    )


def _flat(rows: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows], dtype=np.int64)
    ids = np.concatenate(rows).astype(np.int64) if rows else np.zeros(0, dtype=np.int64)
    return ids, offsets


def read_pairs(data_cfg: DataConfig) -> tuple[list[Preference], list[Preference] | None]:
    """The training pairs and the separate validation ones (None: the last `val_fraction` of
    the training ones are held out), from JSONL files (`data.path`, `data.val_path`) or a
    `datasets` source (`data.dataset` with `data.split`, and `data.val_split` or
    `data.val_path`), read as chat data's conversations are.

    Raises:
        InputError: a missing or empty source, a malformed row (its file and line, or its
            dataset row).
    """
    if data_cfg.path is not None:
        if data_cfg.val_split is not None:
            raise InputError(
                f"data.val_split ({data_cfg.val_split!r}) applies to data.dataset only; with "
                "data.path give a separate validation file as data.val_path."
            )
        val = _read_files(data_cfg.val_path, "data.val_path") if data_cfg.val_path else None
        return _read_files(data_cfg.path, "data.path"), val
    assert data_cfg.dataset is not None  # DataConfig.validate: one of them is set
    cache = cache_folder(Path(data_cfg.cache_dir or default_cache_dir()))
    train = _read_dataset(data_cfg.dataset, data_cfg.split, "data.dataset", cache)
    if data_cfg.val_path is None and data_cfg.val_split is None:
        return train, None
    spec = data_cfg.val_path or data_cfg.dataset
    key = "data.val_path" if data_cfg.val_path else "data.dataset"
    return train, _read_dataset(spec, data_cfg.val_split or data_cfg.split, key, cache)


def _read_files(spec: str, key: str) -> list[Preference]:
    files = resolve_files(spec, key, suffix=".jsonl", what="JSONL")
    return _some([pair for path in files for pair in read_preferences(path)], f"{key} ({spec!r})")


def _read_dataset(spec: str, split: str, key: str, cache: Path) -> list[Preference]:
    """The rows of a `datasets` source's split, each checked as a JSONL line is."""
    dataset = _load_dataset(spec, split, key, cache)
    label = f"{key} ({spec!r}, split {split!r})"
    if not {"chosen", "rejected"} <= set(dataset.column_names):
        raise InputError(
            f"{label} has no 'chosen' and 'rejected' columns (its columns are: "
            f"{', '.join(dataset.column_names)}): data.format preference reads rows of {SHAPE}."
        )
    rows = (check_preference(row, f"{label} row {i}") for i, row in enumerate(dataset))
    return _some(list(rows), label)


def _some(pairs: list[Preference], label: str) -> list[Preference]:
    if not pairs:
        raise InputError(f"{label} holds no preference pairs: add some.")
    return pairs


def _describe(name: str, counts: dict[str, int]) -> str:
    return (
        f"{name} {counted(counts['pairs'], 'pair')}: {counts['kept']:,} kept, "
        f"{counts['truncated']:,} with their completions cut, {counts['skipped']:,} skipped"
    )


def prepare_preference_data(
    data_cfg: DataConfig,
    context_length: int,
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
) -> PreferenceData:
    """Read the pairs of `data.path` (and `data.val_path`), encode them with the run's tokenizer
    and chat template (the `train.init_from` run's; None: text rows only) and fit them to
    `context_length`.

    Raises:
        InputError: a missing or empty source; a malformed row (file and line); a row the
            encoder refuses; too few pairs to hold out `val_fraction`; a split whose pairs were
            all skipped.
    """
    encoder = PreferenceEncoder(tokenizer, template)
    train_pairs, val_pairs = read_pairs(data_cfg)
    if val_pairs is None:
        label = f"data.path ({data_cfg.path!r})"
        n_train = rows_to_train(len(train_pairs), data_cfg.val_fraction, label, "preference pairs")
        train_pairs, val_pairs = train_pairs[:n_train], train_pairs[n_train:]
    train = encode_split(train_pairs, encoder, context_length)
    val = encode_split(val_pairs, encoder, context_length)
    why = (
        "too long: within model.context_length + 1 "
        f"({counted(context_length + 1, 'token')}) the prompt leaves no room for a completion, "
        "or the completions cut to fit are the same"
    )
    fix = "To learn from them, raise model.context_length or shorten their prompts."
    for name, split in (("train", train), ("validation", val)):
        note = skipped_rows_note(name, ("pair", "pairs"), split.skipped_at, why, fix)
        if len(split) == 0:
            raise InputError(f"nothing left to learn from: {note}")
        if note:
            log.warning("%s", note)
    log.info(
        "preference data: %s; %s",
        _describe("train", train.counts),
        _describe("validation", val.counts),
    )
    return PreferenceData(train, val, encoder.pad_id, template)


def preference_token_data(
    data_cfg: DataConfig,
    context_length: int,
    tokenizer: Tokenizer,
    template: ChatTemplate | None,
) -> TokenData:
    """`prepare_preference_data`'s pairs as the run's `TokenData` (its `preference`; no token
    stream), their `source_hash` the sha256 of the encoded pairs of both splits."""
    pairs = prepare_preference_data(data_cfg, context_length, tokenizer, template)
    digest = hashlib.sha256()
    for split in (pairs.train, pairs.val):
        for ids in (split.chosen, split.chosen_offsets, split.rejected, split.rejected_offsets):
            digest.update(ids.tobytes())
        digest.update(split.prompt_lengths.tobytes())
    empty = np.zeros(0, dtype=np.int64)
    return TokenData(tokenizer, empty, empty, digest.hexdigest(), preference=pairs)


def pair_batch(
    split: PreferenceSplit, picks: Sequence[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs `picks` of `split` as one batch: `ids` `(2B, L)` int64 and `completion_mask`
    `(2B, L)` bool, True on each completion's tokens; rows `:B` are the chosen sequences, `B:`
    the rejected ones (row i and row B + i are pair `picks[i]`), each padded with `pad_id`
    after its end to the batch's longest sequence."""
    B = len(picks)
    halves = ((split.chosen, split.chosen_offsets), (split.rejected, split.rejected_offsets))
    length = max(int(np.diff(offsets)[list(picks)].max()) for _, offsets in halves)
    ids = np.full((2 * B, length), pad_id, dtype=np.int64)  # (2B, L)
    mask = np.zeros(ids.shape, dtype=bool)  # (2B, L)
    for half, (tokens, offsets) in enumerate(halves):
        for i, k in enumerate(picks):
            row, start, stop = half * B + i, offsets[k], offsets[k + 1]
            ids[row, : stop - start] = tokens[start:stop]
            mask[row, split.prompt_lengths[k] : stop - start] = True
    return torch.from_numpy(ids), torch.from_numpy(mask)


def pair_positions(split: PreferenceSplit, picks: Sequence[int]) -> int:
    """The positions the model reads of pairs `picks`' rows, padding left out: each sequence's
    length - 1, its last token being only a target."""
    halves = (split.chosen_offsets, split.rejected_offsets)
    return sum(int((np.diff(offsets)[list(picks)] - 1).sum()) for offsets in halves)


class PreferenceSampler(RowSampler):
    """Random batches of preference pairs, drawn with the sampler's own generator.

    Each batch is B pairs as `2B` rows, the chosen sequences then the rejected ones in the same
    order (row i and row B + i are pair i), each padded to the batch's longest sequence (at most
    `context_length + 1` tokens: padding after a sequence's end changes none of its scores under
    the causal mask, so a longer row would only cost time): what `llmcli.objectives.dpo`
    scores. Its state is saved and loaded as `BatchSampler`'s, so a resumed run sees the
    batches an uninterrupted one would.

    Args:
        split: the split's pairs (`PreferenceSplit`).
        pad_id: the id after a sequence's end (never in the completion mask).
        batch_size: B, pairs per batch.
        context_length, seed, rank, world_size, device: as `BatchSampler`'s.
    """

    def __init__(
        self,
        split: PreferenceSplit,
        pad_id: int,
        batch_size: int,
        context_length: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        if len(split) == 0:
            raise InputError("the split has no preference pair to draw from.")
        super().__init__(batch_size, seed, rank, world_size)
        self.split, self.pad_id = split, pad_id
        self.context_length = context_length
        self.device = torch.device(device)

    def next(self) -> tuple[torch.Tensor, ...]:
        """The next batch: `ids` `(2B, L)` int64 and `completion_mask` `(2B, L)` bool, True on
        each completion's tokens, `L` the batch's longest sequence; rows `:B` are the chosen
        sequences, `B:` the rejected. When the split holds the reference's scores, they follow:
        `(2B,)` float32, in row order."""
        picks = self.draw(len(self.split))
        ids, mask = pair_batch(self.split, picks, self.pad_id)
        self.batches += 1
        self.tokens_drawn += pair_positions(self.split, picks)
        batch = [ids.to(self.device), mask.to(self.device)]
        if self.split.reference_logps is not None:
            scores = torch.from_numpy(self.split.reference_logps[picks])  # (B, 2)
            batch.append(scores.T.reshape(-1).to(self.device))  # (2B,): chosen, then rejected
        return tuple(batch)
