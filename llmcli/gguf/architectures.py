"""Which llama.cpp architecture computes a run's model exactly, and its weights under llama.cpp's
tensor names.

| llmcli model options | llama.cpp architecture |
| --- | --- |
| learned positions, LayerNorm, GELU | `gpt2` |
| rotary positions, LayerNorm, GELU | `gptneox` (sequential residual) |
| rotary positions, RMSNorm, ReLU², no biases | `arcee` (Llama with an ungated ReLU² MLP) |

llama.cpp's `gpt2` and `gptneox` graphs always add biases, so a run without them is written with
zero biases (the same function); its `arcee` graph has none, so a run with `model.bias: true` and
RMSNorm is refused. None of the three has a parameter-free query/key norm (`model.qk_norm`),
`gpt2` and `gptneox` only GELU, `arcee` only ReLU². A tied LM head is left out where the
architecture falls back to the token embedding (`gpt2`, `arcee`) and written out for `gptneox`,
which needs `output.weight`.

Every architecture names the tensors alike (`token_embd`, `blk.{i}.attn_qkv`, `blk.{i}.ffn_up`,
...) and takes `nn.Linear`'s `(out, in)` layout as it is. llama.cpp's `gptneox` rotates channel
`i` with `i + hs/2`, as llmcli does; `arcee` rotates neighbouring channels `(2i, 2i + 1)`, so its
query and key rows are reordered within each head (`interleave_rotary_rows`, what
`convert_hf_to_gguf.py` does for Llama), which leaves every attention score unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from llmcli.config import ModelConfig
from llmcli.errors import InputError


@dataclass(frozen=True)
class GGUFArch:
    """One llama.cpp architecture and what its graph computes.

    Attributes:
        name: llama.cpp's name (`general.architecture`).
        pos_emb, norm, mlp: the llmcli model options it computes.
        biases: whether its graph adds biases (then a run without them gets zeros); without,
            a run with biases is refused.
        output_required: whether it needs `output.weight` even for a tied head.
        interleaved_rope: whether it rotates channel pairs `(2i, 2i + 1)` (Llama's layout).
    """

    name: str
    pos_emb: str
    norm: str
    mlp: str
    biases: bool
    output_required: bool = False
    interleaved_rope: bool = False


ARCHITECTURES = (
    GGUFArch("gpt2", pos_emb="learned", norm="layernorm", mlp="gelu", biases=True),
    GGUFArch(
        "gptneox", pos_emb="rope", norm="layernorm", mlp="gelu", biases=True, output_required=True
    ),
    GGUFArch(
        "arcee", pos_emb="rope", norm="rmsnorm", mlp="relu2", biases=False, interleaved_rope=True
    ),
)


def problems(model_cfg: ModelConfig, arch: GGUFArch) -> list[str]:
    """The options of `model_cfg` that `arch` cannot compute, each as `key (value; why)`."""
    found = [
        f"model.{key} ({getattr(model_cfg, key)!r}; llama.cpp's {arch.name} has {want})"
        for key, want in (("pos_emb", arch.pos_emb), ("norm", arch.norm), ("mlp", arch.mlp))
        if getattr(model_cfg, key) != want
    ]
    if model_cfg.qk_norm:
        found.append(f"model.qk_norm (true; llama.cpp's {arch.name} has no query/key norm)")
    if model_cfg.bias and not arch.biases:
        found.append(f"model.bias (true; llama.cpp's {arch.name} has no biases)")
    return found


def choose(model_cfg: ModelConfig) -> GGUFArch:
    """The llama.cpp architecture that computes `model_cfg` exactly.

    Raises:
        InputError: none does; the message names every option in the way, per architecture.
    """
    found = {arch.name: problems(model_cfg, arch) for arch in ARCHITECTURES}
    for arch in ARCHITECTURES:
        if not found[arch.name]:
            return arch
    details = "; ".join(f"{name}: {', '.join(p)}" for name, p in found.items())
    raise InputError(
        "no llama.cpp architecture computes this run's model exactly, so it cannot be written "
        f"as GGUF ({details}). Runs that export: learned positions + LayerNorm + GELU (gpt2), "
        "rope + LayerNorm + GELU (gptneox), rope + RMSNorm + relu2 without biases (arcee), "
        "all without model.qk_norm; --format auto writes a Hugging Face folder of this run."
    )


def interleave_rotary_rows(weight: Tensor, n_head: int) -> Tensor:
    """Reorder the rows of a query or key projection `(n_head * hs, in)` within each head from
    llmcli's rotary pairs `(j, j + hs/2)` to llama.cpp's `(2j, 2j + 1)`: row `2j` of a head
    is its row `j`, row `2j + 1` its row `j + hs/2`."""
    out_features = weight.shape[0]
    hs = out_features // n_head
    rows = weight.reshape(n_head, 2, hs // 2, -1)  # (nh, 2, hs/2, in): halves of each head
    return rows.transpose(1, 2).reshape(weight.shape)  # (nh * hs, in), halves interleaved


def _bias(module: torch.nn.Module, n: int) -> Tensor:
    """A layer's bias, or zeros of length `n` for a layer without one."""
    bias = getattr(module, "bias", None)
    return bias.detach() if bias is not None else torch.zeros(n)


def gguf_tensors(model: torch.nn.Module, arch: GGUFArch) -> dict[str, Tensor]:
    """The model's weights under llama.cpp's names, float32 on the CPU, `(out, in)` layout.

    Args:
        model: a `Transformer` whose options `arch` computes (see `choose`).
        arch: the architecture to write.
    """
    C, nh = model.n_embed, model.n_head
    out: dict[str, Tensor] = {"token_embd.weight": model.wte.weight.detach()}
    if arch.pos_emb == "learned":
        out["position_embd.weight"] = model.wpe.weight.detach()
    for i, block in enumerate(model.blocks):
        qkv = block.attn.qkv.weight.detach()  # (3C, C): queries, keys, values, head-major
        if arch.interleaved_rope:
            q, k, v = qkv.split(C)
            qkv = torch.cat([interleave_rotary_rows(q, nh), interleave_rotary_rows(k, nh), v])
        layers = {
            "attn_norm": block.ln1,
            "attn_qkv": block.attn.qkv,
            "attn_output": block.attn.proj,
            "ffn_norm": block.ln2,
            "ffn_up": block.mlp.fc,
            "ffn_down": block.mlp.proj,
        }
        for name, module in layers.items():
            weight = qkv if name == "attn_qkv" else module.weight.detach()
            out[f"blk.{i}.{name}.weight"] = weight
            if arch.biases:
                out[f"blk.{i}.{name}.bias"] = _bias(module, weight.shape[0])
    out["output_norm.weight"] = model.ln_f.weight.detach()
    if arch.biases:
        out["output_norm.bias"] = _bias(model.ln_f, C)
    if arch.output_required or not model.tie_embeddings:
        out["output.weight"] = model.lm_head.weight.detach()
    return {name: t.to("cpu", torch.float32).contiguous() for name, t in out.items()}
