"""`llmcli export`: a run as a Hugging Face folder that `transformers` loads offline.

The architecture is the one that computes the run's model exactly (see `llmcli.hf.architectures`:
GPT-2, GPT-NeoX or Arcee). The folder loads with `transformers.AutoModelForCausalLM` and
`AutoTokenizer`; writing it needs no `transformers` (only `tokenizers` and `safetensors`). The char
tokenizer becomes a Hugging Face `WordLevel` model over single characters with a pre-tokenizer that
isolates every character, so both encode and decode alike. The end-of-text token (`<|endoftext|>`,
the last id of a char vocabulary, or a BPE vocabulary's) is the export's BOS, EOS and padding
token, which `generate` and lm-evaluation-harness rely on.

A chat run's export carries its chat template (`llmcli.data.chat_template`) where every
`transformers` version looks for it: `chat_template.jinja` (what recent versions read first
and 5.x writes) and `tokenizer_config.json`'s `chat_template` (what older versions read). The chat
tokens are declared `additional_special_tokens`, so `apply_chat_template` gives the ids and the
assistant mask llmcli trains on; `generation_config.json` stops at the end of a turn as well as
at the end of text.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import save

from llmcli.config import Config
from llmcli.data.chat_template import CHAT_TOKENS, TEMPLATE_FILE, ChatTemplate, load_run_template
from llmcli.data.conversations import ConversationEncoder
from llmcli.data.tokenizer import Tokenizer, eot_text, special_tokens
from llmcli.errors import InputError, describe_os_error
from llmcli.fileio import atomic_write_bytes
from llmcli.hf.architectures import choose
from llmcli.hf.common import (
    HF_CONFIG_FILE,
    HF_GENERATION_FILE,
    HF_SPECIAL_TOKENS,
    HF_TOKENIZER_CONFIG,
    HF_TOKENIZER_FILE,
    HF_TORCH_WEIGHTS,
    HF_WEIGHTS_FILE,
    HF_WEIGHTS_INDEX,
    NORM_EPS,
)
from llmcli.hf.lora import peft_adapter_files, restore_base_rows, saved_adapted_model
from llmcli.model.gpt import Transformer
from llmcli.runs.directory import ADAPTER_CONFIG_FILE, ADAPTER_FILE
from llmcli.runs.loading import LoadedRun, load_run

logger = logging.getLogger(__name__)

# Files of another export or checkpoint that `--force` removes, as they would shadow ours.
_STALE_FILES = (
    HF_WEIGHTS_INDEX,
    HF_TORCH_WEIGHTS,
    "pytorch_model.bin.index.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    TEMPLATE_FILE,  # a text run's export must not keep a chat export's template
    # transformers would load the base it names and this adapter instead of this folder's model
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
)
# The subfolder a LoRA run's adapter goes to: beside the base, not in its folder (see above).
ADAPTER_DIR = "adapter"

# ---------------------------------------------------------------------------------------------
# Tokenizer files
# ---------------------------------------------------------------------------------------------


def hf_tokenizer_files(
    tokenizer: Tokenizer, context_length: int, template: ChatTemplate | None = None
) -> dict[str, str]:
    """`tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json` for `AutoTokenizer`
    (a `PreTrainedTokenizerFast` that adds no special tokens when encoding, as llmcli); with a
    chat `template`, also `chat_template.jinja`, the template in the config too, and the chat
    tokens as additional special tokens (skipped by `decode(skip_special_tokens=True)`)."""
    # The end of text as BOS and EOS: what a chat template reads too (the ids llmcli trained on).
    special: dict[str, Any] = dict(special_tokens(eot_text(tokenizer)))
    if template is not None:
        special["additional_special_tokens"] = list(CHAT_TOKENS)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        **special,
    }
    if template is not None:
        tokenizer_config["chat_template"] = template.source
    files = {
        HF_TOKENIZER_FILE: tokenizer.to_json(),  # every llmcli tokenizer.json is Hugging Face's
        HF_TOKENIZER_CONFIG: json.dumps(tokenizer_config, indent=2) + "\n",
        HF_SPECIAL_TOKENS: json.dumps(special, indent=2) + "\n",
    }
    if template is not None:
        files[TEMPLATE_FILE] = template.source
    return files


def run_chat(
    run_dir: Path, tokenizer: Tokenizer
) -> tuple[ChatTemplate | None, tuple[int, ...] | None]:
    """A chat run's template and the tokens that end a reply (its end of turn first:
    `ConversationEncoder.reply_end_ids`), which both exports carry; `(None, None)` for a run
    trained on plain text.

    Raises:
        InputError: an unreadable template, or a tokenizer without the chat tokens (named).
    """
    template = load_run_template(run_dir)
    if template is None:
        return None, None
    # A chat run's tokenizer holds the chat tokens (the encoder says which it lacks otherwise).
    return template, ConversationEncoder(template, tokenizer).reply_end_ids


def _generation_config(
    config: Config, eot_id: int | None, end_ids: tuple[int, ...] | None = None
) -> dict[str, Any]:
    """The run's sampling defaults as a `generation_config.json`; a chat run's stops at each
    token that ends a reply (`end_ids`), as llmcli's replies do."""
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
    if end_ids is not None:
        gen["eos_token_id"] = list(end_ids)
    return gen


# ---------------------------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------------------------


@dataclass
class ExportResult:
    """What `export_hf` wrote (`adapter_dir`: a LoRA run's PEFT adapter folder, unless merged)."""

    architecture: str
    run_dir: Path
    out_dir: Path
    files: list[str]
    n_params: int
    vocab_size: int
    step: int
    adapter_dir: Path | None = None


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


def _check_merge(run: LoadedRun, merge: bool) -> None:
    """Refuse `--merge` on a run without adapters: there is nothing to merge."""
    if merge and run.config.train.lora is None:
        raise InputError(
            f"--merge folds a LoRA run's adapters into its weights, and '{run.run_dir}' has "
            "none (it was not trained with train.lora): there is nothing to merge. Leave out "
            "--merge; the export is the run's plain model either way."
        )


def export_hf(
    checkpoint: str | Path | None,
    out: str | Path,
    *,
    fmt: str = "auto",
    force: bool = False,
    weights: str = "best",
    merge: bool = False,
    notify: Callable[[str], None] | None = None,
) -> ExportResult:
    """Write a run as a Hugging Face folder that `transformers` loads offline.

    The folder holds `config.json`, `generation_config.json` (the run's sampling defaults),
    `model.safetensors` (float32, the architecture's names) and `tokenizer.json`,
    `tokenizer_config.json`, `special_tokens_map.json`, and for a chat run `chat_template.jinja`.
    A LoRA run (`train.lora`) is exported as its base model, with the adapters in PEFT's format
    in `adapter/` (see `lora_export_parts`); with `merge`, as the plain model it equals.
    Each file is written to a temporary name and renamed into place.

    Args:
        checkpoint: a run directory; None picks the latest run under `checkpoints/`.
        out: the folder to write; it must not exist or be empty unless `force`.
        fmt: "auto" (the architecture that computes the model exactly) or one of
            `llmcli.hf.architectures.FORMATS`.
        force: write into a non-empty `out`, replacing the files of a previous export.
        weights: "best" or "last", as `llmcli sample`.
        merge: a LoRA run's adapters folded into the weights (refused for other runs).
        notify: called with lines for the user (the run picked, version warnings).

    Raises:
        InputError: a bad run, options no (or not the asked) architecture computes exactly,
            an `out` that is not usable, or a LoRA run whose adapters cannot be exported
            unmerged (the message says to pass `--merge`), or `merge` for a run without
            adapters.
    """
    run = load_run(checkpoint, weights=weights, device="cpu", notify=notify)
    _check_merge(run, merge)
    out = Path(out)
    _check_out_dir(out, run.run_dir, force)
    arch = choose(run.config.model, fmt)
    model, adapter = run.model, {}
    if not merge:  # a LoRA run's base and adapter, unmerged (other runs: the model, no adapter)
        model, adapter = lora_export_parts(run, arch, base=str(out.resolve()))
    files = _folder_files(run, arch, model, out)
    adapter_dir = out / ADAPTER_DIR if adapter else None
    try:
        out.mkdir(parents=True, exist_ok=True)
        # a previous LoRA export's adapter would apply a second time to merged weights
        stale_adapter = [f"{ADAPTER_DIR}/{name}" for name in (ADAPTER_CONFIG_FILE, ADAPTER_FILE)]
        for stale in (*_STALE_FILES, *stale_adapter):
            if (out / stale).is_file():
                logger.info("removing %s from '%s' (it would shadow the export)", stale, out)
                (out / stale).unlink()
        if (
            adapter_dir is None
            and (out / ADAPTER_DIR).is_dir()
            and not any((out / ADAPTER_DIR).iterdir())
        ):
            (out / ADAPTER_DIR).rmdir()  # what the stale adapter left
        for name, data in files.items():
            atomic_write_bytes(out / name, data)
        if adapter_dir is not None:
            adapter_dir.mkdir(exist_ok=True)
            for name, data in adapter.items():
                atomic_write_bytes(adapter_dir / name, data)
    except OSError as exc:
        raise InputError(f"cannot write the export to '{out}': {describe_os_error(exc)}.") from None
    logger.info("exported '%s' (step %d) as %s to '%s'", run.run_dir, run.step, arch.NAME, out)
    return ExportResult(
        architecture=arch.NAME,
        run_dir=run.run_dir,
        out_dir=out,
        files=list(files),
        n_params=run.model.num_parameters(),  # the base's and the merged model's alike
        vocab_size=run.model.vocab_size,
        step=run.step,
        adapter_dir=adapter_dir,
    )


def _folder_files(run: LoadedRun, arch: ModuleType, model: Transformer, out: Path) -> dict:
    """The export folder's files by name: config, generation defaults, `model`'s weights in
    `arch`'s layout, and the run's tokenizer (and chat template)."""
    tokenizer = run.tokenizer
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
    eps = getattr(model.ln_f, "eps", NORM_EPS)
    hf_config = arch.hf_config(run.config.model, model.vocab_size, eot_id, eps)
    template, end_ids = run_chat(run.run_dir, tokenizer)
    files: dict[str, bytes] = {
        HF_CONFIG_FILE: _json_bytes(hf_config),
        HF_GENERATION_FILE: _json_bytes(_generation_config(run.config, eot_id, end_ids)),
        HF_WEIGHTS_FILE: save(arch.to_hf(model), metadata={"format": "pt"}),
    }
    context_length = run.config.model.context_length
    for name, text in hf_tokenizer_files(tokenizer, context_length, template).items():
        files[name] = text.encode("utf-8")
    return files


def lora_export_parts(
    run: LoadedRun, arch: ModuleType, base: str
) -> tuple[Transformer, dict[str, bytes]]:
    """A LoRA run's base model and its adapter files in PEFT's format for `arch`, which name
    `base` (the export folder) as their base; another run's model and no files.

    The base is the weights the run started from as they are, from the resume state (the base
    is frozen, so they are bitwise `train.init_from`'s), rather than the merged weights less
    `B A * alpha / r`, which would differ from them by rounding. The adapters are those of the
    weights asked for: the last save's (the resume state), or the best step's
    (`best_adapter.safetensors`). Tokens the run added keep their rows of the weights asked
    for in the adapter, as PEFT's trainable tokens, and start as the run started them in the
    base (`llmcli.hf.lora`).

    Raises:
        InputError: an untied LM head's new token rows trained, which PEFT's trainable tokens
            do not reach: `--merge` exports the model.
        CheckpointError: a missing or damaged file of the run.
    """
    lora = run.config.train.lora
    if lora is None:  # a run that trained every weight: the model itself, no adapter
        return run.model, {}
    base_vocab = (run.meta.get("lora") or {}).get("base_vocab_size")
    if not (run.run_dir / ADAPTER_CONFIG_FILE).is_file() or base_vocab is None:
        raise InputError(
            "this LoRA run trained the new token rows of its untied LM head beside its "
            "adapters, which PEFT's adapter files do not hold: pass --merge to export the "
            "model the run trained, adapters folded in."
        )
    is_last = run.step == run.meta.get("step")  # best.safetensors of the last save, or none
    best = None if is_last else run.step
    model = saved_adapted_model(run.run_dir, run.config.model, lora, best)
    with torch.no_grad():  # the weights asked for: their rows are bitwise the run's at that step
        model.wte.weight[base_vocab:] = run.model.wte.weight[base_vocab:]
    files = peft_adapter_files(model, lora, arch, base, base_vocab)
    restore_base_rows(model, base_vocab)
    return model, files


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode("utf-8")
