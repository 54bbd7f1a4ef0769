"""Dependency floors: every minimum version in pyproject.toml has the APIs llmcli relies on.

CI installs the newest releases, so a floor set too low would pass there and break a user who
has an older release. Each floor is listed here with the APIs that need it: this test fails when
pyproject.toml and this table disagree, and, run against the floor versions themselves
(`pip install torch==2.6.0 tokenizers==0.22.1 ...`), when an API is missing.

Torch is the one llmcli calls most, and new torch APIs arrive every release: every torch name
llmcli's source uses is listed in tests/torch_apis.txt, each checked present in the floor's
release. A new call to a name not listed fails `test_every_torch_name_llmcli_uses_is_listed`:
check that torch's floor has it (or raise the floor, or keep a fallback), then list it.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> (floor, the APIs llmcli uses that need it, as importable dotted names)
FLOORS = {
    "torch": (
        "2.6",
        [
            "torch.nn.utils.get_total_norm",  # 2.6: the gradient norm, then clipping by it
            "torch.nn.utils.clip_grads_with_norm_",  # 2.6
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
    # llmcli.claim: one writer of a run, a cache entry or an SAE folder (a lock that its
    # process's end releases); 3.13.1 is the oldest release checked here.
    "filelock": ("3.13.1", ["filelock.FileLock", "filelock.Timeout"]),
}
TORCH_APIS = Path(__file__).with_name("torch_apis.txt")


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


def listed_torch_names() -> set[str]:
    lines = TORCH_APIS.read_text().splitlines()
    return {line.strip() for line in lines if line.strip() and not line.startswith("#")}


def torch_names(source: str) -> set[str]:
    """The dotted torch names a module's source uses: `torch.nn.functional.softmax` for
    `F.softmax` after `import torch.nn.functional as F`, `torch.nn.utils.get_total_norm` for
    `nn.utils.get_total_norm` after `from torch import nn`, ..."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}  # a name bound by an import -> the torch name it stands for
    shadowed: set[str] = set()  # names also bound otherwise (an argument, an assignment)
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
        if isinstance(node, ast.Import):
            for name in node.names:
                if name.name.split(".")[0] == "torch":
                    aliases[name.asname or "torch"] = name.name if name.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for name in node.names:
                aliases[name.asname or name.name] = f"{node.module}.{name.name}"
        elif isinstance(node, ast.arg):
            shadowed.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            shadowed.add(node.id)
    names = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Attribute, ast.Name)):
            continue
        if isinstance(parents.get(node), ast.Attribute):
            continue  # only whole chains: `torch.nn.functional.softmax`, not `torch.nn`
        chain, root = [], node
        while isinstance(root, ast.Attribute):
            chain.append(root.attr)
            root = root.value
        if not isinstance(root, ast.Name) or root.id not in aliases:
            continue
        if chain and root.id in shadowed:
            continue  # `adamw.lr` where `adamw` is also an argument's name
        names.add(".".join([aliases[root.id], *reversed(chain)]))
    return names


def test_torch_names_are_read_through_every_way_of_importing_them() -> None:
    source = (
        "import torch\nimport torch.nn.functional as F\nfrom torch import nn\n"
        "from torch.optim.adamw import adamw\n"
        "def f(x, adamw=None):\n"
        "    y = F.softmax(torch.cuda.get_device_properties(0).total_memory)\n"
        "    return nn.utils.get_total_norm(x), adamw.lr, torch.float32\n"
    )
    assert torch_names(source) == {
        "torch.nn.functional.softmax",
        "torch.cuda.get_device_properties",
        "torch.nn.utils.get_total_norm",
        "torch.float32",
    }


def test_every_torch_name_llmcli_uses_is_listed() -> None:
    used = set()
    for path in sorted((ROOT / "llmcli").rglob("*.py")):
        used |= torch_names(path.read_text(encoding="utf-8"))
    unlisted = sorted(used - listed_torch_names())
    assert not unlisted, (
        f"{unlisted}: new torch names. Check that torch {FLOORS['torch'][0]} (the floor) has "
        f"each, then add them to {TORCH_APIS.name}."
    )
    assert not listed_torch_names() - used, "names llmcli no longer uses: remove them"


def test_every_listed_torch_name_exists() -> None:
    missing = []
    for dotted in sorted(listed_torch_names()):
        try:
            resolve(dotted)
        except (ImportError, AttributeError):
            missing.append(dotted)
    assert not missing
