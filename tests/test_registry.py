import os
import stat

import pytest

from chestnut.msgs import paths
from chestnut.msgs.schema import log
from chestnut.msgs.services import SERVICE_LIST, UnknownServiceError, get_service


def test_every_service_is_an_event_union_member():
    members = set(log.Event.schema.union_fields)
    assert set(SERVICE_LIST) <= members
    assert members - set(SERVICE_LIST) == set()


def test_unknown_service_is_a_clear_error():
    with pytest.raises(UnknownServiceError, match="unknown service 'modelV2'; known services: cameraFrame"):
        get_service("modelV2")


def test_runtime_dir_is_private_and_per_prefix(run_base):
    a, b = paths.runtime_dir("a"), paths.runtime_dir("b")
    assert a != b and a.parent == b.parent == run_base / f"chestnut-{os.getuid()}"
    assert stat.S_IMODE(a.stat().st_mode) == 0o700
    with pytest.raises(ValueError, match="prefix '../x'"):
        paths.runtime_dir("../x")
