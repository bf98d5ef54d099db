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
