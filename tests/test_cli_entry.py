"""``chestnut``'s entry (``launch/cli.py`` ``main``): a Ctrl-C before a command installed its own handling and a
reader that went away end the program as a Unix tool does -- one line or none, the shell's status -- never a
traceback."""

from __future__ import annotations

import subprocess
import sys

from chestnut.launch import cli


def test_a_ctrl_c_while_the_command_imports_is_one_line_and_130(monkeypatch, capsys):
    def interrupted(argv):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", interrupted)
    assert cli.main(["run"]) == 130
    assert capsys.readouterr().err == "chestnut: interrupted (Ctrl-C)\n"


def test_output_to_a_reader_that_went_away_ends_quietly_with_141():
    """``chestnut twin kinds | head -1`` was a BrokenPipeError traceback and exit 1."""
    proc = subprocess.Popen([sys.executable, "-m", "chestnut.launch.cli", "twin", "kinds"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line: the first write fails with EPIPE
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err
    assert err == ""
