"""``chestnut launch``'s exit status (``launch/stack.py`` ``exit_code``): with ``--seconds 0`` Ctrl-C is the
normal end of the run (0 clean, 1 not); 130 only for a Ctrl-C that cut a timed run short."""

import pytest

from chestnut.launch.stack import exit_code


@pytest.mark.parametrize(
    ("ok", "seconds", "interrupted", "want"),
    [
        (True, 0.0, True, 0),  # until Ctrl-C, clean: the normal end
        (False, 0.0, True, 1),  # until Ctrl-C, a violation or a failed start
        (True, 60.0, True, 130),  # a timed run cut short
        (False, 60.0, True, 130),
        (True, 60.0, False, 0),  # a timed run that ran out
        (False, 60.0, False, 1),
        (True, 0.0, False, 0),  # until Ctrl-C, ended by SIGTERM or the stack dying
        (False, 0.0, False, 1),
    ],
)
def test_exit_code(ok, seconds, interrupted, want):
    assert exit_code(ok, seconds, interrupted) == want
