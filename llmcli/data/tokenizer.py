"""Tokenizers: characters or byte-level BPE, behind one interface, each saved as one JSON file.

Every `tokenizer.json` llmcli writes is a Hugging Face `tokenizers` file:
`tokenizers.Tokenizer.from_file(path)` loads it and encodes and decodes exactly as llmcli does
(with `add_special_tokens=False` and `skip_special_tokens=False`). Two kinds share the
`Tokenizer` protocol:

- `CharTokenizer`: one token per character of the training text, ids in sorted character order
  (nanoGPT's `shakespeare_char` vocabulary), plus `"\\n"`, which joins documents and starts an
  empty prompt, and one last id for `<|endoftext|>`, the end-of-text token that Hugging Face
  tools (`generate`, lm-evaluation-harness) need: the model learns it is never next in the
  text. Its `tokenizer.json` is a `WordLevel` model over the characters with `<|endoftext|>` as a
  special added token at the last id, a `Split` pre-tokenizer on `[\\s\\S]` (every character
  its own token, newlines included) and a `Fuse` decoder; `load_tokenizer` recognises that
  structure and gives a `CharTokenizer` back, with its vectorised `encode_array`. Runs from
  before wrote llmcli's own format, `{"kind": "llmcli-char", "version": 2, "chars": [...],
  "eot": "<|endoftext|>"}`, or version 1 (no end-of-text token): both still load as they were,
  and are written in the Hugging Face format when saved again. The trained-tokenizer cache
  (`llmcli.data.tokenizer_cache`) keeps its "char-v2" key: a cached file in the old format loads
  to a tokenizer equal to a newly trained one (same characters, same end-of-text token, same
  `to_json()`), so it is still right to reuse; only what identifies the tokenizer matters there,
  not the file's layout. (The token cache is keyed by `to_json()` itself, so a char corpus is
  tokenized once more after the change, to the same ids.)
- `BPETokenizer`: byte-level BPE trained with Hugging Face `tokenizers` (GPT-2's pre-tokenizer
  regex and byte alphabet) with one special token, `<|endoftext|>`, which joins documents. Any
  Unicode string round-trips exactly. The same class wraps any other Hugging Face
  `tokenizer.json`, used as is: `data.tokenizer` may be the path of one, a folder holding one,
  or a Hugging Face Hub name (`gpt2`, `org/name@revision`), fetched through the Hugging Face
  cache by `llmcli.hub.resolve_pretrained` (offline with `HF_HUB_OFFLINE=1` once cached).

`load_tokenizer(path)` tells the kinds apart by the file's content, so a run directory's
`tokenizer.json` is enough to encode and decode.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from llmcli.errors import InputError
from llmcli.fileio import atomic_write_text, read_user_text
from llmcli.hub import resolve_pretrained, split_hub_name

if TYPE_CHECKING:
    from llmcli.config import DataConfig

log = logging.getLogger(__name__)

EOT = "<|endoftext|>"
CHAR_KIND = "llmcli-char"  # the "kind" of llmcli's own char tokenizer files (versions 1 and 2)
# A char tokenizer in the Hugging Face format: a pre-tokenizer that isolates every character
# (`[\s\S]` matches any one, newlines included) and a decoder that joins tokens as they are.
CHAR_SPLIT_REGEX = r"[\s\S]"
_CHAR_PRE_TOKENIZER = {
    "type": "Split",
    "pattern": {"Regex": CHAR_SPLIT_REGEX},
    "behavior": "Isolated",
    "invert": False,
}
_CHAR_DECODER = {"type": "Fuse"}
_CHAR_ABSENT = ("normalizer", "post_processor", "truncation", "padding")
TOKENIZER_FILE = "tokenizer.json"
# What a Hub name given as data.tokenizer fetches (only tokenizer.json is read).
HUB_TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")
# 256 byte tokens + <|endoftext|>: the smallest byte-level BPE vocabulary (no merges at all).
MIN_BPE_VOCAB = 257
# End-of-text spellings of common Hugging Face tokenizers, tried in order for a foreign file.
_EOT_CANDIDATES = (EOT, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
_MAX_LISTED = 20  # unknown characters named in an error message before "and N more"


@runtime_checkable
class Tokenizer(Protocol):
    """What every tokenizer offers. `eot_id` is None when there is no end-of-text token."""

    vocab_size: int
    eot_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def save(self, path: str | os.PathLike) -> None: ...

    def to_json(self) -> str: ...


def _checked_ids(ids: Iterable[int], vocab_size: int, what: str) -> list[int]:
    """`ids` as ints, or an `InputError` naming the ones outside `0..vocab_size - 1`."""
    ids = [int(i) for i in ids]
    bad = sorted({i for i in ids if not 0 <= i < vocab_size})
    if bad:
        raise InputError(
            f"token ids {bad[:_MAX_LISTED]} are outside the {what} (0..{vocab_size - 1})."
        )
    return ids


def _list_chars(chars: Iterable[str]) -> str:
    chars = sorted(set(chars))
    shown = ", ".join(repr(c) for c in chars[:_MAX_LISTED])
    more = f" and {len(chars) - _MAX_LISTED} more" if len(chars) > _MAX_LISTED else ""
    return shown + more


def lacking_characters(chars: Iterable[str], what: str = "text") -> InputError:
    """The error for a `what` ("text", "conversation") holding characters that a character
    vocabulary lacks: it names them."""
    chars = set(chars)
    return InputError(
        f"the {what} holds {len(chars)} character(s) that the tokenizer's vocabulary lacks: "
        f"{_list_chars(chars)}. Remove them, or train on a corpus that has them."
    )


class CharTokenizer:
    """One token per character; ids are the characters' ranks in sorted order, then `eot`.

    Args:
        chars: the characters, any order; they are sorted and deduplicated.
        eot: the end-of-text token's text, given the id after the last character; None for
            none (a version 1 tokenizer).
    """

    def __init__(self, chars: Iterable[str], eot: str | None = EOT) -> None:
        self.chars: list[str] = sorted(set(chars))
        if not self.chars or any(len(c) != 1 for c in self.chars):
            raise InputError("a char tokenizer needs a non-empty list of single characters.")
        self.eot = eot
        self.eot_id: int | None = len(self.chars) if eot is not None else None
        self.vocab_size = len(self.chars) + (eot is not None)
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        # id -> text: a text is the concatenation of its tokens' texts.
        self.token_texts: list[str] = self.chars if eot is None else [*self.chars, eot]
        # Sorted code points, for a vectorised encode by binary search (see encode_array).
        self._codepoints = np.array([ord(c) for c in self.chars], dtype=np.uint32)

    @classmethod
    def train(cls, texts: Iterable[str]) -> CharTokenizer:
        """The characters of `texts`, plus "\\n" (the document separator and empty prompt)."""
        chars = {"\n"}
        for text in texts:
            chars.update(text)
        return cls(chars)

    def encode_array(self, text: str) -> np.ndarray:
        """Encode to an int64 array, one id per character; fast (vectorised) for long texts.

        The end-of-text token's text, where it occurs, becomes its one id (as a Hugging Face
        tokenizer splits out its special tokens).

        Raises:
            InputError: `text` holds characters outside the vocabulary; the message names them.
        """
        if self.eot is not None and self.eot in text:
            pieces = [self.encode_array(piece) for piece in text.split(self.eot)]
            eot = np.array([self.eot_id], dtype=np.int64)
            return np.concatenate([x for piece in pieces for x in (eot, piece)][1:])
        # "surrogatepass" keeps lone surrogates (which no vocabulary holds) reportable.
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        ids = np.searchsorted(self._codepoints, points)
        np.minimum(ids, len(self.chars) - 1, out=ids)
        unknown = self._codepoints[ids] != points
        if unknown.any():
            raise lacking_characters(chr(p) for p in np.unique(points[unknown]))
        return ids.astype(np.int64, copy=False)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = _checked_ids(ids, self.vocab_size, "char vocabulary")
        return "".join([self.token_texts[i] for i in ids])

    def to_hf(self) -> HFTokenizer:
        """The same tokenizer as a Hugging Face `tokenizers.Tokenizer` (same ids, same text).

        A `WordLevel` model over the characters (ids in sorted order), the end-of-text token at
        the last id as a special added token (split out of a text before anything else), a
        `Split` pre-tokenizer that isolates every character and a `Fuse` decoder.
        """
        vocab = dict(self.stoi)
        if self.eot is not None:
            vocab[self.eot] = len(self.chars)
        hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=None))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(CHAR_SPLIT_REGEX), behavior="isolated")
        hf.decoder = decoders.Fuse()
        if self.eot is not None:
            hf.add_special_tokens([AddedToken(self.eot, special=True, normalized=False)])
        return hf

    def to_json(self) -> str:
        """A Hugging Face `tokenizer.json` (see `to_hf`); `tokenizer_from_json` reads it back
        as a `CharTokenizer`."""
        return self.to_hf().to_str()

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, self.to_json())

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class BPETokenizer:
    """A Hugging Face `tokenizers.Tokenizer`: our byte-level BPE, or any `tokenizer.json`.

    Encoding never adds special tokens (no BOS/EOS post-processing); decoding keeps them, so
    `<|endoftext|>` written in a text comes back as written.

    Args:
        hf: the `tokenizers.Tokenizer` to wrap.
    """

    def __init__(self, hf: Any) -> None:
        self.hf = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.eot_id: int | None = next(
            (i for i in map(hf.token_to_id, _EOT_CANDIDATES) if i is not None), None
        )

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int) -> BPETokenizer:
        """Train byte-level BPE (GPT-2 style) with `<|endoftext|>` to `vocab_size` tokens.

        A small corpus may end with fewer tokens than asked (no pair left to merge).

        Raises:
            InputError: `vocab_size` is below 257 (256 bytes + `<|endoftext|>`).
        """
        if vocab_size < MIN_BPE_VOCAB:
            raise InputError(
                f"data.vocab_size ({vocab_size}) is too small for byte-level BPE: it needs at "
                f"least {MIN_BPE_VOCAB} (256 byte tokens + {EOT}); use e.g. 1024, or "
                "data.tokenizer=char."
            )
        hf = HFTokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        hf.train_from_iterator(_lines_in_batches(texts), trainer)
        tok = cls(hf)
        if tok.vocab_size < vocab_size:
            log.warning(
                "BPE stopped at %d tokens (asked %d): the corpus has no more pairs to merge.",
                tok.vocab_size,
                vocab_size,
            )
        return tok

    @classmethod
    def from_json(cls, text: str, source: str = "tokenizer.json") -> BPETokenizer:
        try:
            tokenizer = cls(HFTokenizer.from_str(text))
        except Exception as exc:  # tokenizers raises plain Exception for a malformed file
            raise InputError(
                f"{source} is not a valid Hugging Face tokenizer.json ({exc})."
            ) from None
        # The model's embedding has one row per id: the ids must be 0..vocab_size - 1, each once.
        ids = sorted(tokenizer.hf.get_vocab(with_added_tokens=True).values())
        if ids != list(range(tokenizer.vocab_size)):
            raise InputError(
                f"{source}: its vocabulary's ids are not 0..{tokenizer.vocab_size - 1}, each "
                "once (an id is repeated or skipped): the file is damaged."
            )
        return tokenizer

    def encode(self, text: str) -> list[int]:
        """The ids of `text`.

        Raises:
            InputError: the tokenizer's model fails on the text (for example a `WordLevel`
                model whose unknown token is not in its vocabulary meets an unknown word).
        """
        try:
            return self.hf.encode(text, add_special_tokens=False).ids
        except Exception as exc:  # tokenizers raises plain Exceptions from its model
            raise self.cannot_encode(text, exc) from None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts in parallel (Rust threads); same ids, and errors, as `encode`."""
        try:
            encodings = self.hf.encode_batch_fast(texts, add_special_tokens=False)
        except Exception as exc:  # as in `encode`
            raise self.cannot_encode("".join(texts), exc) from None
        return [e.ids for e in encodings]

    def cannot_encode(self, text: str, exc: Exception, what: str = "text") -> InputError:
        """Why the model failed on `text`: the characters a character-level vocabulary (a chat
        run's, which has no unknown token) lacks, named; else what the tokenizer said."""
        added = {token.content for token in self.hf.get_added_tokens_decoder().values()}
        vocab = self.hf.get_vocab(with_added_tokens=False)
        for token in added:
            text = text.replace(token, "")
        unknown = {c for c in set(text) if not self._knows(c)}
        if unknown and all(len(t) == 1 or t in added for t in vocab):  # one token a character
            return lacking_characters(unknown, what)
        return InputError(
            f"the tokenizer cannot encode this {what} ({exc}); its tokenizer.json is damaged or "
            "its model has no usable unknown token: use another data.tokenizer."
        )

    def _knows(self, char: str) -> bool:
        try:
            return self.hf.token_to_id(char) is not None
        except Exception:  # a lone surrogate is no string tokenizers can take
            return False

    def decode(self, ids: Iterable[int]) -> str:
        ids = _checked_ids(ids, self.vocab_size, "vocabulary")
        return self.hf.decode(ids, skip_special_tokens=False)

    def to_json(self) -> str:
        return self.hf.to_str()

    def save(self, path: str | os.PathLike) -> None:
        atomic_write_text(path, self.to_json())

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def _lines_in_batches(texts: Iterable[str], lines_per_batch: int = 1000) -> Iterator[list[str]]:
    """Feed BPE training in batches of lines, so that `tokenizers` spreads it over threads."""
    batch: list[str] = []
    for text in texts:
        for line in text.splitlines(keepends=True):
            batch.append(line)
            if len(batch) == lines_per_batch:
                yield batch
                batch = []
    if batch:
        yield batch


def _char_tokenizer_from_hf(data: dict[str, Any]) -> CharTokenizer | None:
    """The `CharTokenizer` that a Hugging Face tokenizer.json is (as `CharTokenizer.to_json`
    writes it), or None when it is any other tokenizer.

    It is one when it tokenizes exactly as a `CharTokenizer`: a `WordLevel` model over single
    characters with ids in sorted order and an unknown token outside the vocabulary, at most one
    added token (special, matched as written: the end-of-text token) at the next id, the
    character-isolating `Split` pre-tokenizer, a `Fuse` decoder and nothing else (no normalizer,
    post-processor, truncation or padding).
    """
    model, added = data.get("model"), data.get("added_tokens") or []
    if not (
        isinstance(model, dict)
        and model.get("type") == "WordLevel"
        and isinstance(model.get("vocab"), dict)
        and all(isinstance(i, int) for i in model["vocab"].values())
        and data.get("pre_tokenizer") == _CHAR_PRE_TOKENIZER
        and data.get("decoder") == _CHAR_DECODER
        and all(data.get(k) is None for k in _CHAR_ABSENT)
        and isinstance(added, list)
        and len(added) <= 1
        and all(_is_plain_special(token) for token in added)
    ):
        return None
    vocab: dict[str, int] = model["vocab"]
    eot = added[0]["content"] if added else None
    chars = [t for t, _ in sorted(vocab.items(), key=lambda item: item[1]) if t != eot]
    n = len(chars)
    if not chars or any(len(c) != 1 for c in chars) or chars != sorted(chars):
        return None
    unk = model.get("unk_token")  # a CharTokenizer has none in its vocabulary
    if [vocab[c] for c in chars] != list(range(n)) or not isinstance(unk, (str, type(None))):
        return None
    if unk in vocab:
        return None
    if eot is not None and not (added[0].get("id") == vocab.get(eot, n) == n):
        return None
    return CharTokenizer(chars, eot=eot)


def _is_plain_special(token: Any) -> bool:
    """An added token that is special and matched exactly as written (no stripping)."""
    return (
        isinstance(token, dict)
        and token.get("special") is True
        and isinstance(token.get("content"), str)
        and len(token["content"]) > 1
        and not any(token.get(k) for k in ("single_word", "lstrip", "rstrip", "normalized"))
    )


def _char_tokenizer_from_llmcli(data: dict[str, Any], source: str) -> CharTokenizer:
    """llmcli's own char format: `version` 1 or 2 (absent: 1), `chars` a list of single
    characters, and in version 2 `eot`, the end-of-text token's text.

    Raises:
        InputError: a field missing or of the wrong type, naming `source` and the field.
    """
    version = data.get("version", 1)
    if type(version) is not int or version not in (1, 2):
        raise InputError(
            f"{source}: 'version' ({version!r}) of an llmcli char tokenizer must be 1 or 2 "
            "(the integer)."
        )
    chars = data.get("chars")
    if not (
        isinstance(chars, list) and chars and all(isinstance(c, str) and len(c) == 1 for c in chars)
    ):
        raise InputError(
            f"{source}: 'chars' of an llmcli char tokenizer must be a non-empty list of single "
            "characters."
        )
    if version == 1:
        return CharTokenizer(chars, eot=None)
    eot = data.get("eot")
    if not (isinstance(eot, str) and len(eot) > 1):
        raise InputError(
            f"{source}: 'eot' of a version 2 llmcli char tokenizer must be the end-of-text "
            f"token's text, a string of more than one character (such as {EOT!r})."
        )
    return CharTokenizer(chars, eot=eot)


def tokenizer_from_json(text: str, source: str = "tokenizer.json") -> Tokenizer:
    """Rebuild a tokenizer from the text of a `tokenizer.json`: a `CharTokenizer` from one that
    `CharTokenizer.to_json` wrote or from llmcli's own char format (versions 1 and 2), else a
    `BPETokenizer` around the Hugging Face tokenizer it is."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"{source} is not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})."
        ) from None
    if not isinstance(data, dict):
        raise InputError(f"{source} is not a tokenizer: it holds a JSON {type(data).__name__}.")
    if data.get("kind") == CHAR_KIND:
        return _char_tokenizer_from_llmcli(data, source)
    if "model" not in data:
        raise InputError(
            f"{source} is neither an llmcli char tokenizer (kind {CHAR_KIND!r}) nor a Hugging "
            "Face tokenizer.json (no 'model' key)."
        )
    return _char_tokenizer_from_hf(data) or BPETokenizer.from_json(text, source)


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """Restore a tokenizer, exactly as saved, from one `tokenizer.json`.

    Raises:
        InputError: the file is missing, not a regular file, unreadable or not a tokenizer.
    """
    text = read_user_text(path, "tokenizer file", kind="JSON")
    return tokenizer_from_json(text, repr(str(path)))


def train_tokenizer(data_cfg: DataConfig, texts: Iterable[str] | str) -> Tokenizer:
    """Build the tokenizer that `data_cfg.tokenizer` names.

    Args:
        data_cfg: uses `tokenizer` ("char", "bpe", the path of a tokenizer.json or of a folder
            holding one, or a Hugging Face Hub name, see `named_tokenizer`) and `vocab_size`
            (bpe).
        texts: the training text, one string or an iterable of documents (consumed once;
            ignored for a tokenizer given by path or name, which is loaded as is).

    Raises:
        InputError: `vocab_size` too small for BPE, or a tokenizer path or name that is not one.
    """
    if isinstance(texts, str):
        texts = [texts]
    kind = data_cfg.tokenizer
    if kind == "char":
        return CharTokenizer.train(texts)
    if kind == "bpe":
        return BPETokenizer.train(texts, data_cfg.vocab_size)
    return named_tokenizer(kind, what="data.tokenizer")


def named_tokenizer(name: str, *, what: str) -> Tokenizer:
    """Load a tokenizer given as a `tokenizer.json` path, a folder holding one, or a Hugging
    Face Hub name (`gpt2`, `org/name@revision`: its `tokenizer.json` through the Hub cache,
    offline with `HF_HUB_OFFLINE=1`; see `llmcli.hub.resolve_pretrained`).

    Raises:
        InputError: no such file or folder and not a Hub name (or one ending in `.json`); a
            folder or Hub repo without a `tokenizer.json`; a Hub name that cannot be fetched;
            a file that is not a tokenizer. `what` (`data.tokenizer`) names the setting.
    """
    if not Path(name).expanduser().exists() and (
        name.endswith(".json") or split_hub_name(name) is None
    ):
        raise InputError(
            f"{what} ({name!r}) must be 'char', 'bpe' or the path of an existing tokenizer.json "
            "(or of a folder holding one) or a Hugging Face Hub name; no such file."
        )
    where = resolve_pretrained(name, what=what, patterns=HUB_TOKENIZER_FILES)
    if where.is_dir():
        if not (where / TOKENIZER_FILE).is_file():
            local = Path(name).expanduser().exists()
            holder = "the folder" if local else "the Hub repository (fetched into"
            raise InputError(
                f"{what} ({name!r}): {holder} {str(where)!r}{'' if local else ')'} has no "
                f"{TOKENIZER_FILE}, the Hugging Face tokenizers file (a repository with only a "
                "slow tokenizer, such as vocab.txt or a SentencePiece model, has none)."
            )
        where = where / TOKENIZER_FILE
    return load_tokenizer(where)


def eot_text(tok: Tokenizer) -> str | None:
    """The end-of-text token's text, or None for a tokenizer without one."""
    return None if tok.eot_id is None else tok.decode([tok.eot_id])


def special_tokens(eot: str | None) -> dict[str, str]:
    """The named special tokens, as Hugging Face names them, of a tokenizer whose end-of-text
    token is `eot` (`eot_text`): it is the `bos_token` and the `eos_token` (none without one).

    The one source of what the Hugging Face export's `tokenizer_config.json` declares and of the
    variables a chat template is rendered with (`llmcli.data.conversations`), so that
    `apply_chat_template` on an export reads the values llmcli trained with.
    """
    return {} if eot is None else {"bos_token": eot, "eos_token": eot}


def separator_ids(tok: Tokenizer) -> list[int]:
    """What joins two documents of a corpus, so also what an empty prompt starts from.

    A char tokenizer's newline (its end-of-text token is for other tools), else the
    end-of-text token, else the tokens of a newline (possibly none).
    """
    if tok.eot_id is not None and not isinstance(tok, CharTokenizer):
        return [tok.eot_id]
    return tok.encode("\n")


def start_ids(tok: Tokenizer) -> list[int]:
    """The ids an empty prompt starts from: `separator_ids`, which must not be empty."""
    ids = separator_ids(tok)
    if not ids:
        raise InputError(
            "this tokenizer has no end-of-text token and encodes '\\n' to nothing: "
            "give a non-empty prompt."
        )
    return ids
