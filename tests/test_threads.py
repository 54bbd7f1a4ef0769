"""CPU threads for generation (llmcli/generation/threads.py): which generations are bound by
one-token steps, the thread count they run on, and the `auto` count within the CPUs this process
may use (llmcli/device.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

import llmcli.device as device
from llmcli.config import ModelConfig, SampleConfig
from llmcli.errors import InputError
from llmcli.generation.threads import (
    ONE_THREAD_DECODE_PARAMS,
    decode_bound,
    sampling_threads,
    torch_threads,
)
from llmcli.model.gpt import Transformer


def test_sampling_threads_one_for_a_small_decode_bound_model_only() -> None:
    cpu = torch.device("cpu")
    tiny = Transformer(ModelConfig(n_layer=4, n_head=4, n_embed=128, context_length=64), 65)  # 0.8M
    big = Transformer(
        ModelConfig(n_layer=6, n_head=6, n_embed=384, context_length=256), 65
    )  # 10.7M
    assert tiny.num_parameters(non_embedding=True) <= ONE_THREAD_DECODE_PARAMS
    assert big.num_parameters(non_embedding=True) > ONE_THREAD_DECODE_PARAMS
    assert sampling_threads(tiny, cpu, decode_bound=True) == 1
    assert sampling_threads(tiny, cpu, decode_bound=False) is None  # full windows: torch's own
    assert sampling_threads(big, cpu, decode_bound=True) is None
    assert sampling_threads(tiny, torch.device("cuda"), decode_bound=True) is None


def test_torch_threads_sets_and_restores_the_count() -> None:
    before = torch.get_num_threads()
    target = 1 if before != 1 else 2
    with torch_threads(target):
        assert torch.get_num_threads() == target
    assert torch.get_num_threads() == before
    with pytest.raises(RuntimeError), torch_threads(target):
        raise RuntimeError("restored even so")
    assert torch.get_num_threads() == before
    with torch_threads(None):
        assert torch.get_num_threads() == before


def test_decode_bound_generations_are_those_of_one_token_steps() -> None:
    shift, short_exact, long_exact = (
        SampleConfig(max_new_tokens=100),
        SampleConfig(max_new_tokens=10, context_policy="exact"),
        SampleConfig(max_new_tokens=100, context_policy="exact"),
    )
    assert decode_bound(shift, 16) and decode_bound(short_exact, 16)
    assert not decode_bound(long_exact, 16)  # past the context each step recomputes the window
    assert not decode_bound(SampleConfig(max_new_tokens=16, context_policy="exact"), 16)


@pytest.mark.parametrize(
    ("busy_share", "cpus", "expected"),
    [(0.0, 2, 2), (0.5, 2, 1), (1.0, 2, 1), (0.25, 8, 6), (0.9, 8, 1)],
)
def test_auto_threads_are_the_cpus_nothing_else_uses(
    monkeypatch: pytest.MonkeyPatch, busy_share: float, cpus: int, expected: int
) -> None:
    # Two readings of /proc/stat 1,000 jiffies apart, `busy_share` of them busy: "auto" takes
    # the idle share of the CPUs, rounded, at least one.
    readings = iter([(10_000, 4_000), (11_000, 4_000 + round(1_000 * (1 - busy_share)))])
    monkeypatch.setattr(device, "_cpu_times", lambda: next(readings))
    monkeypatch.setattr(device.os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(device, "usable_cpus", lambda: cpus)
    monkeypatch.setattr(device.time, "sleep", lambda s: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert device.resolve_threads("auto") == expected


def test_auto_threads_leave_omp_num_threads_and_unreadable_load_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # torchrun's or the user's choice stands
    assert device.resolve_threads("auto") == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "many")  # not a count: torch's own
    assert device.resolve_threads("auto") is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(device, "_cpu_times", lambda: None)  # no /proc/stat (macOS, Windows)
    assert device.resolve_threads("auto") is None
    assert device.resolve_threads(2) == 2 and device.resolve_threads(None) is None


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"cpu.max": "max 100000\n"}, None),  # v2, no limit
        ({"cpu.max": "150000 100000\n"}, 2),  # a share of a CPU counts as one
        ({"cpu.max": "100000 100000\n"}, 1),  # exactly one CPU
        ({"cpu.max": "100001 100000\n"}, 2),  # just over
        ({"cpu.max": "50000 100000\n"}, 1),
        ({"cpu.max": "garbled\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1
        ({"cpu/cpu.cfs_quota_us": "250000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
        ({"cpu/cpu.cfs_quota_us": "100000\n"}, None),  # no period to divide by
        ({}, None),  # no cgroup files (macOS, or not mounted)
    ],
)
def test_the_cgroup_cpu_quota_is_read_from_v2_then_v1_files(
    tmp_path: Path, files: dict[str, str], expected: int | None
) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert device.cgroup_cpu_quota(tmp_path) == expected


@pytest.mark.parametrize(
    ("host", "affinity", "quota", "expected"),
    [(8, 4, 2, 2), (8, 4, None, 4), (8, 8, 3, 3), (8, 2, 5, 2), (1, 1, None, 1)],
)
def test_usable_cpus_are_the_fewest_of_host_affinity_and_quota(
    monkeypatch: pytest.MonkeyPatch, host: int, affinity: int, quota: int | None, expected: int
) -> None:
    monkeypatch.setattr(device.os, "cpu_count", lambda: host)
    monkeypatch.setattr(device.os, "sched_getaffinity", lambda pid: set(range(affinity)), False)
    monkeypatch.setattr(device, "cgroup_cpu_quota", lambda: quota)
    assert device.usable_cpus() == expected


def test_counts_are_cut_and_checked_against_the_usable_cpus(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(device, "usable_cpus", lambda: 2)
    monkeypatch.setattr(device, "_cpu_times", iter([(10_000, 0), (11_000, 1_000)]).__next__)
    monkeypatch.setattr(device.os, "cpu_count", lambda: 8)  # 8 idle CPUs, 2 of them ours
    monkeypatch.setattr(device.time, "sleep", lambda s: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert device.resolve_threads("auto") == 2
    before = torch.get_num_threads()
    with device.torch_threads(8):  # a config written on a bigger machine
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == before
    assert device.check_threads(2) == 2  # the boundary: every usable CPU
    with pytest.raises(InputError, match=r"--threads \(3\) must be in 1\.\.2 \(the CPUs this"):
        device.check_threads(3)


PINNED = """
import torch
from llmcli.device import torch_threads, usable_cpus
with torch_threads("auto"):
    auto = torch.get_num_threads()
with torch_threads(2):
    two = torch.get_num_threads()
print(usable_cpus(), auto, two)
"""


def test_a_process_pinned_to_one_cpu_runs_auto_on_one_thread() -> None:
    cpu = min(os.sched_getaffinity(0))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run(  # pinned as `taskset -c CPU` pins it (sched_setaffinity)
        [sys.executable, "-c", PINNED],
        preexec_fn=lambda: os.sched_setaffinity(0, {cpu}),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "1", "1"]  # usable CPUs, "auto", 2 cut to 1
