"""The CLI shell: version, help, exit statuses and the `config` command (llmcli/cli.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmcli import __version__

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow  # every test here starts `python -m llmcli` in a new process


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "llmcli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_version_and_help() -> None:
    out = run_cli("--version")
    assert out.returncode == 0
    assert out.stdout.strip() == f"llmcli {__version__}"
    for flag in ("-h", "--help"):
        out = run_cli(flag)
        assert out.returncode == 0
        assert "config" in out.stdout and "Usage" in out.stdout


def test_help_does_not_import_heavy_libraries() -> None:
    code = (
        "import sys; from llmcli.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('torch', 'numpy', 'datasets', 'matplotlib', 'transformers')"
        " if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr


def test_config_prints_the_fully_resolved_yaml() -> None:
    out = run_cli("config", "configs/tiny.yaml", "--set", "train.max_steps=700")
    assert out.returncode == 0, out.stderr
    resolved = yaml.safe_load(out.stdout)
    assert resolved["train"]["max_steps"] == 700
    assert resolved["model"]["n_embed"] == 128
    assert resolved["sample"]["top_p"] == 1.0  # a default that tiny.yaml does not write


def test_divisibility_error_exits_2_without_traceback() -> None:
    out = run_cli("config", "configs/tiny.yaml", "--set", "model.n_head=3")
    assert out.returncode == 2
    assert "n_embed (128) must be divisible by model.n_head (3)" in out.stderr
    assert "Traceback" not in out.stderr + out.stdout


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    for args in (
        ("config",),
        ("config", "--bogus"),
        ("no-such-command",),
        ("config", str(tmp_path)),
        ("config", str(tmp_path / "none.yaml")),
    ):
        out = run_cli(*args)
        assert out.returncode == 2, args
        assert "Traceback" not in out.stderr + out.stdout
        assert out.stderr.strip(), args


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["train", "tiny", "--resume"], ["train", "tiny", "--resume=strict"]),
        (["train", "--resume", "tiny"], ["train", "--resume=strict", "tiny"]),
        (["train", "--resume", "auto", "tiny"], ["train", "--resume", "auto", "tiny"]),
        (["eval", "--ablation", "--ablate", "1"], ["eval", "--ablation=zero", "--ablate", "1"]),
        (["eval", "--ablation", "mean"], ["eval", "--ablation", "mean"]),
        # another option's value, a token after `--`, a command without the option: untouched
        (
            ["inspect-attention", "--prompt", "--ablation"],
            ["inspect-attention", "--prompt", "--ablation"],
        ),
        (["train", "--set", "--resume"], ["train", "--set", "--resume"]),
        (["train", "tiny", "--", "--resume"], ["train", "tiny", "--", "--resume"]),
        (["sample", "--prompt", "--ablation"], ["sample", "--prompt", "--ablation"]),
    ],
)
def test_bare_options_get_their_value_and_nothing_else_changes(argv, expected) -> None:
    from llmcli.cli import _with_bare_values

    assert _with_bare_values(argv) == expected
