"""Attribution graph speed: `llmcli graph`'s computation beside circuit-tracer's, same graph.

    python benchmarks/graph_speed.py --checkpoint RUN [--transcoders DIR] [--prompt TEXT]
        [--rounds 3] [--threads N] [--circuit-tracer-python PY]

Times `attribute_graph` (the whole graph, its exactness checks included) on the run's
transcoders for the prompt (default 15 characters: 16 tokens with the end-of-text token first),
and, interleaved round by round, circuit-tracer's `attribute` on the run's Hugging Face export
and the same folder (benchmarks/circuit_tracer_graph.py under PY, a Python that has
circuit-tracer; its own timer, so its imports and model loading are not counted). Both on the
CPU with the same threads. It also checks that the two adjacency matrices agree (largest
difference relative to the largest edge) and reports the memory the graph needs: the adjacency
(nodes squared, nodes = features + (layers + 1) x tokens + logits: bounded by the prompt, the
vocabulary enters only as the logits kept) and an estimate of the frozen forward's activations
(`forward_activations_mb`: about 12 tensors of (256, T, C) float32 per layer, not measured).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmcli.hf.export import export_hf  # noqa: E402
from llmcli.inspection.graph.attribute import attribute_graph  # noqa: E402
from llmcli.inspection.graph.command import open_transcoders, prompt_tokens  # noqa: E402
from llmcli.runs.loading import load_run  # noqa: E402

HERE = Path(__file__).resolve().parent


def circuit_tracer(python: str, export: Path, folder: Path, ids: list[int], out: Path) -> dict:
    """circuit-tracer's graph and its `attribute` seconds (benchmarks/circuit_tracer_graph.py)."""
    args = [python, str(HERE / "circuit_tracer_graph.py"), str(export), str(folder), str(out)]
    subprocess.run(
        [*args, "--tokens", ",".join(map(str, ids))], check=True, capture_output=True, timeout=900
    )
    return torch.load(out, weights_only=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--transcoders", default=None)
    parser.add_argument("--prompt", default="ROMEO:\nO, she is")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--circuit-tracer-python", default=os.environ.get("LLMCLI_CIRCUIT_TRACER_PYTHON")
    )
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    run = load_run(args.checkpoint)
    transcoders = open_transcoders(run, args.transcoders)
    ids = prompt_tokens(run, args.prompt, print)
    ours_s, theirs_s = [], []
    with tempfile.TemporaryDirectory() as tmp:
        export = Path(tmp) / "export"
        if args.circuit_tracer_python:
            export_hf(run.run_dir, export)
        for _ in range(args.rounds):
            start = time.perf_counter()
            graph = attribute_graph(run.model, transcoders.transcoders, ids)
            ours_s.append(time.perf_counter() - start)
            if args.circuit_tracer_python:
                theirs = circuit_tracer(
                    args.circuit_tracer_python,
                    export,
                    transcoders.folder,
                    ids.tolist(),
                    Path(tmp) / "ct.pt",
                )
                theirs_s.append(float(theirs["seconds"]))
    A = graph.adjacency_matrix
    result = {
        "benchmark": "graph_speed",
        "machine": {
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "load_avg_start": [round(x, 2) for x in load_start],
            "load_avg_end": [round(x, 2) for x in os.getloadavg()],
        },
        "model": {
            "n_layer": run.model.n_layer,
            "n_embed": run.model.n_embed,
            "vocab_size": run.model.vocab_size,
            "features_per_layer": transcoders.transcoders.d_transcoder,
        },
        "tokens": len(ids),
        "nodes": A.shape[0],
        "active_features": len(graph.active_features),
        "logits": len(graph.logit_targets),
        "adjacency_mb": round(A.numel() * A.element_size() / 2**20, 3),
        "forward_activations_mb": round(
            256 * len(ids) * run.model.n_embed * 4 * 12 * run.model.n_layer / 2**20, 3
        ),
        "seconds": {"llmcli": [round(s, 3) for s in ours_s]},
        "median_s": {"llmcli": round(statistics.median(ours_s), 3)},
        "checks": vars(graph.checks),
    }
    if theirs_s:
        B = theirs["adjacency_matrix"]
        result["seconds"]["circuit_tracer"] = [round(s, 3) for s in theirs_s]
        result["median_s"]["circuit_tracer"] = round(statistics.median(theirs_s), 3)
        result["llmcli_over_circuit_tracer_time"] = round(
            statistics.median(ours_s) / statistics.median(theirs_s), 3
        )
        same_shape = B.shape == A.shape
        result["same_graph"] = {
            "shape": same_shape,
            "max_abs_difference_over_max_edge": float((A - B).abs().max() / B.abs().max())
            if same_shape
            else None,
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
