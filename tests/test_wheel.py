"""The installed product: a wheel built from this checkout works from any folder.

A user who runs `pip install llmcli` has no `configs/` and no `data/` beside them: the wheel
must carry the shipped configs and the bundled corpora, and shipped names must work from an
empty folder. This builds the wheel (offline, no build isolation), installs it into a fresh
virtual environment (which sees this interpreter's torch and other dependencies, see
`see_this_environment`), and runs the quick-start commands there, with piped output: no
carriage-return bar may reach the log.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow
# Not copied to build from: outputs, caches, a virtual environment made in the checkout (README's
# `.venv`: gigabytes), and Hypothesis' folder, which a parallel worker's tests may be writing.
NOT_SOURCES = (
    *(".git", "build", "dist", "*.egg-info", "checkpoints", ".*cache*", "__pycache__"),
    *(".venv", ".hypothesis"),
)


def run(args: list, cwd: Path, env: dict[str, str], timeout: float = 300):
    out = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, f"{args}\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A venv with the wheel installed: (its bin folder, the environment to run it in)."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "WORLD_SIZE")}
    env.update(
        OMP_NUM_THREADS="1",
        LLMCLI_CACHE=str(tmp / "cache"),
        PIP_NO_INDEX="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    # Build from a copy of the sources, so that no build/ or egg-info folder of this checkout
    # (where setuptools leaves old files behind) can leak into the wheel, and none is written.
    source = tmp / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", tmp / "dist", source],
        tmp,
        env,
    )
    (wheel,) = (tmp / "dist").glob("llmcli-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"llmcli/configs/{p.name}" for p in (ROOT / "configs").glob("*.yaml")}
    shipped |= {
        f"llmcli/configs/references/{p.stem}.json" for p in (ROOT / "configs").glob("*.yaml")
    }
    corpora = {f"llmcli/corpora/{p.name}" for p in (ROOT / "data").glob("*.txt")}
    assert shipped | corpora <= names
    # The corpora are data only: the programs that made them stay in scripts/, out of the wheel.
    assert not [n for n in names if n.startswith("llmcli/corpora/") and n.endswith(".py")]
    assert not [p for p in (ROOT / "data").iterdir() if p.suffix == ".py"]
    # The viewer's page templates are package data too, read with importlib.resources.
    assert {"llmcli/inspection/viewer.html", "llmcli/inspection/sae/features.html"} <= names
    run([sys.executable, "-m", "venv", tmp / "venv"], tmp, env)
    bin_dir = tmp / "venv" / "bin"
    see_this_environment(bin_dir / "python", tmp, env)
    run([bin_dir / "python", "-m", "pip", "install", "--no-deps", "-q", wheel], tmp, env)
    where = run([bin_dir / "python", "-c", "import llmcli; print(llmcli.__file__)"], tmp, env)
    assert where.stdout.startswith(str(tmp / "venv")), where.stdout  # not this checkout
    return bin_dir, env


def see_this_environment(python: Path, cwd: Path, env: dict[str, str]) -> None:
    """Let the venv of `python` import the packages this interpreter imports (the wheel's
    dependencies), wherever they are installed: the system's site-packages (CI) or an outer
    virtual environment (a user's `.venv`), which `venv --system-site-packages` would not see
    (it sees the base interpreter's). A `.pth` file in the venv's site-packages lists this
    interpreter's path entries that the venv lacks, after its own site-packages, so the wheel
    installed there is the llmcli it imports; entries holding an llmcli package (this
    checkout, an editable install) are left out."""
    probe = (
        "import json, sys, sysconfig; "
        "print(json.dumps([sysconfig.get_paths()['purelib'], sys.path]))"
    )
    purelib, own = json.loads(run([python, "-c", probe], cwd, env).stdout)
    extra = [
        p
        for p in sys.path
        if p and p not in own and Path(p).is_dir() and not (Path(p) / "llmcli").exists()
    ]
    Path(purelib, "outer-environment.pth").write_text("\n".join(extra) + "\n", encoding="utf-8")


def test_the_quick_start_runs_from_an_empty_folder(installed, tmp_path: Path) -> None:
    bin_dir, env = installed
    llmcli = bin_dir / "llmcli"
    listed = run([llmcli, "config", "--list"], tmp_path, env).stdout
    assert {line.split()[0] for line in listed.splitlines() if not line.startswith(" ")} == {
        p.stem for p in (ROOT / "configs").glob("*.yaml")
    }

    trained = run(
        [llmcli, "train", "tiny", "--set", "train.max_steps=30", "--set", "train.eval_interval=30"],
        tmp_path,
        env,
    )
    assert (tmp_path / "checkpoints" / "tiny" / "model.safetensors").is_file()
    assert "\r" not in trained.stderr and "train 30/30" in trained.stderr  # plain lines
    assert "warmup_steps (100) is longer than the run" in trained.stderr
    sampled = run([llmcli, "sample", "--prompt", "ROMEO:", "--max-new-tokens", "40"], tmp_path, env)
    # the reference curve ships too: 30 steps differ from it in max_steps and end before it starts
    reference = json.loads(run([llmcli, "info", "--json"], tmp_path, env).stdout)["reference"]
    assert reference["name"] == "tiny" and reference["differs"] == {"train.max_steps": [30, 2000]}
    assert Path(reference["path"]).parts[-4:] == ("llmcli", "configs", "references", "tiny.json")
    assert "venv" in reference["path"]  # the installed copy, not this checkout's
    assert "do not reach the reference's" in reference["missing"]
    assert sampled.stdout.startswith("ROMEO:") and len(sampled.stdout) > len("ROMEO:")
    run([llmcli, "train", "speedrun-cpu", "--set", "train.max_steps=40"], tmp_path, env)
    assert (tmp_path / "checkpoints" / "speedrun-cpu" / "best.safetensors").is_file()

    bad = subprocess.run(
        [llmcli, "train", "tinny"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "speedrun-cpu" in bad.stderr and "Traceback" not in bad.stderr
