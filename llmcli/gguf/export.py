"""`llmcli export --format gguf`: a run as one GGUF file that llama.cpp runs.

The file holds the architecture llama.cpp computes the run's model with (`architectures`), its
hyperparameters, its byte-level BPE vocabulary (`vocab`) and its weights in float32, or with
`dtype="f16"` its matrices in float16 and its vectors (norms, biases) in float32, as
`convert_hf_to_gguf.py --outtype f16` writes them. It is written through the `gguf` package
(llama.cpp's own writer) to a temporary name and renamed into place.

A chat run's file also holds its chat template (`tokenizer.chat_template`, which llama.cpp's
chat modes render) and its end-of-turn token `<|end|>` as the end-of-turn id
(`tokenizer.ggml.eot_token_id`), so a reply stops where llmcli's does; the end of text stays the
BOS and EOS token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmcli.data.chat_template import ChatTemplate
from llmcli.errors import InputError, describe_os_error
from llmcli.fileio import atomic_path
from llmcli.gguf.architectures import GGUFArch, choose, gguf_tensors
from llmcli.gguf.vocab import PRE_TOKENIZER, GGUFVocab, gguf_vocab
from llmcli.hf.common import NORM_EPS
from llmcli.hf.export import run_chat
from llmcli.runs.loading import load_run

logger = logging.getLogger(__name__)

DTYPES = ("f32", "f16")


@dataclass
class GGUFExport:
    """What `export_gguf` wrote."""

    architecture: str
    run_dir: Path
    path: Path
    dtype: str
    n_params: int
    vocab_size: int
    step: int
    n_bytes: int


def _import_gguf() -> Any:
    try:
        import gguf
    except ImportError:
        raise InputError(
            "--format gguf needs the gguf package (llama.cpp's GGUF writer): "
            "pip install 'llmcli[gguf]' (or pip install gguf)."
        ) from None
    return gguf


def _check_out_file(out: Path, force: bool) -> None:
    if out.is_dir():
        raise InputError(
            f"GGUF export target '{out}' is a folder: --format gguf writes one file, "
            "give its name (e.g. --out model.gguf)."
        )
    if out.exists() and not force:
        raise InputError(f"'{out}' exists: choose another --out, or pass --force to replace it.")
    if not out.parent.is_dir():
        raise InputError(f"the folder of --out '{out}' does not exist: create it first.")


def _add_metadata(writer: Any, arch: GGUFArch, model: Any, eps: float, name: str) -> None:
    """The architecture's hyperparameters, under the keys llama.cpp reads for it."""
    writer.add_name(name)
    writer.add_context_length(model.context_length)
    writer.add_embedding_length(model.n_embed)
    writer.add_block_count(model.n_layer)
    writer.add_feed_forward_length(4 * model.n_embed)
    writer.add_head_count(model.n_head)
    writer.add_head_count_kv(model.n_head)
    if arch.norm == "rmsnorm":
        writer.add_layer_norm_rms_eps(eps)
    else:
        writer.add_layer_norm_eps(eps)
    if arch.pos_emb == "rope":
        writer.add_rope_dimension_count(model.n_embed // model.n_head)
        writer.add_rope_freq_base(float(model.config.rope_base))
    if arch.name == "gptneox":
        writer.add_parallel_residual(False)


def _add_vocab(writer: Any, vocab: GGUFVocab) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    if vocab.eot_id is not None:
        writer.add_bos_token_id(vocab.eot_id)
        writer.add_eos_token_id(vocab.eot_id)
    # llmcli encodes prompts as they are: no BOS in front.
    writer.add_add_bos_token(False)


def _add_chat(writer: Any, template: ChatTemplate, end_id: int) -> None:
    """A chat run's template, and its end-of-turn token (where a reply stops)."""
    writer.add_chat_template(template.source)
    writer.add_eot_token_id(end_id)


def export_gguf(
    checkpoint: str | Path | None,
    out: str | Path,
    *,
    dtype: str = "f32",
    force: bool = False,
    weights: str = "best",
    notify: Callable[[str], None] | None = None,
) -> GGUFExport:
    """Write a run as a GGUF file for llama.cpp.

    Args:
        checkpoint: a run directory; None picks the latest run under `checkpoints/`.
        out: the file to write; it must not exist unless `force`.
        dtype: "f32", or "f16" for float16 matrices (vectors stay float32).
        force: replace an existing `out`.
        weights: "best" or "last", as `llmcli sample`.
        notify: called with lines for the user (the run picked, version warnings).

    Raises:
        InputError: a run llama.cpp cannot hold (a char-level tokenizer, model options no
            llama.cpp architecture computes), a bad `dtype` or `out`, or no `gguf` package.
    """
    if dtype not in DTYPES:
        raise InputError(f"--dtype {dtype!r} is not supported for GGUF; use f32 or f16.")
    out = Path(out)
    _check_out_file(out, force)
    gguf = _import_gguf()
    run = load_run(checkpoint, weights=weights, device="cpu", notify=notify)
    model = run.model
    arch = choose(run.config.model)
    vocab = gguf_vocab(run.tokenizer, model.vocab_size)
    template, end_ids = run_chat(run.run_dir, run.tokenizer)
    tensors = gguf_tensors(model, arch)
    eps = getattr(model.ln_f, "eps", NORM_EPS)
    try:
        with atomic_path(out) as tmp:
            writer = gguf.GGUFWriter(tmp, arch.name)
            _add_metadata(writer, arch, model, eps, run.run_dir.name)
            writer.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16 if dtype == "f16" else 0))
            _add_vocab(writer, vocab)
            if template is not None and end_ids is not None:
                _add_chat(writer, template, end_ids[0])  # the end of turn
            for name, tensor in tensors.items():
                array = tensor.numpy()
                if dtype == "f16" and array.ndim == 2:
                    array = array.astype(np.float16)
                writer.add_tensor(name, array)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()
    except OSError as exc:
        raise InputError(f"cannot write '{out}': {describe_os_error(exc)}.") from None
    logger.info("exported '%s' (step %d) as GGUF %s to '%s'", run.run_dir, run.step, arch.name, out)
    return GGUFExport(
        architecture=arch.name,
        run_dir=run.run_dir,
        path=out,
        dtype=dtype,
        n_params=model.num_parameters(),
        vocab_size=model.vocab_size,
        step=run.step,
        n_bytes=out.stat().st_size,
    )
