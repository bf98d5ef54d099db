import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tinymodel import make_tiny_onnx  # noqa: E402


@pytest.fixture(scope="session")
def tiny_onnx(tmp_path_factory) -> Path:
    """A small real ONNX model: x float32[1,3,32,64] -> prob float32[1,1,16,32]."""
    return make_tiny_onnx(tmp_path_factory.mktemp("models") / "tiny.onnx")


@pytest.fixture(autouse=True)
def private_prefix(monkeypatch, request):
    """Every test runs its stack under its own runtime prefix so parallel stacks never collide."""
    import hashlib
    import os
    import shutil

    from chestnut.msgs.paths import runtime_dir

    tag = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:10]
    prefix = f"t{os.getpid()}-{tag}"
    monkeypatch.setenv("CHESTNUT_PREFIX", prefix)
    yield
    shutil.rmtree(runtime_dir(prefix), ignore_errors=True)  # the test's sockets go with it
