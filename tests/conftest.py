"""Fixtures shared by several test modules."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from llmcli.checkpoint import save_model_run
from llmcli.config import config_from_dict
from llmcli.model import Transformer
from llmcli.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and the CI machine's 2 cores are shared).

    A module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def ctrl_c_raises():
    """SIGINT handled as in an interactive terminal: it raises KeyboardInterrupt.

    pytest may run with SIGINT ignored (a shell script's background job, some CI runners), and
    the tests that send Ctrl-C must not depend on who started them.
    """
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def default_sigint() -> None:
    """`preexec_fn` for a child that is sent SIGINT: undo an inherited "ignore SIGINT".

    An ignored signal stays ignored across exec, and Python then leaves it so; with the default
    action restored, the child's Python turns SIGINT into KeyboardInterrupt as in a terminal.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def save_tiny_run(
    run_dir: Path,
    tokenizer: Tokenizer,
    raw_config: dict[str, Any],
    *,
    seed: int = 0,
    sharpen: float | None = None,
    extra_meta: dict[str, Any] | None = None,
) -> Path:
    """Write a readable run directory (no resume state) holding a tiny untrained model.

    Args:
        run_dir: the folder to write.
        tokenizer: the run's tokenizer (its size sets the vocabulary).
        raw_config: config sections, as in a YAML file (defaults fill the rest).
        seed: seeds the model's initial weights.
        sharpen: multiply every weight matrix by this, for sharper logits than the
            near-uniform initialisation gives (so samples and losses differ visibly).
        extra_meta: merged into `meta.json`.
    """
    config = config_from_dict(raw_config)
    model = Transformer.from_config(
        config.model, tokenizer.vocab_size, generator=torch.Generator().manual_seed(seed)
    )
    if sharpen is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim == 2:
                    param.mul_(sharpen)
    save_model_run(run_dir, config, tokenizer, model, extra_meta=extra_meta)
    return run_dir
