"""No code runs from a file another user could write, tinygrad's own included.

tinygrad 0.14 unpickles the values of its disk cache (``helpers.py`` ``diskcache_get``; ``CACHEDB``, default
``$XDG_CACHE_HOME/tinygrad/cache.db``) as they are. A payload planted there -- here an ``os.makedirs`` of a marker
directory in every value of the tables the fallback's build reads -- runs when bare tinygrad builds the model,
and must not run when the node's fallback, the CPU runner or the worker's runners start: they keep tinygrad's
cache in a private directory beside the project's own cache (``backend/jitcache.py``
``private_tinygrad_cache``). And tinygrad's dock lock (``_System.flock_acquire``) sets the umask to 0 and
leaves it; after it the process's umask must be the one it had (``backend/docklock.py``).

Each case runs in a child process (tinygrad reads its environment once, at import).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


class _Payload:
    """Unpickles as ``os.makedirs(marker, exist_ok=True)`` (returns None: a cache miss to tinygrad): the marker
    directory exists iff a pickle was loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[object, tuple[str, int, bool]]:
        return os.makedirs, (self.marker, 0o700, True)


def child(code: str, home: Path, extra_env: dict[str, str] | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CACHEDB", "CACHELEVEL", "DEV")}
    env.update({"XDG_CACHE_HOME": str(home / "xdg"), "CHESTNUT_CACHE": str(home / "chestnut"), **(extra_env or {})})
    script = "import json, os, sys\nout = {}\n" + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=280)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def planted_db(home: Path) -> Path:
    return home / "xdg" / "tinygrad" / "cache.db"


def poison(db: Path, marker: Path) -> int:
    """Replace every value of every table of ``db`` by the payload; returns how many rows were poisoned."""
    blob = pickle.dumps(_Payload(marker))
    with sqlite3.connect(db) as con:
        tables = [r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")]
        n = 0
        for t in tables:
            n += con.execute(f"UPDATE '{t}' SET val = ?", (blob,)).rowcount
    return n


BUILD = """
from chestnut.backend import model
if os.environ.get("TEST_BARE_TINYGRAD"):  # tinygrad's own default cache location, as tinygrad alone uses it
    model.private_tinygrad_cache = lambda *a, **k: None
from chestnut.backend.jitcache import JitCache
from chestnut.fallback.standby import FallbackModel
fb = FallbackModel(os.environ["TEST_ONNX_PATH"], engine="tinygrad",
                   jit_cache=JitCache(__import__("pathlib").Path(os.environ["TEST_JIT_DIR"])))
import tinygrad.helpers as h
out["cachedb"] = h.CACHEDB
"""


def test_a_payload_planted_in_tinygrads_cache_runs_with_bare_tinygrad_but_not_when_the_fallback_starts(
        tmp_path: Path, tiny_onnx: Path) -> None:
    """The issue's case: the fallback's tinygrad model rebuilt from a cold project cache."""
    marker = tmp_path / "payload-ran"
    env = {"TEST_ONNX_PATH": str(tiny_onnx), "TEST_BARE_TINYGRAD": "1"}
    # 1. bare tinygrad fills its default cache with the tables and keys this build reads
    got = child(BUILD, tmp_path, {**env, "TEST_JIT_DIR": str(tmp_path / "jit-1")})
    assert got["cachedb"] == str(planted_db(tmp_path))
    assert poison(planted_db(tmp_path), marker) > 0
    # 2. the reference: bare tinygrad, a cold project cache -> the payload runs
    child(BUILD, tmp_path, {**env, "TEST_JIT_DIR": str(tmp_path / "jit-2")})
    assert marker.is_dir()
    marker.rmdir()
    # 3. the fallback as the node starts it, a cold project cache -> tinygrad's cache is the private one
    got = child(BUILD, tmp_path, {"TEST_ONNX_PATH": str(tiny_onnx), "TEST_JIT_DIR": str(tmp_path / "jit-3")})
    private = tmp_path / "chestnut" / "tinygrad"
    assert got["cachedb"] == str(private / "cache.db")
    assert not marker.exists()
    assert stat.S_IMODE(private.stat().st_mode) == 0o700 and private.stat().st_uid == os.geteuid()


LOOKUP = """
import pickle
import re
{start}
from tinygrad.helpers import CACHELEVEL, diskcache_get
import tinygrad.helpers as h
out["cachedb"] = h.CACHEDB
out["cachelevel"] = int(CACHELEVEL.value)
out["got"] = repr(diskcache_get("planted", "key"))
"""

STARTS = {
    "bare tinygrad": "",
    "node fallback (tinygrad)": "from chestnut.backend.model import ensure_cpu_device; ensure_cpu_device()",
    "worker, real dock": "from chestnut.backend.real_runner import RealRunner; RealRunner(jit_cache=False)",
    "worker, twin": "from chestnut.backend.tinygrad_harness import configure_env; configure_env()",
}


def plant(home: Path, marker: Path) -> None:
    """One table of tinygrad's layout (``'<table>_<VERSION>'``, key, val) holding the payload under a known key."""
    from tinygrad.helpers import VERSION

    db = planted_db(home)
    db.parent.mkdir(parents=True, exist_ok=True)
    with sqlite3.connect(db) as con:
        con.execute(f"CREATE TABLE 'planted_{VERSION}' (key text, val blob, PRIMARY KEY (key))")
        con.execute(f"INSERT INTO 'planted_{VERSION}' VALUES (?, ?)", ("key", pickle.dumps(_Payload(marker))))


@pytest.mark.parametrize("start", list(STARTS), ids=list(STARTS))
def test_tinygrads_cache_lookups_after_each_start_never_read_the_planted_file(tmp_path: Path, start: str) -> None:
    """A cache lookup of the planted key after each process's start: bare tinygrad runs the payload; after the
    node's, the CPU runner's and the workers' starts the lookup reads the private cache and finds nothing."""
    marker = tmp_path / "payload-ran"
    plant(tmp_path, marker)
    got = child(LOOKUP.format(start=STARTS[start]), tmp_path, {"DEV": "CPU"} if "twin" in start else None)
    if start == "bare tinygrad":
        assert got["cachedb"] == str(planted_db(tmp_path)) and marker.is_dir()
        return
    assert (got["cachedb"], got["cachelevel"], got["got"]) == (str(tmp_path / "chestnut" / "tinygrad" / "cache.db"),
                                                               2, "None")
    assert not marker.exists()


@pytest.mark.parametrize("where", ["directory", "database"])
def test_a_private_cache_another_user_could_write_turns_tinygrads_cache_off(tmp_path: Path, where: str) -> None:
    """The payload in the private location itself, which another user could write (mode 0777 / 0666): refused,
    tinygrad's disk cache is off (CACHELEVEL=0), nothing unpickled."""
    marker = tmp_path / "payload-ran"
    plant(tmp_path, marker)
    private = tmp_path / "chestnut" / "tinygrad"
    private.mkdir(parents=True, mode=0o700)
    planted_db(tmp_path).rename(private / "cache.db")
    (private if where == "directory" else private / "cache.db").chmod(0o777 if where == "directory" else 0o666)
    got = child(LOOKUP.format(start=STARTS["node fallback (tinygrad)"]), tmp_path)
    assert (got["cachelevel"], got["got"]) == (0, "None")
    assert not marker.exists()


PUT = """
os.umask(0o022)  # the usual umask: sqlite would create tinygrad's database 0644
from chestnut.backend.model import ensure_cpu_device
ensure_cpu_device()
import tinygrad.helpers as h
h.diskcache_put("chestnut_test", "key", 1)
out["cachedb"] = h.CACHEDB
out["got"] = h.diskcache_get("chestnut_test", "key")
"""


@pytest.mark.parametrize("old", [False, True], ids=["a new cache", "one made 0644 before"])
def test_tinygrads_cache_files_are_ours_alone(tmp_path: Path, old: bool) -> None:
    """tinygrad's database (and sqlite's files beside it) in the private cache are mode 0600, as everything else
    the project writes: created so before tinygrad opens it, or made so when an older run left it 0644."""
    private = tmp_path / "chestnut" / "tinygrad"
    if old:
        private.mkdir(parents=True, mode=0o700)
        sqlite3.connect(private / "cache.db").close()
        (private / "cache.db").chmod(0o644)
    got = child(PUT, tmp_path)
    assert (got["cachedb"], got["got"]) == (str(private / "cache.db"), 1)
    modes = {p.name: f"{stat.S_IMODE(p.lstat().st_mode):04o}" for p in private.iterdir()}
    assert modes.get("cache.db") == "0600" and set(modes.values()) == {"0600"}, modes


UMASK = """
import tempfile
tempfile.tempdir = os.environ["LOCKDIR"]
os.umask(0o027)
from tinygrad.runtime.support.system import System
if os.environ.get("GUARD"):
    from chestnut.backend.docklock import keep_umask_around_tinygrads_lock
    keep_umask_around_tinygrads_lock()
    keep_umask_around_tinygrads_lock()  # idempotent
System.flock_acquire("am_usb:9-9.lock")
try:
    System.flock_acquire("am_usb:9-9.lock")  # a second open file of this process: refused, the umask kept too
except RuntimeError as e:
    out["second"] = str(e).split(".")[0]
after = os.umask(0o077)
out["umask"] = f"{after:04o}"
out["mode"] = f"{os.stat(os.path.join(os.environ['LOCKDIR'], 'am_usb:9-9.lock')).st_mode & 0o7777:04o}"
"""


@pytest.mark.parametrize("guard", [False, True], ids=["bare tinygrad", "the node's"])
def test_the_umask_after_tinygrads_dock_lock_is_the_processs_own(tmp_path: Path, guard: bool) -> None:
    got = child(UMASK, tmp_path, {"LOCKDIR": str(tmp_path), **({"GUARD": "1"} if guard else {})})
    assert got["second"] == "Failed to acquire lock file am_usb:9-9"
    assert got["umask"] == ("0027" if guard else "0000")
    assert got["mode"] == ("0600" if guard else "0666")  # the node's lock file is private; tinygrad's own is not


KEEP_LOG = """
import logging
class Keep(logging.Handler):
    def emit(self, record):
        out.setdefault("log", []).append(f"{record.levelname} {record.name}: {record.getMessage()}")
logging.getLogger("chestnut").addHandler(Keep())
"""

DAMAGED_AT_START = KEEP_LOG + """
from pathlib import Path
from chestnut.backend.jitcache import JitCache, default_cache_dir
from chestnut.backend.model import OnnxModel, _graph_inputs, host_cache_key
data = Path(os.environ["TEST_ONNX_PATH"]).read_bytes()
key = host_cache_key(__import__("hashlib").sha256(data).hexdigest(), _graph_inputs(data, "tiny", {}))
root = default_cache_dir()
JitCache(root).store(key, "a JIT", {})
(root / f"{key.digest}.json").write_bytes(b"not JSON")  # an entry the compile cache refuses: rebuilt by this load
out["digest"] = key.digest
out["cache_hit"] = OnnxModel(data, name="tiny", jit_cache=JitCache(root)).cache_hit
out["refusal"] = JitCache(root).refusal(key)
"""

GARBAGE = bytes(range(256)) * 16  # 4 KiB of no sqlite database (its header is "SQLite format 3\\0")


def _set_aside_line(private: Path) -> tuple[str, Path]:
    """The line of a database moved aside in ``private``, built from the one name it was moved to."""
    (aside,) = private.glob("cache.db.corrupt-*")
    assert re.fullmatch(r"cache\.db\.corrupt-\d{4}-\d\d-\d\d--\d\d-\d\d-\d\d", aside.name), aside.name
    db = private / "cache.db"
    return (f"WARNING chestnut.jitcache: tinygrad's disk cache {db} is damaged (file is not a database); moved it "
            f"aside to {aside} and compiling afresh"), aside


def test_a_damaged_tinygrad_cache_is_moved_aside_and_the_model_compiles_afresh(tmp_path: Path, tiny_onnx: Path) -> None:
    """tinygrad's database overwritten with garbage was ``bad_model: tinygrad could not parse model file ...:
    DatabaseError: file is not a database`` at every load (the node retried load_failed forever), and a refused
    entry of the compile cache was never rebuilt. The cache's damage is said in one line naming the file, the
    garbage kept beside it, and the model compiles (once) into a fresh database and a rebuilt entry."""
    private = tmp_path / "chestnut" / "tinygrad"
    private.mkdir(parents=True, mode=0o700)
    (private / "cache.db").write_bytes(GARBAGE)
    (private / "cache.db").chmod(0o600)
    got = child(DAMAGED_AT_START, tmp_path, {"TEST_ONNX_PATH": str(tiny_onnx)})
    line, aside = _set_aside_line(private)
    entry = tmp_path / "chestnut" / "jit" / f"{got['digest']}.json"
    assert got["log"] == [
        line,
        f"WARNING chestnut.jitcache: compile cache entry {got['digest']}.pkl refused: {entry} is not JSON; rebuilding",
    ]
    assert (got["cache_hit"], got["refusal"]) == (False, None)  # compiled, and its entry rebuilt intact
    assert aside.read_bytes() == GARBAGE
    with sqlite3.connect(private / "cache.db") as con:  # the fresh database holds what this compile put there
        assert con.execute("SELECT count(*) FROM sqlite_master WHERE type = 'table'").fetchone()[0] > 0
    modes = {p.name: f"{stat.S_IMODE(p.lstat().st_mode):04o}" for p in private.iterdir()}
    assert set(modes.values()) == {"0600"}, modes


DAMAGED_LATER = KEEP_LOG + """
from pathlib import Path
from chestnut.backend.model import OnnxModel, ensure_cpu_device
ensure_cpu_device()
import tinygrad.helpers as h
h.db_connection()  # tinygrad opened it intact; the damage comes after (another process, a torn write)
with open(h.CACHEDB, "r+b") as f:
    f.write(bytes(range(256)) * 16)
model = OnnxModel(Path(os.environ["TEST_ONNX_PATH"]))  # parsed (no compile cache: nothing compiled yet)
out["inputs"] = [s.to_json() for s in model.inputs]
h.diskcache_put("chestnut_test", "key", 1)
out["got"] = h.diskcache_get("chestnut_test", "key")
"""


def test_a_tinygrad_cache_damaged_after_tinygrad_opened_it_is_moved_aside_and_the_graph_parsed_again(
        tmp_path: Path, tiny_onnx: Path) -> None:
    """The same damage met by tinygrad itself, past the check at start: one line (logged where the model is
    built), the database moved aside, tinygrad's connection to it closed, and the graph parsed again in the same
    process into the fresh database."""
    got = child(DAMAGED_LATER, tmp_path, {"TEST_ONNX_PATH": str(tiny_onnx)})
    private = tmp_path / "chestnut" / "tinygrad"
    line, aside = _set_aside_line(private)
    assert got["log"] == [line.replace("chestnut.jitcache", "chestnut.model")]
    assert got["inputs"] == [{"name": "x", "shape": [1, 3, 32, 64], "dtype": "float32"}]
    assert got["got"] == 1
    assert aside.read_bytes() == GARBAGE
