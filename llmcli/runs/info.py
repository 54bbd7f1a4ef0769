"""What a run is: its model size, training summary, recorded versions and generation defaults.

`llmcli info` prints `run_info()`; the versions recorded at training time are compared with the
installed ones (see `llmcli.runs.versions`), and the run is placed against its shipped config's
reference curve (see `llmcli.runs.reference`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmcli.data.chat_template import TEMPLATE_FILE
from llmcli.progress import counted, format_bytes
from llmcli.runs.directory import ADAPTER_CONFIG_FILE, METRICS_FILE
from llmcli.runs.loading import load_run
from llmcli.runs.metrics import best_eval, best_figures, format_figures, read_metrics
from llmcli.runs.reference import ReferenceCheck, check_run, describe
from llmcli.runs.versions import record, warnings_for


def run_info(
    checkpoint: str | Path | None = None,
    *,
    weights: str = "best",
    notify: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Summarise a run directory (None: the latest run under checkpoints/).

    `notify` receives the lines `load_run` has for the user (the run picked, version warnings).

    Returns:
        A JSON-ready dict with `run_dir`, `weights`, `model` (config and parameter counts),
        `training` (steps, tokens, elapsed, best val loss), `versions` (recorded and installed),
        `version_warnings`, `generation` (the `sample:` defaults), `tokenizer`, `chat` (whether
        it holds a chat template, and meta.json's `chat_data`), `preference` (a DPO run's),
        `grpo` (a GRPO run's), `lora` (a LoRA run's adapters, see `_lora`; None for others) and
        `reference` (`ReferenceCheck.to_dict()`: the offset from the reference curve at the last
        evaluation and the differing curve keys, or `missing` saying why there is none).
    """
    run = load_run(checkpoint, weights=weights, notify=notify)
    meta = run.meta
    records = read_metrics(run.run_dir / METRICS_FILE)
    best_val, best_step = best_eval(records)
    if meta.get("best_val_loss") is not None:
        best_val, best_step = float(meta["best_val_loss"]), meta.get("best_step", best_step)
    # The run's objective names the figures that say how it does (meta.json's `figures`, since
    # llmcli.objectives; older runs: the loss alone): their values at the best evaluation.
    shows_loss, figures = best_figures(records, best_step, meta)
    config = run.config.to_dict()
    return {
        "run_dir": str(run.run_dir),
        "weights": str(run.weights_path),
        "weights_step": run.step,
        "model": {
            **config["model"],
            "vocab_size": run.model.vocab_size,
            "parameters": run.model.num_parameters(),
            "non_embedding_parameters": run.model.num_parameters(non_embedding=True),
        },
        "training": {
            "steps": meta.get("step", run.step),
            "max_steps": meta.get("max_steps", config["train"]["max_steps"]),
            "tokens": meta.get("tokens"),
            "elapsed_s": meta.get("elapsed_s"),
            "best_val_loss": best_val if shows_loss else None,
            "best_step": best_step,
            "best_figures": figures,
            "device": meta.get("device"),
            "dtype": meta.get("dtype"),
            # the model FLOPs utilisation at the last log step, and the peak it divides by
            "mfu": next((r["mfu"] for r in reversed(records) if "mfu" in r), None),
            "peak_flops": meta.get("peak_flops"),
        },
        "tokenizer": {
            "kind": config["data"]["tokenizer"],
            "vocab_size": run.model.vocab_size,
            "training": meta.get("tokenizer_training"),
        },
        "chat": {
            "template": (run.run_dir / TEMPLATE_FILE).is_file(),
            "data": meta.get("chat_data"),
        },
        "preference": _preference(config, meta),
        "grpo": _grpo(config, meta),
        "lora": _lora(run.run_dir, config, meta),
        "generation": config["sample"],
        "versions": {"recorded": meta.get("versions"), "installed": record()},
        "version_warnings": warnings_for(meta.get("versions")),
        "reference": check_run(run.run_dir, config, meta).to_dict(),
    }


def format_info(info: dict[str, Any]) -> str:
    """`run_info()` as aligned text for a terminal."""
    model, training = info["model"], info["training"]
    recorded = info["versions"]["recorded"] or {}
    installed = info["versions"]["installed"]
    rows = [
        ("run", info["run_dir"]),
        ("weights", f"{info['weights']} (step {info['weights_step']})"),
        (
            "model",
            f"{model['n_layer']} layers, {model['n_head']} heads, n_embed "
            f"{model['n_embed']}, context {model['context_length']}, vocab "
            f"{model['vocab_size']}",
        ),
        (
            "parameters",
            f"{model['parameters']:,} ({model['non_embedding_parameters']:,} without embeddings)",
        ),
        (
            "options",
            ", ".join(
                f"{k}={model[k]}" for k in ("pos_emb", "norm", "qk_norm", "mlp", "tie_embeddings")
            ),
        ),
        ("steps", f"{training['steps']} of {training['max_steps']}"),
        ("tokens", f"{training['tokens']:,}" if training["tokens"] is not None else "unknown"),
        (
            "elapsed",
            f"{training['elapsed_s']:.1f} s" if training["elapsed_s"] is not None else "unknown",
        ),
        *_best_rows(training),
        *_mfu_rows(training),
        ("tokenizer", describe_tokenizer(info["tokenizer"])),
        ("chat template", describe_chat(info["chat"])),
        *([("dpo", describe_preference(info["preference"]))] if info["preference"] else []),
        *([("grpo", describe_grpo(info["grpo"]))] if info.get("grpo") else []),
        *([("lora", describe_lora(info["lora"]))] if info.get("lora") else []),
        ("generation", ", ".join(f"{k}={v}" for k, v in info["generation"].items())),
        *describe(ReferenceCheck(**info["reference"])),
    ]
    for name in sorted(set(recorded) | set(installed)):
        rows.append(
            (
                f"version {name}",
                f"{recorded.get(name, '-')} (installed {installed.get(name) or '-'})",
            )
        )
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def _mfu_rows(training: dict[str, Any]) -> list[tuple[str, str]]:
    """The model FLOPs utilisation at the last log step, against the measured peak (runs from
    before llmcli measured it have none)."""
    mfu, peak = training.get("mfu"), training.get("peak_flops")
    if mfu is None or not peak:
        return []
    return [("mfu", f"{100 * mfu:.1f}% at the last log step, of {peak / 1e9:,.0f} GFLOP/s")]


def _best_rows(training: dict[str, Any]) -> list[tuple[str, str]]:
    """The best evaluation's loss (where it means something) and its objective's figures."""
    best, step, figures = training["best_val_loss"], training["best_step"], training["best_figures"]
    rows = []
    if best is not None or not figures:
        rows.append(("best val loss", f"{best:.4f} at step {step}" if best is not None else None))
    if figures and step is not None:
        rows.append(("best evaluation", f"{format_figures(figures)} at step {step}"))
    return [(name, text or "no evaluation yet") for name, text in rows]


def describe_chat(chat: dict[str, Any]) -> str:
    """The chat row: whether the run holds a chat template, and how its conversations fit."""
    if not chat["template"]:
        return "none (trained on plain text)"
    text = f"yes ({TEMPLATE_FILE})"
    train = (chat.get("data") or {}).get("train")
    if train:
        text += (
            f"; {counted(train['conversations'], 'training conversation')}: "
            f"{train['kept']:,} kept, {train['truncated']:,} truncated, "
            f"{train['skipped']:,} skipped"
        )
    return text


def _preference(config: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any] | None:
    """A DPO run's objective: its beta, its reference (`train.init_from`) and how its pairs
    fit (None for other runs)."""
    train = config["train"]
    if train.get("objective") != "dpo":
        return None
    return {
        "beta": train.get("dpo_beta"),
        "loss_type": train.get("loss_type"),  # null: sigmoid
        "loss_weights": train.get("loss_weights"),
        "reference": train.get("init_from"),
        "data": meta.get("preference_data"),
    }


def _grpo(config: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any] | None:
    """A GRPO run's objective: its group size, reward, KL weight, the run it started from and
    how its prompts fit (None for other runs)."""
    train = config["train"]
    if train.get("objective") != "grpo":
        return None
    keys = ("group_size", "reward", "scale_rewards", "grpo_beta", "init_from")
    return {**{key: train.get(key) for key in keys}, "data": meta.get("prompt_data")}


def describe_grpo(grpo: dict[str, Any]) -> str:
    """The GRPO row: the group, the reward, the KL weight, the start, and the prompts kept."""
    text = (
        f"{grpo['group_size']} completions a prompt, reward {grpo['reward']}, KL weight "
        f"{grpo['grpo_beta']}, from {grpo['init_from']}"
    )
    train = (grpo.get("data") or {}).get("train")
    if train:
        text += f"; {counted(train['prompts'], 'training prompt')}: {train['kept']:,} kept, "
        text += f"{train['skipped']:,} skipped"
    return text


def _lora(run_dir: Path, config: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any] | None:
    """A LoRA run's adapters: `train.lora`'s settings, the base (`train.init_from`), the
    adapter and trainable parameter counts `meta.json` records (None where it does not), and
    whether the run holds them in PEFT's format (None for other runs)."""
    train = config["train"]
    if not train.get("lora"):
        return None
    counts = meta.get("lora") or {}
    return {
        **train["lora"],
        "base": train.get("init_from"),
        "adapter_parameters": counts.get("adapters"),
        "trainable_parameters": counts.get("trainable"),
        "peft_adapter": (run_dir / ADAPTER_CONFIG_FILE).is_file(),
    }


def describe_lora(lora: dict[str, Any]) -> str:
    """The LoRA row: rank, alpha, targets, the parameters that train, and the PEFT files."""
    text = f"rank {lora['rank']}, alpha {lora['alpha']:g} on {', '.join(lora['targets'])}"
    if lora["adapter_parameters"] is not None:
        text += f"; {lora['adapter_parameters']:,} adapter parameters"
        if lora["trainable_parameters"] != lora["adapter_parameters"]:
            text += f" ({lora['trainable_parameters']:,} train with the new tokens' matrices)"
    text += f"; base {lora['base']}"
    if lora["peft_adapter"]:
        text += f"; in PEFT's format ({ADAPTER_CONFIG_FILE})"
    return text


def describe_preference(preference: dict[str, Any]) -> str:
    """The DPO row: beta, the loss types (where not the default), the reference, and how the
    training pairs fit."""
    text = f"beta {preference['beta']}"
    for key, name in (("loss_type", "loss"), ("loss_weights", "weighted")):
        value = preference.get(key)
        if value is not None:
            text += f", {name} {','.join(map(str, value)) if isinstance(value, list) else value}"
    text += f" against {preference['reference']}"
    train = (preference.get("data") or {}).get("train")
    if train:
        text += (
            f"; {counted(train['pairs'], 'training pair')}: {train['kept']:,} kept, "
            f"{train['truncated']:,} truncated, {train['skipped']:,} skipped"
        )
    return text


def describe_tokenizer(tokenizer: dict[str, Any]) -> str:
    """The tokenizer row: its kind and size, and what text it was trained on where known."""
    training = tokenizer.get("training") or {}
    kind = {"char": "char", "bpe": "byte-level BPE"}.get(tokenizer["kind"], tokenizer["kind"])
    text = f"{kind}, vocab {tokenizer['vocab_size']:,}"
    fed, corpus = training.get("trained_on_bytes"), training.get("corpus_bytes")
    if training.get("kind") == "given":
        return f"{text}, given as data.tokenizer ({training.get('name')})"
    if not isinstance(fed, int):
        return text
    if training.get("sample") is None:
        return f"{text}, trained on the whole corpus ({format_bytes(fed)})"
    whole = f" of {format_bytes(corpus)}" if isinstance(corpus, int) else " of a stream"
    sample = f"data.tokenizer_sample {training['sample']}"
    return f"{text}, trained on {format_bytes(fed)}{whole} ({sample})"
