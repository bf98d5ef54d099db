"""The shared-memory frame ring (``msgs/visionipc.py``): lap detection, late and restarting
subscribers, clean-up when the camera dies, and refusal of buffers and peers of another user."""

from __future__ import annotations

import fcntl
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from chestnut.msgs.frames import fill_frame, frame_to_array
from chestnut.msgs.messaging import MalformedMessageError, log_from_bytes, recv_one, sub_sock
from chestnut.msgs.paths import runtime_dir
from chestnut.msgs.visionipc import (
    HELLO_VERSION,
    NOTICE_BYTES,
    SOCKET_NAME,
    FrameBufferError,
    FrameOverwrittenError,
    FrameReader,
    FrameRing,
    FrameSubscriber,
    RingFrame,
    buffer_problem,
    inline_event,
    notice_pipe_problem,
    socket_path,
    streaming_copy_tunables,
)

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def _frame(ring: FrameRing, pixels: np.ndarray, frame_id: int = 0) -> object:
    """A ring cameraFrame (as received: a reader) for uint8 [H, W, 3] pixels written into ``ring``."""
    index, seq = ring.write(pixels)
    msg = fill_frame(frame_id, pixels[:0], 1, 2, "test")
    cf = msg.cameraFrame
    cf.height, cf.width = pixels.shape[:2]
    ring.fill(cf, index, seq, pixels.nbytes)
    return log_from_bytes(msg.to_bytes())


def _memfd_maps() -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if "memfd:chestnut-frames" in line]


def _memfd_fds() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "memfd:chestnut-frames" in target:
            out.append(target)
    return out


CAMERA_SCRIPT = r"""
import sys, numpy as np
from chestnut.msgs.visionipc import FrameRing
ring = FrameRing(4096, slots=2)
sys.stdout.write(f"{ring.session}\n"); sys.stdout.flush()
seq = 0
for line in sys.stdin:
    cmd, n = line.split()
    for _ in range(int(n)):
        seq += 1
        ring.write(np.full(4096, seq & 0xFF, np.uint8))
    sys.stdout.write(f"{seq}\n"); sys.stdout.flush()
    if cmd == "spin":  # write as fast as possible until killed
        while True:
            seq += 1
            ring.write(np.full(4096, seq & 0xFF, np.uint8))
"""


def _camera_process() -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([PY, "-c", CAMERA_SCRIPT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


def _ask(p: subprocess.Popen[str], cmd: str, n: int) -> int:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(f"{cmd} {n}\n")
    p.stdin.flush()
    return int(p.stdout.readline())


class _Buf:
    def __init__(self, session: int, index: int, seq: int, size: int) -> None:
        self.session, self.index, self.seq, self.size = session, index, seq, size


def test_slow_reader_lapped_by_a_camera_process_gets_overwritten_never_torn_data():
    cam, session = _camera_process()
    try:
        seq = _ask(cam, "write", 1)
        sub = FrameSubscriber()
        buf = _Buf(session, 0, seq, 4096)
        view = sub.view(buf)
        assert view[0] == 1 and int(view.sum()) == 4096
        sub.verify(buf)  # nothing happened yet: the frame is intact
        _ask(cam, "write", 2)  # the camera laps the 2-slot ring while the reader holds the view
        with pytest.raises(FrameOverwrittenError) as e:
            sub.verify(buf)
        assert str(e.value) == (
            "frame seq 1: slot 0 was overwritten (now frame 3, done); the reader fell more than 1 frames behind "
            "the camera"
        )
        with pytest.raises(FrameOverwrittenError):  # and a later read of that frame is refused up front
            sub.view(buf)
        assert sub.overwritten == 2
        del view
        # a camera writing flat out: every read either passes the seqlock check with a whole frame or is refused
        last = _ask(cam, "spin", 0)
        passed = refused = 0
        for i in range(2000):
            seq = last + 1 + i
            b = _Buf(session, (seq - 1) % 2, seq, 4096)
            try:
                v = sub.view(b)
                copy = v.copy()
                sub.verify(b)
            except FrameOverwrittenError:
                refused += 1
                continue
            passed += 1
            assert (copy == (seq & 0xFF)).all(), f"frame {seq} passed the check with torn pixels"
        assert passed + refused == 2000
        sub.close()
    finally:
        cam.kill()
        cam.wait()


def test_a_slot_being_written_is_refused():
    with FrameRing(64, slots=2) as ring:
        ev = _frame(ring, np.full((4, 4, 3), 9, np.uint8))
        reader = FrameReader()
        img = reader.view(ev.cameraFrame)
        ring._words[0] = 2 * 2 - 1  # what FrameRing.write stores first for frame 2 in slot 0: odd, being written
        with pytest.raises(FrameOverwrittenError, match=r"^frame seq 1: slot 0 was overwritten \(now frame 2, being "):
            reader.verify(ev.cameraFrame)
        del img
        reader.close()


def test_late_subscriber_restarting_subscriber_and_restarted_camera():
    ring = FrameRing(48, slots=4)
    frames = [_frame(ring, np.full((4, 4, 3), k, np.uint8), k) for k in range(10)]
    late = FrameReader()  # starts after ten frames: maps the ring once, reads the newest ones
    assert (late.read(frames[9].cameraFrame) == 9).all()
    assert (late.read(frames[7].cameraFrame) == 7).all()
    with pytest.raises(FrameOverwrittenError, match=r"^frame seq 6: slot 1 was overwritten \(now frame 10, done\)"):
        late.read(frames[5].cameraFrame)
    assert late.shm.maps == 1
    late.close()  # a subscriber that restarts maps again
    again = FrameReader()
    assert (again.read(frames[9].cameraFrame) == 9).all()
    assert again.shm.maps == 1 and ring.subscribers == 1  # the restarted subscriber replaced the old one
    ring.close()
    ring2 = FrameRing(48, slots=4)  # the camera restarted: a new session, the subscriber maps the new ring
    assert ring2.session != ring.session
    new = _frame(ring2, np.full((4, 4, 3), 42, np.uint8))
    assert (again.read(new.cameraFrame) == 42).all()
    assert again.shm.maps == 2
    with pytest.raises(FrameOverwrittenError, match="a frame of a previous camera"):
        again.read(frames[9].cameraFrame)
    again.close()
    ring2.close()


def test_buffers_cleaned_up_when_the_camera_dies():
    cam, session = _camera_process()
    try:
        seq = _ask(cam, "write", 1)
        before, fds_before = set(_memfd_maps()), len(_memfd_fds())  # other tests' rings may linger until collected
        sub = FrameSubscriber()
        assert (sub.view(_Buf(session, 0, seq, 4096)) == 1).all()
        mapped = set(_memfd_maps()) - before
        assert len(mapped) == 1 and len(_memfd_fds()) == fds_before + 1  # mapped once; mmap's own descriptor
        assert not sub.camera_gone()
        cam.send_signal(signal.SIGKILL)
        cam.wait()
        for _ in range(100):
            if sub.camera_gone():
                break
            time.sleep(0.01)
        assert sub.ring is None
        assert not mapped & set(_memfd_maps())  # unmapped, the last reference: the kernel frees the ring
        assert len(_memfd_fds()) == fds_before
        assert os.listdir(runtime_dir()) == [SOCKET_NAME]  # only the dead camera's socket, no buffer file
        with FrameRing(4096) as ring:  # a new camera replaces the stale socket
            assert ring.subscribers == 0
        assert os.listdir(runtime_dir()) == []  # a camera that stops removes its socket
    finally:
        cam.kill()
        cam.wait()


def test_a_second_live_camera_on_the_prefix_is_refused():
    with FrameRing(64) as ring:
        with pytest.raises(FrameBufferError) as e:
            FrameRing(64)
        assert str(e.value) == (
            f"frame socket {ring.path}: another camera serves this prefix; stop it or choose another CHESTNUT_PREFIX"
        )


def _serve_once(lst: socket.socket, fd: int, notice_fd: int | None, version: object, pipe: bool,
                extra: bool = False) -> None:
    import json

    srv, _ = lst.accept()
    hello = {"version": version, "session": 5, "slots": 2, "stride": 4096, "frame_bytes": 4096 - 64, "size": 8192}
    read_end, write_end = os.pipe2(os.O_CLOEXEC | os.O_DIRECT)  # a camera's notice pipe
    try:
        fds = ([fd, read_end if notice_fd is None else notice_fd] if pipe else [fd]) + ([fd] if extra else [])
        socket.send_fds(srv, [json.dumps(hello).encode()], fds)
    finally:
        os.close(read_end)
        os.close(write_end)
    srv.close()


def _refusal(fd: int, notice_fd: int | None = None, version: object = HELLO_VERSION, pipe: bool = True,
             extra: bool = False) -> str:
    """What a subscriber says when a camera of ours hands over ``fd`` as its ring and ``notice_fd`` as the read end
    of its notice pipe (default: a packet-mode pipe of ours, as a camera's; ``pipe`` False: the ring alone, as a
    camera of hello version 3 did; ``extra``: a third descriptor too), with ``version`` in its hello."""
    import threading

    lst = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    lst.bind(socket_path())
    lst.listen(1)
    t = threading.Thread(target=_serve_once, args=(lst, fd, notice_fd, version, pipe, extra))
    t.start()
    try:
        with pytest.raises(FrameBufferError) as e:
            FrameSubscriber().view(_Buf(5, 0, 1, 1))
        return str(e.value)
    finally:
        t.join(5)
        lst.close()
        os.unlink(socket_path())


def test_a_frame_buffer_of_another_user_is_refused():
    size = 8192
    with tempfile.TemporaryFile(dir=runtime_dir()) as f:  # unlinked, like a memfd, but owned by another user
        f.truncate(size)
        os.fchown(f.fileno(), 65534, 65534)
        os.fchmod(f.fileno(), 0o600)
        fd = os.dup(f.fileno())
    # the fake camera's listener is ours, so the hand-over's own check applies: the descriptor's owner
    msg = None
    try:
        msg = _refusal(fd)
    finally:
        os.close(fd)
    assert msg == (
        f"frame buffer from {socket_path()} belongs to uid 65534, not to uid {os.getuid()}: refused; only a camera "
        f"of uid {os.getuid()} may serve frames here"
    )
    # ours but not sealed against resizing (it could be truncated under a reader: SIGBUS)
    fd = os.memfd_create("chestnut-frames", os.MFD_CLOEXEC)
    os.fchmod(fd, 0o600)
    os.ftruncate(fd, size)
    try:
        msg = _refusal(fd)
    finally:
        os.close(fd)
    assert msg.endswith(
        "is not sealed against resizing (F_SEAL_SHRINK | F_SEAL_GROW): refused; only a camera of "
        f"uid {os.getuid()} may serve frames here"
    )


def test_a_camera_of_another_hello_version_is_named_by_its_version_before_its_descriptors_are_counted():
    """A camera of hello version 3 sends its ring alone (its notices came on the socket): the subscriber said "the
    camera sent 1 descriptors, not 2", which names a symptom; the version is checked first and named."""
    assert HELLO_VERSION == 4
    fd = os.memfd_create("chestnut-frames", os.MFD_CLOEXEC)
    try:
        older = _refusal(fd, version=3, pipe=False)
        newer = _refusal(fd, version=5)  # the count is right, the version is not
        text = _refusal(fd, version="4")
        one = _refusal(fd, pipe=False)  # this version, one descriptor short: the count, in the singular
        three = _refusal(fd, extra=True)  # one too many: the kernel drops it (MSG_CTRUNC), the hello is refused
    finally:
        os.close(fd)
    path = socket_path()
    fix = "the camera and this subscriber run different chestnut versions; restart both from one install"
    assert older == f"frame socket {path}: camera hello version 3, want 4: {fix}"
    assert newer == f"frame socket {path}: camera hello version 5, want 4: {fix}"
    assert text == f"frame socket {path}: camera hello version '4', want 4: {fix}"
    assert one == (
        f"frame socket {path}: the camera sent 1 descriptor, not 2 (its ring and a notice pipe); restart the camera"
    )
    assert three == (f"frame socket {path}: the camera sent more than 2 descriptors (its ring and a notice pipe); "
                     "refused; restart the camera")


def test_buffer_problem_names_every_rule():
    fd = os.memfd_create("chestnut-frames", os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, 8192)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        st, seals, uid = os.fstat(fd), fcntl.fcntl(fd, fcntl.F_GET_SEALS), os.getuid()
        assert buffer_problem(st, seals, uid, 8192) is None
        assert buffer_problem(st, seals, uid, 4096) == "holds 8192 bytes, the camera announced 4096"
        assert buffer_problem(st, seals, uid + 1, 8192) == f"belongs to uid {uid}, not to uid {uid + 1}"
        os.fchmod(fd, 0o640)
        assert buffer_problem(os.fstat(fd), seals, uid, 8192) == "is reachable by group/other (mode 0640)"
    finally:
        os.close(fd)
    with tempfile.NamedTemporaryFile(dir=runtime_dir()) as f:
        os.fchmod(f.fileno(), 0o600)
        st = os.fstat(f.fileno())
        assert buffer_problem(st, 0, os.getuid(), 0) == "is a file with a name (a ring is an unlinked memfd)"


def test_notice_pipe_problem_names_every_rule_and_a_non_pipe_is_refused():
    read_end, write_end = os.pipe()
    try:
        st, uid = os.fstat(read_end), os.getuid()
        assert stat.S_IMODE(st.st_mode) == 0o600  # a pipe's inode is born private to its creator
        assert notice_pipe_problem(st, uid) is None
        assert notice_pipe_problem(st, uid + 1) == f"belongs to uid {uid}, not to uid {uid + 1}"
        os.fchmod(read_end, 0o620)
        assert notice_pipe_problem(os.fstat(read_end), uid) == "is reachable by group/other (mode 0620)"
    finally:
        os.close(read_end)
        os.close(write_end)
    ring_fd = os.memfd_create("chestnut-frames", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    other = os.memfd_create("chestnut-frames", os.MFD_CLOEXEC)
    try:
        os.fchmod(ring_fd, 0o600)
        os.ftruncate(ring_fd, 8192)
        fcntl.fcntl(ring_fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        msg = _refusal(ring_fd, notice_fd=other)  # a sound ring, but a file where the notice pipe belongs
    finally:
        os.close(ring_fd)
        os.close(other)
    assert msg == (
        f"notice pipe from {socket_path()} is not a pipe: refused; only a camera of uid {os.getuid()} may serve "
        "frames here"
    )


def test_write_copies_any_frames_bytes_in_c_order_and_refuses_one_too_big():
    img = np.arange(4 * 8 * 3, dtype=np.uint8).reshape(4, 8, 3)
    wide = np.arange(48, dtype=np.uint16)  # 1-D, items of two bytes: copied as its bytes
    frames = [img, img.reshape(-1), img[:, ::-1], img.reshape(-1)[::-1], wide, img.tobytes()[::-1],
              memoryview(img.tobytes())]
    with FrameRing(img.nbytes, slots=len(frames)) as ring:
        for pixels in frames:
            index, seq = ring.write(pixels)
            start = index * ring.stride + 64
            want = np.ascontiguousarray(pixels).tobytes() if isinstance(pixels, np.ndarray) else bytes(pixels)
            assert bytes(ring.map[start:start + len(want)]) == want
            assert ring._words[index * ring.stride // 8] == 2 * seq  # done: holds frame seq
        with pytest.raises(ValueError, match="frame of 97 bytes does not fit the ring's 96-byte slots"):
            ring.write(np.zeros(97, np.uint8))
        assert ring.seq == len(frames)  # refused before the slot was touched


def test_a_subscriber_of_another_uid_is_refused_by_the_camera_and_cannot_reach_the_socket():
    with FrameRing(64, allowed_uid=os.getuid() + 1000) as ring:  # serves another uid only: we are the stranger
        with pytest.raises(FrameBufferError) as e:
            FrameSubscriber().view(_Buf(ring.session, 0, 1, 1))
        assert str(e.value) == (
            f"frame socket {ring.path}: the camera closed the connection without handing over its ring (it serves "
            f"only its own uid; this subscriber is uid {os.getuid()})"
        )
        assert ring.refused == 1 and ring.subscribers == 0
    with FrameRing(64) as ring:  # a real process of another user: the 0700 runtime directory keeps it out
        assert os.stat(ring.path).st_mode & 0o777 == 0o600
        if os.getuid() != 0:
            pytest.skip("needs root to run a process as another user")
        code = f"import socket; s = socket.socket(socket.AF_UNIX); s.connect({ring.path!r})"
        r = subprocess.run(["/usr/bin/python3", "-c", code], user=65534, capture_output=True, text=True, cwd="/")
        assert r.returncode == 1 and r.stderr.strip().endswith("PermissionError: [Errno 13] Permission denied")
        assert ring.subscribers == 0


def test_reader_takes_both_kinds_and_the_logger_inlines_ring_frames():
    img = np.arange(6 * 8 * 3, dtype=np.uint8).reshape(6, 8, 3)
    inline = log_from_bytes(fill_frame(3, img, 1, 2, "test").to_bytes())
    reader = FrameReader()
    assert not reader.in_ring(inline.cameraFrame)
    seen = reader.view(inline.cameraFrame)  # over the bytes pycapnp read out: no copy of ours, read-only
    assert seen.shape == (6, 8, 3) and not seen.flags.writeable and not seen.flags.owndata and (seen == img).all()
    copied = reader.read(inline.cameraFrame)
    assert copied.flags.writeable and copied.flags.owndata and (copied == img).all()
    assert frame_to_array(inline.cameraFrame).flags.writeable
    assert inline_event(inline, reader) == inline.as_builder().to_bytes()
    with FrameRing(img.nbytes) as ring:
        ev = _frame(ring, img, 4)
        assert reader.in_ring(ev.cameraFrame) and len(ev.cameraFrame.data) == 0
        with pytest.raises(ValueError) as e:
            frame_to_array(ev.cameraFrame)
        assert str(e.value) == (
            "cameraFrame 4: its pixels were in the camera's shared-memory ring, not in the message (read it live "
            "with msgs/visionipc.py FrameReader; chestnut record logs the pixels inline)"
        )
        view = reader.view(ev.cameraFrame)
        assert view.shape == (6, 8, 3) and not view.flags.writeable and (view == img).all()
        del view
        logged = log_from_bytes(inline_event(ev, reader))
        cf = logged.cameraFrame
        assert (frame_to_array(cf) == img).all()
        assert (cf.buffer.seq, cf.buffer.index, cf.buffer.session) == (1, 0, ring.session)
        assert logged.logMonoTime == ev.logMonoTime
    reader.close()


def test_camera_publishes_native_frames_through_the_ring(tmp_path):
    """``chestnut camera --transport shm``: metadata on the bus, pixels identical to the decoded source."""
    from chestnut.launch.camerad import iter_frames

    src = tmp_path / "frames"
    src.mkdir()
    rng = np.random.default_rng(0)
    import av

    for k in range(3):
        frame = av.VideoFrame.from_ndarray(rng.integers(0, 255, (48, 64, 3), dtype=np.uint8), format="bgr24")
        frame.to_image().save(src / f"{k}.png")
    want = list(iter_frames(src, 48, 64, loop=False))
    sock = sub_sock("cameraFrame", timeout_ms=5000)
    cam = subprocess.Popen(
        [
            str(ROOT / ".venv/bin/chestnut"),
            "camera",
            "--source",
            str(src),
            "--transport",
            "shm",
            "--height",
            "48",
            "--width",
            "64",
            "--frames",
            "3",
            "--no-loop",
            "--start-delay",
            "0.5",
            "--rate",
            "5",
        ],
        cwd=ROOT,
    )
    reader = FrameReader()
    try:
        got = []
        for _ in range(3):
            ev = recv_one(sock)
            assert ev is not None
            cf = ev.cameraFrame
            assert len(cf.data) == 0 and cf.buffer.size == 48 * 64 * 3
            got.append((int(cf.frameId), reader.read(cf)))
        assert [fid for fid, _ in got] == [0, 1, 2]
        for (_, img), ref in zip(got, want, strict=True):
            assert (img == ref).all()
        assert cam.wait(10) == 0
    finally:
        cam.kill()
        sock.close(linger=0)
        reader.close()
    assert not Path(socket_path()).exists()  # the camera removed its socket at its stop


def test_the_logger_records_ring_frames_with_their_pixels(tmp_path):
    """``chestnut record`` subscribed to a ring camera: the log holds every frame's pixels and its buffer."""
    from chestnut.msgs.logfile import LogReader, RouteWriter
    from chestnut.msgs.logger import Recorder
    from chestnut.msgs.messaging import PubMaster

    imgs = [np.full((16, 32, 3), 10 * k, np.uint8) for k in range(5)]
    with FrameRing(imgs[0].nbytes, slots=8) as ring, PubMaster(["cameraFrame"]) as pm:
        with RouteWriter(tmp_path, formats=["zst"]) as w:
            rec = Recorder(w, ["cameraFrame"])
            try:
                time.sleep(0.3)  # the logger's connection is up before the first frame (a PUB drops until then)
                for k, img in enumerate(imgs):
                    index, seq = ring.write(img)
                    msg = fill_frame(k, img[:0], 1 + k, 2 + k, "test")
                    msg.cameraFrame.height, msg.cameraFrame.width = 16, 32
                    ring.fill(msg.cameraFrame, index, seq, img.nbytes)
                    pm.send("cameraFrame", msg)
                written = 0
                for _ in range(50):
                    written += rec.step(100)
                    if written == 5:
                        break
            finally:
                rec.close_sockets()
        assert rec.frames_unread == 0
    frames = [ev.cameraFrame for _, service, ev in LogReader(tmp_path, fmt="zst") if service == "cameraFrame"]
    assert [int(cf.frameId) for cf in frames] == [0, 1, 2, 3, 4]
    for k, cf in enumerate(frames):
        assert (frame_to_array(cf) == 10 * k).all()
        assert int(cf.buffer.seq) == k + 1


def test_chestnut_dump_shows_a_ring_frame_by_its_buffer():
    import json

    from chestnut.msgs.dump import format_event

    img = np.full((4, 6, 3), 3, np.uint8)
    with FrameRing(img.nbytes) as ring:
        ev = _frame(ring, img, 7)
        d = json.loads(format_event(ev, as_json=True))
    cf = d["cameraFrame"]
    assert (cf["frameId"], cf["data"], cf["height"], cf["width"]) == (7, "<0 bytes>", 4, 6)
    assert cf["buffer"] == {"session": ring.session, "index": 0, "seq": 1, "size": 72}


def _ring_msg(ring: FrameRing, pixels: np.ndarray, frame_id: int) -> object:
    """A ring cameraFrame builder for ``pixels`` written into ``ring``."""
    index, seq = ring.write(pixels)
    msg = fill_frame(frame_id, pixels[:0], 1, 2, "test")
    msg.cameraFrame.height, msg.cameraFrame.width = pixels.shape[:2]
    ring.fill(msg.cameraFrame, index, seq, pixels.nbytes)
    return msg


def _wait_for(what, timeout_s: float = 5.0):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if out := what():
            return out
        time.sleep(0.002)
    raise AssertionError("condition not met in time")


def _notice(ring: FrameRing, pixels: np.ndarray, frame_id: int) -> tuple[RingFrame, bytes]:
    """Write ``pixels`` into ``ring`` as the camera does: (its notice's RingFrame, its bus message's bytes)."""
    index, seq = ring.write(pixels)
    frame = RingFrame(frame_id=frame_id, sof_ns=1, eof_ns=2, width=pixels.shape[1], height=pixels.shape[0],
                      encoding="bgr888", session=ring.session, index=index, seq=seq, size=pixels.nbytes)
    msg = fill_frame(frame_id, pixels[:0], 1, 2, "test")
    msg.cameraFrame.height, msg.cameraFrame.width = pixels.shape[:2]
    ring.fill(msg.cameraFrame, index, seq, pixels.nbytes)
    return frame, msg.to_bytes()


def test_a_notice_is_56_bytes_that_say_what_the_bus_message_says():
    frame = RingFrame(frame_id=7, sof_ns=10**18, eof_ns=10**18 + 5, width=1928, height=1208, encoding="nv12",
                      session=2**63 - 1, index=3, seq=2**40, size=1928 * 1812)
    record = frame.pack()
    assert len(record) == NOTICE_BYTES == 56
    back = RingFrame.unpack(record)
    assert [getattr(back, f) for f in RingFrame.__slots__] == [getattr(frame, f) for f in RingFrame.__slots__]
    assert back.buffer is back and back.shape == (1812, 1928, 1) and back.encoding == "nv12"
    with pytest.raises(ValueError, match=r"pixel encoding 'yuyv' is none of \['bgr888', 'rgb888', 'gray8', 'nv12'\]"):
        RingFrame(frame_id=1, sof_ns=1, eof_ns=1, width=2, height=2, encoding="yuyv", session=1, index=0, seq=1,
                  size=6)
    with pytest.raises(ValueError, match="frame 1: 5 bytes in the ring for bgr888 2x1"):
        RingFrame(frame_id=1, sof_ns=1, eof_ns=1, width=2, height=1, encoding="bgr888", session=1, index=0, seq=1,
                  size=5)


def test_announce_sends_the_record_notify_sends_and_checks_the_geometry_first():
    import zmq

    pixels = np.zeros((4, 8, 3), np.uint8)
    poller = zmq.Poller()
    with FrameRing(pixels.nbytes) as ring:
        reader = FrameReader(poller=poller)
        first = log_from_bytes(_notice(ring, pixels, 0)[1])  # the bus copy: its view maps the ring
        assert reader.view(first.cameraFrame).shape == (4, 8, 3)
        _wait_for(lambda: ring.subscribers == 1 and ring._notified)
        frame = _notice(ring, pixels, 1)[0]
        assert ring.announce(1, 1, 2, 8, 4, "bgr888", frame.index, frame.seq, 96) == 1
        assert ring.notify(frame) == 1
        records: list[bytes] = []
        _wait_for(lambda: records.extend(reader.shm.take_notices()) or len(records) == 2)
        assert records[0] == records[1] == frame.pack()
        with pytest.raises(ValueError, match="frame 2: 95 bytes in the ring for bgr888 8x4"):
            ring.announce(2, 1, 2, 8, 4, "bgr888", 0, 1, 95)
        with pytest.raises(ValueError, match=r"pixel encoding 'yuyv' is none of"):
            ring.announce(2, 1, 2, 8, 4, "yuyv", 0, 1, 96)
        assert ring.unread == 0 and not reader.shm.take_notices()  # nothing was sent for either
        wrong_size = bytearray(frame.pack())
        wrong_size[40:44] = (95).to_bytes(4, "little")  # size: 95 bytes for an 8x4 bgr888 frame
        with pytest.raises(MalformedMessageError, match="a notice naming frame 1: 95 bytes in the ring for bgr888 8x4"):
            RingFrame.unpack(bytes(wrong_size))
        reader.shm.ring.notices.close()  # the subscriber's end is gone: the camera's next send fails, it is dropped
        assert ring.announce(1, 1, 2, 8, 4, "bgr888", frame.index, frame.seq, 96) == 0
        assert ring._notified == [] and ring.subscribers == 0
    reader.close()


def test_notices_reach_a_polling_reader_once_per_frame_with_the_bus_copy_skipped():
    import zmq

    pixels = np.zeros((4, 8, 3), np.uint8)
    poller = zmq.Poller()
    with FrameRing(pixels.nbytes) as ring:
        reader = FrameReader(poller=poller)
        first = log_from_bytes(_notice(ring, pixels, 0)[1])  # the bus copy: maps the ring
        assert reader.first_sight(first.cameraFrame) and reader.view(first.cameraFrame).shape == (4, 8, 3)
        _wait_for(lambda: ring.subscribers == 1 and ring._notified)
        sent = [_notice(ring, pixels, i) for i in (1, 2)]
        assert [ring.notify(frame) for frame, _ in sent] == [1, 1]
        woke = dict(poller.poll(5000))
        assert woke == {reader.shm.ring.fd: zmq.POLLIN}  # the notice wakes the poll
        assert reader.only_notices(woke) and not reader.only_notices({})
        assert not reader.only_notices({**woke, reader.shm.ring.fd + 1: zmq.POLLIN})  # the bus too
        got: list[RingFrame] = []
        _wait_for(lambda: got.extend(reader.notices()) or len(got) == 2)
        assert [(f.frameId, f.seq, f.index, f.timestampSof, f.timestampEof) for f in got] == [(1, 2, 1, 1, 2),
                                                                                             (2, 3, 2, 1, 2)]
        assert [reader.first_sight(f) for f in got] == [True, True]
        assert [reader.first_sight(log_from_bytes(b).cameraFrame) for _, b in sent] == [False, False]  # taken
        view = reader.view(got[1])
        assert view.shape == (4, 8, 3) and not view.flags.writeable
        reader.verify(got[1])
        assert reader.first_sight(log_from_bytes(_notice(ring, pixels, 3)[1]).cameraFrame)  # bus first
        pipe = ring._notified[0][0]  # the write end of the reader's notice pipe
        good = sent[0][0].pack()
        bad_encoding = good[:-4] + bytes([9]) + good[-3:]
        other = RingFrame(frame_id=5, sof_ns=1, eof_ns=2, width=8, height=4, encoding="bgr888",
                          session=ring.session ^ 2, index=0, seq=9, size=96)
        for record in (b"\x00" * 16, bad_encoding, other.pack(), good + bytes(8)):
            pipe.write(record)
        late: list[RingFrame] = []
        _wait_for(lambda: late.extend(reader.notices()) or reader.bad_notices == 4)
        assert late == []
        assert dict(reader.bad_notice_reasons) == {"framing": 1, "unknown member": 1, "other ring": 1}
        assert reader.shm.bad_notices == 1  # the record over NOTICE_BYTES
        with pytest.raises(ValueError, match=f"a notice for session {ring.session ^ 2:x} on the ring of session "):
            ring.notify(other)
    assert _wait_for(reader.camera_gone) and reader.shm.ring is None
    assert poller.sockets == []  # the ring's notice pipe left the poller with the mapping
    reader.close()


def test_a_reader_that_reads_no_notices_still_sees_its_camera_go():
    # the logger maps the ring but never reads notices: its socket buffer fills, the camera's sends to it fail
    # without blocking (counted), and the camera's end is still seen once it stops
    pixels = np.zeros((4, 8, 3), np.uint8)
    with FrameRing(pixels.nbytes) as ring:
        reader = FrameReader()
        reader.view(log_from_bytes(_ring_msg(ring, pixels, 0).to_bytes()).cameraFrame)
        _wait_for(lambda: ring._notified)
        frame = _notice(ring, pixels, 1)[0]
        t0 = time.monotonic()
        while ring.unread == 0:
            ring.notify(frame)
            assert time.monotonic() - t0 < 30
        assert not reader.camera_gone() and reader.notices() == []
    assert _wait_for(reader.camera_gone)
    reader.close()


class _HeldPipe:
    """A subscriber's notice pipe whose ``write`` stops half way (until ``go``), as FileIO's write does in its system
    call, the GIL released and the descriptor's number already read; ``events`` is the order of writes and closes.
    ``decided`` is set once the ring's ``close`` has either closed it or found the ring's lock held."""

    def __init__(self, pipe: object, decided: threading.Event) -> None:
        self.pipe, self.decided = pipe, decided
        self.inside, self.go = threading.Event(), threading.Event()
        self.events: list[str] = []

    def write(self, data: bytes) -> int | None:
        self.events.append("write begins")
        self.inside.set()
        assert self.go.wait(30)
        n = self.pipe.write(data)  # type: ignore[attr-defined]
        self.events.append("write ends")
        return n  # type: ignore[no-any-return]

    def close(self) -> None:
        self.events.append("close")
        self.pipe.close()  # type: ignore[attr-defined]
        self.decided.set()


class _WatchedLock:
    """The ring's lock, setting ``decided`` when an acquire finds it held (and then waiting for it, as it would)."""

    def __init__(self, lock: threading.Lock, decided: threading.Event) -> None:
        self.lock, self.decided = lock, decided

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.lock.acquire(False):
            return True
        self.decided.set()
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_a_ring_closed_while_a_notice_is_being_written_closes_the_pipe_only_after_the_write():
    """``FrameRing.close`` on one thread while ``notify`` on another is inside a pipe's write: the pipe must not be
    closed under the write (its descriptor's number could be reused by the next file opened, and the write would
    land there). The order is forced, not raced: the write stops half way until the close has either closed the
    pipe (the fault) or found the ring's lock held by the notice (it waits: the fix)."""
    pixels = np.zeros((4, 8, 3), np.uint8)
    ring = FrameRing(pixels.nbytes)
    reader = FrameReader()
    threads: list[threading.Thread] = []
    decided = threading.Event()
    held: _HeldPipe | None = None
    try:
        reader.view(log_from_bytes(_ring_msg(ring, pixels, 0).to_bytes()).cameraFrame)
        _wait_for(lambda: ring._notified)
        frame = _notice(ring, pixels, 1)[0]
        (pipe, conn), = ring._notified
        held = _HeldPipe(pipe, decided)
        ring._notified, ring._pipes[conn] = [(held, conn)], held  # type: ignore[list-item, assignment]
        ring._lock = _WatchedLock(ring._lock, decided)  # type: ignore[assignment]
        took: list[int] = []
        threads.append(threading.Thread(target=lambda: took.append(ring.notify(frame))))
        threads[-1].start()
        assert held.inside.wait(30)  # the notice is inside its write
        threads.append(threading.Thread(target=ring.close))
        threads[-1].start()
        assert decided.wait(30)
        at_decision = list(held.events)
        held.go.set()
        for t in threads:
            t.join(30)
        assert at_decision == ["write begins"]  # the close waited for the lock: the pipe was open throughout
        assert held.events == ["write begins", "write ends", "close"]
        assert took == [1]
        assert ring.notify(frame) == 0  # a notice after the close writes nowhere
    finally:
        if held is not None:
            held.go.set()
        for t in threads:
            t.join(30)
        ring.close()
        reader.close()


def _forged(ring: FrameRing, frame_id: int, index: int, seq: int, nbytes: int) -> bytes:
    """A bus ``cameraFrame`` naming ``ring``'s session with a slot and seq of the sender's choosing."""
    msg = fill_frame(frame_id, np.zeros((0, 8, 3), np.uint8), 1, 2, "forger")
    msg.cameraFrame.height, msg.cameraFrame.width = 4, 8
    ring.fill(msg.cameraFrame, index, seq, nbytes)
    return msg.to_bytes()


def _answer(reader: FrameReader, cf: object) -> tuple[int, str] | None:
    """What the node's loop does with one frame: None when first_sight skips it, else (frame id, what it read)."""
    if not reader.first_sight(cf):
        return None
    try:
        return int(cf.frameId), f"pixels {int(reader.read(cf)[0, 0, 0])}"  # type: ignore[attr-defined]
    except FrameOverwrittenError:
        return int(cf.frameId), "overwritten"  # type: ignore[attr-defined]


def test_a_bus_message_naming_a_seq_its_slot_never_held_does_not_silence_the_session():
    """A ``cameraFrame`` with ``buffer.seq = 2**64-1`` of the camera's session was recorded as taken: every later
    frame of that session (seq 1..20) was skipped as seen, no output, no log line."""
    with FrameRing(96) as ring:
        reader = FrameReader()
        answers = [_answer(reader, log_from_bytes(_forged(ring, 1, 1, 2**64 - 1, 96)).cameraFrame)]
        sent = []
        for i in range(2, 22):
            _, bus = _notice(ring, np.full((4, 8, 3), i, np.uint8), i)
            sent.append(bus)
            answers.append(_answer(reader, log_from_bytes(bus).cameraFrame))
            answers.append(_answer(reader, log_from_bytes(bus).cameraFrame))  # the same frame again: taken once
        answers.append(_answer(reader, log_from_bytes(_forged(ring, 22, 1, 2**64 - 1, 96)).cameraFrame))
        answers.append(_answer(reader, log_from_bytes(sent[-1]).cameraFrame))
        assert ring.seq == 20
    assert answers == [(1, "overwritten")] + [a for i in range(2, 22) for a in ((i, f"pixels {i}"), None)] + [
        (22, "overwritten"), None]


def test_a_notice_is_taken_after_a_forged_bus_copy_and_skipped_after_a_lapped_real_one():
    import zmq

    pixels = np.zeros((4, 8, 3), np.uint8)
    with FrameRing(pixels.nbytes) as ring:
        reader = FrameReader(poller=zmq.Poller())
        answers = [_answer(reader, log_from_bytes(_notice(ring, pixels + 1, 1)[1]).cameraFrame)]  # maps the ring
        _wait_for(lambda: ring.subscribers == 1 and ring._notified)
        # a forger names the next frame (seq 2, slot 1) before the camera wrote it
        answers.append(_answer(reader, log_from_bytes(_forged(ring, 2, 1, 2, pixels.nbytes)).cameraFrame))
        frame, bus = _notice(ring, pixels + 2, 2)
        assert ring.notify(frame) == 1
        got: list[RingFrame] = []
        _wait_for(lambda: got.extend(reader.notices()) or got)
        answers += [_answer(reader, got[0]), _answer(reader, log_from_bytes(bus).cameraFrame)]
        # frame 3's bus copy is read after the camera lapped its slot; its notice then is not a second answer
        frame, bus = _notice(ring, pixels + 3, 3)
        assert ring.notify(frame) == 1
        for i in range(4, 4 + ring.slots):
            _notice(ring, pixels + i, i)
        answers.append(_answer(reader, log_from_bytes(bus).cameraFrame))
        got.clear()
        _wait_for(lambda: got.extend(reader.notices()) or got)
        answers.append(_answer(reader, got[0]))
        frame, bus = _notice(ring, pixels + 9, 9)
        assert ring.notify(frame) == 1
        got.clear()
        _wait_for(lambda: got.extend(reader.notices()) or got)
        answers += [_answer(reader, got[0]), _answer(reader, log_from_bytes(bus).cameraFrame)]
        reader.close()
    assert answers == [(1, "pixels 1"), (2, "overwritten"), (2, "pixels 2"), None, (3, "overwritten"), None,
                       (9, "pixels 9"), None]


def test_a_camera_notice_ahead_of_its_own_ring_is_answered_once_and_silences_nothing():
    """A notice (the camera's own connection) naming seq 10**9 was recorded as taken: every later frame of the
    session (all lower seqs) was skipped as seen, no output and no line after the first."""
    import zmq

    pixels = np.zeros((4, 8, 3), np.uint8)
    with FrameRing(pixels.nbytes) as ring:
        reader = FrameReader(poller=zmq.Poller())
        answers = [_answer(reader, log_from_bytes(_notice(ring, pixels + 1, 1)[1]).cameraFrame)]  # maps the ring
        _wait_for(lambda: ring.subscribers == 1 and ring._notified)
        ahead = RingFrame(frame_id=2, sof_ns=1, eof_ns=2, width=8, height=4, encoding="bgr888", session=ring.session,
                          index=0, seq=10**9, size=pixels.nbytes)
        assert ring.notify(ahead) == 1
        got: list[RingFrame] = []
        _wait_for(lambda: got.extend(reader.notices()) or got)
        answers.append(_answer(reader, got[0]))
        with pytest.raises(FrameOverwrittenError, match=re.escape(
                "frame seq 1000000000: slot 0 holds the older frame 1 (done): frame 1000000000 was never written "
                "there (a message or notice ahead of the camera's writes)")):
            reader.read(got[0])
        for i in (3, 4):
            frame, bus = _notice(ring, pixels + i, i)
            assert ring.notify(frame) == 1
            got.clear()
            _wait_for(lambda: got.extend(reader.notices()) or got)
            answers += [_answer(reader, got[0]), _answer(reader, log_from_bytes(bus).cameraFrame)]
        reader.close()
    assert answers == [(1, "pixels 1"), (2, "overwritten"), (3, "pixels 3"), None, (4, "pixels 4"), None]


@pytest.mark.parametrize(
    ("current", "expected"),
    [
        (None, "glibc.cpu.x86_non_temporal_threshold=0x100000"),
        ("", "glibc.cpu.x86_non_temporal_threshold=0x100000"),
        ("glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2:glibc.cpu.x86_non_temporal_threshold=0x100000"),
        # the user's own threshold wins
        ("glibc.cpu.x86_non_temporal_threshold=0x4040:glibc.malloc.arena_max=2",
         "glibc.cpu.x86_non_temporal_threshold=0x4040:glibc.malloc.arena_max=2"),
        # not glibc's syntax (and unsafe in a supervisord configuration): dropped
        ('x"=1', "glibc.cpu.x86_non_temporal_threshold=0x100000"),
        ("a=%(ENV_HOME)s", "glibc.cpu.x86_non_temporal_threshold=0x100000"),
    ],
)
def test_a_ring_writer_is_started_with_streaming_stores_for_big_frames(current, expected):
    assert streaming_copy_tunables(current) == expected


def test_without_streaming_the_environments_own_tunables_pass_checked():
    assert streaming_copy_tunables(None, streaming=False) == ""
    assert streaming_copy_tunables("glibc.malloc.arena_max=2", streaming=False) == "glibc.malloc.arena_max=2"
    assert streaming_copy_tunables('a=1:b="', streaming=False) == ""


def test_a_polling_reader_takes_one_queued_notice_a_call_and_the_poll_wakes_it_for_the_next():
    """Three notices queued: each call reads one (the EAGAIN a drain ends with is not paid), the poll stays ready
    while any is left, and a camera that stops behind queued notices is still seen gone in one call."""
    import zmq

    pixels = np.zeros((4, 8, 3), np.uint8)
    poller = zmq.Poller()
    with FrameRing(pixels.nbytes) as ring:
        reader = FrameReader(poller=poller)
        reader.view(log_from_bytes(_ring_msg(ring, pixels, 0).to_bytes()).cameraFrame)  # maps the ring
        _wait_for(lambda: ring.subscribers == 1 and ring._notified)
        for i in (1, 2, 3):
            assert ring.notify(_notice(ring, pixels, i)[0]) == 1
        taken = []
        for _ in range(3):
            assert dict(poller.poll(5000)) == {reader.shm.ring.fd: zmq.POLLIN}
            got = reader.notices()
            assert len(got) == 1
            taken.append(got[0].frameId)
        assert taken == [1, 2, 3]
        assert dict(poller.poll(0)) == {} and reader.notices() == []
        for i in (4, 5):
            ring.notify(_notice(ring, pixels, i)[0])
    assert reader.camera_gone() and reader.shm.ring is None  # EOF behind two notices: one call
    reader.close()


def test_checked_geometries_are_remembered_up_to_a_bound_and_a_bad_one_is_refused_every_time():
    """``RingFrame`` checks a geometry once, then looks it up (msgs/visionipc.py "Cold frames"); the cache holds at
    most ``MAX_GEOMETRIES``, so notices naming ever new geometries cannot grow it, and a wrong size is refused
    every time, remembered or not."""
    from chestnut.msgs import visionipc

    visionipc._GEOMETRIES.clear()
    for w in range(2, 2 + 2 * (visionipc.MAX_GEOMETRIES + 10), 2):
        frame = RingFrame(frame_id=1, sof_ns=1, eof_ns=1, width=w, height=2, encoding="nv12", session=1, index=0,
                          seq=1, size=3 * w)
        assert frame.shape == (3, w, 1)
    assert len(visionipc._GEOMETRIES) == visionipc.MAX_GEOMETRIES
    for _ in range(2):
        with pytest.raises(ValueError, match="^frame 7: 11 bytes in the ring for nv12 2x2$"):
            RingFrame(frame_id=7, sof_ns=1, eof_ns=1, width=2, height=2, encoding="nv12", session=1, index=0, seq=1,
                      size=11)
    with pytest.raises(ValueError, match="pixel encoding 'yuyv' is none of"):
        RingFrame(frame_id=1, sof_ns=1, eof_ns=1, width=2, height=2, encoding="yuyv", session=1, index=0, seq=1,
                  size=6)


def test_the_cameras_end_read_by_notices_unmaps_the_ring_at_the_next_camera_gone():
    import zmq

    pixels = np.zeros((4, 8, 3), np.uint8)
    poller = zmq.Poller()
    reader = FrameReader(poller=poller)
    with FrameRing(pixels.nbytes) as ring:
        reader.view(log_from_bytes(_ring_msg(ring, pixels, 0).to_bytes()).cameraFrame)
        _wait_for(lambda: ring._notified)
    # the camera closed: the next notices() reads its end (no notice), camera_gone() then unmaps at once
    assert _wait_for(lambda: reader.notices() == [] and reader.shm._eof)
    assert reader.camera_gone() and reader.shm.ring is None and poller.sockets == []
    reader.close()


def test_a_mapping_that_fails_leaves_the_notice_pipe_to_its_caller_and_closes_nothing_twice():
    """``_Mapping`` takes the pipe's read end only once the ring is mapped: when the mapping fails, the caller's
    close is the only one, and a descriptor that reuses the number later is left alone."""
    import gc

    from chestnut.msgs.visionipc import _Mapping

    read_end, write_end = os.pipe()
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        hello = {"session": 1, "slots": 1, "stride": 64, "frame_bytes": 8, "size": 64}
        with pytest.raises(OSError):  # a pipe cannot be mapped
            _Mapping(a, hello, write_end, read_end)
        os.close(read_end)  # the caller's close (FrameReader._connect), the only one
        gc.collect()
        reused = os.open(os.devnull, os.O_RDONLY)
        try:
            gc.collect()  # a second owner collected now would close the reused number
            os.fstat(reused)
        finally:
            os.close(reused)
    finally:
        os.close(write_end)
        a.close()
        b.close()
