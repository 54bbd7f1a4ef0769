"""A decode step compiled ahead of time, opt-in (`llmcli sample --compile`): the model's own
forward for one new token per row, exported with a static KV cache (`torch.export`) and
compiled to C++ by AOTInductor, the weights frozen in and its matrix products autotuned.

On a small model a decode step's time goes to eager PyTorch's cost per operation (Python,
dispatch, allocation), not to arithmetic; compiled, the whole step is one call. Timed against
`llmcli.generation.fast_decode`'s step after the compile (benchmarks/compiled_step.py, one
thread), it takes 0.92x its time at one row of the `tiny` shape and 0.75x at 8 rows, but on 6
layers of 384 it is slower at every row count (1.04x at one row, 1.6x at 8: Inductor's products
against MKL's, and attention over every column of the cache). So `sample --compile` takes it
only there (`pays`: at most `PAYS_PARAMETERS` weights and `PAYS_ROWS` rows) and keeps the
default step elsewhere (`decode_step`). What it costs: about a minute of compiling per model and
batch size the first time, and a C++ compiler. The compiled step is kept in the compile cache
(`decode/` in `llmcli.cache.compile_cache_dir`), under a key that hashes the weights, the
model's config, the rows and torch's version (`decode_key`), so the next `--compile` on the same
run starts at once. A package is written whole or not at all (`llmcli.fileio.atomic_path`).

The exported function is `Transformer.forward` with `_StaticCache`, a stand-in for `KVCache`
that writes each layer's new keys and values at the step's column given as a tensor (so that one
graph serves every column) and gives attention all `max_len` columns, with a mask that hides
those not written yet (and padding). The graph reads and writes the generation's own `KVCache`
tensors: a prefill through the forward and compiled steps share one cache.

The logits agree with the forward's to float32 rounding (the compiled products sum in another
order), not bit for bit; tests/test_compiled_decode.py checks the tokens against the plain loop.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from llmcli.cache import compile_cache_dir, compile_key
from llmcli.errors import InputError, describe_os_error
from llmcli.fileio import atomic_path
from llmcli.generation.fast_decode import FastDecoder, through_forward
from llmcli.model.gpt import Transformer
from llmcli.model.hooks import HookPoint
from llmcli.model.kv_cache import KVCache

logger = logging.getLogger(__name__)

#: How AOTInductor compiles the step: weights frozen in (so that the products can be packed and
#: tuned for them), each product's kernel chosen by timing Inductor's C++ micro-kernels against
#: ATen's.
INDUCTOR_OPTIONS = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP,ATEN",
}


#: Part of every compiled step's key: bump it when what is compiled changes.
STEP_FORMAT = "llmcli-decode-v2"


class _StaticCache:
    """What `Transformer.forward` asks of a `KVCache`, at a column given as a tensor.

    `update` writes a layer's keys and values of the new token at `column` into that layer's
    buffers `(B, nh, max_len, hs)` and returns them whole; the step's mask hides the columns
    not written yet. Each layer's buffer is an input of its own, so that the compiled graph
    writes the one column in place (a slice of one cache-wide input would be copied whole at
    every step). `length` stays 0: the step always gives `input_pos`.
    """

    length = 0

    def __init__(self, keys: tuple[Tensor, ...], values: tuple[Tensor, ...], column: Tensor):
        self.keys, self.values, self.column = keys, values, column

    def check_room(self, batch_size: int, T: int) -> None:
        """The caller checks the real cache's room before each step."""

    def update(self, layer_idx: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.keys[layer_idx].index_copy_(2, self.column, k)
        self.values[layer_idx].index_copy_(2, self.column, v)
        return self.keys[layer_idx], self.values[layer_idx]

    def advance(self, T: int) -> None:
        """The caller counts the step on the real cache."""


class _Step(nn.Module):
    """The function compiled: logits `(B, V)` of one new token per row; `layers` are every
    layer's key buffer, then every layer's value buffer."""

    def __init__(self, model: Transformer) -> None:
        super().__init__()
        self.model = model

    def forward(
        self, idx: Tensor, input_pos: Tensor, mask: Tensor, column: Tensor, *layers: Tensor
    ) -> Tensor:
        n = len(layers) // 2
        cache = _StaticCache(layers[:n], layers[n:], column)
        logits, _ = self.model(idx, mask=mask, input_pos=input_pos, kv_cache=cache)
        return logits[:, -1]  # (B, 1, V) -> (B, V)


def decode_key(model: Transformer, rows: int, max_len: int) -> str:
    """What a compiled step depends on (`llmcli.cache.compile_key`): the weights, the config,
    the rows and cache length, torch's version, the compile options and `STEP_FORMAT`."""
    about = {
        "config": dataclasses.asdict(model.config),
        "vocab_size": model.vocab_size,
        "rows": rows,
        "max_len": max_len,
        "options": INDUCTOR_OPTIONS,
        "format": STEP_FORMAT,
    }
    return compile_key(about, model.state_dict())


def compile_step(model: Transformer, rows: int, max_len: int, path: Path) -> None:
    """Export and compile the step for `rows` rows and a cache of `max_len` columns into the
    package `path`, in a folder that exists (written under a temporary name, then renamed)."""
    cache = model.new_kv_cache(rows, max_len=max_len)
    layers = [x.clone() for x in (*cache.k.unbind(0), *cache.v.unbind(0))]  # not aliased
    example = (
        torch.zeros(rows, 1, dtype=torch.long),  # idx
        torch.zeros(rows, 1, dtype=torch.long),  # input_pos
        torch.ones(rows, 1, 1, max_len, dtype=torch.bool),  # mask
        torch.zeros(1, dtype=torch.long),  # column
        *layers,
    )
    # AOTInductor names its package *.pt2: it writes into a scratch folder, and the file then
    # takes the place of `atomic_path`'s temporary one.
    limit = sys.getrecursionlimit()  # Inductor raises it for itself and leaves it so
    try:
        with atomic_path(path) as tmp, tempfile.TemporaryDirectory(dir=path.parent) as scratch:
            package = Path(scratch) / "step.pt2"
            with torch.no_grad():
                program = torch.export.export(_Step(model).eval(), example)
                torch._inductor.aoti_compile_and_package(
                    # A copy: Inductor adds its own entries to the options it is given.
                    program,
                    package_path=str(package),
                    inductor_configs=dict(INDUCTOR_OPTIONS),
                )
            os.replace(package, tmp)
    finally:
        sys.setrecursionlimit(limit)


#: Where the compiled step measured faster than `FastDecoder`'s once compiled
#: (benchmarks/compiled_step.py, one thread, interleaved rounds): models of at most
#: `PAYS_PARAMETERS` weights (the `tiny` shape, 0.8M; not 6 layers of 384, 11M) decoding at most
#: `PAYS_ROWS` rows at a time. Elsewhere it was no faster, or slower, and `sample --compile` keeps
#: the default step (`decode_step`).
PAYS_PARAMETERS = 1_000_000
PAYS_ROWS = 8


def pays(model: Transformer, rows: int) -> bool:
    """Whether the compiled step measured faster than the default one for `rows` rows of a
    model of `model`'s size (`PAYS_PARAMETERS`, `PAYS_ROWS`)."""
    return rows <= PAYS_ROWS and sum(p.numel() for p in model.parameters()) <= PAYS_PARAMETERS


def decode_step(
    model: Any,
    rows: int,
    *,
    cache_dir: Path | None = None,
    notify: Callable[[str], Any] = logger.warning,
) -> CompiledDecoder | Literal["auto"]:
    """What `sample --compile` decodes `rows` rows of `model` with: the compiled step
    (`CompiledDecoder.for_model`) where it `pays`, else "auto" (`generate`'s default step), said
    through `notify`, with nothing compiled.

    Raises:
        InputError: as `CompiledDecoder.for_model`.
    """
    check_compilable(model)
    if not pays(model, rows):
        notify(
            f"--compile: the compiled decode step is no faster than the default one for {rows} "
            f"row(s) of a model this size (benchmarks/compiled_step.py: it pays up to "
            f"{PAYS_ROWS} rows of {PAYS_PARAMETERS:,} weights); sampling with the default step"
        )
        return "auto"
    return CompiledDecoder.for_model(model, rows, cache_dir=cache_dir, notify=notify)


def check_compilable(model: Any) -> None:
    """Raise `InputError` unless `model` is a `Transformer` on the CPU (what is compiled)."""
    if not isinstance(model, Transformer) or model.wte.weight.device.type != "cpu":
        raise InputError("--compile compiles the decode step of a model on the CPU only")


class CompiledDecoder:
    """A `DecodeStep` (`llmcli.generation.engine`) for `rows` rows: the compiled step; for
    another batch size or cache `FastDecoder`'s; None where neither applies now (a hook function
    at work, autocast, training mode), when the caller runs the model's forward.

    The weights are compiled in: they must not change while the decoder is in use.
    """

    #: The decoder made last in this process, which the next batch of the same model and rows
    #: reuses: one only, so that no model is kept alive past its use.
    last: CompiledDecoder | None = None

    def __init__(self, model: Transformer, step: Callable[..., Tensor], rows: int, max_len: int):
        self.model, self.step = model, step
        self.rows, self.max_len = rows, max_len
        self.fast = FastDecoder.for_model(model)
        self.points = [m for m in model.modules() if isinstance(m, HookPoint)]
        self.device_type = model.wte.weight.device.type
        self.columns = torch.arange(max_len).expand(rows, 1, 1, max_len)  # (B, 1, 1, max_len)
        self.mask = torch.empty(rows, 1, 1, max_len, dtype=torch.bool)  # the step's, whole
        self.positions = torch.empty(rows, 1, dtype=torch.long)
        self.column = torch.empty(1, dtype=torch.long)
        self._layers: tuple[KVCache | None, tuple[Tensor, ...]] = (None, ())

    @classmethod
    def for_model(
        cls,
        model: Any,
        rows: int,
        *,
        cache_dir: Path | None = None,
        notify: Callable[[str], Any] = logger.warning,
    ) -> CompiledDecoder:
        """The compiled step of a `Transformer` on the CPU for `rows` rows and a cache of
        `context_length` columns: the one made before in this process, else loaded from the
        compile cache, else compiled (about a minute on a small model) and kept there.

        Raises:
            InputError: not a CPU `Transformer`, or compiling failed (no C++ compiler, ...).
        """
        check_compilable(model)
        last = CompiledDecoder.last
        if last is not None and last.model is model and last.rows == rows:
            return last
        max_len = model.context_length
        folder = (cache_dir or compile_cache_dir()) / "decode"
        path = folder / f"{decode_key(model, rows, max_len)}.pt2"
        if not path.exists():
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise InputError(
                    f"cannot write the compiled decode step in '{folder}': "
                    f"{describe_os_error(e)}; set $LLMCLI_CACHE (or $TORCHINDUCTOR_CACHE_DIR) "
                    "to a folder you can write"
                ) from None
            notify(
                f"compiling the decode step for {rows} row(s) (about a minute the first time; "
                f"kept in {folder})"
            )
            try:
                compile_step(model, rows, max_len, path)
            except Exception as e:  # Inductor's failures have no common type
                raise InputError(
                    f"could not compile the decode step ({type(e).__name__}: "
                    f"{str(e).splitlines()[0] if str(e) else ''}); AOTInductor needs a C++ "
                    "compiler (g++): install one, or sample without --compile"
                ) from e
        try:
            step = torch._inductor.aoti_load_package(str(path))
        except Exception as e:  # a package this torch cannot load, or a damaged file
            raise InputError(
                f"could not load the compiled decode step {path} ({type(e).__name__}): delete "
                "it, and --compile compiles it again"
            ) from e
        CompiledDecoder.last = cls(model, step, rows, max_len)
        return CompiledDecoder.last

    def __call__(
        self, idx: Tensor, cache: KVCache, mask: Tensor | None, input_pos: Tensor | None
    ) -> Tensor | None:
        """Logits `(B, V)` of the token after `idx` `(B,)`; arguments as `FastDecoder`'s."""
        B, past = idx.shape[0], cache.length
        if B != self.rows or cache.max_len != self.max_len:
            return None if self.fast is None else self.fast(idx, cache, mask, input_pos)
        if through_forward(self.model, self.points, self.device_type):
            return None
        cache.check_room(B, 1)
        if mask is None:  # every column written so far, the new one included
            torch.lt(self.columns, past + 1, out=self.mask)
        else:  # (B, 1, 1, past + 1): the columns after it are not written yet
            self.mask.zero_()
            self.mask.narrow(3, 0, past + 1).copy_(mask)
        positions = self.positions.fill_(past) if input_pos is None else input_pos
        self.column.fill_(past)
        if self._layers[0] is not cache:  # each layer's buffers, views made once a cache
            self._layers = (cache, (*cache.k.unbind(0), *cache.v.unbind(0)))
        idx = idx.reshape(B, 1).contiguous()
        logits = self.step(idx, positions, self.mask, self.column, *self._layers[1])
        cache.advance(1)
        return logits
