"""A child process for the training tests: the real `llmcli` CLI, pausing at a chosen step.

Run as `python tests/pausing_child.py ARGS...` (the arguments of `llmcli`) with PAUSE_AT=<step>
and PAUSE_MARKER=<path>: after that training step it writes the marker and waits until
MARKER.go exists (or 2 minutes), so that a test can send a signal at a known moment.
"""

import os
import sys
import time
from pathlib import Path

import llmcli.training.loop as T
from llmcli.cli import main

pause_at, marker = int(os.environ["PAUSE_AT"]), Path(os.environ["PAUSE_MARKER"])
original = T.train


def on_step(step):
    if step == pause_at:
        marker.write_text(str(step))
        for _ in range(12000):
            if marker.with_suffix(".go").exists():
                break
            time.sleep(0.01)


def train(*args, **kwargs):
    return original(*args, on_step=on_step, **kwargs)


T.train = train
main(sys.argv[1:])
