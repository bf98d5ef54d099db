"""Fuzzing every subscribed service over real ZeroMQ sockets (``msgs/messaging.py``).

Per service, hypothesis sends batches of hostile bytes through a PUB/SUB pair: random and truncated
bytes, bytes edited at random, pointer cycles (a struct that points at itself), lists claiming huge
lengths, unknown union members and well-formed messages of another service. The contract:

- 0 crashes: no exception reaches the subscriber's caller, and a good message sent after each batch
  arrives;
- every message is accounted for: delivered (then it is a well-formed event of this service whose
  every field reads) or counted as malformed, exactly once: delivered + counted == sent;
- memory stays bounded over the whole run.
"""

from __future__ import annotations

import random
import struct
import time
from typing import Any

import psutil
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chestnut.msgs.messaging import SubSocket, drain_sock, new_message, pub_sock, sub_sock
from chestnut.msgs.schema import log
from chestnut.msgs.services import SERVICE_LIST

SERVICES = list(SERVICE_LIST)
EVENT = log.Event.schema.node.struct
RSS_GROWTH_LIMIT_MB = 64  # over the whole run; each message is bounded by ZMQ_MAXMSGSIZE and the traversal limit
EXAMPLES = 40  # per service: bounded, seconds in all

_pairs: dict[str, tuple[zmq.Socket, SubSocket]] = {}
_rss0: list[int] = []


def _pair(service: str) -> tuple[zmq.Socket, SubSocket]:
    """One connected PUB/SUB pair per service for the whole module."""
    if service not in _pairs:
        pub, sub = pub_sock(service), sub_sock(service)
        deadline = time.monotonic() + 10
        hello = sample(service, 0)
        while time.monotonic() < deadline:  # ZeroMQ drops messages until the subscription has arrived
            pub.send(hello)
            if sub.poll(20):
                drain_sock(sub)
                break
        else:
            raise AssertionError(f"{service}: subscriber never connected")
        sub.malformed.clear()
        _pairs[service] = (pub, sub)
    return _pairs[service]


@pytest.fixture(scope="module", autouse=True)
def _sockets():
    _rss0.append(psutil.Process().memory_info().rss)
    yield
    for pub, sub in _pairs.values():
        pub.close()
        sub.close()
    _pairs.clear()


# ---------------------------------------------------------------- well-formed samples and hostile bytes


def sample(service: str, seed: int) -> bytes:
    """A well-formed Event of ``service`` with some content (lists and texts filled)."""
    rng = random.Random(seed)
    msg = new_message(service)
    m = getattr(msg, service)
    text = "x" * rng.randrange(0, 40)
    if service == "cameraFrame":
        m.frameId, m.width, m.height, m.data, m.sourceName = (
            seed,
            4,
            2,
            bytes(rng.randrange(256) for _ in range(24)),
            text,
        )
    elif service == "modelOutput":
        outs = m.init("outputs", rng.randrange(0, 3))
        for o in outs:
            o.name, o.shape, o.data = text, [2, 2], bytes(16)
        m.reason = text
    elif service == "chestnutHealth":
        for layer in m.init("layers", 4):
            layer.reason = text
            layer.init("counters", rng.randrange(0, 3))
    elif service == "initData":
        m.init("versions", 2)
        m.config = text
    elif service == "controlState":
        m.events = [text] * rng.randrange(0, 4)
    elif service == "twinState":
        m.faults = [text] * rng.randrange(0, 3)
    elif service == "nodeState":
        m.reason = text
    elif service == "chestnutActive":
        m.reason = text
    return msg.to_bytes()


def _words(*words: int) -> bytes:
    """A single-segment message: segment table, then the words."""
    return struct.pack("<II", 0, len(words)) + struct.pack(f"<{len(words)}Q", *words)


def _struct_ptr(offset: int, data_words: int, ptr_words: int) -> int:
    return ((offset & 0x3FFFFFFF) << 2) | (data_words << 32) | (ptr_words << 48)


def _list_ptr(offset: int, size_code: int, count: int) -> int:
    return ((offset & 0x3FFFFFFF) << 2) | 1 | (size_code << 32) | (count << 35)


def _event_data(discriminant: int) -> tuple[int, int]:
    """The Event's two data words with ``discriminant`` in its union tag (16-bit slot discriminantOffset)."""
    data = bytearray(8 * EVENT.dataWordCount)
    struct.pack_into("<H", data, 2 * EVENT.discriminantOffset, discriminant)
    return struct.unpack("<QQ", bytes(data))


def _tag(service: str) -> int:
    return int(log.Event.schema.fields[service].proto.discriminantValue)


def huge_lists(service: str, data_words: int, counts: list[tuple[int, int]]) -> bytes:
    """An Event whose member struct's pointers are lists claiming ``count`` elements (size code ``code``)
    in a message a few words long."""
    d0, d1 = _event_data(_tag(service))
    n = len(counts)
    member = [0] * data_words + [_list_ptr(n - 1 - i, code, count) for i, (code, count) in enumerate(counts)]
    return _words(_struct_ptr(0, 2, 1), d0, d1, _struct_ptr(0, data_words, n), *member)


def self_pointer(service: str) -> bytes:
    """An Event whose member pointer points back at the Event itself (a cycle a naive reader follows forever)."""
    d0, d1 = _event_data(_tag(service))
    return _words(_struct_ptr(0, 2, 1), d0, d1, _struct_ptr(-4, 2, 1))


def unknown_member(service: str, tag: int) -> bytes:
    d0, d1 = _event_data(tag)
    return _words(_struct_ptr(0, 2, 1), d0, d1, _struct_ptr(0, 1, 0), 0)


def hostile(service: str) -> st.SearchStrategy[bytes]:
    good = st.integers(0, 1000).map(lambda seed: sample(service, seed))
    return st.one_of(
        st.binary(max_size=2048),  # random bytes
        st.tuples(good, st.floats(0, 1, exclude_max=True)).map(lambda g: g[0][: int(len(g[0]) * g[1])]),  # truncated
        st.tuples(good, st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=8)).map(
            lambda g: _edit(g[0], g[1])
        ),
        st.just(self_pointer(service)),  # deep nesting: a pointer cycle
        st.builds(
            lambda dw, counts: huge_lists(service, dw, counts),
            st.integers(0, 3),
            st.lists(st.tuples(st.integers(1, 7), st.integers(1 << 20, (1 << 29) - 1)), min_size=1, max_size=4),
        ),
        st.integers(len(SERVICES), 0xFFFF).map(lambda tag: unknown_member(service, tag)),  # wrong union member
        st.sampled_from([s for s in SERVICES if s != service]).map(lambda other: sample(other, 1)),  # another service
    )


def _edit(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    out = bytearray(data)
    for pos, value in edits:
        out[pos % len(out)] = value
    return bytes(out)


# ---------------------------------------------------------------- the contract


@pytest.mark.timeout(300)
@pytest.mark.parametrize("service", SERVICES)
@settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True, database=None
)
@given(data=st.data())
def test_hostile_messages_are_each_counted_or_delivered_and_never_crash_the_subscriber(service: str, data: Any):
    pub, sub = _pair(service)
    batch = data.draw(st.lists(hostile(service), min_size=1, max_size=8))
    marker = data.draw(st.integers(1, (1 << 63) - 1))
    end = new_message(service)
    end.logMonoTime = marker
    counted_before = sum(sub.malformed.values())
    for msg in batch:
        pub.send(msg)
    pub.send(end.to_bytes())
    delivered: list[Any] = []
    deadline = time.monotonic() + 10
    while not any(e.logMonoTime == marker for e in delivered):
        assert time.monotonic() < deadline, f"{service}: the good message after the batch never arrived"
        sub.poll(50)
        delivered += drain_sock(sub)
    assert sub.disconnects == 0  # every message was within the service's bound: none refused by ZeroMQ
    others = [e for e in delivered if e.logMonoTime != marker]
    for event in others:
        assert event.which() == service
        event.to_dict()  # every field reads: a delivered event never raises later
    assert len(others) + sum(sub.malformed.values()) - counted_before == len(batch)


def test_the_fuzzing_met_every_kind_of_malformed_message_and_memory_stayed_bounded():
    if set(_pairs) != set(SERVICES):
        pytest.skip("runs after the fuzzing of every service (run the whole file)")
    for service, (_, sub) in _pairs.items():
        assert set(sub.malformed) == {"framing", "pointer", "unknown member", "wrong service"}, service
    grown_mb = (psutil.Process().memory_info().rss - _rss0[0]) / 2**20
    assert grown_mb < RSS_GROWTH_LIMIT_MB
