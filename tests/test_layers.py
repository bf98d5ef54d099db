"""The package's layering, import cycles, the README's generated import graph, self-contained citations.

The checker is ``tests/importgraph.py``; the synthetic trees here prove it reports what it must, so the
real-tree tests cannot pass vacuously.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import importgraph as ig

# the background notes a reader of this repository does not have; spelt in pieces so this file does not cite them
OUTSIDE_DOCS = tuple(stem + ".md" for stem in ("FACTS", "MISSION", "DESIGN")) + tuple(
    "../" + folder for folder in ("shared", "seed")
)


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    for top in ig.TOP_FOLDERS:
        (root / top).mkdir(exist_ok=True)
        (root / top / "__init__.py").touch()
    return root


# --- the real tree


def test_no_upward_import() -> None:
    problems = ig.upward(ig.scan())
    assert problems == [], "upward imports:\n" + "\n".join(problems)


def test_no_import_cycle() -> None:
    problems = ig.cycles(ig.scan())
    assert problems == [], "import cycles:\n" + "\n".join(problems)


def test_every_package_file_is_in_a_layer() -> None:
    files = ig.source_files(ig.ROOT)
    assert "chestnut.backend.sim.engine" in files and "chestnut.launch.cli" in files
    assert {ig.folder_of(rel) for rel in files.values()} <= set(ig.LAYERS)


def test_documents_carry_the_generated_graph() -> None:
    want = ig.readme_block(ig.folder_graph(ig.scan()))
    for doc in ig.DOCUMENTS:
        block = ig.extract_block((ig.ROOT / doc).read_text(encoding="utf-8"))
        assert block is not None, f"{doc} has no generated import graph ({ig.BEGIN} ... {ig.END})"
        assert block == want, f"{doc}'s import graph is stale: run .venv/bin/python tests/importgraph.py --write"


def outside_citations(root: Path) -> list[str]:
    """``"path:line cites NAME"`` for every tracked text file under ``root`` naming a note outside the repository."""
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    hits = []
    for rel in filter(None, tracked.decode().split("\0")):
        path = root / rel
        if not path.is_file():  # deleted in the working tree, not yet committed
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            hits += [f"{rel}:{n} cites {name}" for name in OUTSIDE_DOCS if name in line]
    return hits


def test_no_tracked_file_cites_notes_outside_the_repository() -> None:
    hits = outside_citations(ig.ROOT)
    assert hits == [], "cite the primary source or docs/... instead:\n" + "\n".join(hits)


def test_a_citation_outside_the_repository_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(f'"""Rule (see {OUTSIDE_DOCS[0]} section 2)."""\n')
    (tmp_path / "b.md").write_text(f"x\nfrom {OUTSIDE_DOCS[-1]}/doc\n")
    (tmp_path / "untracked.py").write_text(f"# {OUTSIDE_DOCS[1]}\n")
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run(["git", "add", "a.py", "b.md"], cwd=tmp_path, check=True)
    assert outside_citations(tmp_path) == [f"a.py:1 cites {OUTSIDE_DOCS[0]}", f"b.md:2 cites {OUTSIDE_DOCS[-1]}"]


# --- the checker on synthetic trees


def test_upward_import_in_a_function_is_reported(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "msgs/codec.py": "import os\n\n\ndef decode():\n    from chestnut.node.config import load\n",
            "node/config.py": "from chestnut.msgs import codec\n\n\ndef load():\n    return codec\n",
        },
    )
    imports = ig.scan(root)
    assert ig.Import("msgs/codec.py", 5, "chestnut.node.config") in imports
    assert ig.upward(imports, root) == [
        "msgs/codec.py:5 imports chestnut.node.config: layer 0 (msgs) must not import layer 3 (node);"
        " move what it needs down to layer 0 or below"
    ]


def test_type_checking_relative_and_import_module_imports_count(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "node/offline/replay.py": "x = 1\n",
            "node/watch.py": (
                "from typing import TYPE_CHECKING\n"
                "import importlib\n"
                "if TYPE_CHECKING:\n"
                "    from ..launch import cli\n"
                "from .offline import replay\n"
                "stack = importlib.import_module('chestnut.launch.stack')\n"
            ),
            "launch/cli.py": "",
            "launch/stack.py": "",
        },
    )
    assert ig.upward(ig.scan(root), root) == [
        "node/watch.py:4 imports chestnut.launch.cli: layer 3 (node) must not import layer 5 (launch);"
        " move what it needs down to layer 3 or below",
        "node/watch.py:5 imports chestnut.node.offline.replay: layer 3 (node) must not import layer 4"
        " (node/offline); move what it needs down to layer 3 or below",
        "node/watch.py:6 imports chestnut.launch.stack: layer 3 (node) must not import layer 5 (launch);"
        " move what it needs down to layer 3 or below",
    ]


def test_cycle_between_three_files_is_reported(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "backend/a.py": "from chestnut.backend import b\n",
            "backend/b.py": "import chestnut.backend.sim.c\n",
            "backend/sim/c.py": "def f():\n    from chestnut.backend.a import g\n",
            "backend/d.py": "from chestnut.backend import a\n",  # into the cycle, not part of it
        },
    )
    imports = ig.scan(root)
    assert ig.upward(imports, root) == []
    assert ig.cycles(imports, root) == [
        "import cycle between backend/a.py, backend/b.py, backend/sim/c.py: backend/a.py:1 imports"
        " chestnut.backend.b; backend/b.py:1 imports chestnut.backend.sim.c; backend/sim/c.py:2 imports"
        " chestnut.backend.a"
    ]


def test_layered_tree_reports_nothing_and_counts_folder_edges(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "msgs/schema.py": "import numpy\n",
            "backend/protocol.py": "from chestnut.msgs.schema import X\nfrom chestnut.msgs import schema\n",
            "backend/sim/twin.py": "from chestnut.backend import protocol as P\nfrom ..protocol import Y\n",
            "fallback/standby.py": "from chestnut.backend.protocol import Z\n",
            "launch/cli.py": "from chestnut.fallback import standby\nfrom chestnut.backend.sim import twin\n",
        },
    )
    imports = ig.scan(root)
    assert ig.upward(imports, root) == [] and ig.cycles(imports, root) == []
    assert dict(ig.folder_graph(imports, root)) == {
        ("backend", "msgs"): 1,
        ("backend/sim", "backend"): 1,
        ("fallback", "backend"): 1,
        ("launch", "fallback"): 1,
        ("launch", "backend/sim"): 1,
    }
    assert ig.render(ig.folder_graph(imports, root)).splitlines()[-6:] == [
        "  launch -->|1| fallback",
        "  launch -->|1| backend_sim",
        "  fallback -->|1| backend",
        "  backend -->|1| msgs",
        "  backend_sim -->|1| backend",
        "```",
    ]


def test_strongly_connected_components() -> None:
    edges = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert ig.strongly_connected(edges) == [["a", "b", "c"], ["d", "e"], ["f"]]


def test_write_replaces_only_the_block(tmp_path: Path) -> None:
    root = _tree(tmp_path, {"backend/x.py": "from chestnut.msgs import y\n", "msgs/y.py": ""})
    readme = tmp_path / "README.md"
    readme.write_text(f"# t\n\nbefore\n{ig.BEGIN}\nold\n{ig.END}\nafter\n")
    assert ig.main(["--root", str(root), "--write", str(readme)]) == 0
    want = ig.readme_block(ig.folder_graph(ig.scan(root), root))
    assert readme.read_text() == f"# t\n\nbefore\n{want}\nafter\n"
    assert "  backend -->|1| msgs" in want
    assert ig.main(["--root", str(root), "--write", str(tmp_path / "msgs" / "y.py")]) == 2


def test_check_exit_status(tmp_path: Path, capsys) -> None:
    root = _tree(tmp_path, {"fallback/s.py": "from chestnut.node import main\n", "node/main.py": ""})
    assert ig.main(["--root", str(root), "--check"]) == 1
    assert capsys.readouterr().out.startswith("fallback/s.py:1 imports chestnut.node.main: layer 2 (fallback)")


LAUNCH_MODULE_MAX_LINES = 600
"""``launch/`` is the folder a newcomer opens first: each module does one job and stays readable at a sitting
(our bound)."""


def test_no_module_in_launch_is_over_600_lines() -> None:
    launch = Path(__file__).resolve().parents[1] / "launch"
    sizes = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in sorted(launch.glob("*.py"))}
    assert "stack.py" in sizes and len(sizes) > 10
    assert {name: n for name, n in sizes.items() if n > LAUNCH_MODULE_MAX_LINES} == {}
