"""The ``chestnut`` console script's entry (``pyproject.toml`` ``[project.scripts]``): ``launch/cli.py`` ``main``
with a Ctrl-C covered from this module's first line on.

Python raises ``KeyboardInterrupt`` for a SIGINT from early in its own start-up
(https://docs.python.org/3/library/signal.html#execution-of-python-signal-handlers: its default SIGINT handler
raises it); ``cli.main`` turns it into one line and :data:`EXIT_INTERRUPTED`, but only once ``cli`` and what it
imports at its top (argparse, logging: ~10-20 ms) are loaded. The console script that pip writes imports its entry
point's module before it calls anything (``from MODULE import main``), so a Ctrl-C while ``cli`` itself was
imported was a traceback and a death by SIGINT. This module imports nothing at its top that the interpreter has
not loaded already, and imports ``cli`` inside the ``try``.

What comes before this module's first line is Python's own: a SIGINT before the interpreter installed its handler
takes the default action (the process ends by SIGINT, 130 from a shell, nothing printed); one while ``site``
imports what the ``.pth`` files of the environment name ends the interpreter's start-up ("Fatal Python error:
init_import_site", exit 1; an editable install's finder makes that ~10 ms); one while the script looks this module up
(``chestnut`` is the first package it imports from the environment: ~1 ms) is Python's KeyboardInterrupt traceback.
"""

import sys  # loaded by the interpreter before any script runs: no import work here

EXIT_INTERRUPTED = 130  # launch/cli.py's, which this module must not import before its try


def main() -> int:
    """``chestnut COMMAND ...`` (``launch/cli.py`` ``main``), a Ctrl-C while ``cli`` is imported included: the same
    line and status as ``cli.main``'s."""
    try:
        from chestnut.launch.cli import main as cli_main

        return cli_main()
    except KeyboardInterrupt:
        print("chestnut: interrupted (Ctrl-C)", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
