"""A Ctrl-C that breaks the local executor's process pool as it starts leaves no thread traceback on stderr
(``node/offline/executor.py`` ``_ManagerRaceQuiet``), and hides nothing else."""

from __future__ import annotations

import threading
from concurrent.futures.process import _ExecutorManagerThread  # type: ignore[attr-defined]

from chestnut.node.offline.executor import _ManagerRaceQuiet


def _args(exc: BaseException, thread: object) -> threading.ExceptHookArgs:
    return threading.ExceptHookArgs([type(exc), exc, None, thread])  # type: ignore[call-arg]


def test_only_the_managers_dict_race_is_kept_off_stderr_and_the_hook_is_restored() -> None:
    seen: list[str] = []
    before = threading.excepthook
    threading.excepthook = lambda a: seen.append(f"{a.exc_type.__name__}: {a.exc_value}")
    try:
        manager = object.__new__(_ExecutorManagerThread)  # the pool's manager thread, as the hook sees it
        other = threading.Thread(target=lambda: None)
        race = RuntimeError("dictionary changed size during iteration")
        with _ManagerRaceQuiet():
            threading.excepthook(_args(race, manager))
            threading.excepthook(_args(RuntimeError("something else"), manager))
            threading.excepthook(_args(race, other))
            threading.excepthook(_args(ValueError("bad"), manager))
        assert seen == ["RuntimeError: something else", "RuntimeError: dictionary changed size during iteration",
                        "ValueError: bad"]
        threading.excepthook(_args(race, manager))  # restored on exit: said again
        assert seen[-1] == "RuntimeError: dictionary changed size during iteration" and len(seen) == 4
    finally:
        threading.excepthook = before
