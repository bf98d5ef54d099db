"""The offline commands' bad arguments (``chestnut check``, ``replay``, ``fleet make``): one line each that names
the program once, exit status 2, and the one workers rule (``node/offline/replay.py`` ``check_workers``) that the
executors, ``replay()`` and ``--workers`` share; their numbers (``--tol``, ``--slack-ms``, ``--deadline-ms``,
``--wait-timeout-ms``) refused as they are parsed when NaN, infinite or out of range.

``chestnut check --workers 0`` was ``<time> ERROR chestnut.check: chestnut check: --workers must be >= 1, got 0``:
the logger's name and a hand-written prefix, the program named twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from chestnut.launch.cli import main
from chestnut.node.config import cpu_count
from chestnut.node.offline.check_cli import bound_ms
from chestnut.node.offline.contracts import CheckParams
from chestnut.node.offline.executor import LocalExecutor, make_executor
from chestnut.node.offline.fleet import MAX_COPIES, check_copies
from chestnut.node.offline.fleet_cli import copy_count, slack_ms, worker_count
from chestnut.node.offline.replay import check_workers, max_workers, replay
from chestnut.node.offline.replay_cli import tolerance

CHESTNUT = "import sys; from chestnut.launch.cli import main; sys.exit(main(sys.argv[1:]))"


def _chestnut(args: list[str]) -> subprocess.CompletedProcess[str]:
    """The command in a child, with the logging ``chestnut`` sets up (a test process's own would hide a prefix)."""
    return subprocess.run([sys.executable, "-c", CHESTNUT, *args], capture_output=True, text=True, timeout=120)


def _chestnut_measured(args: list[str], out: Path, timeout_s: float = 120.0) -> tuple[int, str, str, int, float]:
    """(exit status, stdout, stderr, peak RSS in KiB, wall s) of the command in a child: ``wait4`` gives that child's
    own ``ru_maxrss``, whatever other children this process ran."""
    out.mkdir()
    t0 = time.monotonic()
    with open(out / "stdout", "w") as so, open(out / "stderr", "w") as se:
        proc = subprocess.Popen([sys.executable, "-c", CHESTNUT, *args], stdout=so, stderr=se, text=True)
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() - t0 > timeout_s:
            proc.kill()
            proc.wait()
            pytest.fail(f"chestnut {' '.join(args)} ran past {timeout_s} s")
        time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return (proc.returncode, (out / "stdout").read_text(), (out / "stderr").read_text(), usage.ru_maxrss,
            time.monotonic() - t0)


def _error_line(stderr: str) -> str:
    """The one line ``stderr`` holds, less its time stamp (``<date> <time> ERROR ...``)."""
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    return lines[0].split(" ", 2)[2]


@pytest.fixture(scope="module")
def one_message_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A log of one ``nodeState`` and no node configuration: replay looks at ``--model`` and nothing else."""
    from drivelog import write_one_message_log

    return write_one_message_log(tmp_path_factory.mktemp("one-message") / "logs")


def test_workers_0_is_the_parsers_one_line_with_the_program_named_once(tmp_path: Path) -> None:
    done = _chestnut(["check", str(tmp_path), "--workers", "0"])
    assert (done.returncode, done.stdout, done.stderr) == (2, "", (
        "chestnut check: error: argument --workers: '0': give a number of workers >= 1 (chestnut check --help)\n"
    ))


@pytest.mark.parametrize("command", ["check", "replay"])
@pytest.mark.parametrize("value", ["0", "-3", "x", "1.5"])
def test_a_worker_count_below_1_or_not_a_whole_number_is_refused_as_it_is_parsed(
    command: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, str(tmp_path), "--workers", value])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"chestnut {command}: error: argument --workers: {value!r}: give a number of workers >= 1 "
        f"(chestnut {command} --help)\n"
    )


@pytest.mark.parametrize("value", ["0", "100001", "x"])
def test_a_copy_count_out_of_range_is_refused_as_it_is_parsed(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["fleet", "make", "--from", str(tmp_path), "--copies", value, str(tmp_path / "out")])
    assert info.value.code == 2 and not (tmp_path / "out").exists()
    assert capsys.readouterr().err == (
        f"chestnut fleet make: error: argument --copies: {value!r}: give a number of copies in 1..100000 "
        "(chestnut fleet make --help)\n"
    )


@pytest.mark.parametrize(
    ("command", "option"), [("check", ["--ship-logs"]), ("replay", ["--ray-address", "10.0.0.1:6379"])]
)
def test_a_ray_option_without_executor_ray_is_one_line_with_the_program_named_once(
    command: str, option: list[str], tmp_path: Path
) -> None:
    done = _chestnut([command, str(tmp_path), *option])
    assert (done.returncode, done.stdout, done.stderr) == (2, "", (
        f"chestnut {command}: --ship-logs and --ray-address are for --executor ray (local workers read the paths)\n"
    ))


def test_the_type_functions_take_what_the_rules_take() -> None:
    assert (worker_count("1"), worker_count("16")) == (1, 16)
    assert (copy_count("1"), copy_count(str(MAX_COPIES))) == (1, MAX_COPIES)


@pytest.mark.parametrize("workers", [0, -1])
def test_a_library_caller_passing_a_worker_count_below_1_gets_one_value_error(workers: int, tmp_path: Path) -> None:
    """One rule, one message, wherever the count comes in; ``make_executor("local", workers=0)`` was a pool of 1
    (0 read as "the default")."""
    why = f"workers must be >= 1, got {workers}"
    for call in (
        lambda: check_workers(workers),
        lambda: LocalExecutor(workers),
        lambda: make_executor("local", workers=workers),
        lambda: replay(tmp_path / "no-such-log", workers=workers),  # refused before the log is looked for
    ):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == why
    assert check_workers(1) == 1


def _over_the_bound(workers: int) -> str:
    ncpu = cpu_count()
    return (f"workers must be at most {4 * ncpu} on this machine (4 per CPU it may run on, {ncpu} CPUs: more only "
            f"take turns for them, each with its own memory), got {workers}")


@pytest.mark.parametrize("command", ["check", "replay"])
def test_more_workers_than_this_machine_bounds_are_one_line_before_anything_runs(command: str, tmp_path: Path) -> None:
    """``--workers 100000`` was taken: a fleet of that many segments got that many processes."""
    for workers in (max_workers() + 1, 100000):
        done = _chestnut([command, str(tmp_path), "--workers", str(workers)])
        assert (done.returncode, done.stdout, done.stderr) == (2, "",
                                                               f"chestnut {command}: {_over_the_bound(workers)}\n")


def test_the_worker_bound_is_4_per_cpu_and_only_for_workers_on_this_machine(tmp_path: Path) -> None:
    most = max_workers()
    assert most == 4 * cpu_count()
    assert check_workers(most) == most and check_workers(most + 1, here=False) == most + 1  # a cluster's own CPUs
    assert worker_count(str(most + 1)) == most + 1  # the executor decides (a cluster at --ray-address: its CPUs)
    for call in (
        lambda: check_workers(most + 1),
        lambda: LocalExecutor(most + 1),
        lambda: make_executor("local", workers=most + 1),
        lambda: replay(tmp_path / "no-such-log", workers=most + 1),  # refused before the log is looked for
    ):
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == _over_the_bound(most + 1)


def test_check_copies_is_make_fleets_rule() -> None:
    with pytest.raises(ValueError) as info:
        check_copies(0)
    assert str(info.value) == "copies must be in 1..100000, got 0"
    assert check_copies(MAX_COPIES) == MAX_COPIES


TOL = "give a tolerance, > 0 and <= 1"
SLACK = "give a slack in milliseconds, >= 0 and <= 60000 (a minute)"
BOUND = "give a time in milliseconds, > 0 and <= 60000 (a minute)"


@pytest.mark.parametrize(
    ("command", "option", "value", "want"),
    [
        ("replay", "--tol", "nan", TOL),
        ("replay", "--tol", "inf", TOL),  # matched every frame: exit 0, "0 mismatch(es)"
        ("replay", "--tol", "-1", TOL),
        ("replay", "--tol", "0", TOL),
        ("replay", "--tol", "1.5", TOL),
        ("replay", "--tol", "x", TOL),
        ("replay", "--slack-ms", "nan", SLACK),  # "ERROR chestnut.replay: cannot convert float NaN to integer"
        ("replay", "--slack-ms", "inf", SLACK),
        ("replay", "--slack-ms", "-50", SLACK),  # taken: a bound 50 ms short of the deadline
        ("replay", "--slack-ms", "1e303", SLACK),  # OverflowError, a traceback
        ("check", "--slack-ms", "1e303", SLACK),
        ("check", "--slack-ms", "60000.5", SLACK),
        ("check", "--deadline-ms", "1e303", BOUND),
        ("check", "--deadline-ms", "60001", BOUND),
        ("check", "--wait-timeout-ms", "1e303", BOUND),
        ("check", "--wait-timeout-ms", "0", BOUND),
    ],
)
def test_a_number_out_of_its_range_is_refused_as_it_is_parsed(
    command: str, option: str, value: str, want: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([command, str(tmp_path), option, value])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"chestnut {command}: error: argument {option}: {value!r}: {want} (chestnut {command} --help)\n"
    )


def test_replay_tol_inf_is_one_line_and_nothing_else(tmp_path: Path) -> None:
    done = _chestnut(["replay", str(tmp_path), "--tol", "inf"])
    assert (done.returncode, done.stdout, done.stderr) == (2, "", (
        "chestnut replay: error: argument --tol: 'inf': give a tolerance, > 0 and <= 1 (chestnut replay --help)\n"
    ))


def test_the_number_types_take_their_whole_range() -> None:
    assert (tolerance("1e-4"), tolerance("1")) == (1e-4, 1.0)
    assert (slack_ms("0"), slack_ms("100"), slack_ms("60000")) == (0.0, 100.0, 60000.0)
    assert (bound_ms("0.5"), bound_ms("60000")) == (0.5, 60000.0)
    # the largest bounds still make whole nanoseconds (1e303 ms overflowed int())
    p = CheckParams(deadline_ms=60000.0, slack_ms=60000.0, wait_timeout_ms=60000.0)
    assert p.answer_bound_ns == 120_000_000_000 and p.hang_bound_ns > p.answer_bound_ns


def test_replay_refuses_a_model_over_the_loaders_bound_from_its_size_before_reading_it(
    one_message_log: Path, tmp_path: Path
) -> None:
    """A 3 GiB ``--model`` (sparse: no block on disk) is refused from its ``stat`` against the loader's
    ``MAX_MODEL_BYTES``: one line naming the file, its size and the bound, exit 2. It was read whole first, twice
    (3.2 GB RSS, 19 s), then refused as ``bad_model: ... not a readable ONNX model``."""
    big = tmp_path / "big.onnx"
    with open(big, "wb") as f:
        f.truncate(3 << 30)
    assert big.stat().st_size == 3 << 30 and big.stat().st_blocks == 0
    rc, out, err, rss_kib, wall_s = _chestnut_measured(
        ["replay", str(one_message_log), "--model", str(big)], tmp_path / "run")
    assert (rc, out, _error_line(err)) == (2, "", (
        f"ERROR chestnut.replay: primary model {big} is 3221225472 bytes, over the 2147483648 bytes an ONNX model "
        "can be: give --model PATH"
    ))
    assert rss_kib < 512 << 10, f"peak RSS {rss_kib} KiB: the file was read"
    assert wall_s < 60


@pytest.mark.parametrize(
    ("kind", "what"),
    [
        ("directory", "is a directory, not a model file: give {flag} PATH (the .onnx file)"),
        ("/dev/zero", "is a character device, not a regular file: give {flag} PATH"),
        ("fifo", "is a FIFO, not a regular file: give {flag} PATH"),  # never opened: that would wait for a writer
    ],
    ids=["directory", "dev-zero", "fifo"],
)
@pytest.mark.parametrize("flag", ["--model", "--fallback-model"])
def test_replay_says_what_a_model_path_is_when_it_is_no_model_file(
    kind: str, what: str, flag: str, one_message_log: Path, tiny_onnx: Path, tmp_path: Path
) -> None:
    """A directory or a device given as a model was "not found on this machine"; it is there, and the line says
    what it is instead. One line, exit 2."""
    if kind == "directory":
        path = tmp_path / "models"
        path.mkdir()
    elif kind == "fifo":
        path = tmp_path / "model.onnx"
        os.mkfifo(path)
    else:
        path = Path(kind)
    models = ["--model", str(path)] if flag == "--model" else ["--model", str(tiny_onnx), flag, str(path)]
    done = _chestnut(["replay", str(one_message_log), *models])
    role = "primary" if flag == "--model" else "fallback"
    assert (done.returncode, done.stdout, _error_line(done.stderr)) == (2, "", (
        f"ERROR chestnut.replay: {role} model {path} {what.format(flag=flag)}"
    ))


@pytest.mark.timeout(120)  # a FIFO that is opened blocks for good: fail, never hang
def test_check_skips_a_log_file_that_is_not_a_regular_file_and_checks_the_rest(
    one_message_log: Path, tmp_path: Path
) -> None:
    """FIFOs in the tree ``chestnut check`` walks: each one named ``rlog.*`` is one WARNING line, once (the tree is
    walked twice: the progress count, then the logs), never opened, and the two logs are checked as usual (exit 0);
    a FIFO by another name is no log file and not mentioned. It was ``... rlog.zst: a FIFO, not a regular file; give
    a log file ...``, exit 2, nothing checked."""
    import shutil

    seg = next(one_message_log.iterdir()).name
    for log in ("a", "b"):
        shutil.copytree(one_message_log, tmp_path / "tree" / log)
    fifo_seg = tmp_path / "tree" / "b" / (seg.rsplit("--", 1)[0] + "--1")
    fifo_seg.mkdir()
    os.mkfifo(fifo_seg / "rlog.zst")  # a segment of its own
    os.mkfifo(tmp_path / "tree" / "b" / seg / "rlog.mcap")  # beside the segment's regular rlog.zst
    os.mkfifo(tmp_path / "tree" / "pipe")
    done = _chestnut(["check", str(tmp_path / "tree")])
    assert done.returncode == 0, done.stderr
    assert [line.split(" ", 2)[2] for line in done.stderr.splitlines()] == [
        f"WARNING chestnut.check: {fifo_seg / 'rlog.zst'}: a FIFO, not a regular file: skipped (never opened)",
        f"WARNING chestnut.check: {tmp_path / 'tree' / 'b' / seg / 'rlog.mcap'}: a FIFO, not a regular file: "
        "skipped (never opened)",
    ]
    assert "chestnut check: 2 log(s), worst first" in done.stdout and "2 of 2 segment(s)" in done.stdout
    assert done.stdout.splitlines()[-1] == "0 violation(s)"


def test_replay_skips_a_log_file_that_is_not_a_regular_file_and_replays_the_rest(
    one_message_log: Path, tiny_onnx: Path, tmp_path: Path
) -> None:
    """``chestnut replay`` walks a tree as ``chestnut check`` does (one ``skip_once``): a FIFO ``rlog.zst`` segment
    is one WARNING line, never opened, and the log's real segment is replayed (exit 0). It was ``... rlog.zst: a
    FIFO, not a regular file; give a log file ...``, exit 2, nothing replayed."""
    import shutil

    seg = next(one_message_log.iterdir()).name
    shutil.copytree(one_message_log, tmp_path / "logs")
    fifo_seg = tmp_path / "logs" / (seg.rsplit("--", 1)[0] + "--1")
    fifo_seg.mkdir()
    os.mkfifo(fifo_seg / "rlog.zst")
    done = _chestnut(["replay", str(tmp_path / "logs"), "--model", str(tiny_onnx)])
    assert done.returncode == 0, done.stderr
    assert [line.split(" ", 2)[2] for line in done.stderr.splitlines()] == [
        f"WARNING chestnut.replay: {fifo_seg / 'rlog.zst'}: a FIFO, not a regular file: skipped (never opened)",
    ]
    assert "1 segment(s), 0 frames replayed" in " ".join(done.stdout.split())


@pytest.mark.parametrize(("deadline", "wait"), [("5000", "3000"), ("3000", "3000")])
@pytest.mark.parametrize("deadline_first", [True, False], ids=["deadline-first", "wait-first"])
def test_check_refuses_a_deadline_not_below_the_wait_timeout_as_it_is_parsed(
    deadline: str, wait: str, deadline_first: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The node's own rule for the pair (``node/config.py`` ``deadline_refusal``, what its configuration refuses):
    ``chestnut check --deadline-ms 5000 --wait-timeout-ms 3000`` was taken and the log checked with a deadline past
    the hang bound. Refused by the parser, whichever flag comes first, before any log is looked for."""
    pair = [["--deadline-ms", deadline], ["--wait-timeout-ms", wait]]
    args = [*pair[0], *pair[1]] if deadline_first else [*pair[1], *pair[0]]
    with pytest.raises(SystemExit) as info:
        main(["check", str(tmp_path / "no-such-log"), *args])
    assert info.value.code == 2
    assert capsys.readouterr().err == (
        f"chestnut check: error: --deadline-ms = {float(deadline)}; want 0 < it < --wait-timeout-ms ({float(wait)}) "
        "(chestnut check --help)\n"
    )


def test_the_deadline_rule_is_the_nodes_one() -> None:
    from chestnut.backend.errors import ConfigError
    from chestnut.launch.cli import OneLineParser
    from chestnut.node.config import NodeConfig, deadline_refusal, validate
    from chestnut.node.offline.check_cli import add_arguments

    cfg = NodeConfig()
    cfg.timing.deadline_ms, cfg.dock.wait_timeout_ms = 5000.0, 3000.0
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert info.value.detail == deadline_refusal(5000.0, 3000.0) == (
        "timing.deadline_ms = 5000.0; want 0 < it < dock.wait_timeout_ms (3000.0)"
    )
    assert deadline_refusal(150.0, 3000.0) is None
    parser = OneLineParser(prog="chestnut check")
    add_arguments(parser)
    args = parser.parse_args(["x", "--wait-timeout-ms", "3000", "--deadline-ms", "150"])  # a pair the node takes
    assert (args.deadline_ms, args.wait_timeout_ms) == (150.0, 3000.0)


@pytest.mark.parametrize("where", ["same", "inside"])
def test_fleet_make_into_its_own_source_folder_is_refused_in_one_line(one_message_log: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str],
                                                                       where: str) -> None:
    """The copies would join the log they copy: a later replay of it counts them (it did: 3 routes from 1)."""
    import shutil

    from chestnut.launch.cli import main

    src = tmp_path / "logs"
    shutil.copytree(one_message_log, src)
    before = sorted(p.name for p in src.iterdir())
    out = src if where == "same" else src / "fleet"
    assert main(["fleet", "make", "--from", str(src), "--copies", "2", str(out)]) == 2
    what = "the same folder as" if where == "same" else "inside"
    assert capsys.readouterr().err == (
        f"chestnut fleet make: OUT {out} is {what} --from {src}: the copies would join the log they copy (a later "
        "replay of it would count them); give a folder outside it\n")
    assert sorted(p.name for p in src.iterdir()) == before  # nothing made
