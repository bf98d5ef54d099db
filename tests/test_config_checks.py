"""``node/config.py`` ``validate``: a configuration that can never run is refused when it loads, in one line
naming the key, rather than failing frame by frame or as an allocation at start."""

from __future__ import annotations

import os

import pytest

from chestnut.node.config import MAX_INPUT_ELEMENTS, ConfigError, NodeConfig, validate


def test_an_unknown_preprocess_is_refused_with_the_known_ones():
    cfg = NodeConfig()
    cfg.model.preprocess = "warp:nosuch"
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == "config: model.preprocess = 'warp:nosuch'; use one of ppocr, unit, warp:ppocr, warp:unit"


@pytest.mark.parametrize("name", ["ppocr", "unit", "warp:ppocr", "warp:unit"])
def test_every_known_preprocess_is_accepted(name):
    cfg = NodeConfig()
    cfg.model.preprocess = name
    assert validate(cfg).model.preprocess == name


def test_an_absurd_input_shape_is_refused_before_anything_allocates():
    cfg = NodeConfig()
    cfg.model.shape = (1, 3, 100000, 100000)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == ("config: model.shape = [1, 3, 100000, 100000]: 30000000000 elements, over the "
                            "16777216 a model input may have (64 MiB of float32)")
    cfg.model.shape = (1, 1, 4096, 4096)  # exactly the bound
    assert MAX_INPUT_ELEMENTS == 4096 * 4096 and validate(cfg).model.shape == (1, 1, 4096, 4096)


def _refusal(tmp_path, toml: str) -> str:
    """The one line ``load_config`` refuses ``toml`` with."""
    from chestnut.node.config import load_config

    path = tmp_path / "node.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    return str(e.value)


@pytest.mark.parametrize(("toml", "message"), [
    # an empty model path named no file and ended in an AttributeError traceback
    ('[model]\npath = ""\n',
     "model.path = ''; want a file path (a non-empty string; leave the key out for the default)"),
    # Python's own text was the reason
    ("[model]\npath = 5\n", "model.path = 5; want a file path (a string)"),
    ("[fallback]\npath = 5\n", "fallback.path = 5; want a file path (a string)"),
    ("[model]\nranges = {text_prob = [1.0]}\n",
     "model.ranges.text_prob = [1.0]; want [low, high], two finite numbers with low <= high"),
    ('[model]\nranges = {text_prob = [0.0, "1"]}\n',
     "model.ranges.text_prob = [0.0, '1']; want [low, high], two finite numbers with low <= high"),
    ("[model]\nranges = {text_prob = [nan, 1.0]}\n",
     "model.ranges.text_prob = [nan, 1.0]; want [low, high], two finite numbers with low <= high"),
    ("[model.ranges]\ntext_prob = [1.0, 0.0]\n",
     "model.ranges.text_prob = [1.0, 0.0]; want [low, high], two finite numbers with low <= high"),
    ("[model]\nranges = 5\n", "model.ranges = 5; want a table of output name = [low, high]"),
    # the wait timeout is checked itself, and a conflict names both keys
    ("[dock]\nwait_timeout_ms = 0\n", "dock.wait_timeout_ms = 0; want a finite number > 0"),
    ("[dock]\nwait_timeout_ms = -5\n", "dock.wait_timeout_ms = -5; want a finite number > 0"),
    ("[dock]\nwait_timeout_ms = 100\n", "timing.deadline_ms = 150.0; want 0 < it < dock.wait_timeout_ms (100)"),
    ("[timing]\ndeadline_ms = 3000\n", "timing.deadline_ms = 3000.0; want 0 < it < dock.wait_timeout_ms (3000)"),
    # accepted silently before
    ('[timing]\nframe_service = "nope"\n',
     "timing.frame_service = 'nope'; want a service that carries camera frames: cameraFrame"),
    ('[timing]\nframe_service = "modelOutput"\n',
     "timing.frame_service = 'modelOutput'; want a service that carries camera frames: cameraFrame"),
    ('[model]\ninput = ""\n', "model.input = ''; want the name of the model's input (a non-empty string)"),
    ("[timing]\nstable_after_s = inf\n", "timing.stable_after_s = inf; want a finite number"),
    ("[timing]\nstable_after_s = nan\n", "timing.stable_after_s = nan; want > 0"),
    ("[timing]\nstable_after_s = -1\n", "timing.stable_after_s = -1.0; want > 0"),
    ("[timing]\nflap_window_s = 0\n", "timing.flap_window_s = 0.0; want > 0"),
    ("[timing]\nflap_backoff_s = -5\n", "timing.flap_backoff_s = -5.0; want > 0"),
    ("[timing]\nconsumer_timeout_s = inf\n", "timing.consumer_timeout_s = inf; want a finite number"),
    ("[timing]\nmax_frame_age_ms = inf\n", "timing.max_frame_age_ms = inf; want a finite number"),
    ("[timing]\nhang_margin_ms = nan\n", "timing.hang_margin_ms = nan; want a finite number"),
    ("[timing]\nbackoff_max_s = -inf\n", "timing.backoff_initial_s = 1.0, backoff_max_s = -inf, backoff_factor = 2.0; "
                                         "want initial <= max and factor >= 1"),
    ("[dock]\noptions = {x = [1, inf]}\n", "dock.options.x[1] = inf; want a finite number"),
    ("[timing]\nstart_timeout_s = 1e999\n", "timing.start_timeout_s = inf; want a finite number"),
    ("[timing]\nflap_backoff_s = 1" + "0" * 400 + "\n",
     "timing.flap_backoff_s = 1" + "0" * 400 + "; want a finite number"),
])
def test_a_bad_value_is_refused_in_one_line_naming_the_key_and_what_is_wanted(tmp_path, toml, message):
    assert _refusal(tmp_path, toml) == f"config: {message}"


def test_zero_fallback_threads_is_onnxruntimes_default_and_kept(tmp_path):
    """``fallback.threads`` is onnxruntime's ``intra_op_num_threads``, whose 0 is onnxruntime's own default."""
    from chestnut.node.config import load_config

    path = tmp_path / "node.toml"
    path.write_text('[fallback]\nthreads = 0\npath = ""\n')
    cfg = load_config(path)
    assert (cfg.fallback.threads, cfg.fallback.path) == (0, None)  # an empty fallback path: the primary's file


def test_every_frame_service_is_in_the_registry():
    from chestnut.msgs.services import SERVICE_LIST
    from chestnut.node.config import FRAME_SERVICES

    assert FRAME_SERVICES == ("cameraFrame",) and all(s in SERVICE_LIST for s in FRAME_SERVICES)


@pytest.mark.parametrize(("flags", "message"), [
    (["--wait-timeout-ms", "100"], "timing.deadline_ms = 150.0; want 0 < it < dock.wait_timeout_ms (100.0)"),
    (["--wait-timeout-ms", "0"], "dock.wait_timeout_ms = 0.0; want a finite number > 0"),
    (["--wait-timeout-ms", "nan"], "dock.wait_timeout_ms = nan; want a finite number > 0"),
    (["--deadline-ms", "inf"], "timing.deadline_ms = inf; want 0 < it < dock.wait_timeout_ms (3000)"),
])
def test_a_bad_flag_is_refused_naming_its_key(tmp_path, flags, message):
    import argparse

    from chestnut.node.config import add_arguments, from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    path = tmp_path / "node.toml"
    path.write_text("")
    with pytest.raises(ConfigError) as e:
        from_args(p.parse_args(["--config", str(path), *flags]))
    assert str(e.value) == f"config: {message}"


def test_a_non_finite_value_set_in_code_is_refused():
    cfg = NodeConfig()
    cfg.timing.agreement_tol = float("inf")
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value) == "config: timing.agreement_tol = inf; want a finite number"


@pytest.mark.parametrize(("toml", "message"), [
    # accepted before: 1e20 ms, a wait no frame outlives, and counts and rates no run ever completes
    ("[timing]\nhost_window_ms = 1e20\n", "timing.host_window_ms = 1e+20; want at most 60000 ms, a minute"),
    ("[dock]\nwait_timeout_ms = 60001\n", "dock.wait_timeout_ms = 60001; want at most 60000 ms, a minute"),
    ("[timing]\nmax_frame_age_ms = 1e9\n", "timing.max_frame_age_ms = 1000000000.0; want at most 60000 ms, a minute"),
    ("[timing]\nhang_margin_ms = 60001\n", "timing.hang_margin_ms = 60001.0; want at most 60000 ms, a minute"),
    ("[timing]\nframe_period_ms = 1e6\n", "timing.frame_period_ms = 1000000.0; want at most 60000 ms, a minute"),
    ("[timing]\nhost_late_ms = 1e6\n", "timing.host_late_ms = 1000000.0; want at most 60000 ms, a minute"),
    ("[timing]\nstable_after_s = 1e20\n", "timing.stable_after_s = 1e+20; want at most 2592000 s, 30 days"),
    ("[timing]\nstart_timeout_s = 2592001\n", "timing.start_timeout_s = 2592001.0; want at most 2592000 s, 30 days"),
    ("[timing]\nbackoff_max_s = 1e300\n", "timing.backoff_max_s = 1e+300; want at most 2592000 s, 30 days"),
    ("[timing]\nhealth_hz = 1e6\n", "timing.health_hz = 1000000.0; want at most 100 Hz"),
    ("[timing]\nprobe_hz = 101\n", "timing.probe_hz = 101.0; want at most 100 Hz"),
    ("[timing]\nshadow_frames = 9223372036854775807\n",
     "timing.shadow_frames = 9223372036854775807; want at most 1000, 50 s of frames at 20 Hz"),
    ("[timing]\nmiss_run = 1001\n", "timing.miss_run = 1001; want at most 1000, 50 s of frames at 20 Hz"),
    ("[timing]\nflap_max_failovers = 1001\n",
     "timing.flap_max_failovers = 1001; want at most 1000, 50 s of frames at 20 Hz"),
    # factor ** 64 overflowed a float (OverflowError) at the 65th retry
    ("[timing]\nbackoff_factor = 1e10\n", "timing.backoff_factor = 10000000000.0; want at most 10"),
    ("[timing]\nagreement_tol = 2\n",
     "timing.agreement_tol = 2.0; want at most 1: it takes any two outputs of one sign as agreeing"),
])
def test_a_value_over_its_upper_bound_is_refused_naming_the_bound(tmp_path, toml, message):
    assert _refusal(tmp_path, toml) == f"config: {message}"


def test_every_upper_bound_is_accepted(tmp_path):
    from chestnut.node.config import load_config

    path = tmp_path / "node.toml"
    path.write_text("[dock]\nwait_timeout_ms = 60000\n[timing]\nhost_window_ms = 60000\nmax_frame_age_ms = 60000\n"
                    "stable_after_s = 2592000\nflap_window_s = 2592000\nhealth_hz = 100\nshadow_frames = 1000\n"
                    "backoff_factor = 10\nbackoff_max_s = 2592000\nagreement_tol = 1\n")
    t = load_config(path).timing
    assert (t.host_window_ms, t.stable_after_s, t.health_hz, t.shadow_frames, t.backoff_factor) == (
        60000.0, 2592000.0, 100.0, 1000, 10.0)


def test_fallback_threads_are_at_most_the_cpus_this_process_may_run_on(tmp_path):
    """``threads = 100000`` was taken: onnxruntime made 32000 threads and 16 GB, and the node ignored SIGINT."""
    import os

    from chestnut.node.config import cpu_count, load_config

    ncpu = len(os.sched_getaffinity(0))
    assert cpu_count() == ncpu
    want = (f"want 0..{ncpu} (onnxruntime's intra-op threads, at most the {ncpu} CPUs this process may run on; 0: "
            "onnxruntime's default, one per physical core)")
    assert _refusal(tmp_path, "[fallback]\nthreads = 100000\n") == f"config: fallback.threads = 100000; {want}"
    assert _refusal(tmp_path, f"[fallback]\nthreads = {ncpu + 1}\n") == f"config: fallback.threads = {ncpu + 1}; {want}"
    assert _refusal(tmp_path, "[fallback]\nthreads = -2\n") == f"config: fallback.threads = -2; {want}"
    path = tmp_path / "ok.toml"
    path.write_text(f"[fallback]\nthreads = {ncpu}\n")
    assert load_config(path).fallback.threads == ncpu


def test_a_wait_timeout_flag_over_its_bound_is_refused_naming_its_key(tmp_path):
    import argparse

    from chestnut.node.config import add_arguments, from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    path = tmp_path / "node.toml"
    path.write_text("")
    with pytest.raises(ConfigError) as e:
        from_args(p.parse_args(["--config", str(path), "--wait-timeout-ms", "1e30"]))
    assert str(e.value) == "config: dock.wait_timeout_ms = 1e+30; want at most 60000 ms, a minute"


def _read_refusal(path) -> str:
    from chestnut.node.config import load_config

    with pytest.raises(ConfigError) as e:
        load_config(path)
    return str(e.value)


def test_a_config_path_that_is_no_regular_file_is_refused_without_waiting(tmp_path):
    """A FIFO is opened without waiting for a writer (it would wait forever), a directory is named as one."""
    import os

    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    assert _read_refusal(fifo) == f"config: cannot read {fifo}: a FIFO, not a regular file"
    assert _read_refusal(tmp_path) == f"config: cannot read {tmp_path}: a directory, not a regular file"
    missing = tmp_path / "missing.toml"
    assert _read_refusal(missing) == f"config: cannot read {missing}: [Errno 2] No such file or directory: '{missing}'"


def test_a_config_over_its_size_bound_is_refused_not_read_whole(tmp_path):
    from chestnut.node.config import CONFIG_MAX_BYTES, load_config

    path = tmp_path / "node.toml"
    with open(path, "wb") as f:
        f.truncate(1 << 30)  # sparse: a GiB on paper, nothing on disk
    assert _read_refusal(path) == f"config: cannot read {path}: over the 1048576 bytes a node configuration may have"
    path.write_text("# padding\n" * (CONFIG_MAX_BYTES // 10) + "#" * (CONFIG_MAX_BYTES % 10))  # exactly the bound
    assert path.stat().st_size == CONFIG_MAX_BYTES and load_config(path).fallback.threads == 1


def test_a_config_that_is_not_utf8_is_one_line_and_exit_2(tmp_path):
    """``chestnut run`` printed a UnicodeDecodeError traceback and exited 1; ``chestnut launch --node-config``
    already refused the same file in one line (``launch/frames.py`` ``read_node_toml``)."""
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path / "node.toml"
    path.write_bytes(b"\xff\xfe")
    why = "'utf-8' codec can't decode byte 0xff in position 0: invalid start byte"
    assert _read_refusal(path) == f"config: {path} is not valid TOML: {why}"
    chestnut = str(Path(sys.executable).with_name("chestnut"))
    r = subprocess.run([chestnut, "run", "--dock", "none", "--config", str(path)], capture_output=True, text=True,
                       timeout=120)
    lines = r.stderr.splitlines()
    assert (r.returncode, len(lines)) == (2, 1), r.stderr
    assert lines[0].split(" ", 2)[2] == f"ERROR chestnut.node: unusable configuration: config: {path} is not valid " \
                                        f"TOML: {why}"


def test_a_config_others_can_change_is_refused_as_a_model_file_is(tmp_path):
    """A 0666 ``--config`` file, or one in a folder anyone may write, was read: it names the model the node runs,
    so another user could choose it (``backend/model.py`` ``untrusted_file``, the model file's rule)."""
    from chestnut.node.config import load_config

    folder = tmp_path.resolve() / "cfg"
    folder.mkdir(mode=0o755)
    path = folder / "node.toml"
    path.write_text("[fallback]\nthreads = 1\n")
    path.chmod(0o666)
    assert _read_refusal(path) == (
        f"config: node configuration file {path} is writable by group or other (mode 0666): another user could "
        f"change what the node computes (chmod go-w {path})"
    )
    path.chmod(0o644)  # a git checkout's launch/node.toml
    assert load_config(path).fallback.threads == 1
    folder.chmod(0o777)
    assert _read_refusal(path) == (
        f"config: node configuration folder {folder} is writable by group or other (mode 0777): another user "
        f"could change what the node computes (chmod go-w {folder})"
    )
    folder.chmod(0o1777)  # sticky, like /tmp: others cannot replace our file in it
    assert load_config(path).fallback.threads == 1


@pytest.mark.skipif(os.getuid() != 0, reason="a file of another user needs root to make")
def test_a_config_of_another_user_is_refused_and_one_of_root_is_not(tmp_path, monkeypatch):
    from chestnut.node.config import load_config

    folder = tmp_path.resolve() / "cfg"
    folder.mkdir(mode=0o755)
    path = folder / "node.toml"
    path.write_text("[fallback]\nthreads = 1\n")
    os.chown(path, 65534, 65534)
    assert _read_refusal(path) == (
        f"config: node configuration file {path} is owned by uid 65534, not by root: another user could "
        "change what the node computes (copy it to a folder you own)"
    )
    os.chown(path, 0, 0)
    os.chown(folder, 65534, 65534)
    assert _read_refusal(path) == (
        f"config: node configuration folder {folder} is owned by uid 65534, not by root: another user "
        "could change what the node computes (copy it to a folder you own)"
    )
    os.chown(folder, 0, 0)
    monkeypatch.setattr(os, "getuid", lambda: 4242)  # a service user reading root's 0644 /etc/chestnut/node.toml
    assert load_config(path).fallback.threads == 1
    os.chown(path, 65534, 65534)  # for a user other than root, the line names both owners it would take
    assert _read_refusal(path) == (
        f"config: node configuration file {path} is owned by uid 65534, not by uid 4242 or root: another user "
        "could change what the node computes (copy it to a folder you own)"
    )


@pytest.mark.skipif(os.getuid() != 0, reason="a file of another user needs root to make")
def test_a_config_reached_through_a_symlink_names_the_file_it_leads_to(tmp_path):
    """``--config link.toml``, a link of ours to another user's file, said ``link.toml is owned by uid 65534``: the
    link is ours; the file it leads to is named."""
    folder = tmp_path.resolve() / "cfg"
    folder.mkdir(mode=0o755)
    target = folder / "theirs.toml"
    target.write_text("[fallback]\nthreads = 1\n")
    os.chown(target, 65534, 65534)
    link = folder / "link.toml"
    link.symlink_to(target)
    assert _read_refusal(link) == (
        f"config: node configuration file {link} -> {target} is owned by uid 65534, not by root: another user could "
        "change what the node computes (copy it to a folder you own)"
    )


def test_a_config_reached_through_a_symlink_that_others_can_change_names_the_file_it_leads_to(tmp_path):
    folder = tmp_path.resolve() / "cfg"
    folder.mkdir(mode=0o755)
    target = folder / "theirs.toml"
    target.write_text("[fallback]\nthreads = 1\n")
    target.chmod(0o666)
    link = folder / "link.toml"
    link.symlink_to(target)
    assert _read_refusal(link) == (
        f"config: node configuration file {link} -> {target} is writable by group or other (mode 0666): another "
        f"user could change what the node computes (chmod go-w {target})"
    )


def test_chestnut_run_refuses_a_config_others_can_change_in_one_line_and_exit_2(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    path = tmp_path.resolve() / "node.toml"
    path.write_text("")
    path.chmod(0o646)
    chestnut = str(Path(sys.executable).with_name("chestnut"))
    r = subprocess.run([chestnut, "run", "--dock", "none", "--config", str(path)], capture_output=True, text=True,
                       timeout=120)
    lines = r.stderr.splitlines()
    assert (r.returncode, len(lines)) == (2, 1), r.stderr
    assert lines[0].split(" ", 2)[2] == (
        f"ERROR chestnut.node: unusable configuration: config: node configuration file {path} is writable by group "
        f"or other (mode 0646): another user could change what the node computes (chmod go-w {path})"
    )
