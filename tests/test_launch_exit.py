"""``chestnut launch``'s exit status (``launch/stack.py`` ``exit_code``): with ``--seconds 0`` Ctrl-C is the
normal end of the run (0 clean, 1 not); 128 + the signal only for a Ctrl-C (130) or SIGTERM (143) that cut a
timed run short."""

import signal

import pytest

from chestnut.launch.stack import exit_code


@pytest.mark.parametrize(
    ("ok", "seconds", "signum", "want"),
    [
        (True, 0.0, signal.SIGINT, 0),  # until stopped, clean: the normal end
        (False, 0.0, signal.SIGINT, 1),  # until stopped, a violation or a failed start
        (True, 0.0, signal.SIGTERM, 0),  # until stopped, by a process manager
        (True, 60.0, signal.SIGINT, 130),  # a timed run cut short by Ctrl-C
        (False, 60.0, signal.SIGINT, 130),
        (True, 60.0, signal.SIGTERM, 143),  # ... or by SIGTERM
        (True, 60.0, None, 0),  # a timed run that ran out
        (False, 60.0, None, 1),
        (True, 0.0, None, 0),  # until stopped, ended by the stack dying
        (False, 0.0, None, 1),
    ],
)
def test_exit_code(ok, seconds, signum, want):
    assert exit_code(ok, seconds, signum) == want
