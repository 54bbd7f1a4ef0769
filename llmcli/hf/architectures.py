"""Which `transformers` architecture computes exactly a run's model, and which holds a folder's.

| llmcli model options | exported as |
| --- | --- |
| learned positions, LayerNorm | GPT-2 (`GPT2LMHeadModel`) |
| rotary positions, LayerNorm | GPT-NeoX (`GPTNeoXForCausalLM`, sequential residual) |
| rotary positions, RMSNorm | Arcee (`ArceeForCausalLM`: Llama with an ungated MLP) |
| learned positions, RMSNorm | refused: no architecture has both |
| QK-norm (parameter-free) | refused: the models with a query/key norm have a gated MLP |

Any of them takes `model.mlp` gelu or relu2, `model.bias` on or off and a tied or untied LM head.
No export needs `trust_remote_code`.
"""

from __future__ import annotations

from types import ModuleType

from llmcli.config import ModelConfig
from llmcli.errors import InputError
from llmcli.hf import arcee, gpt2, neox

ARCHITECTURES: dict[str, ModuleType] = {m.NAME: m for m in (gpt2, neox, arcee)}
FORMATS = ("auto", *ARCHITECTURES)
BY_MODEL_TYPE: dict[str, ModuleType] = {m.MODEL_TYPE: m for m in ARCHITECTURES.values()}
# Hugging Face model types that llmcli cannot hold, and why: named when init_from meets one.
_UNSUPPORTED = {
    "llama": "a gated MLP (gate_proj, SwiGLU); llmcli's MLP is ungated",
    "mistral": "a gated MLP (gate_proj) and grouped-query attention",
    "qwen2": "a gated MLP (gate_proj) and grouped-query attention",
    "qwen3": "a gated MLP (gate_proj) and grouped-query attention",
    "gemma": "a gated MLP (gate_proj)",
    "phi": "a parallel attention/MLP block and partial rotary embeddings",
    "opt": "learned positions offset by 2 and ReLU",
}


def choose(model_cfg: ModelConfig, fmt: str = "auto") -> ModuleType:
    """The architecture module to export `model_cfg` as (`fmt`: "auto" or a name in FORMATS).

    Raises:
        InputError: an unknown format, or no (or not the asked) architecture computes the model
            exactly; the message names the options in the way and the closest exportable
            setting.
    """
    if fmt not in FORMATS:
        raise InputError(
            f"--format {fmt!r} is not supported; the formats are {', '.join(FORMATS)} "
            "(Hugging Face folders) and gguf (a llama.cpp file)."
        )
    if fmt != "auto":
        found = ARCHITECTURES[fmt].problems(model_cfg)
        if found:
            raise InputError(
                f"this run cannot be exported as {fmt}: "
                + "; ".join(p.option for p in found)
                + f". Set {', '.join(p.fix for p in found)}, or let --format auto choose."
            )
        return ARCHITECTURES[fmt]
    candidates = {name: arch.problems(model_cfg) for name, arch in ARCHITECTURES.items()}
    for name, found in candidates.items():
        if not found:
            return ARCHITECTURES[name]
    fewest = min(len(found) for found in candidates.values())
    closest = [
        f"{', '.join(p.fix for p in found)} (exports as {name})"
        for name, found in candidates.items()
        if len(found) == fewest
    ]
    options = sorted({p.option.split(" (")[0] for found in candidates.values() for p in found})
    raise InputError(
        "no Hugging Face architecture computes this run's model exactly ("
        + ", ".join(
            f"{name}: {'; '.join(p.option for p in found)}" for name, found in candidates.items()
        )
        + f"). The options in the way: {', '.join(options)}; the closest exportable setting: "
        + " or ".join(closest)
        + "."
    )


def for_model_type(model_type: object, source: str) -> ModuleType:
    """The architecture module that reads a `config.json` of `model_type`.

    Raises:
        InputError: a model type llmcli cannot hold (naming what is in the way where known).
    """
    if not isinstance(model_type, str):
        shown = "missing" if model_type is None else f"{model_type!r}, not a string"
        raise InputError(
            f"{source}: model_type is {shown}: it names the architecture, one of "
            f"{', '.join(repr(t) for t in BY_MODEL_TYPE)}."
        )
    if model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model_type]
    why = _UNSUPPORTED.get(model_type)
    supported = ", ".join(repr(t) for t in BY_MODEL_TYPE)
    raise InputError(
        f"{source}: model_type is {model_type!r}, which llmcli's model cannot hold"
        + (f": it has {why}" if why else "")
        + f". Supported model types: {supported}."
    )
