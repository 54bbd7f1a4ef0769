"""Dependency floors: every minimum version in pyproject.toml has the APIs llmcli relies on.

CI installs the newest releases, so a floor set too low would pass there and break a user who
has an older release. Each floor is listed here with the APIs that need it: this test fails when
pyproject.toml and this table disagree, and, run against the floor versions themselves
(`pip install torch==2.5.0 tokenizers==0.20.0 ...`), when an API is missing.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> (floor, the APIs llmcli uses that need it, as importable dotted names)
FLOORS = {
    "torch": (
        "2.5",
        [
            "torch.OutOfMemoryError",  # 2.5: the device-independent out-of-memory error
            "torch.nn.functional.rms_norm",  # 2.4
            "torch.amp.GradScaler",  # 2.3: GradScaler("cuda") / ("cpu")
            "torch.nn.functional.scaled_dot_product_attention",
            "torch.compile",
        ],
    ),
    "tokenizers": (
        "0.22.1",
        [
            "tokenizers.Tokenizer.encode_batch_fast",  # 0.20
            "tokenizers.pre_tokenizers.Split",
            "tokenizers.decoders.Fuse",
        ],
    ),
    "safetensors": (
        "0.4.3",
        ["safetensors.torch.save", "safetensors.torch.load_file", "safetensors.safe_open"],
    ),
    "typer": (
        "0.26",
        ["typer.Typer", "typer.Option", "typer.Argument", "typer.core.TyperCommand.parse_args"],
    ),
    # llmcli.hub's errors and repo-id check (1.22: IncompleteSnapshotError).
    "huggingface_hub": (
        "1.22",
        [
            "huggingface_hub.snapshot_download",
            "huggingface_hub.errors.IncompleteSnapshotError",
            "huggingface_hub.utils.validate_repo_id",
        ],
    ),
    "datasets": ("2.19", ["datasets.load_dataset", "datasets.load_from_disk"]),
    "tqdm": ("4.66", ["tqdm.auto.tqdm", "tqdm.contrib.logging.logging_redirect_tqdm"]),
    "pyyaml": ("6.0", ["yaml.safe_load", "yaml.safe_dump"]),
    "numpy": ("2.0", ["numpy.frombuffer", "numpy.searchsorted", "numpy.memmap"]),
    # llmcli.data.chat_template: a sandboxed environment with the `generation` tag, as transformers'
    # (3.1.6: the last known sandbox escapes fixed; a run's template is untrusted text).
    "jinja2": (
        "3.1.6",
        ["jinja2.sandbox.ImmutableSandboxedEnvironment", "jinja2.ext.Extension", "jinja2.nodes"],
    ),
    "matplotlib": (
        "3.8.4",
        ["matplotlib.figure.Figure", "matplotlib.backends.backend_agg.FigureCanvasAgg"],
    ),
}


def resolve(dotted: str) -> object:
    """Import the longest importable module prefix of `dotted`, then walk the attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def declared_floors() -> dict[str, str]:
    # The [project] dependencies array (tomllib would need Python 3.11; llmcli runs on 3.10).
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert block, "pyproject.toml has no dependencies array"
    floors = {}
    for requirement in re.findall(r'"([^"]+)"', block[1]):
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement.replace(" ", ""))
        assert match, f"{requirement!r}: give every dependency a floor, as name>=version"
        floors[match[1].lower()] = match[2]
    return floors


def test_pyproject_floors_are_the_ones_checked_here() -> None:
    assert declared_floors() == {name: floor for name, (floor, _) in FLOORS.items()}


@pytest.mark.parametrize("package", sorted(FLOORS))
def test_every_api_behind_a_floor_is_importable(package: str) -> None:
    for dotted in FLOORS[package][1]:
        assert resolve(dotted) is not None, dotted
