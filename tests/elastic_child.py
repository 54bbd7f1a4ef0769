"""A torchrun worker for the fault-tolerance tests: `llmcli` that SIGKILLs one rank once.

`torchrun ... tests/elastic_child.py train CONFIG ...` runs the real CLI in every worker. In the
first attempt of the worker group (TORCHELASTIC_RESTART_COUNT 0), the rank KILL_RANK (default 1)
kills itself with SIGKILL right after computing training step KILL_AT_STEP, as a hardware fault
or an OOM killer would; torchrun then restarts the group, and the later attempts run undisturbed.
"""

import os
import signal
import sys

import llmcli.training.loop as T
from llmcli.cli import main

kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
if kill_at and first_attempt and os.environ.get("RANK") == os.environ.get("KILL_RANK", "1"):
    real_step, steps_done = T.train_step, []  # the first attempt starts at step 0

    def step_then_die(*args, **kwargs):
        result = real_step(*args, **kwargs)
        steps_done.append(result)
        if len(steps_done) == kill_at:  # the loop counts the step after this returns
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    T.train_step = step_then_die

main(sys.argv[1:])
