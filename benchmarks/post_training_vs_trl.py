"""Post-training side by side with TRL: llmcli's DPO step against TRL's DPOTrainer, and GRPO's
update against GRPOTrainer's, on the same weights and the same data.

    python benchmarks/post_training_vs_trl.py [--objective dpo grpo] [--threads 1 2]
        [--rounds 3] [--steps 30] [--work DIR]

The setting: a tiny GPT-2-layout chat run (4 layers of 128, context 128, learned positions,
LayerNorm, tied embeddings) whose tokenizer is a 512-token byte-level BPE trained on
`data/chat-train.jsonl`, with the chat tokens; its weights are random (a step costs the same
whatever they are), and TRL reads them through `llmcli export`'s Hugging Face folder.

Each way trains in a process of its own, through its own training loop (`llmcli.training.loop`
as `llmcli train` runs it; TRL's `Trainer.train`), for `--steps` steps; a step's time is the time
between two consecutive steps' ends (llmcli's `on_step`; a `TrainerCallback.on_step_end`), so
all a loop does per step counts, and the median of steps 11 on is its steady state (the first
steps warm the allocator, and llmcli scores the reference once before them). The ways run in
interleaved rounds, their order rotating, so that a busy machine slows each alike:

- DPO, 8 pairs of `data/dpo-train.jsonl` a step (beta 0.1): `llmcli` (`train.objective: dpo`:
  rows packed whole into rows of the context, the reference's scores computed once), `trl`
  (DPOTrainer with its defaults: the reference's forward in every step, activation
  checkpointing) and `trl_no_checkpointing` (the same without checkpointing). `speed_vs_*` is
  TRL's step time over llmcli's: above 1, llmcli is faster.
- GRPO, 4 prompts of `data/grpo-train.jsonl` x 8 completions of up to 32 tokens at temperature
  1 (TRL's defaults otherwise: beta 0, loss `dapo`, one iteration), rewarded by the share of the
  answer's characters a completion holds: the sampling (llmcli's `GRPOObjective.shares`; TRL's
  `_generate_and_score_completions`: generation, rewards and advantages in both) is timed apart
  from the step, and `update` is the step less its sampling; `token_speed_vs_*` compares the
  updates per completion token (each library stops a reply at its own end tokens, so their
  replies' mean lengths, `*_completion_length`, differ a little).

`dpo_packing_1t` times DPO's forward and backward on those rows packed (llmcli's way) against
the rows cut to their batch's longest, one a row, in one process.

Equal losses: first, both train 10 steps on the same 8 pairs
at every step with the same optimizer (AdamW, lr 1e-4 constant, betas 0.9 and 0.999, no
weight decay, gradients clipped to 1.0), and `dpo_loss_max_diff` is the largest difference of
their per-step losses. GRPO's loss is TRL's by `tests/test_grpo_loss.py` (TRL's own loss on the
same completions); sampled completions differ between two libraries, so their losses are not
compared here.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = {"n_layer": 4, "n_head": 4, "n_embed": 128, "context_length": 128, "dropout": 0.0}
PAIRS, PROMPTS, GROUP, NEW_TOKENS = 8, 4, 8, 32
WAYS = {
    "dpo": ("llmcli", "trl", "trl_no_checkpointing"),
    "grpo": ("llmcli", "trl", "trl_no_checkpointing"),
}
EQUAL = {"lr": 1e-4, "steps": 10}
REWARD = '''
def overlap(prompt, completion, answer):
    """The share of the answer's characters that the completion holds."""
    return sum(ch in completion for ch in answer) / max(len(answer), 1)
'''


def prepare(work: Path) -> None:
    """The base run, its export, the pairs, the prompts and the reward file, in `work`."""
    import torch

    from llmcli.cli import main as llmcli_main
    from llmcli.config import DataConfig, config_from_dict
    from llmcli.data.chat_template import default_template
    from llmcli.data.conversations import add_chat_tokens
    from llmcli.data.tokenizer import train_tokenizer
    from llmcli.model.gpt import Transformer
    from llmcli.runs.directory import save_model_run

    rows = [json.loads(line) for line in (ROOT / "data" / "chat-train.jsonl").open()]
    texts = [turn["content"] for row in rows for turn in row["messages"]]
    tokenizer = add_chat_tokens(train_tokenizer(DataConfig(tokenizer="bpe", vocab_size=512), texts))
    config = config_from_dict({"model": MODEL, "data": {"format": "chat"}})
    model = Transformer(
        config.model, tokenizer.vocab_size, generator=torch.Generator().manual_seed(0)
    )
    save_model_run(work / "base", config, tokenizer, model)
    default_template().save(work / "base")
    try:  # its report on stderr: stdout is the benchmark's one JSON object
        with contextlib.redirect_stdout(sys.stderr):
            llmcli_main(["export", "--checkpoint", str(work / "base"), "--out", str(work / "hf")])
    except SystemExit as exc:
        assert exc.code == 0, exc.code
    for name, source, n in (("pairs", "dpo-train", PAIRS), ("prompts", "grpo-train", 64)):
        lines = (ROOT / "data" / f"{source}.jsonl").read_text().splitlines()[:n]
        (work / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    (work / "reward.py").write_text(REWARD)


# --- the workers: each trains one way in its own process and prints its times -----------------


def llmcli_config(work: Path, objective: str, steps: int, threads: int, equal: bool):
    from llmcli.config import config_from_dict

    train = {
        "objective": objective,
        "init_from": str(work / "base"),
        "device": "cpu",
        "max_steps": steps,
        "threads": threads,
        "eval_interval": steps,
        "eval_steps": 1,
        "log_interval": 1 if equal else 10,
        "seed": 0,
    }
    if objective == "dpo":
        pairs = str(work / "pairs.jsonl")  # the validation split too: every pair trains
        data = {"format": "preference", "path": pairs, "val_path": pairs}
        train |= {"batch_size": PAIRS, "dpo_beta": 0.1}
    else:
        prompts = str(work / "prompts.jsonl")
        data = {"format": "prompts", "path": prompts, "val_path": prompts}
        train |= {"batch_size": PROMPTS, "group_size": GROUP, "reward": f"{work}/reward.py:overlap"}
    if equal:
        lr = EQUAL["lr"]
        train |= {"lr": lr, "min_lr": lr, "warmup_steps": 0, "weight_decay": 0.0, "beta2": 0.999}
    sample = {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "top_k": None}
    raw = {"model": {"dropout": 0.0}, "data": data, "train": train, "sample": sample}
    return config_from_dict(raw, name=objective)


def run_llmcli(work: Path, objective: str, steps: int, threads: int, equal: bool) -> dict:
    from llmcli.data.preference_data import PreferenceSampler
    from llmcli.objectives.grpo import GRPOObjective
    from llmcli.runs.metrics import read_metrics
    from llmcli.training.loop import train

    if equal:  # every step the same pairs, as TRL's one batch of the 8-row dataset
        PreferenceSampler.draw = lambda self, n: list(range(n))
    sampling: list[float] = []
    shares = GRPOObjective.shares

    def timed_shares(self, *args, **kwargs):
        start = time.perf_counter()
        out = shares(self, *args, **kwargs)
        sampling.append(time.perf_counter() - start)
        return out

    GRPOObjective.shares = timed_shares
    ends: list[float] = []
    out = Path(tempfile.mkdtemp(dir=work))
    config = llmcli_config(work, objective, steps, threads, equal)
    train(config, out_dir=out, progress=False, on_step=lambda _: ends.append(time.perf_counter()))
    records = [r for r in read_metrics(out / "metrics.jsonl") if r["kind"] == "train"]
    lengths = [r["completions/mean_length"] for r in records if "completions/mean_length" in r]
    losses = [r["train_loss"] for r in records]
    return {"ends": ends, "sampling": sampling, "losses": losses, "lengths": lengths}


def run_trl(work: Path, objective: str, steps: int, checkpointing: bool, equal: bool) -> dict:
    import datasets
    import transformers
    import trl

    hf = work / "hf"
    common = {
        "output_dir": str(work / "trl-out"),
        "use_cpu": True,
        "bf16": False,
        "report_to": [],
        "max_steps": steps,
        "save_strategy": "no",
        "gradient_checkpointing": checkpointing,
        "disable_tqdm": True,
        "seed": 0,
        "logging_steps": 1 if equal else 10,
    }
    if equal:
        common |= {"learning_rate": EQUAL["lr"], "lr_scheduler_type": "constant"}
    rows = [
        json.loads(line)
        for line in (work / f"{'pairs' if objective == 'dpo' else 'prompts'}.jsonl").open()
    ]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    if objective == "dpo":
        args = trl.DPOConfig(per_device_train_batch_size=PAIRS, **common)
        trainer = trl.DPOTrainer(
            model=model,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tokenizer,
        )
    else:
        namespace: dict = {}
        exec(REWARD, namespace)  # the llmcli run's reward file, as a TRL reward function

        def overlap(completions, answer, **_):
            texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
            return [namespace["overlap"](None, t, a) for t, a in zip(texts, answer, strict=True)]

        args = trl.GRPOConfig(
            per_device_train_batch_size=PROMPTS * GROUP,
            num_generations=GROUP,
            max_completion_length=NEW_TOKENS,
            **common,
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=overlap,
            args=args,
            train_dataset=datasets.Dataset.from_list(rows),
            processing_class=tokenizer,
        )
    sampling: list[float] = []
    losses: list[float] = []
    ends: list[float] = []
    step = trainer.training_step
    if objective == "grpo":
        generate = trainer._generate_and_score_completions

        def timed_generate(*args, **kwargs):
            start = time.perf_counter()
            out = generate(*args, **kwargs)
            sampling.append(time.perf_counter() - start)
            return out

        trainer._generate_and_score_completions = timed_generate

    def recorded_step(*args, **kwargs):
        loss = step(*args, **kwargs)
        losses.append(float(loss))
        return loss

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            ends.append(time.perf_counter())

    trainer.training_step = recorded_step
    trainer.add_callback(Clock())
    trainer.train()
    logged = trainer.state.log_history
    lengths = [r["completions/mean_length"] for r in logged if "completions/mean_length" in r]
    return {"ends": ends, "sampling": sampling, "losses": losses, "lengths": lengths}


def worker(args: argparse.Namespace) -> None:
    import torch

    threads = args.threads[0]
    torch.set_num_threads(threads)
    work, way = Path(args.work), args.worker
    if way == "llmcli":
        out = run_llmcli(work, args.objective[0], args.steps, threads, args.equal)
    else:
        checkpointing = way == "trl"
        out = run_trl(work, args.objective[0], args.steps, checkpointing, args.equal)
    print("RESULT " + json.dumps(out))


def packing(work: Path, threads: int, rounds: int = 15) -> dict[str, float]:
    """A DPO step's forward and backward (`llmcli.objectives.dpo.dpo_step`, the reference's
    scores given) on the benchmark's 8 pairs, the 16 rows packed whole into rows of the context
    (what llmcli does where it saves positions: `llmcli.objectives.packing`) against the rows
    cut to their longest, one a row."""
    import torch

    from llmcli.data.preference_data import pair_batch
    from llmcli.model.gpt import Transformer
    from llmcli.objectives import dpo, objective_for, preference_scores
    from llmcli.objectives.dpo import dpo_step
    from llmcli.objectives.dpo_losses import DPOLoss
    from llmcli.training.init_from import load_init_weights, resolve_init_from

    torch.set_num_threads(threads)
    config = resolve_init_from(llmcli_config(work, "dpo", 1, threads, False))
    data = objective_for(config).read_data(None)
    pairs = data.preference
    ids, mask = pair_batch(pairs.train, list(range(PAIRS)), pairs.pad_id)  # (2B, L)
    model = Transformer(config.model, data.tokenizer.vocab_size)
    load_init_weights(model, str(work / "base"))
    loss = DPOLoss.from_config(config.train)
    with torch.no_grad():
        reference = preference_scores.completion_logps(model, ids, mask)
    plan = dpo.packing_for
    packed = plan(model, mask)
    assert packed is not None, "the benchmark's pairs should pack"

    def step(way: str) -> None:
        dpo.packing_for = plan if way == "packed" else (lambda model, mask: None)
        dpo_step(model, reference, ids, mask, loss)[0].backward()

    times: dict[str, list[float]] = {"cut": [], "packed": []}
    for way in times:  # warm-up
        step(way)
    for r in range(rounds):
        for way in ("cut", "packed")[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            for _ in range(5):
                step(way)
            times[way].append((time.perf_counter() - start) / 5)
    dpo.packing_for = plan
    cut_s, packed_s = (statistics.median(times[k]) for k in ("cut", "packed"))
    return {
        "positions_cut": int(ids[:, 1:].numel()),
        "positions_packed": int(packed.real.numel()),
        "positions_real": int(packed.real.sum()),
        "cut_s": round(cut_s, 5),
        "packed_s": round(packed_s, 5),
        "packed_over_cut": round(packed_s / cut_s, 3),
    }


# --- the parent: rounds of workers, then the figures -------------------------------------------


def spawn(work: Path, objective: str, way: str, steps: int, threads: int, equal: bool) -> dict:
    command = [sys.executable, __file__, "--worker", way, "--work", str(work)]
    command += ["--objective", objective, "--steps", str(steps), "--threads", str(threads)]
    command += ["--equal"] if equal else []
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": str(ROOT),
    }
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{way} ({objective}) failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def steady(out: dict, skip: int = 10) -> dict[str, float]:
    """The median step, and of its sampling, from step `skip + 1` on."""
    ends = out["ends"]
    steps = [b - a for a, b in zip(ends[skip - 1 :], ends[skip:], strict=False)]
    figures = {"step_s": statistics.median(steps)}
    if out["lengths"]:  # the same work on both sides: completions of about the same length
        figures["completion_length"] = statistics.mean(out["lengths"])
    if out["sampling"]:
        sampling = out["sampling"][skip : skip + len(steps)]
        figures["sampling_s"] = statistics.median(sampling)
        figures["update_s"] = statistics.median(
            s - g for s, g in zip(steps, sampling, strict=False)
        )
    return figures


def measure(work: Path, objective: str, threads: int, rounds: int, steps: int) -> dict:
    ways = WAYS[objective]
    per_round: dict[str, list[dict]] = {way: [] for way in ways}
    for r in range(rounds):
        order = ways[r % len(ways) :] + ways[: r % len(ways)]
        for way in order:
            per_round[way].append(steady(spawn(work, objective, way, steps, threads, False)))
    result: dict[str, float] = {}
    for way, figures in per_round.items():
        for name in figures[0]:
            result[f"{way}_{name}"] = round(statistics.median(f[name] for f in figures), 5)
    for peer in ways[1:]:
        key = "update_s" if objective == "grpo" else "step_s"
        result[f"speed_vs_{peer}"] = round(result[f"{peer}_{key}"] / result[f"llmcli_{key}"], 3)
        if objective == "grpo":
            total = result[f"{peer}_step_s"] / result["llmcli_step_s"]
            result[f"step_speed_vs_{peer}"] = round(total, 3)
            # the update's time per completion token: the two sample replies of other lengths
            ours = result["llmcli_update_s"] / result["llmcli_completion_length"]
            theirs = result[f"{peer}_update_s"] / result[f"{peer}_completion_length"]
            result[f"token_speed_vs_{peer}"] = round(theirs / ours, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--objective", nargs="+", default=["dpo", "grpo"], choices=["dpo", "grpo"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--work", default=None, help="a folder for the runs (default: a temporary one)"
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--equal", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import torch
    import transformers
    import trl

    work = Path(args.work or tempfile.mkdtemp(prefix="post-training-vs-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    prepare(work)
    result: dict = {"benchmark": "post_training_vs_trl", "steps": args.steps, "rounds": args.rounds}
    if "dpo" in args.objective:
        ours = spawn(work, "dpo", "llmcli", EQUAL["steps"], 1, True)["losses"]
        theirs = spawn(work, "dpo", "trl_no_checkpointing", EQUAL["steps"], 1, True)["losses"]
        result["dpo_losses"] = {"llmcli": ours, "trl": theirs}
        result["dpo_loss_max_diff"] = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
        result["dpo_packing_1t"] = packing(work, 1)
    for objective in args.objective:
        for threads in args.threads:
            result[f"{objective}_{threads}t"] = measure(
                work, objective, threads, args.rounds, args.steps
            )
    result |= {
        "setting": {
            "model": MODEL,
            "vocab": "BPE 512 + chat tokens",
            "pairs": PAIRS,
            "prompts": PROMPTS,
            "group": GROUP,
            "max_new_tokens": NEW_TOKENS,
        },
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
