"""A fingerprint file is read by one bounded reader (``backend/fingerprint.py`` ``read_fingerprint_file``), the node's
(``node/contract.py`` ``read_fingerprint``, ``check_fallback``) and ``chestnut model prepare``'s (``launch/assets.py``
``prepared_damage``) alike: a regular file of at most ``FINGERPRINT_MAX_BYTES`` (1 MiB), refused on its size before it
is read, never through a symlink, never a FIFO opened; each refusal is one line.

The node read it whole (``Path.read_text``): a sparse 1 GiB file planted there took 10 s and 2 GB of memory before it
said "Expecting value"; a symlink was followed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from nodeharness import write_node_config
from tinymodel import make_tiny_onnx

from chestnut.backend.errors import ConfigError
from chestnut.backend.fingerprint import FINGERPRINT_MAX_BYTES, FingerprintFileError, read_fingerprint_file
from chestnut.fallback.standby import FallbackModel
from chestnut.launch.assets import file_sha256, prepared_damage
from chestnut.node.config import load_config
from chestnut.node.contract import check_fallback, declare_contract, read_fingerprint

BIG = 64 * FINGERPRINT_MAX_BYTES  # 64 MiB, sparse: what a whole read would cost shows in /proc/self/io


def bytes_read() -> int:
    """This process's bytes read so far by read(2) and its kin (``rchar``, proc(5))."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that holds none (``truncate``)."""
    with open(path, "wb") as f:
        f.truncate(size)
    return path


def test_the_bound_is_one_mib():
    assert FINGERPRINT_MAX_BYTES == 1 << 20


def test_an_oversized_sparse_fingerprint_is_refused_by_the_node_without_reading_it(tmp_path):
    fp = sparse(tmp_path / "m.fingerprint.json", BIG)
    before = bytes_read()
    with pytest.raises(ConfigError) as e:
        read_fingerprint(fp)
    read = bytes_read() - before
    assert str(e.value) == (f"fingerprint: {fp} is unreadable: it is 67108864 bytes, over the 1048576 a fingerprint "
                            "may hold")
    assert read < FINGERPRINT_MAX_BYTES, f"{read} bytes read"  # the old reader read all 67108864


def test_the_bound_itself_is_read_and_one_byte_more_is_refused(tmp_path):
    body = b'{"seed": 1}'
    exact = tmp_path / "exact.fingerprint.json"
    exact.write_bytes(body + b" " * (FINGERPRINT_MAX_BYTES - len(body)))
    assert os.path.getsize(exact) == 1048576
    assert read_fingerprint(exact) == {"seed": 1}
    over = tmp_path / "over.fingerprint.json"
    over.write_bytes(body + b" " * (FINGERPRINT_MAX_BYTES + 1 - len(body)))
    with pytest.raises(FingerprintFileError) as e:
        read_fingerprint_file(over)
    assert (e.value.reason, e.value.problem) == ("too_big", "is 1048577 bytes, over the 1048576 a fingerprint may hold")


def test_a_planted_symlink_is_refused_in_one_line_and_not_followed(tmp_path):
    target = tmp_path / "elsewhere.json"
    target.write_text('{"seed": 1}')
    fp = tmp_path / "m.fingerprint.json"
    fp.symlink_to(target)
    with pytest.raises(ConfigError) as e:
        read_fingerprint(fp)
    assert str(e.value) == f"fingerprint: {fp} is unreadable: it is a symlink, not a regular file"
    assert fp.is_symlink() and target.read_text() == '{"seed": 1}'


def test_a_fifo_is_refused_without_being_opened(tmp_path):
    fp = tmp_path / "m.fingerprint.json"
    os.mkfifo(fp)  # opening it for reading would wait for a writer for good
    with pytest.raises(ConfigError) as e:
        read_fingerprint(fp)
    assert str(e.value) == f"fingerprint: {fp} is unreadable: it is a FIFO, not a regular file"


@pytest.mark.parametrize(
    ("content", "reason", "problem"),
    [
        (b"\xff{", "not_json", "does not read as JSON"),
        (b"[1, 2]", "not_object", "is not a JSON object"),
    ],
)
def test_what_is_not_a_fingerprint_object_is_one_line(tmp_path, content, reason, problem):
    fp = tmp_path / "m.fingerprint.json"
    fp.write_bytes(content)
    with pytest.raises(FingerprintFileError) as e:
        read_fingerprint_file(fp)
    assert (e.value.reason, e.value.problem, str(e.value)) == (reason, problem, f"{fp} {problem}")
    with pytest.raises(ConfigError) as c:
        read_fingerprint(fp)
    assert c.value.detail == f"{fp} is unreadable: it {problem}"


def test_no_fingerprint_is_none_for_the_node(tmp_path):
    assert read_fingerprint(tmp_path / "none.fingerprint.json") is None
    with pytest.raises(FingerprintFileError) as e:
        read_fingerprint_file(tmp_path / "none.fingerprint.json")
    assert (e.value.reason, e.value.problem) == ("missing", "cannot be read (No such file or directory)")


def test_model_prepare_reads_the_fingerprint_with_the_same_reader(tiny_onnx, tmp_path):
    out = tmp_path / "tiny.onnx"
    shutil.copyfile(tiny_onnx, out)
    meta = {"sha256": file_sha256(out)}
    fp = sparse(out.with_suffix(".fingerprint.json"), BIG)
    before = bytes_read()
    damage = prepared_damage(out, meta)
    assert bytes_read() - before < FINGERPRINT_MAX_BYTES + 2 * out.stat().st_size  # the model twice, not the 64 MiB
    assert damage == "its fingerprint tiny.fingerprint.json is 67108864 bytes, over the 1048576 a fingerprint may hold"
    fp.unlink()
    fp.symlink_to(tmp_path / "anything.json")
    assert prepared_damage(out, meta) == "its fingerprint tiny.fingerprint.json is a symlink, not a regular file"


def test_a_separate_fallbacks_oversized_fingerprint_refuses_it_in_one_line(tiny_onnx, tmp_path):
    cfg = load_config(write_node_config(tmp_path / "node.toml", tiny_onnx, dock="none"))
    contract = declare_contract(cfg, None)
    other = make_tiny_onnx(tmp_path / "other.onnx", seed=1)  # the contract's shapes, other bytes
    fp = sparse(other.with_suffix(".fingerprint.json"), BIG)
    fallback = FallbackModel(other, input_shapes={"x": (1, 3, 32, 64)})
    assert check_fallback(contract, fallback, other) == (
        f"fallback model {other} refused: its fingerprint {fp} is unreadable: it is 67108864 bytes, over the "
        "1048576 a fingerprint may hold", "")
