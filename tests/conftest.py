"""Fixtures shared by several test modules."""

from __future__ import annotations

import signal

import pytest
import torch


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
