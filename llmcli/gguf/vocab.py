"""A run's tokenizer as GGUF metadata: llama.cpp's `gpt2` tokenizer (byte-level BPE).

llama.cpp holds a BPE vocabulary as its token strings (byte-level: GPT-2's byte-to-unicode
alphabet), their types and the merges, and pre-tokenizes with a regex it names (`gpt-2` is
GPT-2's, which `data.tokenizer: bpe` trains with). A char-level run's vocabulary is a
`WordLevel` model over characters, which no llama.cpp tokenizer is, so it is refused with what
works instead. Token ids past the tokenizer (a vocabulary padded in the model) become unused
`[PAD{id}]` tokens, as `convert_hf_to_gguf.py` writes them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from llmcli.data.tokenizer import BPETokenizer, CharTokenizer, Tokenizer
from llmcli.errors import InputError

# llama.cpp's token types (gguf.TokenType), written as plain ints.
NORMAL, CONTROL, UNUSED = 1, 3, 5
PRE_TOKENIZER = "gpt-2"  # llama.cpp's name for GPT-2's pre-tokenizer regex


@dataclass(frozen=True)
class GGUFVocab:
    """What llama.cpp's `gpt2` tokenizer reads: tokens by id, their types, merges, end of text."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    eot_id: int | None


def _refuse_char() -> InputError:
    return InputError(
        "this run has a char-level tokenizer (data.tokenizer: char), which llama.cpp cannot "
        "hold: its tokenizers are BPE, SentencePiece and WordPiece, not one token per "
        "character. Export it for transformers with --format auto (a Hugging Face folder), or "
        "train a run with data.tokenizer: bpe (byte-level BPE) and export that as GGUF."
    )


def _check_byte_level(data: dict) -> None:
    """Refuse a tokenizer.json that is not GPT-2-style byte-level BPE, naming what differs."""
    model, pre, decoder = data.get("model") or {}, data.get("pre_tokenizer"), data.get("decoder")
    differences = []
    if model.get("type") != "BPE":
        differences.append(f"its model is {model.get('type')!r}, not BPE")
    if not (isinstance(pre, dict) and pre.get("type") == "ByteLevel" and pre.get("use_regex")):
        differences.append("its pre-tokenizer is not GPT-2's byte-level regex (ByteLevel)")
    elif pre.get("add_prefix_space"):
        differences.append("it adds a prefix space, which llama.cpp's gpt2 tokenizer does not")
    if not (isinstance(decoder, dict) and decoder.get("type") == "ByteLevel"):
        differences.append("its decoder is not ByteLevel")
    if data.get("normalizer") is not None:
        differences.append("it has a normalizer")
    if differences:
        raise InputError(
            "this run's tokenizer is not byte-level BPE as llama.cpp reads it ("
            + "; ".join(differences)
            + "). Train a run with data.tokenizer: bpe, or export with --format auto for "
            "transformers."
        )


def gguf_vocab(tokenizer: Tokenizer, n_vocab: int) -> GGUFVocab:
    """The tokenizer's vocabulary as llama.cpp's `gpt2` tokenizer holds it.

    Args:
        tokenizer: the run's tokenizer.
        n_vocab: the model's vocabulary size (>= the tokenizer's; ids past it are padding).

    Raises:
        InputError: a char-level tokenizer, or one that is not GPT-2-style byte-level BPE.
    """
    if isinstance(tokenizer, CharTokenizer) or not isinstance(tokenizer, BPETokenizer):
        raise _refuse_char()
    data = json.loads(tokenizer.to_json())
    _check_byte_level(data)
    by_id = {i: token for token, i in data["model"]["vocab"].items()}
    special = {t["id"] for t in data.get("added_tokens") or [] if t.get("special")}
    by_id.update({t["id"]: t["content"] for t in data.get("added_tokens") or []})
    tokens, types = [], []
    for i in range(n_vocab):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(CONTROL if i in special else NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
    # tokenizers writes merges as "a b" strings, or since 0.20 as [a, b] pairs.
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    return GGUFVocab(tokens, types, merges, tokenizer.eot_id)
