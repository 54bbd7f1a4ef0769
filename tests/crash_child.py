"""A child process for the crash tests: the real `llmcli` CLI, killable at a chosen moment.

Run as `python tests/crash_child.py` with CRASH_JOB=<path>: it does its imports first (they take
seconds), then waits for the job file `{"argv": [...], "env": {...}, "cwd": ...}` and runs
`llmcli ARGV` there, pausing (to be killed) where the job's environment says:
- CRASH_MARKER: a file written when it pauses (MARKER.started at its first training step);
- CRASH_AT_STEP: pause after that training step;
- CRASH_IN_WRITE=name:n:fraction: pause with `fraction` of the n-th write of file `name` done.
Used by tests/test_crash.py and benchmarks/crash_soak.py.
"""

import json
import os
import sys
import time
from pathlib import Path

# Warm up (the imports take seconds), then wait for a job: {"argv", "env", "cwd"}.
import matplotlib.backends.backend_agg  # noqa: F401

import llmcli.cli  # noqa: F401
import llmcli.data.tokens
import llmcli.fileio as fileio
import llmcli.generation.engine
import llmcli.inspection.attention
import llmcli.model.gpt
import llmcli.training.loop as T
from llmcli.runs.metrics import plot_losses

job_file = Path(os.environ["CRASH_JOB"])
plot_losses(job_file.with_suffix(".none"), job_file.with_suffix(".png"))  # loads the fonts
for _ in range(60000):
    if job_file.exists():
        break
    time.sleep(0.01)
else:
    sys.exit(3)
job = json.loads(job_file.read_text())
os.environ.update(job["env"])
os.chdir(job["cwd"])
env = os.environ
marker = Path(env["CRASH_MARKER"])


def pause(why):  # until killed (or 2 minutes)
    marker.write_text(why)
    time.sleep(120)


at_step = int(env.get("CRASH_AT_STEP", "0"))
original_train = T.train


def on_step(step):
    started = marker.with_suffix(".started")
    if not started.exists():
        started.write_text(str(step))
    if step == at_step:
        pause(f"step {step}")


def train(*args, **kwargs):
    return original_train(*args, on_step=on_step, **kwargs)


T.train = train

if env.get("CRASH_IN_WRITE"):  # name:n:fraction -> pause with that part of its n-th write done
    name, nth, fraction = env["CRASH_IN_WRITE"].split(":")
    real_write, seen = fileio._write_and_sync, [0]

    def write(path, data):
        if path.name.startswith(f".{name}.tmp-"):
            seen[0] += 1
            if seen[0] == int(nth):
                with open(path, "wb") as fh:
                    fh.write(data[: int(len(data) * float(fraction))])
                    fh.flush()
                    os.fsync(fh.fileno())
                pause(f"writing {name}")
        real_write(path, data)

    fileio._write_and_sync = write

llmcli.cli.main(job["argv"])
