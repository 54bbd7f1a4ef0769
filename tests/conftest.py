"""Fixtures shared by several test modules."""

from __future__ import annotations

import hashlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import constants
from hypothesis import settings

from llmcli.config import config_from_dict
from llmcli.data.tokenizer import Tokenizer
from llmcli.device import usable_cpus
from llmcli.model.gpt import Transformer
from llmcli.runs.directory import save_model_run

ROOT = Path(__file__).resolve().parents[1]

# Every Hypothesis test tries the same examples on every run, CI's included, also where its own
# settings do not say so: a failure is then reproducible rather than luck.
settings.register_profile("derandomized", derandomize=True)
settings.load_profile("derandomized")


# --- parallel workers (pytest-xdist, `-n auto` in pyproject.toml) -------------------------------

_THREADS_BEFORE = pytest.StashKey[str | None]()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto`: one worker per CPU this process may use (a container's quota and `taskset`
    count, the host's other CPUs do not), and none with a single CPU, where a worker would
    only add its start-up: the tests then run in this process. PYTEST_XDIST_AUTO_NUM_WORKERS,
    where set, is xdist's to read."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    cpus = usable_cpus()
    return cpus if cpus > 1 else 0


def pytest_configure(config: pytest.Config) -> None:
    """In the process that starts workers: each worker's torch, and every process its tests
    start, gets its share of the CPUs (one thread for one worker a CPU), set before the workers
    start, as torch and OpenMP read OMP_NUM_THREADS once, at start-up; two workers with a
    thread a CPU each would only wait for each other."""
    workers = getattr(config.option, "numprocesses", None)
    if not workers or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    config.stash[_THREADS_BEFORE] = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // workers))


def pytest_unconfigure(config: pytest.Config) -> None:
    if _THREADS_BEFORE not in config.stash:
        return
    before = config.stash[_THREADS_BEFORE]
    if before is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = before


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In a worker: the files holding slow tests first. Workers take whole files in collection
    order (`--dist loadfile --no-loadscope-reorder`); started first, the long files run beside
    the many short ones, and no worker is left running one alone at the end. A run without
    workers keeps the files' order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    slow = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow)  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def fixed_threads() -> Iterator[None]:
    """`train.threads: auto` counts the CPUs other work leaves free, which changes with the
    machine's load, and a run's floating-point sums with it: with OMP_NUM_THREADS set, auto
    takes that count, so runs compared bit for bit (in this process or a child, in a module's
    fixture or a test) agree. Session-wide, so that it is set before any other fixture."""
    before = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    if before is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = before


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
    model = Transformer(
        config.model, tokenizer.vocab_size, generator=torch.Generator().manual_seed(seed)
    )
    if sharpen is not None:
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim == 2:
                    param.mul_(sharpen)
    save_model_run(run_dir, config, tokenizer, model, extra_meta=extra_meta)
    return run_dir


# --- a Hugging Face Hub cache, offline ---------------------------------------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
CLOSED_PORT = "http://127.0.0.1:9"  # the discard port: nothing listens, a connection fails at once


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty Hub cache, offline mode on, and a Hub endpoint that nothing answers."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    for var in ("HF_HOME", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", CLOSED_PORT)
    # huggingface_hub read the environment when it was imported: keep its copies in step.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "ENDPOINT", CLOSED_PORT)
    return cache


def go_online(monkeypatch: pytest.MonkeyPatch, endpoint: str = CLOSED_PORT) -> None:
    """Offline mode off; the Hub at `endpoint` (by default a port where nothing answers)."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)


def cache_repo(
    cache: Path, repo_id: str, files: dict[str, str], commit: str = COMMIT, ref: str | None = "main"
) -> Path:
    """Put `files` in the Hub cache as huggingface_hub stores a download: the content in
    `blobs/<hash>`, a symlink to it in `snapshots/<commit>/`, and `refs/<ref>` holding the
    commit (no newline). Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        blob = repo / "blobs" / hashlib.sha256(content.encode()).hexdigest()
        blob.write_text(content, encoding="utf-8")
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit, encoding="utf-8")
    return snapshot


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory) -> Path:
    """The first 20,000 characters of the bundled corpus, with a token cache beside them."""
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text((ROOT / "data" / "shakespeare.txt").read_text(encoding="utf-8")[:20_000])
    return path


def small_run_config(corpus: Path, **train: Any) -> dict:
    """A raw config of a 1-layer, 16-wide char model on `corpus`, trained on the CPU: seconds per
    run; `train` overrides or adds `train.*` keys."""
    return {
        "model": {"n_layer": 1, "n_head": 2, "n_embed": 16, "context_length": 16},
        "data": {"path": str(corpus), "cache_dir": str(corpus.parent / "cache")},
        "train": {
            "device": "cpu",
            "batch_size": 4,
            "warmup_steps": 2,
            "log_interval": 2,
            **train,
        },
    }


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium (tests/browser_helpers.py), one session per test module."""
    from browser_helpers import chromium

    with chromium() as driver:
        yield driver
