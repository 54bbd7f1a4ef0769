"""Hugging Face interoperability: export a run as a GPT-2 folder, start a run from one.

llmcli's default `Transformer` is GPT-2's architecture, so the mapping is a renaming:

| llmcli | Hugging Face `GPT2LMHeadModel` |
| --- | --- |
| `wte`, `wpe` | `transformer.wte`, `transformer.wpe` |
| `blocks.{i}.ln1`, `blocks.{i}.ln2` | `transformer.h.{i}.ln_1`, `transformer.h.{i}.ln_2` |
| `blocks.{i}.attn.qkv`, `.attn.proj` | `transformer.h.{i}.attn.c_attn`, `.attn.c_proj` |
| `blocks.{i}.mlp.fc`, `.mlp.proj` | `transformer.h.{i}.mlp.c_fc`, `.mlp.c_proj` |
| `ln_f`, `lm_head` | `transformer.ln_f`, `lm_head` |

GPT-2's projections are `Conv1D` layers, `y = x @ W + b` with `W` of shape `(in, out)`, the
transpose of `nn.Linear`'s `(out, in)`. Both fuse the query, key and value projections in the same
order (queries, then keys, then values, each head-major), so only the transpose is needed.
GPT-2 always has biases; a run trained with `model.bias: false` is exported with zero biases,
which computes exactly the same function.

What GPT-2 cannot express is refused with a message naming the option: rotary position
embeddings (`model.pos_emb: rope`), RMSNorm (`model.norm: rmsnorm`) and QK-norm
(`model.qk_norm: true`). The ReLU² MLP (`model.mlp: relu2`) is GPT-2's
`activation_function="relu2"`, and an untied LM head is `tie_word_embeddings=false`.

The folder `export_hf` writes loads offline with `transformers.AutoModelForCausalLM` and
`AutoTokenizer`; writing it needs no `transformers` (only `tokenizers` and `safetensors`). Our
char tokenizer becomes a Hugging Face `WordLevel` model over single characters with a
pre-tokenizer that isolates every character, so both encode and decode alike. The end-of-text
token (`<|endoftext|>`, the last id of a char vocabulary, or a BPE vocabulary's) is the export's
BOS, EOS and padding token, which `generate` and lm-evaluation-harness rely on.

`train.init_from: PATH` goes the other way (`resolve_init_from` + `load_gpt2_weights`): the
model's shape comes from the folder's `config.json`, the tokenizer from its `tokenizer.json`, and
the weights from its `model.safetensors` (or sharded safetensors, or `pytorch_model.bin` read
with `weights_only=True`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llmcli.errors import CheckpointError, InputError, describe_os_error
from llmcli.fileio import atomic_write_bytes

if TYPE_CHECKING:
    import torch

    from llmcli.config import Config, ModelConfig
    from llmcli.model import Transformer
    from llmcli.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

FORMATS = ("hf",)
HF_CONFIG_FILE = "config.json"
HF_GENERATION_FILE = "generation_config.json"
HF_WEIGHTS_FILE = "model.safetensors"
HF_WEIGHTS_INDEX = "model.safetensors.index.json"
HF_TORCH_WEIGHTS = "pytorch_model.bin"
HF_TOKENIZER_FILE = "tokenizer.json"
HF_TOKENIZER_CONFIG = "tokenizer_config.json"
HF_SPECIAL_TOKENS = "special_tokens_map.json"
# Files of another export or checkpoint that `--force` removes, as they would shadow ours.
_STALE_FILES = (
    HF_WEIGHTS_INDEX,
    HF_TORCH_WEIGHTS,
    "pytorch_model.bin.index.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which llmcli's model uses
# GPT-2 activation names -> llmcli's model.mlp. The tanh approximations of GELU load into the
# exact GELU (as nanoGPT does with OpenAI's weights), with a warning: logits differ slightly.
_EXACT_ACTIVATIONS = {"gelu": "gelu", "relu2": "relu2"}
_APPROX_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu_python_tanh", "gelu_accurate")
# Buffers that old GPT-2 checkpoints saved (the causal mask), not weights.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias")


# ---------------------------------------------------------------------------------------------
# Architecture: what maps, and how the names and shapes correspond
# ---------------------------------------------------------------------------------------------


def check_gpt2_compatible(model_cfg: ModelConfig) -> None:
    """Refuse model options that GPT-2's architecture cannot express.

    Raises:
        InputError: names the first such option and its value.
    """
    refused = []
    if model_cfg.pos_emb != "learned":
        refused.append(
            f"model.pos_emb ({model_cfg.pos_emb!r}; GPT-2 has learned position embeddings only)"
        )
    if model_cfg.norm != "layernorm":
        refused.append(f"model.norm ({model_cfg.norm!r}; GPT-2 uses LayerNorm)")
    if model_cfg.qk_norm:
        refused.append("model.qk_norm (true; GPT-2 has no query/key normalisation)")
    if model_cfg.mlp not in _EXACT_ACTIVATIONS.values():
        refused.append(f"model.mlp ({model_cfg.mlp!r})")
    if refused:
        raise InputError(
            "this run cannot be exported as GPT-2: its recipe uses "
            + ", ".join(refused)
            + ". Only runs with the GPT-2 architecture (pos_emb learned, norm layernorm, "
            "qk_norm false) can be exported."
        )


def _hf_name(name: str) -> str:
    """llmcli parameter name -> Hugging Face GPT-2 name (`blocks.0.attn.qkv.weight` ->
    `transformer.h.0.attn.c_attn.weight`)."""
    if name == "lm_head.weight":
        return name
    parts = name.split(".")
    if parts[0] == "blocks":
        module = {
            "ln1": "ln_1",
            "ln2": "ln_2",
            "attn.qkv": "attn.c_attn",
            "attn.proj": "attn.c_proj",
            "mlp.fc": "mlp.c_fc",
            "mlp.proj": "mlp.c_proj",
        }
        inner = ".".join(parts[2:-1])
        return f"transformer.h.{parts[1]}.{module[inner]}.{parts[-1]}"
    return "transformer." + name


def _is_conv1d(hf_name: str) -> bool:
    return hf_name.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight"))


def to_gpt2_state_dict(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face GPT-2 names and layouts (CPU, contiguous).

    Linear weights `(out, in)` become `Conv1D` weights `(in, out)`; missing biases (a model with
    `bias=False`) become zeros. The LM head is included only when untied.

    Raises:
        InputError: the model uses an option GPT-2 cannot express.
    """
    import torch

    if model.wpe is None:
        raise InputError(
            "this model uses rotary position embeddings (model.pos_emb 'rope'), "
            "which GPT-2 cannot express."
        )
    out: dict[str, torch.Tensor] = {}
    for mod_name, module in model.named_modules():
        is_linear = isinstance(module, torch.nn.Linear)
        if not (is_linear or isinstance(module, (torch.nn.LayerNorm, torch.nn.Embedding))):
            if any(True for _ in module.parameters(recurse=False)):
                raise InputError(
                    f"layer '{mod_name}' ({type(module).__name__}) has no GPT-2 "
                    "equivalent (RMSNorm? set model.norm: layernorm)."
                )
            continue
        if mod_name == "lm_head" and model.tie_embeddings:
            continue  # GPT-2 ties it to transformer.wte.weight
        weight = module.weight.detach().to("cpu")
        hf_weight = _hf_name(f"{mod_name}.weight")
        out[hf_weight] = (weight.t() if _is_conv1d(hf_weight) else weight).contiguous()
        if mod_name == "lm_head" or isinstance(module, torch.nn.Embedding):
            continue  # GPT-2's LM head and embeddings have no bias
        bias = module.bias
        n_out = weight.shape[0]  # Linear (out, in) and LayerNorm (C,) alike
        out[_hf_name(f"{mod_name}.bias")] = (
            bias.detach().to("cpu").contiguous()
            if bias is not None
            else torch.zeros(n_out, dtype=weight.dtype)
        )
    return out


def from_gpt2_state_dict(
    tensors: dict[str, torch.Tensor], n_layer: int, tie_embeddings: bool, source: str = "weights"
) -> dict[str, torch.Tensor]:
    """Hugging Face GPT-2 weights -> llmcli names and layouts.

    Accepts names with or without the `transformer.` prefix (`GPT2LMHeadModel` / `GPT2Model`
    checkpoints) and ignores the causal-mask buffers old checkpoints saved.

    Raises:
        CheckpointError: a tensor name that is not GPT-2's (names it), or an untied model
            without `lm_head.weight`.
    """
    reverse: dict[str, str] = {}
    for i in range(n_layer):
        for ours, theirs in (
            ("ln1", "ln_1"),
            ("ln2", "ln_2"),
            ("attn.qkv", "attn.c_attn"),
            ("attn.proj", "attn.c_proj"),
            ("mlp.fc", "mlp.c_fc"),
            ("mlp.proj", "mlp.c_proj"),
        ):
            for kind in ("weight", "bias"):
                reverse[f"h.{i}.{theirs}.{kind}"] = f"blocks.{i}.{ours}.{kind}"
    for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"):
        reverse[name] = name

    out: dict[str, torch.Tensor] = {}
    unknown = []
    for name, tensor in tensors.items():
        if name == "lm_head.weight":
            if not tie_embeddings:
                out[name] = tensor
            continue  # tied: the same values as wte
        short = name.removeprefix("transformer.")
        if short.endswith(_IGNORED_SUFFIXES) and short not in reverse:
            continue
        if short not in reverse:
            unknown.append(name)
            continue
        out[reverse[short]] = tensor.t() if _is_conv1d(short) else tensor
    if unknown:
        raise CheckpointError(
            f"{source} holds tensors that a GPT-2 model with {n_layer} layers does not have: "
            f"{', '.join(sorted(unknown)[:5])}{' ...' if len(unknown) > 5 else ''}. Is "
            "config.json (n_layer) from the same checkpoint?"
        )
    if not tie_embeddings and "lm_head.weight" not in out:
        raise CheckpointError(
            f"{source} has no lm_head.weight, but config.json says tie_word_embeddings false."
        )
    return {k: v.contiguous() for k, v in out.items()}


def gpt2_config(
    model_cfg: ModelConfig,
    vocab_size: int,
    eot_id: int | None,
    layer_norm_eps: float = LAYER_NORM_EPS,
) -> dict[str, Any]:
    """The `config.json` of the GPT-2 equivalent of `model_cfg` (a plain dict)."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": vocab_size,
        "n_positions": model_cfg.context_length,
        "n_embd": model_cfg.n_embed,
        "n_layer": model_cfg.n_layer,
        "n_head": model_cfg.n_head,
        "n_inner": None,  # 4 * n_embd, as llmcli's MLP
        "activation_function": model_cfg.mlp,  # "gelu" (exact, erf) or "relu2"
        "resid_pdrop": model_cfg.dropout,
        "embd_pdrop": model_cfg.dropout,
        "attn_pdrop": model_cfg.dropout,
        "layer_norm_epsilon": layer_norm_eps,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "use_cache": True,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "tie_word_embeddings": model_cfg.tie_embeddings,
        "torch_dtype": "float32",
    }


def model_config_from_gpt2(
    hf_cfg: dict[str, Any], base: ModelConfig, source: str = HF_CONFIG_FILE
) -> ModelConfig:
    """llmcli's `ModelConfig` for a GPT-2 `config.json`; `base` gives what GPT-2 leaves open
    (dropout).

    Raises:
        InputError: the config is not GPT-2's, lacks a key, or uses an option llmcli's model
            cannot express (names it).
    """
    model_type = hf_cfg.get("model_type")
    if model_type != "gpt2":
        raise InputError(
            f"{source}: model_type is {model_type!r}, but train.init_from supports GPT-2 "
            "checkpoints only (model_type 'gpt2')."
        )

    def integer(*keys: str) -> int:
        for key in keys:
            value = hf_cfg.get(key)
            if value is not None:
                if type(value) is not int or value <= 0:
                    raise InputError(f"{source}: {key} ({value!r}) must be a positive integer.")
                return value
        raise InputError(f"{source} lacks {keys[0]}: it is not a complete GPT-2 config.")

    n_embed = integer("n_embd", "hidden_size")
    n_head = integer("n_head", "num_attention_heads")
    n_layer = integer("n_layer", "num_hidden_layers")
    context_length = integer("n_positions", "n_ctx", "max_position_embeddings")
    if n_embed % n_head:
        raise InputError(f"{source}: n_embd ({n_embed}) is not divisible by n_head ({n_head}).")

    refused = []
    n_inner = hf_cfg.get("n_inner")
    if n_inner is not None and n_inner != 4 * n_embed:
        refused.append(f"n_inner ({n_inner}; llmcli's MLP is 4 * n_embd = {4 * n_embed})")
    if not hf_cfg.get("scale_attn_weights", True):
        refused.append("scale_attn_weights (false; llmcli scales by 1/sqrt(head size))")
    if hf_cfg.get("scale_attn_by_inverse_layer_idx", False):
        refused.append("scale_attn_by_inverse_layer_idx (true)")
    if hf_cfg.get("add_cross_attention", False):
        refused.append("add_cross_attention (true)")
    activation = hf_cfg.get("activation_function", "gelu_new")
    if activation in _EXACT_ACTIVATIONS:
        mlp = _EXACT_ACTIVATIONS[activation]
    elif activation in _APPROX_GELUS:
        mlp = "gelu"
        logger.warning(
            "%s: activation_function %r (tanh-approximated GELU) is loaded into llmcli's exact "
            "GELU; logits differ slightly from the original model's",
            source,
            activation,
        )
    else:
        refused.append(f"activation_function ({activation!r}; llmcli has gelu and relu2)")
    if refused:
        raise InputError(
            f"{source} uses GPT-2 options that llmcli's model cannot express: "
            + ", ".join(refused)
            + "."
        )
    eps = hf_cfg.get("layer_norm_epsilon", LAYER_NORM_EPS)
    if not isinstance(eps, (int, float)) or not math.isclose(eps, LAYER_NORM_EPS):
        logger.warning(
            "%s: layer_norm_epsilon %r is loaded with llmcli's %g; logits differ slightly",
            source,
            eps,
            LAYER_NORM_EPS,
        )
    return dataclasses.replace(
        base,
        n_layer=n_layer,
        n_head=n_head,
        n_embed=n_embed,
        context_length=context_length,
        bias=True,
        pos_emb="learned",
        norm="layernorm",
        qk_norm=False,
        mlp=mlp,
        tie_embeddings=bool(hf_cfg.get("tie_word_embeddings", True)),
    )


# ---------------------------------------------------------------------------------------------
# Tokenizer files
# ---------------------------------------------------------------------------------------------


def hf_tokenizer_json(tokenizer: Tokenizer) -> str:
    """The tokenizer as a Hugging Face `tokenizer.json` that encodes and decodes as ours.

    A char tokenizer becomes a `WordLevel` model over its characters, with a pre-tokenizer that
    isolates every character (`[\\s\\S]` matches any one, newlines included) and a `Fuse`
    decoder that joins tokens with nothing between them. A BPE tokenizer already is one.
    """
    from llmcli.tokenizer import CharTokenizer

    if isinstance(tokenizer, CharTokenizer):
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        vocab = dict(tokenizer.stoi)
        if tokenizer.eot is not None:
            vocab[tokenizer.eot] = tokenizer.eot_id
        hf = HFTokenizer(models.WordLevel(vocab=vocab, unk_token=None))
        hf.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
        hf.decoder = decoders.Fuse()
        if tokenizer.eot is not None:
            hf.add_special_tokens([AddedToken(tokenizer.eot, special=True, normalized=False)])
        return hf.to_str()
    return tokenizer.to_json()


def _eot_token(tokenizer: Tokenizer) -> str | None:
    """The end-of-text token's text (None without one): BOS and EOS of the export."""
    return None if tokenizer.eot_id is None else tokenizer.decode([tokenizer.eot_id])


def hf_tokenizer_files(tokenizer: Tokenizer, context_length: int) -> dict[str, str]:
    """`tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` for `AutoTokenizer`
    (a `PreTrainedTokenizerFast` that adds no special tokens when encoding, as llmcli)."""
    eot = _eot_token(tokenizer)
    special = {"bos_token": eot, "eos_token": eot} if eot is not None else {}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        **special,
    }
    return {
        HF_TOKENIZER_FILE: hf_tokenizer_json(tokenizer),
        HF_TOKENIZER_CONFIG: json.dumps(tokenizer_config, indent=2) + "\n",
        HF_SPECIAL_TOKENS: json.dumps(special, indent=2) + "\n",
    }


def _generation_config(config: Config, eot_id: int | None) -> dict[str, Any]:
    """The run's sampling defaults as a `generation_config.json`."""
    sample = config.sample
    gen: dict[str, Any] = {"max_new_tokens": sample.max_new_tokens}
    if sample.temperature > 0:
        gen.update(do_sample=True, temperature=sample.temperature, top_p=sample.top_p)
        if sample.top_k is not None:
            gen["top_k"] = sample.top_k
    else:
        gen["do_sample"] = False
    if eot_id is not None:
        gen.update(bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id)
    return gen


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


@dataclass
class ExportResult:
    """What `export_hf` wrote."""

    run_dir: Path
    out_dir: Path
    files: list[str]
    n_params: int
    vocab_size: int
    step: int


def _check_out_dir(out: Path, run_dir: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise InputError(f"export target '{out}' exists and is a file: choose another --out.")
    if out.resolve() == run_dir.resolve():
        raise InputError(
            f"export target '{out}' is the run directory itself; the export would overwrite its "
            "weights. Choose another --out."
        )
    if out.is_dir() and any(out.iterdir()) and not force:
        raise InputError(
            f"export target '{out}' exists and is not empty: choose a new folder, or pass "
            "--force to write into it (the files of a previous export are replaced)."
        )


def export_hf(
    checkpoint: str | Path | None,
    out: str | Path,
    *,
    format: str = "hf",
    force: bool = False,
    weights: str = "best",
) -> ExportResult:
    """Write a run as a Hugging Face GPT-2 folder that `transformers` loads offline.

    The folder holds `config.json`, `generation_config.json` (the run's sampling defaults),
    `model.safetensors` (float32, GPT-2 names) and `tokenizer.json`, `tokenizer_config.json`,
    `special_tokens_map.json`. Each file is written to a temporary name and renamed into place.

    Args:
        checkpoint: a run directory; None picks the latest run under `checkpoints/`.
        out: the folder to write; it must not exist or be empty unless `force`.
        format: "hf" (the only one for now).
        force: write into a non-empty `out`, replacing the files of a previous export.
        weights: "best" or "last", as `llmcli sample`.

    Raises:
        InputError: a bad run, an option GPT-2 cannot express, or an `out` that is not usable.
    """
    from safetensors.torch import save

    from llmcli import checkpoint as ckpt

    if format not in FORMATS:
        raise InputError(
            f"--format {format!r} is not supported; the formats are {', '.join(FORMATS)}."
        )
    run_dir = Path(checkpoint) if checkpoint is not None else ckpt.find_latest_run()
    out = Path(out)
    _check_out_dir(out, run_dir if run_dir.is_dir() else run_dir.parent, force)
    run = ckpt.load_run(run_dir, weights=weights, device="cpu")
    check_gpt2_compatible(run.config.model)
    model, tokenizer = run.model, run.tokenizer
    eot_id = tokenizer.eot_id
    if eot_id is None:
        newline = tokenizer.encode("\n")
        logger.warning(
            "the run's tokenizer has no end-of-text token (a char run from before llmcli had "
            "one), so the export has no BOS/EOS token: lm-evaluation-harness then needs "
            "--model_args pretrained=%s,prefix_token_id=%s",
            out,
            newline[0] if newline else "<id>",
        )
    eps = getattr(model.ln_f, "eps", LAYER_NORM_EPS)

    files: dict[str, bytes] = {
        HF_CONFIG_FILE: _json_bytes(gpt2_config(run.config.model, model.vocab_size, eot_id, eps)),
        HF_GENERATION_FILE: _json_bytes(_generation_config(run.config, eot_id)),
        HF_WEIGHTS_FILE: save(to_gpt2_state_dict(model), metadata={"format": "pt"}),
    }
    for name, text in hf_tokenizer_files(tokenizer, run.config.model.context_length).items():
        files[name] = text.encode("utf-8")

    try:
        out.mkdir(parents=True, exist_ok=True)
        for stale in _STALE_FILES:
            if (out / stale).is_file():
                logger.info("removing %s from '%s' (it would shadow the export)", stale, out)
                (out / stale).unlink()
        for name, data in files.items():
            atomic_write_bytes(out / name, data)
    except OSError as exc:
        raise InputError(f"cannot write the export to '{out}': {describe_os_error(exc)}.") from None
    logger.info("exported '%s' (step %d) to '%s'", run.run_dir, run.step, out)
    return ExportResult(
        run_dir=run.run_dir,
        out_dir=out,
        files=list(files),
        n_params=model.num_parameters(),
        vocab_size=model.vocab_size,
        step=run.step,
    )


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------------
# Import (train.init_from)
# ---------------------------------------------------------------------------------------------


def _weights_files(folder: Path) -> list[Path]:
    """The weight files of an HF folder, in the order `transformers` prefers them ([] if none)."""
    if (folder / HF_WEIGHTS_FILE).is_file():
        return [folder / HF_WEIGHTS_FILE]
    index = folder / HF_WEIGHTS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(
                f"'{index}' is not a safetensors index (no weight_map)."
            ) from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise CheckpointError(
                f"'{index}' names shards that are missing: {', '.join(missing[:5])}."
            )
        return [folder / s for s in shards]
    if (folder / HF_TORCH_WEIGHTS).is_file():
        return [folder / HF_TORCH_WEIGHTS]
    return []


def check_gpt2_folder(path: str | Path) -> tuple[Path, dict[str, Any]]:
    """Check that `path` is a Hugging Face GPT-2 folder and read its `config.json`.

    Returns:
        `(folder, config.json as a dict)`.

    Raises:
        InputError: the folder is missing, or lacks config.json, weights or tokenizer.json (all
            that is missing is named), or config.json is not JSON.
    """
    folder = Path(path).expanduser()
    what = f"train.init_from ('{path}')"
    if not folder.exists():
        raise InputError(
            f"{what} does not exist: give a local Hugging Face GPT-2 folder "
            "(config.json, model.safetensors, tokenizer.json)."
        )
    if not folder.is_dir():
        raise InputError(
            f"{what} is a file: give the folder that holds config.json, "
            "model.safetensors and tokenizer.json."
        )
    missing = []
    if not (folder / HF_CONFIG_FILE).is_file():
        missing.append(f"{HF_CONFIG_FILE} (the architecture)")
    if not _weights_files(folder):
        missing.append(f"weights ({HF_WEIGHTS_FILE}, {HF_WEIGHTS_INDEX} or {HF_TORCH_WEIGHTS})")
    if not (folder / HF_TOKENIZER_FILE).is_file():
        hint = (
            " (only vocab.json/merges.txt: re-save it with a recent transformers, "
            "AutoTokenizer.from_pretrained(DIR).save_pretrained(DIR))"
            if (folder / "vocab.json").is_file()
            else ""
        )
        missing.append(f"{HF_TOKENIZER_FILE}{hint}")
    if missing:
        raise InputError(
            f"{what} is not a Hugging Face GPT-2 checkpoint folder: it lacks "
            + "; ".join(missing)
            + "."
        )
    cfg_path = folder / HF_CONFIG_FILE
    try:
        hf_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as exc:
        raise InputError(f"'{cfg_path}' is not readable JSON ({exc}).") from None
    if not isinstance(hf_cfg, dict):
        raise InputError(f"'{cfg_path}' is not a model config (a JSON {type(hf_cfg).__name__}).")
    return folder, hf_cfg


def _load_folder_tokenizer(folder: Path, hf_cfg: dict[str, Any]) -> Tokenizer:
    from llmcli.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder / HF_TOKENIZER_FILE)
    vocab, model_vocab = tokenizer.vocab_size, hf_cfg.get("vocab_size")
    if model_vocab != vocab:
        relation = "larger" if isinstance(model_vocab, int) and model_vocab > vocab else "smaller"
        raise InputError(
            f"'{folder / HF_CONFIG_FILE}' has vocab_size {model_vocab!r}, {relation} than its "
            f"tokenizer's {vocab} tokens ('{folder / HF_TOKENIZER_FILE}'); llmcli needs them "
            "equal. Use the tokenizer the model was trained with."
        )
    return tokenizer


def read_gpt2_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight file(s), on the CPU, under their HF names.

    Raises:
        CheckpointError: no weights, or a file that is corrupt or unsafe to load.
    """
    import pickle

    import torch
    from safetensors.torch import load_file

    files = _weights_files(folder)
    if not files:
        raise CheckpointError(f"'{folder}' has no weights ({HF_WEIGHTS_FILE}).")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            if path.suffix == ".safetensors":
                tensors.update(load_file(path, device="cpu"))
            else:
                tensors.update(torch.load(path, map_location="cpu", weights_only=True))
        except pickle.UnpicklingError as exc:
            if "Unsupported global" in str(exc):  # a pickled class or function
                raise CheckpointError(
                    f"'{path}' holds Python objects other than tensors; it was refused unread "
                    "(loading it could run code). Convert it to model.safetensors."
                ) from None
            raise CheckpointError(f"'{path}' is corrupt or not a weights file.") from None
        except Exception as exc:  # safetensors and torch raise many error types on bad files
            raise CheckpointError(f"'{path}' is corrupt or not a weights file ({exc}).") from None
    bad = [k for k, v in tensors.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(
            f"the weights of '{folder}' hold non-tensor entries: {', '.join(map(str, bad[:5]))}."
        )
    return tensors


def load_gpt2_weights(model: Transformer, path: str | Path) -> None:
    """Copy a Hugging Face GPT-2 folder's weights into `model` (built with its shape).

    Raises:
        CheckpointError: a missing, unexpected or mis-shaped tensor (named).
    """
    from llmcli import checkpoint as ckpt

    folder = Path(path).expanduser()
    source = f"the weights of '{folder}'"
    ours = from_gpt2_state_dict(
        read_gpt2_weights(folder), model.n_layer, model.tie_embeddings, source
    )
    ckpt.load_weights(model, ours, folder)


@dataclass
class GPT2Folder:
    """A Hugging Face GPT-2 folder loaded as llmcli objects."""

    path: Path
    model_config: ModelConfig
    tokenizer: Tokenizer
    model: Transformer
    hf_config: dict[str, Any]


def load_gpt2_folder(
    path: str | Path, *, base: ModelConfig | None = None, device: str = "cpu"
) -> GPT2Folder:
    """Load a Hugging Face GPT-2 folder as an llmcli model (eval mode) and tokenizer.

    Args:
        path: the folder (config.json, weights, tokenizer.json).
        base: model options GPT-2 leaves open (dropout); default `ModelConfig()`.
        device: where to put the model.

    Raises:
        InputError: not a GPT-2 folder, an inexpressible option, a vocabulary mismatch,
            bad weights (each message names the file and what to fix).
    """
    from llmcli.config import ModelConfig
    from llmcli.model import Transformer

    folder, hf_cfg = check_gpt2_folder(path)
    model_cfg = model_config_from_gpt2(hf_cfg, base or ModelConfig(), str(folder / HF_CONFIG_FILE))
    tokenizer = _load_folder_tokenizer(folder, hf_cfg)
    model = Transformer.from_config(model_cfg, tokenizer.vocab_size)
    load_gpt2_weights(model, folder)
    model.to(device)
    model.eval()
    return GPT2Folder(folder, model_cfg, tokenizer, model, hf_cfg)


def resolve_init_from(config: Config) -> Config:
    """The config of a run that starts from `train.init_from` (a Hugging Face GPT-2 folder).

    `model` takes the folder's architecture (keeping `dropout`), `data.tokenizer` becomes the
    folder's `tokenizer.json` (used as is) and `train.init_from` its absolute path, so the
    resolved config written into the run describes the model exactly (sample and resume need
    nothing else). The weights are copied by `load_gpt2_weights` once the model is built.

    Raises:
        InputError: not a GPT-2 folder, an inexpressible option or a vocabulary mismatch.
    """
    folder, hf_cfg = check_gpt2_folder(config.train.init_from)
    model_cfg = model_config_from_gpt2(hf_cfg, config.model, str(folder / HF_CONFIG_FILE))
    _load_folder_tokenizer(folder, hf_cfg)
    folder = folder.resolve()
    resolved = dataclasses.replace(
        config,
        model=model_cfg,
        data=dataclasses.replace(config.data, tokenizer=str(folder / HF_TOKENIZER_FILE)),
        train=dataclasses.replace(config.train, init_from=str(folder)),
    )
    resolved.validate()
    changed = [
        f"model.{k}={v!r}"
        for k, v in dataclasses.asdict(model_cfg).items()
        if getattr(config.model, k) != v
    ]
    logger.info("init_from '%s': %s", folder, ", ".join(changed) or "model shape unchanged")
    return resolved
