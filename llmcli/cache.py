"""llmcli's cache on disk: its folder, and the compile cache in it with the key of what is kept.

`default_cache_dir()` is the folder llmcli keeps what it can make again: `$LLMCLI_CACHE`, else
`$XDG_CACHE_HOME/llmcli`, else `~/.cache/llmcli` (the token cache, `llmcli.data.prepared`, lives
in its `tokens/`). `compile_cache_dir()` is where compiled code is kept, so that a machine pays a
model's compile once: Inductor's cache (`$TORCHINDUCTOR_CACHE_DIR`, else `<cache>/inductor`),
which holds `torch.compile`'s graphs for training (`llmcli.training.compiling`) and, in its
`decode/`, the decode steps AOTInductor compiled for `sample --compile`
(`llmcli.generation.compiled_decode`). `compile_key` names what compiled code depends on, for
both.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

#: Inductor's own setting for its cache folder; llmcli's compile cache unless it is set.
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def default_cache_dir() -> Path:
    """`$LLMCLI_CACHE`, else `$XDG_CACHE_HOME/llmcli`, else `~/.cache/llmcli`."""
    if os.environ.get("LLMCLI_CACHE"):
        return Path(os.environ["LLMCLI_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "llmcli"


def compile_cache_dir() -> Path:
    """The compile cache folder: `$TORCHINDUCTOR_CACHE_DIR`, else `<llmcli cache>/inductor`
    (Inductor's default, under `/tmp`, would be emptied by a reboot)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return default_cache_dir() / "inductor"


def compile_key(about: Mapping[str, Any], weights: Mapping[str, Tensor] | None = None) -> str:
    """What compiled code depends on, hashed (32 hex digits): `about` (the config, shapes,
    options: anything JSON can write, other values by `str`) with torch's version, and the
    weights where they are compiled in (`state_dict()`: names and bytes)."""
    digest = hashlib.sha256()
    what = {**about, "torch": torch.__version__}
    digest.update(json.dumps(what, sort_keys=True, default=str).encode())
    for name, tensor in (weights or {}).items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:32]
