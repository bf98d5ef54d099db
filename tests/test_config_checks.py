"""``node/config.py`` ``validate``: a configuration that can never run is refused when it loads, in one line
naming the key, rather than failing frame by frame or as an allocation at start."""

from __future__ import annotations

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
    ("[fallback]\nthreads = -2\n", "fallback.threads = -2; want >= 0 (onnxruntime's intra-op threads; 0: "
                                   "onnxruntime's default, one per physical core)"),
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
