"""A chat run's exports carry its template (llmcli/hf/export.py, llmcli/gguf/export.py).

The references are the peers' own readers: `transformers`' `AutoTokenizer` on the exported
folder must give, through `apply_chat_template`, the ids and the assistant mask llmcli trains
on (`ConversationEncoder`), whichever of its two places it reads the template from; its model
the same logits on them; its `generate` must stop at the end of a turn. The GGUF file, read
with gguf's `GGUFReader`, must hold the template and the end-of-turn id.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import gguf
import pytest
import torch
from chat_helpers import CONVERSATIONS, save_chat_run
from conftest import save_tiny_run
from hf_helpers import TEXT, assert_close, cli

from llmcli.data.chat_template import CHAT_TOKENS, END_OF_TURN, default_template
from llmcli.data.conversations import ConversationEncoder, add_chat_tokens
from llmcli.data.tokenizer import BPETokenizer
from llmcli.runs.directory import save_model_run
from llmcli.runs.loading import load_run

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path]:
    """A chat run and its Hugging Face export."""
    root = tmp_path_factory.mktemp("chat-export")
    run_dir = save_chat_run(root / "run")
    assert cli("export", "--checkpoint", run_dir, "--out", root / "hf") == 0
    return run_dir, root / "hf"


def encoder_of(run_dir: Path) -> ConversationEncoder:
    return ConversationEncoder(default_template(), load_run(run_dir).tokenizer)


def assert_same_chat_ids(hf_tok, encoder: ConversationEncoder) -> None:
    """`apply_chat_template` gives llmcli's ids and mask, and with a generation prompt its
    prompt ids, for every sample conversation."""
    for messages in CONVERSATIONS:
        ours = encoder.encode(messages)
        theirs = hf_tok.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert list(theirs["input_ids"]) == ours.ids.tolist()
        assert list(theirs["assistant_masks"]) == ours.mask.astype(int).tolist()
        before = messages[:-1]  # ends with the user's turn
        prompt = hf_tok.apply_chat_template(
            before, tokenize=True, return_dict=True, add_generation_prompt=True
        )
        assert list(prompt["input_ids"]) == encoder.prompt(before)
        text = hf_tok.apply_chat_template(before, tokenize=False, add_generation_prompt=True)
        assert text == default_template().render(before, True).text


def test_transformers_gives_the_runs_chat_ids_and_mask_from_either_template_file(
    exported, tmp_path
):
    from transformers import AutoTokenizer

    run_dir, out = exported
    source = default_template().source
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == source
    config = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["chat_template"] == source
    assert config["additional_special_tokens"] == list(CHAT_TOKENS)
    encoder = encoder_of(run_dir)

    hf_tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert set(CHAT_TOKENS) <= set(hf_tok.all_special_tokens)
    assert_same_chat_ids(hf_tok, encoder)
    # Decoding a reply without special tokens leaves its text, as llmcli's chat shows it.
    reply = encoder.encode(CONVERSATIONS[0]).ids[-5:-1].tolist()  # "Hi!<|end|>"
    assert hf_tok.decode(reply, skip_special_tokens=True) == "Hi!"

    # Versions before chat_template.jinja read only tokenizer_config.json's template.
    legacy = tmp_path / "legacy"
    shutil.copytree(out, legacy)
    (legacy / "chat_template.jinja").unlink()
    assert_same_chat_ids(AutoTokenizer.from_pretrained(legacy, local_files_only=True), encoder)

    # What this transformers writes back (save_pretrained) reads the same.
    resaved = tmp_path / "resaved"
    hf_tok.save_pretrained(resaved)
    assert_same_chat_ids(AutoTokenizer.from_pretrained(resaved, local_files_only=True), encoder)


def test_exported_model_computes_llmclis_logits_on_a_conversation(exported):
    from transformers import AutoModelForCausalLM

    run_dir, out = exported
    ours = load_run(run_dir).model
    theirs = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    for messages in CONVERSATIONS:
        ids = torch.from_numpy(encoder_of(run_dir).encode(messages).ids)[None]  # (1, N)
        with torch.no_grad():
            expected, _ = ours(ids)
            actual = theirs(ids).logits
        assert_close(actual, expected, "chat logits")


@pytest.mark.parametrize("writes", ["end of turn", "end of text"])
def test_a_reply_ends_at_either_end_token_in_the_exports_generate_and_in_llmcli(tmp_path, writes):
    """A model whose every next token is `<|end|>` (or the end of text): the export's
    `generate` stops after it, on the ids generation_config.json lists (TRL's GRPO samples so),
    and llmcli's replies (GRPO's, `llmcli eval --answers`) stop alike, leaving it out of the
    reply and saying which token ended it."""
    from transformers import AutoModelForCausalLM

    from llmcli.generation.replies import replies

    run_dir = save_chat_run(tmp_path / "run", tie_embeddings=False)
    run = load_run(run_dir)
    encoder = encoder_of(run_dir)
    end_id, eot = encoder.end_id, run.tokenizer.eot_id
    assert encoder.reply_end_ids == (end_id, eot)
    written = end_id if writes == "end of turn" else eot
    with torch.no_grad():  # the final norm outputs ones; only the written token's row sees them
        run.model.ln_f.weight.zero_()
        run.model.ln_f.bias.fill_(1.0)
        run.model.lm_head.weight.zero_()
        run.model.lm_head.weight[written] = 1.0
    save_model_run(run_dir, run.config, run.tokenizer, run.model)
    out = tmp_path / "hf"
    assert cli("export", "--checkpoint", run_dir, "--out", out) == 0
    generation = json.loads((out / "generation_config.json").read_text(encoding="utf-8"))
    assert generation["eos_token_id"] == [end_id, eot]

    theirs = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    prompt = encoder.prompt(CONVERSATIONS[0][:-1])
    with torch.no_grad():
        ids = theirs.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
    assert ids[0, len(prompt) :].tolist() == [written]
    greedy = dataclasses.replace(run.config.sample, temperature=0.0)
    assert replies(run.model.eval(), [prompt], [10], encoder.reply_end_ids, greedy) == [
        ([], written)
    ]


def test_text_run_export_into_a_chat_export_leaves_no_template(exported, tmp_path):
    from hf_helpers import make_run

    _, out = exported
    folder = tmp_path / "hf"
    shutil.copytree(out, folder)
    text_run = make_run(tmp_path / "text")
    assert cli("export", "--checkpoint", text_run, "--out", folder, "--force") == 0
    assert not (folder / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((folder / "tokenizer_config.json").read_text())


def test_gguf_holds_the_template_and_the_end_of_turn_id(tmp_path, capsys):
    tokenizer = add_chat_tokens(BPETokenizer.train([TEXT * 4], 300))
    raw = {
        "model": {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 32},
        "data": {"tokenizer": "bpe", "format": "chat"},
    }
    run_dir = save_tiny_run(tmp_path / "run", tokenizer, raw, seed=1)
    default_template().save(run_dir)
    out = tmp_path / "chat.gguf"
    assert cli("export", "--checkpoint", run_dir, "--format", "gguf", "--out", out) == 0
    capsys.readouterr()

    reader = gguf.GGUFReader(out)
    fields = {key: reader.fields[key].contents() for key in reader.fields}
    end_id = encoder_of(run_dir).end_id
    assert fields["tokenizer.chat_template"] == default_template().source
    assert fields["tokenizer.ggml.eot_token_id"] == end_id
    assert fields["tokenizer.ggml.eos_token_id"] == tokenizer.eot_id  # the end of text stays
    assert fields["tokenizer.ggml.tokens"][end_id] == END_OF_TURN
    assert fields["tokenizer.ggml.token_type"][end_id] == gguf.TokenType.CONTROL

    (run_dir / "chat_template.jinja").unlink()  # the same run trained on plain text
    out = tmp_path / "text.gguf"
    assert cli("export", "--checkpoint", run_dir, "--format", "gguf", "--out", out) == 0
    reader = gguf.GGUFReader(out)
    assert "tokenizer.chat_template" not in reader.fields
    assert "tokenizer.ggml.eot_token_id" not in reader.fields
