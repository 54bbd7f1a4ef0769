"""`train.compile`: `torch.compile` where it pays, with inductor's caches kept on disk.

Compiling fuses the step's small kernels (GELU, the adds, copies and norms beside the GEMMs)
and drops most of the Python between them, but its warm-up is long on a CPU (35 s for the tiny
model on 2 cores) and there it gains little: 1.2% of the small config's step (1,165 against
1,179 ms), and nothing beyond the noise in tiny's whole loop. Inductor keeps what it compiled
in a cache, by default in `/tmp/torchinductor_<user>`, which a reboot empties; llmcli points it
at its compile cache (`llmcli.cache.compile_cache_dir`: `<llmcli cache>/inductor`, with
`$LLMCLI_CACHE`, else `~/.cache/llmcli`) unless `TORCHINDUCTOR_CACHE_DIR` is set, so that a
machine pays a model's warm-up once: compiling the tiny model again takes 2.5 s.

`train.compile: auto` compiles when the time compiling is expected to save is more than its
warm-up: the device's `SAVING` of the eager step time (measured on the config's model for
about two seconds before training, as `llmcli plan` measures it) times the steps left, against
`WARM_S` for a model whose graphs this cache holds (`RECORD` lists them) and `COLD_S` for one
it does not. The choice is written into `meta.json` (`compiled`), and a resumed run keeps it:
compiled and eager steps round differently, and a resumed run must end where an uninterrupted
one does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llmcli.cache import CACHE_ENV, compile_cache_dir, compile_key
from llmcli.config import Config
from llmcli.fileio import JSONFileError, atomic_write_json, read_json

log = logging.getLogger(__name__)

RECORD = "llmcli-compiled.json"  # the keys of the models compiled with this cache
COLD_S = 60.0  # the warm-up of a model the cache has not seen (35 s for tiny on 2 CPU cores)
WARM_S = 5.0  # the warm-up of one it has (2.5 s for tiny)
# The share of an eager step compiling saves, by device: measured on 2 CPU cores (the small
# config's step); on CUDA nanoGPT's report (an A100 step from about 250 to 135 ms), not measured
# here. A device not listed is not compiled by auto.
SAVING = {"cpu": 0.012, "cuda": 0.45}
MEASURE_S = 2.0  # seconds of eager steps timed to decide


def inductor_cache() -> Path:
    """The inductor cache folder, the compile cache (`llmcli.cache.compile_cache_dir`), set for
    this process when `$TORCHINDUCTOR_CACHE_DIR` is unset, before anything compiles."""
    cache = compile_cache_dir()
    os.environ[CACHE_ENV] = str(cache)
    return cache


def step_key(config: Config, vocab_size: int, device: torch.device) -> str:
    """What makes inductor's graphs for a run's step (`llmcli.cache.compile_key`): the model,
    the batch, the device, torch."""
    what = {
        "model": dataclasses.asdict(config.model),
        "vocab_size": vocab_size,
        "batch_size": config.train.batch_size,
        "device": device.type,
    }
    return compile_key(what)


def _compiled_keys(cache: Path) -> set[str]:
    try:
        keys = read_json(cache / RECORD)
    except JSONFileError:  # a cache's record: without it the next run measures again
        return set()
    return set(keys) if isinstance(keys, list) else set()


def remember(cache: Path, key: str) -> None:
    """Note that the cache now holds the graphs of `key` (after a compiled step ran)."""
    keys = _compiled_keys(cache) | {key}
    try:
        cache.mkdir(parents=True, exist_ok=True)
        atomic_write_json(cache / RECORD, sorted(keys))
    except OSError as exc:  # a read-only cache costs the next run its warm-up, nothing more
        log.warning("could not note the compiled model in %s (%s)", cache, exc.strerror)


@dataclass(frozen=True)
class Choice:
    """Whether the run compiles, and why (for the log)."""

    compile: bool
    reason: str


def pays(eager_step_s: float, steps_left: int, warm: bool, device: str) -> Choice:
    """`train.compile: auto`'s rule: compile when the device's `SAVING` of the eager steps left
    is more than the warm-up (`WARM_S` with the graphs in the cache, else `COLD_S`)."""
    saved = SAVING.get(device, 0.0) * eager_step_s * steps_left
    warm_up = WARM_S if warm else COLD_S
    cache = "in the cache" if warm else "not in the cache yet"
    verdict = "compiles" if saved > warm_up else "stays eager"
    reason = (
        f"train.compile auto: {verdict} (about {saved:.0f} s saved over {steps_left} steps of "
        f"{eager_step_s * 1e3:.0f} ms, against a warm-up of about {warm_up:.0f} s: the model's "
        f"graphs are {cache})"
    )
    return Choice(saved > warm_up, reason)


def choose(
    setting: bool | str,
    key: str,
    steps_left: int,
    measure_step_s: Callable[[], float],
    *,
    device: str = "cpu",
    resumed: bool | None = None,
) -> Choice:
    """Whether a run compiles: `train.compile` true or false as set; `auto` by `pays`, unless
    the run is resumed with its choice recorded (`resumed`), which it keeps."""
    if setting is not True and setting != "auto":
        return Choice(False, "")  # as asked: nothing to say
    if setting is True:
        return Choice(True, "train.compile true: the step runs compiled (torch.compile)")
    if resumed is not None:
        return Choice(resumed, f"train.compile auto: as the run chose at its start ({resumed})")
    if steps_left <= 0 or device not in SAVING:
        reason = f"train.compile auto: stays eager ({steps_left} steps left on {device})"
        return Choice(False, reason)
    warm = key in _compiled_keys(inductor_cache())
    return pays(measure_step_s(), steps_left, warm, device)


def compiled(model: nn.Module, choice: Choice, key: str, full_rows: bool = True) -> nn.Module:
    """`model` compiled (with inductor's cache on disk) when `choice` says so, else itself; the
    cache's record notes `key` once the first compiled forward has run. A step whose rows all
    fill the context (`full_rows`) gets static graphs; for the others (DPO's and GRPO's rows,
    cut to each batch's longest or packed, change width from batch to batch) torch.compile
    marks a size dynamic once it changes, where static graphs would recompile at every new
    width up to torch.compile's limit, then run eager."""
    if choice.reason:
        log.info("%s", choice.reason)
    if not choice.compile:
        return model
    cache = inductor_cache()
    # full rows: eval and probe batches get graphs of their own
    module = torch.compile(model, dynamic=False if full_rows else None)

    def noted(*_: Any) -> None:
        remember(cache, key)
        handle.remove()

    handle = module.register_forward_hook(noted)
    return module
