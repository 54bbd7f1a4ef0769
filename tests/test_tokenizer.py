"""Tokenizers: char (ids are ranks in the sorted characters; saved as a Hugging Face
tokenizer.json that `tokenizers` encodes alike; llmcli's older char files still load) and
byte-level BPE (against a pure-Python GPT-2 BPE encoder written from OpenAI's `encoder.py`
algorithm), save/load, errors."""

import json
from pathlib import Path

import pytest
import regex
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st

from llmcli.config import DataConfig
from llmcli.data.tokenizer import (
    EOT,
    BPETokenizer,
    CharTokenizer,
    Tokenizer,
    load_tokenizer,
    start_ids,
    tokenizer_from_json,
    train_tokenizer,
)
from llmcli.data.tokens import prepare_data
from llmcli.errors import InputError

CORPUS = Path(__file__).resolve().parents[1] / "data" / "shakespeare.txt"
TRICKY = [
    "",
    " ",
    "\n\n\n",
    "  leading and trailing  \n",
    "héllo wörld, ça va? 🎉🎉 日本語のテキスト",
    "tabs\tand\r\nwindows\rlines",
    "\x00\x01\x7f\u200b\ufeff",
    "e\u0301 (combining accent), 👩‍👩‍👧 (ZWJ family)",
    f"one document{EOT}another{EOT}{EOT}",
    "<|endoftext",
    "it's they're we've I'm you'll he'd 1234567 3.14",
]


@pytest.fixture(scope="module")
def text() -> str:
    return CORPUS.read_text(encoding="utf-8")[:300_000]


@pytest.fixture(scope="module")
def bpe(text: str) -> BPETokenizer:
    return BPETokenizer.train([text], vocab_size=600)


# --- char ---------------------------------------------------------------------------------


def test_char_matches_the_seed_formula(text: str) -> None:
    tok = train_tokenizer(DataConfig(tokenizer="char"), text)
    chars = sorted(set(text) | {"\n"})  # the seed: sorted(list(set(text)))
    stoi = {c: i for i, c in enumerate(chars)}
    sample = text[1000:3000]
    assert isinstance(tok, CharTokenizer) and isinstance(tok, Tokenizer)
    assert tok.vocab_size == len(chars) + 1  # the end-of-text token takes the last id
    assert tok.eot_id == len(chars) and tok.decode([tok.eot_id]) == EOT
    assert tok.encode(sample) == [stoi[c] for c in sample]
    assert tok.decode(tok.encode(sample)) == sample
    assert tok.encode_batch([sample, "", "a"]) == [tok.encode(sample), [], [stoi["a"]]]
    assert start_ids(tok) == [stoi["\n"]]


def test_char_trains_on_documents_and_adds_newline() -> None:
    tok = train_tokenizer(DataConfig(tokenizer="char"), iter(["ba", "ca"]))
    assert tok.chars == ["\n", "a", "b", "c"]


def test_char_unknown_characters_are_named_sorted_once() -> None:
    tok = CharTokenizer.train(["hello world"])
    with pytest.raises(InputError) as err:
        tok.encode("hello ☃ wörld é ☃ ZZ")
    msg = str(err.value)
    assert "'Z', 'é', 'ö', '☃'" in msg
    assert msg.count("'☃'") == 1 and "4 character" in msg


def test_char_save_load_restores_exactly(tmp_path: Path, text: str) -> None:
    tok = CharTokenizer.train([text + "é\u2028"])
    tok.save(tmp_path / "tokenizer.json")
    data = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["model"]["type"] == "WordLevel"  # a Hugging Face tokenizer.json
    assert data["added_tokens"][0]["content"] == EOT and data["added_tokens"][0]["special"]
    assert data["model"]["vocab"][EOT] == tok.eot_id == len(tok.chars)
    back = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(back, CharTokenizer)
    assert back.to_json() == tok.to_json() and back.chars == tok.chars
    assert (back.eot, back.eot_id, back.vocab_size, back.stoi) == (
        tok.eot,
        tok.eot_id,
        tok.vocab_size,
        tok.stoi,
    )
    assert back.encode(text[:500] + "é\u2028") == tok.encode(text[:500] + "é\u2028")
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer.json"]  # no temp file left


def test_char_tokenizer_json_is_read_by_hugging_face_tokenizers(tmp_path: Path) -> None:
    tok = CharTokenizer.train(TRICKY)
    tok.save(tmp_path / "tokenizer.json")
    hf = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert hf.get_vocab_size(with_added_tokens=True) == tok.vocab_size
    assert hf.token_to_id(EOT) == tok.eot_id
    for s in [*TRICKY, "\n".join(TRICKY), EOT, f"\n{EOT}\n<|endoftext{EOT}|>"]:
        ids = tok.encode(s)
        assert hf.encode(s).ids == ids, repr(s)  # default add_special_tokens adds nothing
        assert hf.encode(s, add_special_tokens=False).ids == ids
        assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids) == s
    assert "☃" not in tok.stoi
    with pytest.raises(Exception, match="UNK"):  # an unknown character is an error, as for ours
        hf.encode("a☃")


# Derandomized, as test_fuzz_readers.py's: every run, CI's included, tries the same examples.
@settings(max_examples=200, deadline=None, derandomize=True)
@given(s=st.text(alphabet="ab \n\t\r\u2028é🎉<|>endoftxt", max_size=60))
def test_char_hugging_face_encoding_equals_ours(s: str) -> None:
    tok = CharTokenizer.train(["ab \n\t\r\u2028é🎉<|>endoftxt"])
    hf = tokenizers.Tokenizer.from_str(tok.to_json())
    ids = tok.encode(s)
    assert hf.encode(s).ids == ids
    assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids) == s


def test_other_word_level_tokenizers_stay_bpe_tokenizers(tmp_path: Path) -> None:
    """Only what tokenizes exactly as a CharTokenizer is read back as one."""
    tok = CharTokenizer.train(["abc"])
    base = json.loads(tok.to_json())
    changes = {
        "multi-character word": lambda d: d["model"]["vocab"].update({"ab": 5}),
        "ids not in sorted order": lambda d: d["model"]["vocab"].update({"a": 2, "b": 1}),
        "a normalizer": lambda d: d.update(normalizer={"type": "Lowercase"}),
        "another pre-tokenizer": lambda d: d.update(pre_tokenizer={"type": "Whitespace"}),
        "an unknown token in the vocabulary": lambda d: d["model"].update(unk_token="a"),
        "a non-special added token": lambda d: d["added_tokens"][0].update(special=False),
    }
    for what, change in changes.items():
        data = json.loads(json.dumps(base))
        change(data)
        back = tokenizer_from_json(json.dumps(data))
        assert isinstance(back, BPETokenizer), what
    same = tokenizer_from_json(json.dumps(base, indent=2))  # layout does not matter
    assert isinstance(same, CharTokenizer) and same.to_json() == tok.to_json()


def test_char_end_of_text_token_is_one_id_and_round_trips() -> None:
    tok = CharTokenizer.train(["<ab|>ext\nd"])
    text = f"ab{EOT}ba\n{EOT}"
    ids = tok.encode(text)
    assert ids == tok.encode("ab") + [tok.eot_id] + tok.encode("ba\n") + [tok.eot_id]
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, EOT]) == [ids, [tok.eot_id]]
    assert start_ids(tok) == tok.encode("\n")  # documents are joined by newlines, as before


def test_char_version_1_file_loads_without_end_of_text(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps({"kind": "llmcli-char", "version": 1, "chars": ["\n", "a", "b"]}))
    old = load_tokenizer(path)
    assert isinstance(old, CharTokenizer)
    assert (old.chars, old.vocab_size, old.eot, old.eot_id) == (["\n", "a", "b"], 3, None, None)
    assert old.encode("ab\n") == [1, 2, 0]
    with pytest.raises(InputError, match="outside"):
        old.decode([3])
    # Saved again, it is a Hugging Face file, still without an end-of-text token.
    old.save(path)
    again = load_tokenizer(path)
    assert isinstance(again, CharTokenizer) and (again.vocab_size, again.eot) == (3, None)
    hf = tokenizers.Tokenizer.from_file(str(path))
    assert hf.encode("ab\n").ids == [1, 2, 0] and hf.get_vocab_size() == 3
    path.write_text(json.dumps({"kind": "llmcli-char", "version": 2, "chars": ["a"]}))
    with pytest.raises(InputError, match="'eot'"):
        load_tokenizer(path)


def test_char_version_2_file_loads_as_before(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    chars = ["\n", " ", "a", "b"]
    path.write_text(json.dumps({"kind": "llmcli-char", "version": 2, "chars": chars, "eot": EOT}))
    old = load_tokenizer(path)
    assert isinstance(old, CharTokenizer)
    assert (old.chars, old.eot, old.eot_id, old.vocab_size) == (chars, EOT, 4, 5)
    assert old.encode(f"ab {EOT}\n") == [2, 3, 1, 4, 0]
    assert old.to_json() == CharTokenizer(chars).to_json()  # as a tokenizer trained now


def test_char_tokenizer_cached_in_the_old_format_is_reused(
    tmp_path: Path, text: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The data cache keeps its "char-v2" key: an old-format cached tokenizer loads equal to a
    newly trained one, so it is reused, and so is the token file keyed by its `to_json()`."""
    corpus = tmp_path / "c.txt"
    corpus.write_text(text[:20_000], encoding="utf-8")
    cfg = DataConfig(path=str(corpus), tokenizer="char")
    first = prepare_data(cfg, 8, cache_dir=tmp_path / "cache")
    folder = tmp_path / "cache" / "tokenizers"
    [cached] = [
        f
        for f in folder.iterdir()
        if f.suffix == ".json" and not f.name.endswith((".training.json", ".lock.json"))
    ]
    chars = first.tokenizer.chars
    cached.write_text(json.dumps({"kind": "llmcli-char", "version": 2, "chars": chars, "eot": EOT}))

    def no_training(*args: object) -> None:
        raise AssertionError("the cached tokenizer was not reused")

    monkeypatch.setattr(CharTokenizer, "train", no_training)
    second = prepare_data(cfg, 8, cache_dir=tmp_path / "cache")
    assert second.tokenizer.to_json() == first.tokenizer.to_json()
    assert second.cache_files == first.cache_files


def test_char_decode_rejects_unknown_ids() -> None:
    tok = CharTokenizer.train(["ab"])  # "\n", "a", "b", then the end-of-text token (3)
    with pytest.raises(InputError, match=r"\[-1, 4\]"):
        tok.decode([0, 3, 4, -1])


# --- BPE ----------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (OpenAI encoder.py)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


GPT2_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
)


def reference_bpe_encode(tokenizer_json: str, text: str) -> list[int]:
    """GPT-2 byte-level BPE, as OpenAI's encoder.py does it, from a tokenizer.json's vocab and
    merges; `<|endoftext|>` is split out first as a special token."""
    model = json.loads(tokenizer_json)["model"]
    vocab = model["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    ranks = {pair: i for i, pair in enumerate(merges)}
    byte_map = _bytes_to_unicode()
    ids: list[int] = []
    for k, part in enumerate(text.split(EOT)):
        if k:
            ids.append(vocab[EOT])
        for word in GPT2_PATTERN.findall(part):
            symbols = [byte_map[b] for b in word.encode("utf-8")]
            while len(symbols) > 1:
                rank, i = min(
                    (ranks.get(p, float("inf")), i)
                    for i, p in enumerate(zip(symbols, symbols[1:], strict=False))
                )
                if rank == float("inf"):
                    break
                first, second = symbols[i], symbols[i + 1]
                merged, j = [], 0
                while j < len(symbols):
                    if j + 1 < len(symbols) and (symbols[j], symbols[j + 1]) == (first, second):
                        merged.append(first + second)
                        j += 2
                    else:
                        merged.append(symbols[j])
                        j += 1
                symbols = merged
            ids.extend(vocab[s] for s in symbols)
    return ids


def test_bpe_trains_to_vocab_size_with_eot(bpe: BPETokenizer) -> None:
    assert bpe.vocab_size == 600
    assert bpe.eot_id == bpe.hf.token_to_id(EOT) is not None
    assert start_ids(bpe) == [bpe.eot_id]
    assert isinstance(bpe, Tokenizer)


def test_bpe_matches_reference_gpt2_encoder(bpe: BPETokenizer, text: str) -> None:
    sample = text[50_000:58_000]
    for s in [sample, *TRICKY]:
        assert bpe.encode(s) == reference_bpe_encode(bpe.to_json(), s), repr(s[:40])
    assert len(bpe.encode(sample)) < len(sample.encode("utf-8")) / 2  # merges do compress


def test_bpe_batch_equals_single(bpe: BPETokenizer, text: str) -> None:
    texts = [text[i : i + 700] for i in range(0, 7000, 700)] + TRICKY
    assert bpe.encode_batch(texts) == [bpe.encode(t) for t in texts]


@pytest.mark.parametrize("s", TRICKY)
def test_bpe_round_trips_tricky_strings(bpe: BPETokenizer, s: str) -> None:
    assert bpe.decode(bpe.encode(s)) == s


@settings(max_examples=300, deadline=None, derandomize=True)
@given(s=st.text())
def test_bpe_round_trips_any_unicode(bpe: BPETokenizer, s: str) -> None:
    assert bpe.decode(bpe.encode(s)) == s


@settings(max_examples=100, deadline=None, derandomize=True)
@given(parts=st.lists(st.text(max_size=20), max_size=5))
def test_bpe_round_trips_text_containing_the_eot_token(bpe: BPETokenizer, parts: list) -> None:
    s = EOT.join(parts)
    assert bpe.decode(bpe.encode(s)) == s


def test_bpe_save_load_restores_exactly(tmp_path: Path, bpe: BPETokenizer, text: str) -> None:
    bpe.save(tmp_path / "tokenizer.json")
    back = load_tokenizer(tmp_path / "tokenizer.json")
    assert isinstance(back, BPETokenizer)
    assert back.to_json() == bpe.to_json()
    assert (back.vocab_size, back.eot_id) == (bpe.vocab_size, bpe.eot_id)
    assert back.encode(text[:3000]) == bpe.encode(text[:3000])


def test_tokenizer_json_path_is_used_as_is(tmp_path: Path, bpe: BPETokenizer) -> None:
    path = tmp_path / "tok.json"
    bpe.save(path)
    tok = train_tokenizer(DataConfig(tokenizer=str(path), vocab_size=5000), "ignored text")
    assert tok.to_json() == bpe.to_json()


def test_bpe_vocab_size_too_small() -> None:
    with pytest.raises(InputError, match=r"data.vocab_size \(100\).*at least 257"):
        train_tokenizer(DataConfig(tokenizer="bpe", vocab_size=100), "some text")


def test_bpe_decode_rejects_unknown_ids(bpe: BPETokenizer) -> None:
    with pytest.raises(InputError, match="outside the vocabulary"):
        bpe.decode([1, 600])


# --- loading errors -----------------------------------------------------------------------


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(InputError, match="bad.json.*not JSON"):
        load_tokenizer(bad)
    bad.write_text("[1, 2]", encoding="utf-8")
    with pytest.raises(InputError, match="JSON list"):
        load_tokenizer(bad)
    bad.write_text('{"hello": 1}', encoding="utf-8")
    with pytest.raises(InputError, match="neither"):
        load_tokenizer(bad)
    bad.write_text('{"model": {"type": "nonsense"}}', encoding="utf-8")
    with pytest.raises(InputError, match="not a valid Hugging Face tokenizer.json"):
        load_tokenizer(bad)
    with pytest.raises(InputError, match="must be 'char', 'bpe' or the path"):
        train_tokenizer(DataConfig(tokenizer=str(tmp_path / "nope.json")), "x")
