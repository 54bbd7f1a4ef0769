"""What preparing the data gives, and where it lives: the token cache's folder and the splits.

`TokenData` is what `llmcli.data.tokens.prepare_data` returns: the train and validation ids as
memory maps of the cache's token files, with the tokenizer and the key of the sources; for
conversations (`data.format: chat`, `llmcli.data.chat`) also `ChatData`, each split's loss mask
and windows; for preference pairs (`data.format: preference`, `llmcli.data.preference_data`)
`PreferenceData`. The cache folder is the `cache_dir` argument, else `data.cache_dir`, else
llmcli's (`llmcli.cache.default_cache_dir`: `$LLMCLI_CACHE`, else `$XDG_CACHE_HOME/llmcli`,
else `~/.cache/llmcli`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmcli.data.chat_template import ChatTemplate
from llmcli.data.tokenizer import Tokenizer
from llmcli.errors import InputError
from llmcli.fileio import JSONFileError, read_json


def cache_folder(cache: Path) -> Path:
    """`cache`, with its `tokens/` folder, made if missing."""
    cache = cache.expanduser()
    try:
        (cache / "tokens").mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(
            f"cannot create the token cache folder {str(cache)!r} ({exc.strerror}): set "
            "data.cache_dir or $LLMCLI_CACHE to a writable folder."
        ) from None
    return cache


def read_cache_json(path: Path) -> dict | None:
    """A cache file's JSON object, or None for one that is missing or damaged (only a cache)."""
    try:
        data = read_json(path)
    except JSONFileError:
        return None
    return data if isinstance(data, dict) else None


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclass
class ChatSplit:
    """One split's conversations as windows of its token file.

    Attributes:
        tokens: `(N,)` uint16/uint32 ids of the split's conversations, one after another.
        mask: `(N,)` uint8, 1 on the tokens the model is trained to write.
        starts: `(K,)` int64, the first token of each window (a conversation's first).
        lengths: `(K,)` int64, each window's tokens (at most `context_length + 1`).
        counts: `conversations`, and of them `kept` whole, `truncated` at a turn's end and
            `skipped` (no assistant turn ends within the window).
        skipped_rows: the split's rows (0-based) left out, for messages that name them.
    """

    tokens: np.ndarray
    mask: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    counts: dict[str, int]
    skipped_rows: list[int] = field(default_factory=list)


@dataclass
class ChatData:
    """What `TokenData.chat` holds for conversation data: the template, both splits' windows,
    and the id that pads a window after its conversation (the end-of-turn token)."""

    template: ChatTemplate
    train: ChatSplit
    val: ChatSplit
    pad_id: int

    def counts(self) -> dict[str, dict[str, int]]:
        """Each split's conversation counts (for meta.json)."""
        return {"train": self.train.counts, "val": self.val.counts}


@dataclass
class PreferenceSplit:
    """A split's pairs that fit, as flat arrays.

    `chosen` and `rejected` hold each pair's whole sequence (prompt then completion), pair i at
    `chosen[chosen_offsets[i]:chosen_offsets[i + 1]]` (likewise rejected); `prompt_lengths[i]`
    is how many of its first tokens are the prompt. `counts`: pairs, kept, truncated, skipped.
    `where` names each kept pair's row ("prefs.jsonl line 4") and `truncated` says whether its
    completions were cut; `skipped_at` names the rows left out.
    """

    chosen: np.ndarray  # (N_c,) int64
    chosen_offsets: np.ndarray  # (P + 1,) int64
    rejected: np.ndarray  # (N_r,) int64
    rejected_offsets: np.ndarray  # (P + 1,) int64
    prompt_lengths: np.ndarray  # (P,) int64
    counts: dict[str, int]
    where: list[str] = field(default_factory=list)  # (P,)
    truncated: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))  # (P,)
    skipped_at: list[str] = field(default_factory=list)
    # DPO's reference scores of each pair's chosen and rejected completion, (P, 2) float32,
    # once computed (`llmcli.objectives.dpo.score_pairs_once`); None: scored in each step.
    reference_logps: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.prompt_lengths)


@dataclass
class PreferenceData:
    """Both splits, the id that pads a batch's rows after their ends, and the chat template
    the pairs were encoded with (None: text rows only)."""

    train: PreferenceSplit
    val: PreferenceSplit
    pad_id: int
    template: ChatTemplate | None = None

    def counts(self) -> dict[str, dict[str, int]]:
        """Each split's pair counts (for meta.json): pairs, kept, truncated, skipped."""
        return {"train": self.train.counts, "val": self.val.counts}


@dataclass
class PromptSplit:
    """A split's prompts that fit, for GRPO: each prompt's ids (`ids[i]`, int64, what the model
    reads before its completion), the answer its reward checks against (None where the row
    gives none), its text as the reward reads it (the rendered conversation or the text) and
    its row ("prompts.jsonl line 4"). `counts`: prompts, kept, skipped (no room left in the
    context for a completion); `skipped_at` names the rows left out."""

    ids: list[np.ndarray]
    answers: list[str | None]
    texts: list[str]
    where: list[str]
    counts: dict[str, int]
    skipped_at: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.ids)

    def first(self, n: int) -> PromptSplit:
        """The split's first `n` prompts (all of them when it holds fewer)."""
        return PromptSplit(
            self.ids[:n], self.answers[:n], self.texts[:n], self.where[:n], self.counts
        )


@dataclass
class PromptData:
    """Both splits of GRPO's prompts, the tokens that end a completion (the chat template's end
    of turn, then the end-of-text token where there is one; for text prompts the end-of-text
    token alone), and the template the prompts were rendered with (None: text prompts only)."""

    train: PromptSplit
    val: PromptSplit
    end_ids: tuple[int, ...]
    template: ChatTemplate | None = None

    @property
    def end_id(self) -> int:
        """The first end token: the one that pads a batch's rows after their ends."""
        return self.end_ids[0]

    def counts(self) -> dict[str, dict[str, int]]:
        """Each split's prompt counts (for meta.json): prompts, kept, skipped."""
        return {"train": self.train.counts, "val": self.val.counts}


@dataclass
class TokenData:
    """Tokenized train and validation streams, memory-mapped from the token cache.

    Attributes:
        tokenizer: the tokenizer that produced the ids.
        train: `(N_train,)` uint16/uint32 `np.memmap` of token ids.
        val: `(N_val,)` uint16/uint32 `np.memmap` of token ids.
        source_hash: sha256 of the source text (training and validation), tokenizer aside.
        cache_files: the token files the arrays map.
        tokenizer_training: how the tokenizer was made: `kind` (char, bpe, given), and for a
            trained one `vocab_size`, `trained_on_bytes`, `corpus_bytes` (None: a stream's, not
            known ahead) and `sample` (`data.tokenizer_sample`, or None: the whole corpus);
            None for a tokenizer passed in (a resumed run's).
        text_bytes: the sources' UTF-8 text (None: a stream's, not counted).
        chat: with `data.format: chat`, each split's mask and windows; None for plain text.
        preference: with `data.format: preference`, each split's encoded pairs (`train` and
            `val` then hold no tokens); else None.
        prompts: with `data.format: prompts`, each split's encoded prompts (likewise); else
            None.
    """

    tokenizer: Tokenizer
    train: np.ndarray
    val: np.ndarray
    source_hash: str
    cache_files: list[Path] = field(default_factory=list)
    tokenizer_training: dict | None = None
    text_bytes: int | None = None
    chat: ChatData | None = None
    preference: PreferenceData | None = None
    prompts: PromptData | None = None
