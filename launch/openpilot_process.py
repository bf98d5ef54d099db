"""Example: the node as an openpilot-manager-style process entry (``system/manager/process_config.py``).

Copy the entry into a manager's process list. ``PythonProcess`` starts ``main()`` of the module in a
child process and stops it with SIGINT, then SIGKILL after its stop budget; chestnut's node stops
its worker and flushes within 5 s of SIGINT/SIGTERM, so the manager's default budget suffices.

    PythonProcess("chestnutd", "chestnut.node.main", only_onroad),

``chestnut.node.main.main()`` reads its configuration from ``$CHESTNUT_CONFIG`` (a TOML file) when
started without arguments.
"""

from __future__ import annotations

PROCESS_ENTRY = {
    "name": "chestnutd",
    "module": "chestnut.node.main",
    "should_run": "only_onroad",
    "sigkill_budget_s": 5.0,
}
