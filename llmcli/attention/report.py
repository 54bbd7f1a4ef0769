"""Look inside a trained model's attention: capture every head, score it, dump it, draw it.

The seed warns that averaged attention weights hide differences between individual heads, so
everything here keeps the heads apart: `capture_attention` records the softmax weights of every
layer and head through the model's explicit attention path, `head_metrics` says what each head
does (entropy, previous-token, first-token/sink, distance, induction), `save_dump` writes
`attention.npz` (or `.safetensors` / `.json`) and `plot_layers` one PNG per layer. The offline
HTML viewer lives in `llmcli.attention.viewer`.

Shapes: `L` layers, `H` heads, `T` tokens; an attention map is `[T, T]`, query x key, each row a
probability distribution over the keys at or before the query (causal).

Several prompts are captured in one right-padded batch with a key padding mask. With right
padding every real query sits before every pad key, so the causal mask alone already hides the
padding from real tokens; each dump is then sliced to its own prompt's length, so padding never
appears in a dump (a test checks each dump equals the prompt run alone).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from llmcli.errors import InputError, describe_os_error

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

#: The per-head metrics computed on every prompt, in the order of the `metrics` array's last axis.
METRIC_NAMES: tuple[str, ...] = ("entropy", "prev_token", "first_token", "mean_distance")
#: The extra metric `--induction` appends (computed on a repeated random sequence, not the prompt).
INDUCTION = "induction"
#: Dump formats and their file suffixes.
FORMATS: dict[str, str] = {"npz": ".npz", "safetensors": ".safetensors", "json": ".json"}


# --------------------------------------------------------------------------------------------
# Metrics: pure NumPy functions of attention maps [..., T, T] -> [...].
# Query 0 can only attend to itself, so it carries no information about a head and would pull
# every score towards "attends to position 0 with certainty": all metrics average over the
# queries 1..T-1. A map with T == 1 has no such query and scores NaN.
# --------------------------------------------------------------------------------------------


def _check_maps(attn: np.ndarray) -> np.ndarray:
    attn = np.asarray(attn, dtype=np.float64)
    if attn.ndim < 2 or attn.shape[-1] != attn.shape[-2]:
        raise ValueError(f"attention maps must be [..., T, T], got shape {attn.shape}")
    return attn


def entropy_score(attn: np.ndarray) -> np.ndarray:
    """Normalised entropy: mean over queries q >= 1 of H(row q) / log(q + 1).

    Row q spreads over q + 1 keys, so log(q + 1) is its largest possible entropy: the score is 1
    for uniform attention over the past and 0 for a head that always attends to one key.

    Args:
        attn: attention maps `[..., T, T]` (query x key, rows sum to 1).

    Returns:
        `[...]` scores in [0, 1] (NaN when T == 1).
    """
    attn = _check_maps(attn)
    T = attn.shape[-1]
    if T < 2:
        return np.full(attn.shape[:-2], np.nan)
    p = attn[..., 1:, :]  # (..., T-1, T)
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    ent = -plogp.sum(-1)  # (..., T-1)
    return (ent / np.log(np.arange(2, T + 1))).mean(-1)


def prev_token_score(attn: np.ndarray) -> np.ndarray:
    """Previous-token score: mean over queries q >= 1 of attn[q, q - 1].

    Args:
        attn: attention maps `[..., T, T]`.

    Returns:
        `[...]` scores in [0, 1] (NaN when T == 1).
    """
    attn = _check_maps(attn)
    if attn.shape[-1] < 2:
        return np.full(attn.shape[:-2], np.nan)
    return np.diagonal(attn, offset=-1, axis1=-2, axis2=-1).mean(-1)  # (..., T-1) -> (...)


def first_token_score(attn: np.ndarray) -> np.ndarray:
    """First-token (attention sink) score: mean over queries q >= 1 of attn[q, 0].

    Args:
        attn: attention maps `[..., T, T]`.

    Returns:
        `[...]` scores in [0, 1] (NaN when T == 1).
    """
    attn = _check_maps(attn)
    if attn.shape[-1] < 2:
        return np.full(attn.shape[:-2], np.nan)
    return attn[..., 1:, 0].mean(-1)


def mean_distance(attn: np.ndarray) -> np.ndarray:
    """Mean attention distance: mean over queries q >= 1 of sum_k attn[q, k] * |q - k|, in tokens.

    0 for a head that attends to itself, 1 for a previous-token head, q / 2 on average for uniform
    attention over the past.

    Args:
        attn: attention maps `[..., T, T]`.

    Returns:
        `[...]` distances in tokens (NaN when T == 1).
    """
    attn = _check_maps(attn)
    T = attn.shape[-1]
    if T < 2:
        return np.full(attn.shape[:-2], np.nan)
    pos = np.arange(T)
    dist = np.abs(pos[:, None] - pos[None, :])  # (T, T)
    return (attn[..., 1:, :] * dist[1:]).sum(-1).mean(-1)  # (..., T-1) -> (...)


def induction_score(attn: np.ndarray, period: int) -> np.ndarray:
    """Induction score on a sequence that repeats itself after `period` tokens (Olsson et al. 2022).

    For every query q in the second copy (period <= q < 2 * period), the same token occurred
    earlier at q - period; an induction head attends to the token after that occurrence,
    q - period + 1. The score is the mean of attn[q, q - period + 1] over those queries.

    Args:
        attn: attention maps `[..., T, T]` over the repeated sequence, T >= 2 * period.
        period: the length of one copy.

    Returns:
        `[...]` scores in [0, 1].
    """
    attn = _check_maps(attn)
    if period < 1 or attn.shape[-1] < 2 * period:
        raise ValueError(f"need T >= 2 * period, got T={attn.shape[-1]}, period={period}")
    q = np.arange(period, 2 * period)
    return attn[..., q, q - period + 1].mean(-1)  # (..., period) -> (...)


def head_metrics(attn: np.ndarray) -> np.ndarray:
    """All of `METRIC_NAMES` for attention maps `[..., T, T]` -> `[..., len(METRIC_NAMES)]`."""
    attn = _check_maps(attn)
    scores = [
        entropy_score(attn),
        prev_token_score(attn),
        first_token_score(attn),
        mean_distance(attn),
    ]
    return np.stack(scores, axis=-1)


def repeated_random_tokens(
    vocab_size: int, period: int, batch: int, generator: torch.Generator
) -> torch.Tensor:
    """Random sequences of `period` tokens, each followed by itself: `(batch, 2 * period)` ids.

    Tokens within one copy are distinct when the vocabulary allows it, so every token of the
    second copy has exactly one earlier occurrence and the induction target is unambiguous.
    """
    import torch

    rows = []
    for _ in range(batch):
        if vocab_size >= period:
            row = torch.randperm(vocab_size, generator=generator)[:period]
        else:
            row = torch.randint(vocab_size, (period,), generator=generator)
        rows.append(torch.cat([row, row]))
    return torch.stack(rows)  # (batch, 2 * period)


# --------------------------------------------------------------------------------------------
# Capture.
# --------------------------------------------------------------------------------------------


def capture_attention(
    model: torch.nn.Module,
    idx: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the model in eval mode (dropout off) and record every layer's per-head weights.

    Goes through `Transformer.forward_with_attention`, the explicit softmax path; the logits are
    those of the normal forward (a test checks it). The model's train/eval mode is restored.

    Args:
        model: a `llmcli.model.Transformer`.
        idx: token ids `(B, T)`, T <= context_length.
        key_padding_mask: optional `(B, T)` bool, True where a key is padding.

    Returns:
        logits `(B, T, vocab)` and attention `(B, L, H, T, T)` (query x key), both float32 CPU.
    """
    import torch

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits, weights = model.forward_with_attention(idx, key_padding_mask=key_padding_mask)
    finally:
        model.train(was_training)
    attn = torch.stack(list(weights), dim=1)  # L x (B, H, T, T) -> (B, L, H, T, T)
    return logits.float().cpu(), attn.float().cpu()


# --------------------------------------------------------------------------------------------
# The dump.
# --------------------------------------------------------------------------------------------


@dataclass
class AttentionDump:
    """One prompt's captured attention and head metrics (what `attention.npz` holds).

    Attributes:
        attn: float32 `[L', H', T, T]` for the selected layers and heads (query x key).
        tokens: the decoded text of each token, `T` strings.
        token_ids: int64 `[T]`.
        metrics: float32 `[L', H', M]`.
        metric_names: `M` names, see `METRIC_NAMES` (+ `INDUCTION`).
        layers: the model layer index of each row of `attn` (`L'` ints).
        heads: the model head index of each column of `attn` (`H'` ints).
        meta: checkpoint path and weights sha256, prompt, config, versions, selection.
    """

    attn: np.ndarray
    tokens: list[str]
    token_ids: np.ndarray
    metrics: np.ndarray
    metric_names: list[str]
    layers: list[int]
    heads: list[int]
    meta: dict[str, Any] = field(default_factory=dict)

    def arrays(self) -> dict[str, np.ndarray]:
        """The dump as named NumPy arrays (no object dtypes: loads with allow_pickle=False)."""
        return {
            "attn": np.ascontiguousarray(self.attn, dtype=np.float32),
            "tokens": np.array(self.tokens, dtype=np.str_).reshape(len(self.tokens)),
            "token_ids": np.asarray(self.token_ids, dtype=np.int64),
            "metrics": np.ascontiguousarray(self.metrics, dtype=np.float32),
            "metric_names": np.array(self.metric_names, dtype=np.str_),
            "layers": np.asarray(self.layers, dtype=np.int64),
            "heads": np.asarray(self.heads, dtype=np.int64),
            "meta": np.array(json.dumps(self.meta, sort_keys=True)),
        }


def _atomic_write(path: Path, write: Any) -> None:
    """Call write(tmp_path) on a temporary file next to `path`, then rename it into place.

    The temporary file is created by `write` itself, so it gets the usual permissions (umask).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _json_floats(a: np.ndarray) -> Any:
    """Nested lists of Python floats, NaN as None (JSON has no NaN)."""
    return [_json_floats(x) for x in a] if a.ndim else (None if np.isnan(a) else float(a))


def save_dump(dump: AttentionDump, path: str | Path, fmt: str = "npz") -> Path:
    """Write a dump atomically as `npz`, `safetensors` or `json`; returns the path.

    - npz: the arrays of `AttentionDump.arrays()`, `meta` a 0-d JSON string.
    - safetensors: the numeric arrays as tensors; `tokens`, `metric_names` and `meta` as JSON
      strings in the header metadata (safetensors holds no string tensors).
    - json: one object with the same keys; `meta` is an object, NaN metrics are null.
    """
    path = Path(path)
    if fmt not in FORMATS:
        raise InputError(f"unknown dump format {fmt!r}: choose one of {', '.join(FORMATS)}.")
    arrays = dump.arrays()
    if fmt == "npz":

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)

    elif fmt == "safetensors":
        from safetensors.numpy import save_file

        tensors = {k: arrays[k] for k in ("attn", "token_ids", "metrics", "layers", "heads")}
        metadata = {
            "tokens": json.dumps(dump.tokens),
            "metric_names": json.dumps(dump.metric_names),
            "meta": json.dumps(dump.meta, sort_keys=True),
        }

        def write(tmp: Path) -> None:
            save_file(tensors, str(tmp), metadata=metadata)

    else:
        obj = {
            "attn": _json_floats(arrays["attn"]),
            "tokens": list(dump.tokens),
            "token_ids": [int(i) for i in arrays["token_ids"]],
            "metrics": _json_floats(arrays["metrics"]),
            "metric_names": list(dump.metric_names),
            "layers": [int(i) for i in dump.layers],
            "heads": [int(i) for i in dump.heads],
            "meta": dump.meta,
        }

        def write(tmp: Path) -> None:
            tmp.write_text(json.dumps(obj, allow_nan=False), encoding="utf-8")

    _atomic_write(path, write)
    return path


def load_dump(path: str | Path) -> AttentionDump:
    """Read a dump written by `save_dump` in any of the three formats (chosen by suffix)."""
    path = Path(path)
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            a = {k: z[k] for k in z.files}
        tokens, names, meta = list(a["tokens"]), list(a["metric_names"]), json.loads(str(a["meta"]))
    elif path.suffix == ".safetensors":
        from safetensors import safe_open
        from safetensors.numpy import load_file

        a = load_file(str(path))
        with safe_open(str(path), framework="numpy") as f:
            md = f.metadata()
        tokens, names, meta = (
            json.loads(md["tokens"]),
            json.loads(md["metric_names"]),
            json.loads(md["meta"]),
        )
    elif path.suffix == ".json":
        obj = json.loads(path.read_text(encoding="utf-8"))
        a = {
            "attn": np.array(obj["attn"], dtype=np.float32),
            "token_ids": np.array(obj["token_ids"], dtype=np.int64),
            "metrics": np.array(obj["metrics"], dtype=np.float64),
            "layers": np.array(obj["layers"], dtype=np.int64),
            "heads": np.array(obj["heads"], dtype=np.int64),
        }
        tokens, names, meta = obj["tokens"], obj["metric_names"], obj["meta"]
    else:
        raise InputError(f"{str(path)!r} is not a dump: expected a .npz, .safetensors or .json.")
    return AttentionDump(
        attn=a["attn"].astype(np.float32).reshape(a["attn"].shape),
        tokens=[str(t) for t in tokens],
        token_ids=a["token_ids"].astype(np.int64),
        metrics=a["metrics"].astype(np.float32),
        metric_names=[str(n) for n in names],
        layers=[int(i) for i in a["layers"]],
        heads=[int(i) for i in a["heads"]],
        meta=meta,
    )


def format_metrics_table(dump: AttentionDump) -> str:
    """The head metrics as a text table: one row per (layer, head), one column per metric."""
    names = dump.metric_names
    width = max(8, *(len(n) for n in names))
    lines = ["layer head  " + "  ".join(f"{n:>{width}}" for n in names)]
    for i, layer in enumerate(dump.layers):
        for j, head in enumerate(dump.heads):
            cells = "  ".join(
                f"{'-':>{width}}" if math.isnan(v) else f"{v:>{width}.3f}"
                for v in dump.metrics[i, j].tolist()
            )
            lines.append(f"{layer:>5} {head:>4}  {cells}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Pictures.
# --------------------------------------------------------------------------------------------


def token_label(text: str) -> str:
    """A token's text made visible on one line: spaces as '␣', newlines as '↵', tabs as '⇥'."""
    if text == "":
        return "∅"
    return text.replace(" ", "␣").replace("\n", "↵").replace("\r", "␍").replace("\t", "⇥")


def _short_label(text: str, limit: int = 10) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def label_step(T: int, max_labels: int = 32) -> int:
    """Label every `step`-th token so that at most `max_labels` labels sit on an axis."""
    return max(1, math.ceil(T / max_labels))


def plot_layers(dump: AttentionDump, out_dir: str | Path) -> list[Path]:
    """One PNG per layer: a heatmap per head plus the mean over the dump's heads.

    Each panel is labelled with the tokens (every `label_step`-th one for long prompts) and
    grows with the prompt, so maps up to the context length stay readable.

    Returns:
        The written paths, `layer-<L>.png` for each layer in the dump.
    """
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    T = len(dump.tokens)
    labels = [_short_label(token_label(t)) for t in dump.tokens]
    step = label_step(T)
    ticks = list(range(0, T, step))
    panel = min(7.0, max(3.0, 1.5 + 0.06 * T))  # inches per heatmap: 5.3 for 64 tokens
    font = 7 if T <= 64 else 6
    n_panels = len(dump.heads) + 1
    ncols = math.ceil(math.sqrt(n_panels))
    nrows = math.ceil(n_panels / ncols)
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="white")
    future = np.triu(np.ones((T, T), dtype=bool), k=1)  # (T, T): keys after the query
    paths = []
    for li, layer in enumerate(dump.layers):
        fig, axes = plt.subplots(
            nrows,
            ncols,
            figsize=(panel * ncols + 1.2, panel * nrows + 0.8),
            squeeze=False,
            gridspec_kw={"wspace": 0.25, "hspace": 0.3},
        )
        maps = [dump.attn[li, hi] for hi in range(len(dump.heads))]
        maps.append(dump.attn[li].mean(axis=0))  # (H', T, T) -> (T, T)
        heads_txt = ",".join(str(h) for h in dump.heads)
        titles = [f"head {h}" for h in dump.heads] + [f"mean of heads {heads_txt}"]
        for k, ax in enumerate(axes.flat):
            if k >= n_panels:
                ax.axis("off")
                continue
            # Keys after the query are masked (blank), not drawn as weight 0.
            shown = np.ma.masked_array(maps[k], mask=future)
            im = ax.imshow(shown, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_title(titles[k], fontsize=9)
            ax.set_xticks(ticks, [labels[i] for i in ticks], rotation=90, fontsize=font)
            ax.set_yticks(ticks, [labels[i] for i in ticks], fontsize=font)
            if k % ncols == 0:
                ax.set_ylabel("query", fontsize=8)
            if k >= n_panels - ncols:
                ax.set_xlabel("key", fontsize=8)
        fig.colorbar(im, ax=axes.ravel().tolist(), shrink=0.6, label="attention weight")
        fig.suptitle(f"layer {layer} ({T} tokens)", fontsize=11)
        path = out_dir / f"layer-{layer}.png"

        def write(tmp: Path, fig: Any = fig) -> None:
            fig.savefig(tmp, dpi=100, format="png", bbox_inches="tight")

        _atomic_write(path, write)
        plt.close(fig)
        paths.append(path)
    return paths


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def select_indices(chosen: Sequence[int] | None, n: int, what: str) -> list[int]:
    """Validate `--layer`/`--head` choices against `n`; None or empty means all. Sorted, unique."""
    if not chosen:
        return list(range(n))
    bad = [i for i in chosen if not 0 <= i < n]
    if bad:
        raise InputError(
            f"--{what} {bad[0]} is out of range: the model has {n} {what}s, numbered 0 to {n - 1}."
        )
    return sorted(set(int(i) for i in chosen))


# --------------------------------------------------------------------------------------------
# Prompts.
# --------------------------------------------------------------------------------------------


def read_prompt_file(path: str | Path) -> list[str]:
    """Prompts from a file: a JSON list of strings, or else one prompt per line.

    In the line format blank lines are skipped and the newline ending each line is not part of
    the prompt; a prompt that must contain newlines needs the JSON form.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"--prompt-file {str(path)!r} does not exist: check the path.") from None
    except UnicodeDecodeError:
        raise InputError(f"--prompt-file {str(path)!r} is not UTF-8 text.") from None
    except OSError as exc:
        raise InputError(f"cannot read --prompt-file {str(path)!r}: {exc.strerror}.") from None
    if path.suffix == ".json" or text.lstrip().startswith("["):
        try:
            prompts = json.loads(text)
        except ValueError as exc:
            raise InputError(
                f"--prompt-file {str(path)!r} is not a valid JSON list ({exc}); "
                "write a JSON list of strings, or one prompt per line."
            ) from None
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise InputError(f"--prompt-file {str(path)!r}: the JSON must be a list of strings.")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise InputError(f"--prompt-file {str(path)!r} holds no prompt.")
    return prompts


def encode_prompt(
    tokenizer: Any, prompt: str, context_length: int, *, truncate: bool = False, label: str = ""
) -> tuple[list[int], bool]:
    """Token ids of `prompt`, checked against the context length.

    Returns:
        `(ids, truncated)`. With `truncate`, a prompt longer than `context_length` keeps its
        last `context_length` tokens; without, it is an `InputError`.
    """
    what = label or "the prompt"
    if prompt == "":
        raise InputError(f"{what} is empty: give at least one character of text.")
    ids = list(tokenizer.encode(prompt))
    if not ids:
        raise InputError(f"{what} encodes to no tokens: give some text.")
    if len(ids) <= context_length:
        return ids, False
    if not truncate:
        raise InputError(
            f"{what} is {len(ids)} tokens long but the model's context_length is "
            f"{context_length}: shorten it, or pass --truncate to keep its last "
            f"{context_length} tokens."
        )
    return ids[-context_length:], True


#: The prompt used when the run's validation text cannot be read (Shakespeare, as the corpus).
FALLBACK_PROMPT = (
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n"
)


def default_prompt_ids(run: Any, cache_dir: str | Path | None = None) -> tuple[list[int], str]:
    """The default prompt: the first context_length tokens of the run's validation split.

    The run's `config.data` says where the corpus is; `data.prepare_data` reads it through the
    token cache (tokenized once at training time). Where that fails (the corpus moved, a
    dataset that is not cached), the prompt is `FALLBACK_PROMPT`, and the returned note says so.

    Returns:
        `(token ids, a one-line note saying where the prompt came from)`.
    """
    from llmcli.data import prepare_data

    ctx = run.model.context_length
    data_cfg = run.config.data
    where = data_cfg.path if data_cfg.path is not None else f"dataset {data_cfg.dataset}"
    try:
        val = prepare_data(data_cfg, ctx, tokenizer=run.tokenizer, cache_dir=cache_dir).val
        ids = [int(i) for i in val[:ctx]]
        return ids, (
            f"prompt: the first {len(ids)} tokens of the validation split of {where} "
            "(pass --prompt TEXT to choose one)"
        )
    except InputError as exc:
        reason = str(exc)
    try:
        ids = list(run.tokenizer.encode(FALLBACK_PROMPT))[:ctx]
    except InputError as exc:
        raise InputError(
            f"no default prompt: the run's validation text ({where}) cannot be read ({reason}), "
            f"and the built-in fallback prompt does not encode ({exc}). Pass --prompt TEXT."
        ) from None
    note = (
        f"prompt: the run's validation text ({where}) cannot be read ({reason}); using a "
        "built-in fallback prompt instead (pass --prompt TEXT to choose one)"
    )
    log.warning(note)
    return ids, note


# --------------------------------------------------------------------------------------------
# The command's library function.
# --------------------------------------------------------------------------------------------

#: How many prompts run through the model in one padded batch.
BATCH_PROMPTS = 16
#: Repeated random sequences averaged by the induction score.
INDUCTION_SEQUENCES = 8


@dataclass
class InspectResult:
    """What `inspect_attention` did: one dump and one output folder per prompt."""

    run_dir: Path
    dumps: list[AttentionDump]
    out_dirs: list[Path]
    files: list[list[Path]]
    notes: list[str] = field(default_factory=list)


def capture_prompts(
    model: torch.nn.Module, prompts_ids: Sequence[Sequence[int]], batch_size: int = BATCH_PROMPTS
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Capture prompts of different lengths in right-padded batches; return each unpadded.

    Right padding puts every pad after every real token, so under the causal mask no real query
    can see a pad key; the key padding mask is passed anyway (it also keeps the positions of a
    prompt those it has alone). Each result is sliced back to its own length.

    Returns:
        For each prompt, `(logits (T, V), attn (L, H, T, T))` with T its own length.
    """
    import torch

    device = next(model.parameters()).device
    out: list[tuple[torch.Tensor, torch.Tensor]] = []
    for start in range(0, len(prompts_ids), batch_size):
        chunk = prompts_ids[start : start + batch_size]
        T = max(len(ids) for ids in chunk)
        idx = torch.zeros(len(chunk), T, dtype=torch.long)  # (B, T), pads are token 0
        pad = torch.ones(len(chunk), T, dtype=torch.bool)  # (B, T), True = padding
        for b, ids in enumerate(chunk):
            idx[b, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            pad[b, : len(ids)] = False
        mask = pad.to(device) if bool(pad.any()) else None
        logits, attn = capture_attention(model, idx.to(device), key_padding_mask=mask)
        for b, ids in enumerate(chunk):
            n = len(ids)
            out.append((logits[b, :n], attn[b, :, :, :n, :n]))  # (n, V), (L, H, n, n)
    return out


def induction_scores(
    model: torch.nn.Module,
    vocab_size: int,
    *,
    sequences: int = INDUCTION_SEQUENCES,
    seed: int = 0,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Per-head induction scores `[L, H]` on repeated random sequences of context_length // 2.

    Returns:
        The scores and a description for the dump's meta (period, sequences, seed).
    """
    import torch

    period = max(1, model.context_length // 2)
    gen = torch.Generator().manual_seed(seed)
    idx = repeated_random_tokens(vocab_size, period, sequences, gen)  # (S, 2 * period)
    device = next(model.parameters()).device
    _, attn = capture_attention(model, idx.to(device))  # (S, L, H, 2p, 2p)
    scores = induction_score(attn.numpy(), period).mean(0)  # (S, L, H) -> (L, H)
    return scores, {"period": period, "sequences": sequences, "seed": seed}


def build_dumps(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    induction: bool = False,
    truncate: bool = False,
    prompts_ids: Sequence[Sequence[int]] | None = None,
    meta: dict[str, Any] | None = None,
) -> list[AttentionDump]:
    """Capture, score and select: one `AttentionDump` per prompt (nothing written to disk).

    Args:
        model: a `Transformer`.
        tokenizer: encodes the prompts and decodes each token for the labels.
        prompts: the prompt texts (ignored where `prompts_ids` is given).
        layers, heads: the model indices to keep (None: all); metrics follow the selection.
        induction: append the induction score (same for every prompt: it is measured on a
            repeated random sequence, recorded in meta).
        truncate: keep the last context_length tokens of a long prompt instead of failing.
        prompts_ids: token ids to use directly (e.g. the default validation slice).
        meta: common metadata merged into every dump's meta.
    """
    n_layer, n_head, ctx = model.n_layer, model.n_head, model.context_length
    layer_sel = select_indices(layers, n_layer, "layer")
    head_sel = select_indices(heads, n_head, "head")
    if prompts_ids is None:
        if not prompts:
            raise InputError("no prompt given: pass --prompt TEXT or --prompt-file FILE.")
        encoded = [
            encode_prompt(
                tokenizer,
                p,
                ctx,
                truncate=truncate,
                label=f"prompt #{i + 1}" if len(prompts) > 1 else "",
            )
            for i, p in enumerate(prompts)
        ]
    else:
        encoded = [(list(ids), False) for ids in prompts_ids]
        for ids, _ in encoded:
            if not 0 < len(ids) <= ctx:
                raise InputError(f"a prompt must be 1 to {ctx} tokens long, got {len(ids)}.")
    names = list(METRIC_NAMES)
    extra: dict[str, Any] = {}
    ind = None
    if induction:
        ind, extra["induction"] = induction_scores(model, _vocab_size(tokenizer))
        names.append(INDUCTION)
    captured = capture_prompts(model, [ids for ids, _ in encoded])
    li, hi = np.array(layer_sel), np.array(head_sel)
    dumps = []
    for i, ((ids, truncated), (_, attn_t)) in enumerate(zip(encoded, captured, strict=True)):
        attn = attn_t.numpy()  # (L, H, T, T)
        metrics = head_metrics(attn)  # (L, H, 4)
        if ind is not None:
            metrics = np.concatenate([metrics, ind[..., None]], axis=-1)  # (L, H, 5)
        text = tokenizer.decode(ids)
        dump_meta = {
            **(meta or {}),
            **extra,
            "prompt": text,
            "prompt_index": i,
            "n_tokens": len(ids),
            "truncated": truncated,
            "layers": layer_sel,
            "heads": head_sel,
            "metric_names": names,
        }
        dumps.append(
            AttentionDump(
                attn=attn[li][:, hi].astype(np.float32),  # (L', H', T, T)
                tokens=[tokenizer.decode([t]) for t in ids],
                token_ids=np.array(ids, dtype=np.int64),
                metrics=metrics[li][:, hi].astype(np.float32),  # (L', H', M)
                metric_names=names,
                layers=layer_sel,
                heads=head_sel,
                meta=dump_meta,
            )
        )
    return dumps


def _vocab_size(tokenizer: Any) -> int:
    size = tokenizer.vocab_size
    return int(size() if callable(size) else size)


def write_outputs(
    dump: AttentionDump,
    out_dir: str | Path,
    fmt: str = "npz",
    *,
    pictures: bool = True,
    viewer: bool = True,
) -> list[Path]:
    """Write `attention.<fmt>`, `layer-<L>.png` per layer and `attention.html` into `out_dir`."""
    from llmcli.attention.viewer import write_viewer

    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(
            f"cannot create output folder {str(out_dir)!r}: {exc.strerror}; choose --out DIR."
        ) from None
    if not out_dir.is_dir():
        raise InputError(f"--out {str(out_dir)!r} is not a folder: choose another --out DIR.")
    try:
        files = [save_dump(dump, out_dir / f"attention{FORMATS[fmt]}", fmt)]
        if pictures:
            files += plot_layers(dump, out_dir)
        if viewer:
            files.append(write_viewer(dump, out_dir / "attention.html"))
    except OSError as exc:  # every file is written atomically: earlier ones stay whole
        raise InputError(
            f"cannot write into {str(out_dir)!r}: {describe_os_error(exc)}; or choose --out DIR."
        ) from None
    return files


def prompt_dir(out_dir: Path, index: int, n_prompts: int) -> Path:
    """Where prompt `index`'s files go: `out_dir` itself for one prompt, else
    `out_dir/prompt-000/`, `out_dir/prompt-001/`, ... in the order the prompts were given."""
    return out_dir if n_prompts == 1 else out_dir / f"prompt-{index:03d}"


def inspect_attention(
    checkpoint: str | Path | None = None,
    prompts: Sequence[str] = (),
    *,
    prompt_file: str | Path | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    out_dir: str | Path | None = None,
    fmt: str = "npz",
    induction: bool = False,
    truncate: bool = False,
    weights: str = "best",
    device: str = "cpu",
    pictures: bool = True,
    viewer: bool = True,
) -> InspectResult:
    """`llmcli inspect-attention`: load a run, capture each prompt, write dumps, PNGs, viewer.

    Args:
        checkpoint: a run directory; None takes the latest run under `checkpoints/`.
        prompts: prompt texts; with none (and no `prompt_file`) the first context_length tokens
            of the run's validation text are used.
        prompt_file: more prompts, see `read_prompt_file`; they follow `prompts`.
        layers, heads: model indices to keep in the dumps (None: all).
        out_dir: default `<run>/attention/`. One prompt writes there; several write
            `prompt-000/`, `prompt-001/`, ... (see `prompt_dir`).
        fmt: "npz", "safetensors" or "json".
        induction: add the induction score column.
        truncate: keep the last context_length tokens of too-long prompts.
        weights: "best" or "last" (see `checkpoint.load_run`).
        device: where the model runs: "cpu", "cuda", "mps" or "auto".
        pictures, viewer: write the PNGs and the HTML viewer.

    Raises:
        InputError: no run, bad prompt, layer or head out of range, unknown format.
    """
    from llmcli import __version__
    from llmcli.checkpoint import load_run
    from llmcli.device import resolve_device

    if fmt not in FORMATS:
        raise InputError(f"--format {fmt!r} is not known: choose one of {', '.join(FORMATS)}.")
    prompts = list(prompts)
    if prompt_file is not None:
        prompts += read_prompt_file(prompt_file)
    run = load_run(checkpoint, weights=weights, device=resolve_device(device, what="--device"))
    model = run.model
    # Check the selection before any work, with the model's own sizes in the message.
    select_indices(layers, model.n_layer, "layer")
    select_indices(heads, model.n_head, "head")
    from llmcli.versions import warnings_for

    notes: list[str] = warnings_for(run.meta.get("versions"))
    prompts_ids = None
    if not prompts:
        ids, note = default_prompt_ids(run)
        prompts_ids = [ids]
        notes.append(note)
        default_note = note
    weights_path = Path(run.weights_path) if run.weights_path else None
    meta = {
        "checkpoint": str(Path(run.run_dir).resolve()),
        "weights_file": str(weights_path.resolve()) if weights_path else None,
        "weights_sha256": sha256_file(weights_path) if weights_path else None,
        "step": run.step,
        "config": run.config.to_dict(),
        "llmcli_version": __version__,
    }
    if prompts_ids is not None:
        meta["default_prompt"] = default_note
    dumps = build_dumps(
        model,
        run.tokenizer,
        prompts,
        layers=layers,
        heads=heads,
        induction=induction,
        truncate=truncate,
        prompts_ids=prompts_ids,
        meta=meta,
    )
    root = Path(out_dir) if out_dir is not None else Path(run.run_dir) / "attention"
    out_dirs, files = [], []
    for i, dump in enumerate(dumps):
        folder = prompt_dir(root, i, len(dumps))
        out_dirs.append(folder)
        files.append(write_outputs(dump, folder, fmt, pictures=pictures, viewer=viewer))
    return InspectResult(
        run_dir=Path(run.run_dir), dumps=dumps, out_dirs=out_dirs, files=files, notes=notes
    )
