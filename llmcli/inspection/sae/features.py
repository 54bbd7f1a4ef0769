"""`llmcli sae features`: what each feature of an SAE responds to, and what it writes.

For each feature, over consecutive windows of the run's validation split (as `sae eval` reads
them):

- its top activating contexts: the `top` tokens where it is most active, each with the tokens
  before it (and a few after) in its window and the feature's activation on every one of them,
  so that the activating tokens can be marked;
- its density: the share of tokens it is active on (0: dead on this text);
- its logit effect: its decoder direction read straight through the unembedding, the layers
  above the hook point skipped (the direct path, as Neuronpedia's logit tables): for the
  residual stream and the sublayers' outputs the direction itself (for `attn.z`, through the
  output projection), then the final norm's gain (LayerNorm also centres it), then the LM
  head: the tokens it promotes most and suppresses most.

Two passes: one finds every feature's top tokens (a running top-k per feature, so memory does
not grow with the text), the other recomputes the windows that hold them for the contexts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from llmcli.errors import InputError
from llmcli.inspection.sae.evaluate import ReadOptions, open_sae, read_batches
from llmcli.inspection.sae.folder import LoadedSAE
from llmcli.inspection.sae.points import is_heads, read_activations
from llmcli.progress import Progress
from llmcli.runs.loading import LoadedRun

#: Tokens shown before and after a context's activating token.
BEFORE, AFTER = 24, 6
#: Tokens listed as a feature's logit effect, each way.
LOGIT_TOKENS = 8


@dataclass
class Context:
    """One of a feature's top activating tokens, in its window.

    Attributes:
        tokens: the tokens shown, as text.
        acts: the feature's activation on each of them.
        at: the index in `tokens` of the activating token.
        value: the activation there (`acts[at]`).
        start: where the shown tokens start in the text (a token index).
    """

    tokens: list[str]
    acts: list[float]
    at: int
    value: float
    start: int


@dataclass
class Feature:
    """What `feature_report` found for one feature."""

    index: int
    density: float
    max_activation: float
    contexts: list[Context] = field(default_factory=list)
    promoted: list[tuple[str, float]] = field(default_factory=list)
    suppressed: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class FeatureReport:
    """Features of an SAE on a text; JSON-ready through `to_dict`."""

    sae: str
    run: str
    hook: str
    data: str
    tokens: int
    n_features: int
    features: list[Feature]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def logit_effects(model: nn.Module, W_dec: Tensor, hook: str) -> Tensor:
    """Each feature's direct effect on the logits (see the module doc).

    Shape:
        W_dec `(F, d_in)` -> `(F, V)`
    """
    with torch.no_grad():
        directions = W_dec.to(model.lm_head.weight.dtype)  # (F, d_in)
        if is_heads(hook):  # the heads' outputs, through the output projection
            layer = int(hook.split(".")[1])
            directions = directions @ model.blocks[layer].attn.proj.weight.T  # (F, C)
        if hook != "final_norm":
            norm = model.ln_f
            if isinstance(norm, nn.LayerNorm):
                directions = directions - directions.mean(-1, keepdim=True)
            if getattr(norm, "weight", None) is not None:
                directions = directions * norm.weight  # (F, C)
        return directions @ model.lm_head.weight.T  # (F, V)


@torch.no_grad()
def top_tokens(
    loaded: LoadedSAE, run: LoadedRun, batches: list[tuple[Tensor, Tensor]], top: int, bar: Progress
) -> tuple[Tensor, Tensor, Tensor, int]:
    """Every feature's `top` largest activations over `batches`, where they are and how often it
    is active.

    Returns:
        `(values (F, top), rows (F, top) long, fired (F,) long, tokens)`: `rows` numbers the
        tokens of all batches in turn (a batch's `B * T` rows after the batch before it).
    """
    sae, hook = loaded.sae, loaded.info.hook
    device = sae.W_dec.device
    values = torch.full((sae.d_sae, top), -torch.inf, device=device)
    rows = torch.zeros((sae.d_sae, top), dtype=torch.long, device=device)
    fired = torch.zeros(sae.d_sae, dtype=torch.long, device=device)
    offset = 0
    for x, _ in batches:
        acts = sae.encode(read_activations(run.model, hook, x).float())  # (N, F)
        fired += (acts > 0).sum(0)
        n = min(top, len(acts))
        v, r = acts.T.topk(n, dim=1)  # (F, n)
        values, keep = torch.cat([values, v], 1).topk(top, dim=1)  # (F, top)
        rows = torch.cat([rows, r + offset], 1).gather(1, keep)
        offset += len(acts)
        bar.update()
    return values, rows, fired, offset


def _contexts(
    loaded: LoadedSAE,
    run: LoadedRun,
    where: dict[int, list[tuple[int, int, int]]],
    batches: list[tuple[Tensor, Tensor]],
    starts: list[list[int]],
    progress: bool,
) -> dict[tuple[int, int], Context]:
    """The contexts at `where`: batch -> [(feature, row, rank)]; keyed by (feature, rank)."""
    out: dict[tuple[int, int], Context] = {}
    bar = Progress(len(where), desc="sae contexts", unit="batch", enabled=progress)
    for b, wanted in sorted(where.items()):
        x, _ = batches[b]
        acts = loaded.sae.encode(read_activations(run.model, loaded.info.hook, x).float())
        T = x.shape[1]
        acts = acts.view(x.shape[0], T, -1)  # (B, T, F)
        for feature, row, rank in wanted:
            window, pos = divmod(row, T)
            lo, hi = max(0, pos - BEFORE), min(T, pos + AFTER + 1)
            ids = x[window, lo:hi].tolist()
            shown = acts[window, lo:hi, feature].tolist()
            out[(feature, rank)] = Context(
                tokens=[run.tokenizer.decode([i]) for i in ids],
                acts=shown,
                at=pos - lo,
                value=shown[pos - lo],
                start=starts[b][window] + lo,
            )
        bar.update()
    bar.close()
    return out


def _logit_lists(effects: Tensor, tokenizer: Any, n: int) -> tuple[list, list]:
    """The `n` tokens `effects` `(V,)` raises most and lowers most, with the amounts."""
    n = min(n, len(effects))
    up, down = effects.topk(n), effects.topk(n, largest=False)

    def named(top: Any) -> list[tuple[str, float]]:
        ids, values = top.indices.tolist(), top.values.tolist()
        return [(tokenizer.decode([i]), v) for i, v in zip(ids, values, strict=True)]

    return named(up), named(down)


@torch.no_grad()
def feature_report(
    options: ReadOptions = ReadOptions(),
    features: Sequence[int] = (),
    *,
    top: int = 8,
    progress: bool = False,
    notify: Callable[[str], Any] = print,
) -> FeatureReport:
    """`llmcli sae features`: the features asked for (all of them when none is) on the text of
    `options` (see the module doc).

    Raises:
        InputError: a feature the SAE does not have, `top` below 1; as `evaluate_sae`.
    """
    if top < 1:
        raise InputError(f"--top ({top}) must be at least 1.")
    loaded, run, device = open_sae(options, notify)
    n_features = loaded.sae.d_sae
    for f in features:
        if not 0 <= f < n_features:
            raise InputError(f"--feature {f}: the SAE's features are 0..{n_features - 1}.")
    chosen = list(dict.fromkeys(features)) or list(range(n_features))
    _, starts, batches, label = read_batches(run, options, device)
    with Progress(len(batches), desc="sae features", unit="batch", enabled=progress) as bar:
        values, rows, fired, tokens = top_tokens(loaded, run, batches, top, bar)
    offsets = np.cumsum([0] + [x.numel() for x, _ in batches])
    where: dict[int, list[tuple[int, int, int]]] = {}
    for f in chosen:
        for rank in range(top):
            if values[f, rank] > 0:
                row = int(rows[f, rank])
                b = int(np.searchsorted(offsets, row, side="right") - 1)
                where.setdefault(b, []).append((f, row - int(offsets[b]), rank))
    contexts = _contexts(loaded, run, where, batches, starts, progress)
    effects = logit_effects(run.model, loaded.sae.W_dec[chosen], loaded.info.hook)  # (n, V)
    report = []
    for i, f in enumerate(chosen):
        promoted, suppressed = _logit_lists(effects[i], run.tokenizer, LOGIT_TOKENS)
        report.append(
            Feature(
                index=f,
                density=int(fired[f]) / tokens,
                max_activation=max(0.0, float(values[f, 0])),
                contexts=[contexts[(f, r)] for r in range(top) if (f, r) in contexts],
                promoted=promoted,
                suppressed=suppressed,
            )
        )
    return FeatureReport(
        sae=str(loaded.folder),
        run=str(run.run_dir),
        hook=loaded.info.hook,
        data=label,
        tokens=tokens,
        n_features=n_features,
        features=report,
    )


def _shown(text: str) -> str:
    return text.replace("\n", "↵").replace("\t", "⇥").replace("\r", "␍")


def context_line(context: Context) -> str:
    """A context as one line, the tokens where the feature is active inside ⟦ ⟧."""
    out, inside = [], False
    for token, act in zip(context.tokens, context.acts, strict=True):
        active = act > 0
        if active != inside:
            out.append("⟦" if active else "⟧")
            inside = active
        out.append(_shown(token))
    return "".join(out) + ("⟧" if inside else "")


def format_features(report: FeatureReport, limit: int | None = None) -> str:
    """The features as text: per feature its density, its contexts, its logit effect. With
    `limit`, only the `limit` densest features, one line each."""
    head = (
        f"SAE {report.sae}: {report.n_features:,} features at {report.hook}; "
        f"{report.tokens:,} tokens of {report.data}"
    )
    if limit is not None:
        ranked = sorted(report.features, key=lambda f: -f.density)[:limit]
        lines = [head, f"the {len(ranked)} densest features (--feature I shows one in full):"]
        for f in ranked:
            top = context_line(f.contexts[0]) if f.contexts else "(never active)"
            up = " ".join(_shown(t) for t, _ in f.promoted[:4])
            lines.append(
                f"{f.index:>6}  density {f.density:.4f}  max {f.max_activation:6.2f}  "
                f"promotes {up}  {top}"
            )
        return "\n".join(lines)
    lines = [head]
    for f in report.features:
        lines += [
            "",
            f"feature {f.index}: density {f.density:.4f} ({f.density * report.tokens:,.0f}"
            f" tokens), max activation {f.max_activation:.3f}",
        ]
        lines += [f"  {c.value:7.3f}  {context_line(c)}" for c in f.contexts]
        lines.append("  promotes:   " + "  ".join(f"{_shown(t)} {v:+.2f}" for t, v in f.promoted))
        lines.append("  suppresses: " + "  ".join(f"{_shown(t)} {v:+.2f}" for t, v in f.suppressed))
    return "\n".join(lines)
