"""circuit-tracer's attribution graph of a run exported for Hugging Face: the reference that
`llmcli graph` is tested against (tests/test_graph_circuit_tracer.py) and timed beside
(benchmarks/graph_speed.py).

Runs under a Python with circuit-tracer installed, and imports nothing of llmcli: circuit-tracer
0.5.0 pins transformers <= 4.57.3 and huggingface_hub < 1.0, which llmcli's own pins exclude,
so the two live in separate environments. It builds TransformerLens's GPT-2 from the export
(weights unfolded, as circuit-tracer's `from_pretrained_and_transcoders` loads them), loads the
transcoder folder with circuit-tracer's own loader, and runs `attribute` on the token ids given:

    python benchmarks/circuit_tracer_graph.py EXPORT TRANSCODERS OUT.pt --tokens 0,5,9 \\
        [--max-logits 10] [--logit-probability 0.95] [--max-feature-nodes N] [--batch-size B]
        [--frontend DIR [--slug NAME]]

OUT.pt holds the graph's tensors under `Graph.to_pt`'s names (logit targets as ids) and
`seconds`, the time `attribute` took; the last line printed is the same as JSON. With
`--frontend DIR`, circuit-tracer's `create_graph_files` writes its frontend JSON there too.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import yaml


def replacement_model(export: Path, transcoder_folder: Path):
    """circuit-tracer's TransformerLens replacement model of the export, with the transcoders."""
    from circuit_tracer.replacement_model.replacement_model_transformerlens import (
        TransformerLensReplacementModel,
    )
    from circuit_tracer.utils.hf_utils import load_transcoders
    from transformer_lens import HookedTransformerConfig
    from transformer_lens.pretrained.weight_conversions.gpt2 import convert_gpt2_weights
    from transformers import AutoTokenizer, GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(export).eval()
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
        model_name="llmcli-export",
        tokenizer_name=str(export),  # create_graph_files reads the tokenizer from here
        device="cpu",
    )
    config = yaml.safe_load((transcoder_folder / "config.yaml").read_text())
    # circuit-tracer opens the layer files relative to the working directory.
    config["transcoders"] = [str(transcoder_folder / name) for name in config["transcoders"]]
    transcoders = load_transcoders(config, torch.device("cpu"), torch.float32, False, False)
    model = TransformerLensReplacementModel.from_config(
        cfg, transcoders, tokenizer=AutoTokenizer.from_pretrained(export)
    )
    # The replacement model wraps each MLP and the unembedding (`old_mlp`, `old_unembed`).
    weights = {
        name.replace(".mlp.", ".mlp.old_mlp.").replace("unembed.", "unembed.old_unembed."): t
        for name, t in convert_gpt2_weights(hf, cfg).items()
    }
    _, unexpected = model.load_state_dict(weights, strict=False)  # masks, transcoders: kept
    if unexpected:
        raise SystemExit(f"weights the replacement model does not have: {unexpected}")
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("export", type=Path)
    parser.add_argument("transcoders", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", required=True, help="token ids joined by commas")
    parser.add_argument("--max-logits", type=int, default=10)
    parser.add_argument("--logit-probability", type=float, default=0.95)
    parser.add_argument("--max-feature-nodes", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--frontend", type=Path, help="also run create_graph_files into DIR")
    parser.add_argument("--slug", default="graph")
    args = parser.parse_args()
    from circuit_tracer.attribution.attribute import attribute

    torch.set_num_threads(torch.get_num_threads())
    model = replacement_model(args.export, args.transcoders)
    tokens = torch.tensor([int(t) for t in args.tokens.split(",")])
    start = time.perf_counter()
    graph = attribute(
        tokens,
        model,
        max_n_logits=args.max_logits,
        desired_logit_prob=args.logit_probability,
        batch_size=args.batch_size,
        max_feature_nodes=args.max_feature_nodes,
    )
    seconds = time.perf_counter() - start
    saved = {
        "input_tokens": graph.input_tokens.cpu(),
        "active_features": graph.active_features.cpu(),
        "activation_values": graph.activation_values.cpu(),
        "selected_features": graph.selected_features.cpu(),
        "adjacency_matrix": graph.adjacency_matrix.cpu(),
        "logit_targets": torch.tensor([t.vocab_idx for t in graph.logit_targets]),
        "logit_probabilities": graph.logit_probabilities.cpu(),
        "seconds": seconds,
    }
    torch.save(saved, args.out)
    if args.frontend is not None:
        from circuit_tracer.utils.create_graph_files import create_graph_files

        create_graph_files(graph, args.slug, str(args.frontend))
    nodes = graph.adjacency_matrix.shape[0]
    print(json.dumps({"tool": "circuit-tracer", "seconds": seconds, "nodes": nodes}))


if __name__ == "__main__":
    main()
