"""Model FLOPs utilisation (MFU), as nanoGPT's `estimate_mfu` reports it: the FLOPs the trained
tokens take by the formula `llmcli plan` prints (`6 N + 12 L T C` a token;
`llmcli.training.plan.flops_per_token`), per second and per process, over the device's peak.

nanoGPT divides by an A100's promised bf16 peak (312 TFLOPS). A laptop's CPU has no such
figure, so the peak here is measured once a process, on the device and at the precision the
steps run in: the best of a few square matrix products (n 1024 on the CPU, 4096 on a GPU), with
the threads the run uses. A run's MFU is then the share of what this device's matrix products
reach that its training reaches: on the idle 2-core development machine (a 365 GFLOP/s peak
with 2 threads) the tiny config reached 42% at 29,000 tokens/s.
"""

from __future__ import annotations

import torch

from llmcli.device import timed

# A process measures each (device, dtype, threads) once.
_PEAKS: dict[tuple[str, torch.dtype, int], float] = {}


def peak_flops(device: torch.device, dtype: torch.dtype, repeats: int = 3) -> float:
    """The device's matrix-product FLOPs per second at `dtype`: the best of `repeats` products
    of two square matrices, after one to warm up. About 0.1 s on a CPU."""
    key = (str(device), dtype, torch.get_num_threads())
    if key not in _PEAKS:
        n = 1024 if device.type == "cpu" else 4096
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=gen).to(device, dtype) for _ in range(2))
        best = min(timed(lambda: a @ b, device) for _ in range(repeats + 1))
        _PEAKS[key] = 2 * n**3 / best
    return _PEAKS[key]


def mfu(flops_per_token: int, tokens_per_s: float, peak: float, world_size: int = 1) -> float:
    """The share of a process's peak that training `tokens_per_s` tokens a second (over every
    process) takes."""
    return flops_per_token * tokens_per_s / world_size / peak
