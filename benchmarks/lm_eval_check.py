"""An exported run in EleutherAI's lm-evaluation-harness: its bits per byte against `llmcli eval`.

`lm-eval` (with its `hf` extra) is too heavy for the test extra, so this runs the real harness
once, outside the test suite: the run is exported (`llmcli export`), the harness scores one text
with a local `loglikelihood_rolling` task (no dataset download: `HF_*_OFFLINE=1`), and
`llmcli eval --data` scores the same text. Prints JSON: both bits-per-byte figures and their
relative difference (target: within 0.5%; the harness cuts its windows one token differently).

Usage:
    python benchmarks/lm_eval_check.py --run checkpoints/speedrun-cpu [--text FILE]
        [--lm-eval PATH/TO/lm_eval] [--bytes 20000]

Without `--text`, the text is the last `--bytes` bytes of `data/tinyshakespeare.txt` (inside the
validation split of the shipped configs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK = """task: llmcli_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def run(cmd: list[str], env: dict[str, str]) -> str:
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="the run directory to export and score")
    parser.add_argument("--text", default=None, help="a UTF-8 text file (default: see above)")
    parser.add_argument("--bytes", type=int, default=20_000, help="bytes of the default text")
    parser.add_argument("--lm-eval", default=shutil.which("lm_eval") or "lm_eval")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="llmcli-lm-eval-"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    text_path = Path(args.text) if args.text else work / "text.txt"
    if args.text is None:
        corpus = (ROOT / "data" / "tinyshakespeare.txt").read_bytes()
        text_path.write_bytes(corpus[-args.bytes :])
    text = text_path.read_text(encoding="utf-8")
    (work / "tasks").mkdir()
    (work / "tasks" / "doc.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (work / "tasks" / "llmcli_text.yaml").write_text(TASK.format(data=work / "tasks" / "doc.jsonl"))

    llmcli = [sys.executable, "-m", "llmcli"]
    run([*llmcli, "export", "--checkpoint", args.run, "--out", str(work / "hf")], env)
    ours = json.loads(
        run([*llmcli, "eval", "--checkpoint", args.run, "--data", str(text_path), "--json"], env)
    )
    run(
        [
            args.lm_eval,
            "--model",
            "hf",
            "--model_args",
            f"pretrained={work / 'hf'},dtype=float32",
            "--tasks",
            "llmcli_text",
            "--include_path",
            str(work / "tasks"),
            "--device",
            "cpu",
            "--batch_size",
            "1",
            "--output_path",
            str(work / "out"),
        ],
        env,
    )
    (results_file,) = sorted((work / "out").rglob("results_*.json"))
    theirs = json.loads(results_file.read_text())["results"]["llmcli_text"]
    harness_bpb = theirs.get("bits_per_byte,none", theirs.get("bits_per_byte"))
    config = json.loads((work / "hf" / "config.json").read_text())
    print(
        json.dumps(
            {
                "run": args.run,
                "architecture": config["model_type"],
                "text": str(text_path),
                "text_bytes": len(text.encode("utf-8")),
                "llmcli_eval_bits_per_byte": ours["bits_per_byte"],
                "lm_eval_bits_per_byte": harness_bpb,
                "relative_difference": harness_bpb / ours["bits_per_byte"] - 1,
            },
            indent=1,
        )
    )
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
