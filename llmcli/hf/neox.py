"""llmcli's model as GPT-NeoX (`GPTNeoXForCausalLM`): rotary positions with LayerNorm.

| llmcli | Hugging Face `GPTNeoXForCausalLM` |
| --- | --- |
| `wte` | `gpt_neox.embed_in` |
| `blocks.{i}.ln1`, `.ln2` | `gpt_neox.layers.{i}.input_layernorm`, `.post_attention_layernorm` |
| `blocks.{i}.attn.qkv`, `.attn.proj` | `gpt_neox.layers.{i}.attention.query_key_value`, `.dense` |
| `blocks.{i}.mlp.fc`, `.mlp.proj` | `gpt_neox.layers.{i}.mlp.dense_h_to_4h`, `.dense_4h_to_h` |
| `ln_f`, `lm_head` | `gpt_neox.final_layer_norm`, `embed_out` |

GPT-NeoX with `use_parallel_residual=False` and `rotary_pct=1.0` is llmcli's block: pre-norm
`x + attn(ln1(x))`, then `x + mlp(ln2(x))`, rotary embeddings on the whole head in the
"rotate half" layout (channel i pairs with i + hs/2, frequencies `base**(-2i/hs)`), attention
scaled by `1/sqrt(hs)`. Two layouts differ: GPT-NeoX's fused QKV projection groups its rows by
head (`q_h, k_h, v_h` for each head h) where llmcli's groups them by kind (every head's queries,
then keys, then values), so the rows are reordered; and its LayerNorms and MLP always have
biases, so a run without biases is exported with zero biases, which computes the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from llmcli.config import ModelConfig
from llmcli.hf.common import (
    Problem,
    activation,
    bias_or_zeros,
    config_file,
    cpu,
    field,
    leftovers,
    mismatches,
    model_shape,
    refuse,
    rope_parameters,
    take,
    warn_eps,
)
from llmcli.model.gpt import Transformer

# Buffers that some GPT-NeoX checkpoints saved (causal mask, rotary table): not weights.
_BUFFERS = (".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")
NAME = "gpt-neox"
MODEL_TYPE = "gpt_neox"
HF_CLASS = "GPTNeoXForCausalLM"


def problems(model_cfg: ModelConfig) -> list[Problem]:
    """The options GPT-NeoX cannot compute exactly (none: it can export the run)."""
    return mismatches(model_cfg, "GPT-NeoX", pos_emb="rope", norm="layernorm")


def hf_config(
    model_cfg: ModelConfig, vocab_size: int, eot_id: int | None, eps: float
) -> dict[str, Any]:
    """The `config.json` of the GPT-NeoX equivalent of `model_cfg`."""
    settings = {
        "hidden_size": model_cfg.n_embed,
        "num_hidden_layers": model_cfg.n_layer,
        "num_attention_heads": model_cfg.n_head,
        "intermediate_size": 4 * model_cfg.n_embed,
        "hidden_act": model_cfg.mlp,
        "max_position_embeddings": model_cfg.context_length,
        "layer_norm_eps": eps,
        "use_parallel_residual": False,
        "attention_bias": model_cfg.bias,
        # transformers 5.x reads rope_parameters, 4.x rotary_pct and rotary_emb_base.
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": model_cfg.rope_base,
            "partial_rotary_factor": 1.0,
        },
        "rotary_pct": 1.0,
        "rotary_emb_base": model_cfg.rope_base,
        "attention_dropout": model_cfg.attention_dropout,
        "hidden_dropout": model_cfg.dropout,
        "initializer_range": 0.02,
    }
    return config_file(HF_CLASS, MODEL_TYPE, vocab_size, settings, eot_id, model_cfg.tie_embeddings)


def _by_head(kind_major: torch.Tensor, n_head: int) -> torch.Tensor:
    """QKV rows grouped by kind (`[Q; K; V]`, heads inside) -> grouped by head (`[q_h k_h v_h]`)."""
    rest = kind_major.shape[1:]
    return kind_major.reshape(3, n_head, -1, *rest).transpose(0, 1).reshape(kind_major.shape)


def _by_kind(head_major: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of `_by_head`."""
    rest = head_major.shape[1:]
    return head_major.reshape(n_head, 3, -1, *rest).transpose(0, 1).reshape(head_major.shape)


# llmcli's target inside a block -> GPT-NeoX's module (PEFT's LoRA layers are nn.Linear's).
_LORA_MODULES = {
    "attn.qkv": "attention.query_key_value",
    "attn.proj": "attention.dense",
    "mlp.fc": "mlp.dense_h_to_4h",
    "mlp.proj": "mlp.dense_4h_to_h",
}
LORA_FAN_IN_FAN_OUT = False
# The token embedding, whose rows a LoRA run adds train as PEFT's trainable tokens.
LORA_EMBEDDING = "gpt_neox.embed_in"


def lora_to_hf(name: str, B: torch.Tensor, n_head: int) -> dict[str, torch.Tensor]:
    """An adapted layer (`blocks.0.attn.qkv`) -> the GPT-NeoX module its adapter goes on, with
    its `B (out, r)`: the QKV's rows reordered by head as its weight's are (`B A`'s rows are
    `B`'s, so `A` stays)."""
    _, i, target = name.split(".", 2)
    module = f"gpt_neox.layers.{i}.{_LORA_MODULES[target]}"
    return {module: _by_head(B, n_head) if target == "attn.qkv" else B}


def to_hf(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under GPT-NeoX names and layouts (CPU, contiguous)."""
    C, nh = model.n_embed, model.n_head
    out = {"gpt_neox.embed_in.weight": cpu(model.wte.weight)}
    for i, block in enumerate(model.blocks):
        prefix = f"gpt_neox.layers.{i}"
        for ours, theirs in (
            (block.ln1, "input_layernorm"),
            (block.ln2, "post_attention_layernorm"),
        ):
            out[f"{prefix}.{theirs}.weight"] = cpu(ours.weight)
            out[f"{prefix}.{theirs}.bias"] = bias_or_zeros(ours, C)
        attn, mlp = block.attn, block.mlp
        out[f"{prefix}.attention.query_key_value.weight"] = _by_head(cpu(attn.qkv.weight), nh)
        out[f"{prefix}.attention.dense.weight"] = cpu(attn.proj.weight)
        if attn.qkv.bias is not None:
            out[f"{prefix}.attention.query_key_value.bias"] = _by_head(cpu(attn.qkv.bias), nh)
            out[f"{prefix}.attention.dense.bias"] = cpu(attn.proj.bias)
        out[f"{prefix}.mlp.dense_h_to_4h.weight"] = cpu(mlp.fc.weight)
        out[f"{prefix}.mlp.dense_h_to_4h.bias"] = bias_or_zeros(mlp.fc, 4 * C)
        out[f"{prefix}.mlp.dense_4h_to_h.weight"] = cpu(mlp.proj.weight)
        out[f"{prefix}.mlp.dense_4h_to_h.bias"] = bias_or_zeros(mlp.proj, C)
    out["gpt_neox.final_layer_norm.weight"] = cpu(model.ln_f.weight)
    out["gpt_neox.final_layer_norm.bias"] = bias_or_zeros(model.ln_f, C)
    if not model.tie_embeddings:
        out["embed_out.weight"] = cpu(model.lm_head.weight)
    return out


def model_config(hf_cfg: dict[str, Any], base: ModelConfig, source: str) -> ModelConfig:
    """llmcli's `ModelConfig` for a GPT-NeoX `config.json` (`base` gives dropout).

    Raises:
        InputError: a missing key, or features llmcli's model cannot hold (all named).
    """
    shape = model_shape(hf_cfg, source)
    n_embed = shape["n_embed"]
    refused = []
    inner = field(hf_cfg, source, "intermediate_size", int, 4 * n_embed)
    if inner != 4 * n_embed:
        refused.append(f"intermediate_size {inner} (llmcli: 4 * hidden)")
    if field(hf_cfg, source, "use_parallel_residual", bool, True):
        refused.append("use_parallel_residual (llmcli's block is sequential)")
    rope = rope_parameters(hf_cfg, source, partial_default=0.25)
    if rope["partial_rotary_factor"] != 1.0:
        refused.append(f"rotary_pct {rope['partial_rotary_factor']} (llmcli rotates whole heads)")
    if rope["rope_type"] != "default":
        refused.append(f"rope type {rope['rope_type']!r} (llmcli: plain rotary)")
    mlp = activation(hf_cfg, "hidden_act", "gelu", source)
    if mlp is None:
        refused.append(f"hidden_act {hf_cfg.get('hidden_act')!r} (llmcli: gelu or relu2)")
    refuse(source, refused, "GPT-NeoX")
    warn_eps(hf_cfg, "layer_norm_eps", source)
    return dataclasses.replace(
        base,
        **shape,
        bias=True,  # its LayerNorms and MLP always have biases
        pos_emb="rope",
        rope_base=rope["rope_theta"],
        norm="layernorm",
        qk_norm=False,
        mlp=mlp,
        tie_embeddings=field(hf_cfg, source, "tie_word_embeddings", bool, False),
    )


def from_hf(
    tensors: dict[str, torch.Tensor], model_cfg: ModelConfig, source: str
) -> dict[str, torch.Tensor]:
    """GPT-NeoX weights -> llmcli names and layouts (a missing attention bias becomes zeros).

    Raises:
        CheckpointError: a missing tensor, or tensors the config does not account for.
    """
    C, nh = model_cfg.n_embed, model_cfg.n_head
    names = {"gpt_neox.embed_in.weight": "wte.weight"}
    names.update(
        {
            "gpt_neox.final_layer_norm.weight": "ln_f.weight",
            "gpt_neox.final_layer_norm.bias": "ln_f.bias",
        }
    )
    for i in range(model_cfg.n_layer):
        p, b = f"gpt_neox.layers.{i}", f"blocks.{i}"
        for theirs, ours in (
            ("input_layernorm", "ln1"),
            ("post_attention_layernorm", "ln2"),
            ("attention.dense", "attn.proj"),
            ("mlp.dense_h_to_4h", "mlp.fc"),
            ("mlp.dense_4h_to_h", "mlp.proj"),
        ):
            names[f"{p}.{theirs}.weight"] = f"{b}.{ours}.weight"
            names[f"{p}.{theirs}.bias"] = f"{b}.{ours}.bias"
    out: dict[str, torch.Tensor] = {}
    for theirs, ours in names.items():
        if theirs.endswith("attention.dense.bias") and theirs not in tensors:
            out[ours] = torch.zeros(C)  # attention_bias false
        else:
            out[ours] = take(tensors, theirs, source)
    used = set(names)
    for i in range(model_cfg.n_layer):
        qkv = f"gpt_neox.layers.{i}.attention.query_key_value"
        out[f"blocks.{i}.attn.qkv.weight"] = _by_kind(take(tensors, f"{qkv}.weight", source), nh)
        bias = tensors.get(f"{qkv}.bias", torch.zeros(3 * C))
        out[f"blocks.{i}.attn.qkv.bias"] = _by_kind(bias, nh)
        used |= {f"{qkv}.weight", f"{qkv}.bias"}
    if not model_cfg.tie_embeddings:
        out["lm_head.weight"] = take(tensors, "embed_out.weight", source)
    used |= {"embed_out.weight"} | {k for k in tensors if k.endswith(_BUFFERS)}
    leftovers(tensors, used, source, "GPT-NeoX")
    return {k: v.contiguous() for k, v in out.items()}
