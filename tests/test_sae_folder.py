"""The SAE folder is SAELens's format: SAELens loads what `llmcli sae train` writes, its
`encode` / `decode` equal llmcli's, and run at the `hook_name` it records on the Hugging Face
export (through TransformerLens) it changes the logits exactly as llmcli's spliced SAE does."""

from __future__ import annotations

import json

import pytest
import torch
from model_helpers import assert_close
from sae_helpers import small_run, trained_sae

from llmcli.errors import CheckpointError
from llmcli.inspection.sae.folder import CFG_FILE, load_sae
from llmcli.inspection.sae.points import read_activations, transformer_lens_name
from llmcli.inspection.sae.steer import splice
from llmcli.runs.loading import load_run

sae_lens = pytest.importorskip("sae_lens")  # the test extra
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run(tmp_path_factory, small_corpus):
    return small_run(tmp_path_factory.mktemp("run") / "run", small_corpus)


@pytest.fixture(scope="module")
def folders(run, tmp_path_factory):
    """SAEs of each kind: TopK on the residual stream, BatchTopK on an MLP, TopK on attn.z."""
    root = tmp_path_factory.mktemp("saes")
    return {
        "topk": trained_sae(run, root / "topk"),
        "batchtopk": trained_sae(
            run, root / "batchtopk", hook="blocks.0.mlp_out", activation="batchtopk"
        ),
        "z": trained_sae(run, root / "z", hook="blocks.1.attn.z"),
    }


@pytest.fixture(scope="module")
def transformer_lens_model(run, tmp_path_factory):
    """The run exported for Hugging Face, as TransformerLens runs GPT-2 (no weights folded)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
    from transformers import GPT2LMHeadModel

    from llmcli.hf.export import export_hf

    out = tmp_path_factory.mktemp("hf") / "export"
    export_hf(run, out)
    hf = GPT2LMHeadModel.from_pretrained(out).eval()
    c = hf.config
    cfg = HookedTransformerConfig(
        n_layers=c.n_layer,
        d_model=c.n_embd,
        n_ctx=c.n_positions,
        d_head=c.n_embd // c.n_head,
        n_heads=c.n_head,
        d_mlp=4 * c.n_embd,
        d_vocab=c.vocab_size,
        act_fn=c.activation_function,
        normalization_type="LN",
        eps=c.layer_norm_epsilon,
        default_prepend_bos=False,
    )
    model = HookedTransformer(cfg)
    model.load_state_dict(convert_gpt2_weights(hf, cfg), strict=False)
    return model.eval()


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 30, (3, 16), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", ["topk", "batchtopk", "z"])
def test_saelens_loads_the_folder_and_encodes_and_decodes_as_llmcli(run, folders, kind) -> None:
    ours = load_sae(folders[kind])
    theirs = sae_lens.SAE.load_from_disk(folders[kind])
    architecture = {"topk": "topk", "batchtopk": "jumprelu", "z": "topk"}[kind]
    assert theirs.cfg.architecture() == architecture
    assert theirs.cfg.metadata.hook_name == transformer_lens_name(ours.info.hook)
    x = read_activations(load_run(run).model, ours.info.hook, tokens())  # (48, d_in)
    x = torch.cat([x, torch.randn(x.shape, generator=torch.Generator().manual_seed(1)) * 3])
    with torch.no_grad():
        acts = ours.sae.encode(x)
        if kind == "z":  # SAELens reads hook_z activations as (..., heads, head size)
            assert_close(theirs.encode(x.view(len(x), 4, 4)), acts, "encode")
            assert_close(theirs.decode(acts).flatten(1), ours.sae.decode(acts), "decode")
        else:
            assert_close(theirs.encode(x), acts, "encode")
            assert_close(theirs.decode(acts), ours.sae.decode(acts), "decode")
        assert (acts > 0).any()


def test_each_hook_point_is_the_same_activation_under_its_transformer_lens_name(
    run, transformer_lens_model
) -> None:
    model, idx = load_run(run).model, tokens(2)
    seen = {}

    def keep(name):
        return lambda act: seen.update({name: act})

    with torch.no_grad(), model.hooks({name: keep(name) for name in model.hook_names()}):
        model(idx)
    _, cache = transformer_lens_model.run_with_cache(idx)
    assert len(seen) == 2 + 2 * 9
    for name, act in seen.items():
        assert_close(cache[transformer_lens_name(name)], act, name)


def test_saelens_at_its_hook_on_the_export_changes_the_logits_as_llmcli_does(
    run, folders, transformer_lens_model
) -> None:
    model, idx = load_run(run).model, tokens(3)
    for kind in ("topk", "batchtopk"):
        ours, theirs = load_sae(folders[kind]), sae_lens.SAE.load_from_disk(folders[kind])
        with torch.no_grad(), model.hooks({ours.info.hook: splice(ours.sae)}):
            spliced, _ = model(idx)
        hook = [(theirs.cfg.metadata.hook_name, lambda act, hook, sae=theirs: sae(act))]
        with torch.no_grad():
            logits = transformer_lens_model.run_with_hooks(idx, fwd_hooks=hook)
            clean, _ = model(idx)
        assert_close(logits, spliced, kind)
        assert (spliced - clean).abs().max() > 1e-3  # the SAE did change them


def test_the_config_records_llmcli_s_own_names_and_a_foreign_folder_is_refused(
    folders, tmp_path
) -> None:
    cfg = json.loads((folders["topk"] / CFG_FILE).read_text())
    assert cfg["metadata"]["llmcli"]["hook"] == "blocks.1.resid_post"
    assert cfg["metadata"]["hook_name"] == "blocks.1.hook_resid_post"
    assert (cfg["d_in"], cfg["d_sae"], cfg["k"]) == (16, 64, 4)
    del cfg["metadata"]["llmcli"]
    (tmp_path / CFG_FILE).write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="no metadata.llmcli.hook"):
        load_sae(tmp_path)
    with pytest.raises(CheckpointError, match="holds no cfg.json"):
        load_sae(tmp_path / "nothing")


def test_transformer_lens_names() -> None:
    assert transformer_lens_name("embed") == "blocks.0.hook_resid_pre"
    assert transformer_lens_name("blocks.3.attn.z") == "blocks.3.attn.hook_z"
    assert transformer_lens_name("blocks.10.mlp_out") == "blocks.10.hook_mlp_out"
    assert transformer_lens_name("final_norm") == "ln_final.hook_normalized"
