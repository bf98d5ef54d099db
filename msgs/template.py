"""A message serialised once, sent many times with its per-message fields written into a copy of its bytes.

A publisher whose messages differ from one to the next only in a few scalars and in the contents of fixed-size
``Data`` fields (the primary's ``modelOutput``: the same model id, tensor names, shapes and dtypes every frame)
need not build each one field by field and serialise it: openpilot's cereal builds its message structure once
(``cereal/messaging/__init__.py`` ``new_message``) and its model daemon refills the same buffers every frame
(``selfdrive/modeld/fill_model_msg.py``). Here the whole message is built once with pycapnp and serialised;
each message after that is a copy of those bytes with the fields that change written in place
(:meth:`MessageTemplate.fill`: one ``bytearray`` copy, one ``struct.pack_into`` per scalar, one copy per
``Data`` field), so its bytes are exactly those a fresh build with the same values serialises to.

Where each field lies is found, not computed: the message is built once with every field at a first value
and once more per field with that field alone at a second value; the bytes that differ are the field's
(:func:`MessageTemplate.make`). A value pair that differs in every byte of its encoding makes the field's
whole extent show; the template is then checked against a build with every field at its second value, byte
for byte, and refused (:class:`TemplateError`) if any byte differs -- a field the builder places by its value
(a ``Text``, a ``Data`` field whose length changes) cannot be a template field.

Field kinds (Cap'n Proto encodings, little-endian, https://capnproto.org/encoding.html "Structs"):
``"u64"``, ``"u32"`` (unsigned integers), ``"f32"`` (IEEE 754 binary32), ``"bool"`` (one bit), and
``"data"`` (a ``Data`` field of the first build's length in bytes). Scalars must have the schema default 0
(``false``): the encoding stores a value XORed with its default, and only those are written as they are.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

KINDS = ("u64", "u32", "f32", "bool", "data")
"""The field kinds a template writes (module docstring)."""

_SCALAR = {"u64": struct.Struct("<Q"), "u32": struct.Struct("<I"), "f32": struct.Struct("<f")}
# two values per kind whose encodings differ in every byte (bits 0x01.. and 0xfe.. / 0x7e.. for a finite f32)
_FIRST: dict[str, Any] = {"u64": 0x0101010101010101, "u32": 0x01010101,
                          "f32": struct.unpack("<f", bytes([1, 1, 1, 1]))[0], "bool": False}
_SECOND: dict[str, Any] = {"u64": 0xFEFEFEFEFEFEFEFE, "u32": 0xFEFEFEFE,
                           "f32": struct.unpack("<f", bytes([0xFE, 0xFE, 0xFE, 0x7E]))[0], "bool": True}


class TemplateError(ValueError):
    """The message cannot be a template for these fields (a field not found where its kind says, or the
    bytes of a build not reproduced): said in one line; the caller builds its messages field by field."""


@dataclass(frozen=True)
class _Slot:
    kind: str
    offset: int  # bytes from the message's start (a bool: the byte holding its bit)
    size: int  # bytes (a bool: 1)
    mask: int = 0  # a bool's bit within its byte


class MessageTemplate:
    """One message's bytes and where its fields lie in them (:meth:`make`); :meth:`fill` makes each message.

    ``fields``: (name, kind) pairs in the order :meth:`fill` takes their values."""

    def __init__(self, base: bytes, fields: tuple[tuple[str, str], ...], slots: tuple[_Slot, ...],
                 data_sizes: tuple[int, ...]) -> None:
        self.base = base
        self.fields = fields
        self.data_sizes = data_sizes
        """The byte length of each ``"data"`` field, in field order (a value must have exactly that many)."""
        self._plan = tuple((s.kind, s.offset, s.size, s.mask, _SCALAR.get(s.kind)) for s in slots)

    @property
    def nbytes(self) -> int:
        """The size of every message the template makes (bytes)."""
        return len(self.base)

    @classmethod
    def make(cls, build: Callable[[Sequence[Any]], Any], fields: Sequence[tuple[str, str]],
             data_sizes: Sequence[int] = ()) -> MessageTemplate:
        """The template of the message ``build(values)`` makes (an ``Event`` builder, or its serialised bytes),
        with ``values`` one per field of ``fields`` ((name, kind) pairs, kinds in :data:`KINDS`); ``data_sizes``:
        the length in bytes of each ``"data"`` field, in field order (at least 1 each).

        Raises :class:`TemplateError` (a kind unknown, a size missing or 0, a field whose bytes are not where a
        field of its kind would be, or a build not reproduced byte for byte) and whatever ``build`` raises."""
        fields = tuple((str(n), str(k)) for n, k in fields)
        sizes = iter(int(s) for s in data_sizes)
        first: list[Any] = []
        second: list[Any] = []
        sizes_used: list[int] = []
        for name, kind in fields:
            if kind not in KINDS:
                raise TemplateError(f"field {name!r}: kind {kind!r} is not one of {', '.join(KINDS)}")
            if kind == "data":
                n = next(sizes, 0)
                if n < 1:
                    raise TemplateError(f"field {name!r}: a data field needs its size (bytes, at least 1)")
                sizes_used.append(n)
                first.append(b"\x01" * n)
                second.append(b"\xfe" * n)
            else:
                first.append(_FIRST[kind])
                second.append(_SECOND[kind])
        if next(sizes, None) is not None:
            raise TemplateError(f"{len(data_sizes)} data sizes for {len(sizes_used)} data field(s)")

        def serialised(values: Sequence[Any]) -> np.ndarray:
            made = build(values)
            data = made if isinstance(made, bytes | bytearray) else made.to_bytes()
            return np.frombuffer(bytes(data), dtype=np.uint8)

        base = serialised(first)
        slots: list[_Slot] = []
        for i, (name, kind) in enumerate(fields):
            one = list(first)
            one[i] = second[i]
            other = serialised(one)
            if len(other) != len(base):
                raise TemplateError(f"field {name!r}: its value changes the message's size")
            slots.append(_locate(name, kind, base, other, first[i]))
        template = cls(base.tobytes(), fields, tuple(slots), tuple(sizes_used))
        for values in (first, second):  # every field written where it was found: the builds, byte for byte
            if template.fill(values) != serialised(values).tobytes():
                raise TemplateError("a filled copy differs from a fresh build of the same values")
        return template

    def fill(self, values: Sequence[Any]) -> bytearray:
        """A new message: the template's bytes with ``values`` written in (one per field, in field order: an
        ``int`` for ``u64``/``u32``, a ``float`` for ``f32``, a ``bool``, and for ``data`` a C-contiguous
        buffer -- bytes, a numpy array -- of exactly that field's size).

        Raises ``struct.error`` for an integer outside its kind or a float beyond binary32's range, and
        ``ValueError`` for a data value of another size; nothing is returned then."""
        buf = bytearray(self.base)
        for (kind, offset, size, mask, codec), value in zip(self._plan, values, strict=True):
            if codec is not None:
                codec.pack_into(buf, offset, value)
            elif kind == "bool":
                buf[offset] = buf[offset] | mask if value else buf[offset] & ~mask
            else:
                src = memoryview(value).cast("B")
                if src.nbytes != size:
                    raise ValueError(f"a data value of {src.nbytes} bytes for a field of {size}")
                buf[offset:offset + size] = src
        return buf


def _locate(name: str, kind: str, base: np.ndarray, other: np.ndarray, first: Any) -> _Slot:
    """Where field ``name`` of ``kind`` lies: ``base`` and ``other`` are two builds that differ in it alone (the
    first holding ``first``). Raises :class:`TemplateError`."""
    at = np.flatnonzero(base != other)
    if len(at) == 0:
        raise TemplateError(f"field {name!r}: its value does not show in the message")
    start, end = int(at[0]), int(at[-1]) + 1
    if kind == "bool":
        bit = int(base[start]) ^ int(other[start])
        if end - start != 1 or bit & (bit - 1):
            raise TemplateError(f"field {name!r}: {bin(bit).count('1')} bit(s) over {end - start} byte(s), not one")
        if base[start] & bit:
            raise TemplateError(f"field {name!r}: its bit is set for false (a schema default other than false?)")
        return _Slot(kind, start, 1, bit)
    size = _SCALAR[kind].size if kind in _SCALAR else len(first)
    if end - start != size or len(at) != size or (kind != "data" and start % size):
        raise TemplateError(f"field {name!r}: {len(at)} byte(s) at {start}..{end}, not one {kind} of {size} bytes")
    want = _SCALAR[kind].pack(first) if kind in _SCALAR else bytes(first)
    if base[start:end].tobytes() != want:
        raise TemplateError(f"field {name!r}: its bytes hold another value than written (a schema default not 0?)")
    return _Slot(kind, start, size)
