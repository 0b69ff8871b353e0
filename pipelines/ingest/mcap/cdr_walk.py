"""The CDR walker: one payload decoded in full, field by field in wire order, noting where each
field is (its _Layout). The column decoders use it for templates and for the slow path."""

from __future__ import annotations

import struct
from dataclasses import dataclass

from pipelines.ingest.mcap.results import CORRUPT, UNKNOWN_ENCODING, McapDecodeError


@dataclass(frozen=True)
class _Layout:
    """Where a payload's fields are, for every payload with the same structural bytes."""

    little_endian: bool
    const: tuple[tuple[int, int], ...]  # payload byte ranges that must equal the template's
    numbers: tuple[tuple[str, str, int, int], ...]  # (name, kind, payload offset, count)
    labels: dict  # name -> the template's value


_ENCAPSULATIONS = {b"\x00\x00": False, b"\x00\x01": True}  # CDR_BE, CDR_LE (XCDR1)


def _walk(payload, program) -> tuple[dict, _Layout]:
    """Decode one CDR payload; also say where its fields are. Raises McapDecodeError."""
    cursor = _Cursor(bytes(payload))
    p = cursor.p
    try:
        for kind, name in program:
            cursor.read(kind, name)
    except struct.error:
        raise McapDecodeError(CORRUPT, f"CDR payload of {len(p)} bytes is cut short") from None
    if cursor.off > len(p):
        raise McapDecodeError(CORRUPT, f"CDR payload of {len(p)} bytes is cut short")
    return cursor.values, cursor.layout()


def _little_endian(p: bytes) -> bool:
    """The payload's byte order from its encapsulation header; plain CDR (XCDR1) only."""
    head = p[:2]
    if head not in _ENCAPSULATIONS:
        if len(p) < 4:
            raise McapDecodeError(CORRUPT, f"CDR payload of {len(p)} bytes has no header")
        raise McapDecodeError(
            UNKNOWN_ENCODING,
            f"CDR encapsulation 0x{p[0]:02x}{p[1]:02x} is not plain CDR (XCDR1 LE/BE)",
        )
    return _ENCAPSULATIONS[head]


class _Cursor:
    """Reads one payload's fields in wire order. `off` is the next byte; `const` collects the
    structural byte ranges, `numbers` the numbers' offsets, `values` and `labels` the fields.
    Alignment counts from the end of the 4-byte encapsulation header."""

    def __init__(self, p: bytes):
        self.p = p
        self.little = _little_endian(p)
        self.e = "<" if self.little else ">"
        self.u32 = struct.Struct(self.e + "I")
        self.off = 4
        self.const = [(0, 4)]
        self.numbers: list[tuple[str, str, int, int]] = []
        self.values: dict = {}
        self.labels: dict = {}

    def layout(self) -> _Layout:
        return _Layout(self.little, tuple(self.const), tuple(self.numbers), self.labels)

    def read(self, kind: str, name: str) -> None:
        """One field of the program (see ros2_types._PROGRAMS for the kinds)."""
        if kind == "time":
            self.time(name)
        elif kind == "string":
            self.values[name] = self.labels[name] = self.string()
        elif kind == "string[]":
            self.strings(name)
        elif kind == "f8[]":
            self.float64_sequence(name)
        elif kind.startswith("f8*"):
            self.float64_run(name, int(kind[3:]))
        elif kind == "f4":
            self.float32(name)
        else:  # pragma: no cover - programs are ours
            raise AssertionError(kind)

    def align(self, n: int) -> int:
        return self.off + (-(self.off - 4)) % n

    def string(self) -> str:
        p = self.p
        self.off = off = self.align(4)
        (n,) = self.u32.unpack_from(p, off)
        if off + 4 + n > len(p):
            raise McapDecodeError(CORRUPT, "CDR string runs past the payload")
        raw = p[off + 4 : off + 4 + n]
        self.const.append((off, off + 4 + n))
        self.off = off + 4 + n
        try:
            return raw[:-1].decode() if n else ""
        except UnicodeDecodeError:
            raise McapDecodeError(CORRUPT, "CDR string is not UTF-8") from None

    def count(self) -> int:
        """A sequence's element count (a structural field)."""
        self.off = off = self.align(4)
        (count,) = self.u32.unpack_from(self.p, off)
        self.const.append((off, off + 4))
        self.off += 4
        return count

    def time(self, name: str) -> None:
        self.off = off = self.align(4)
        sec, nanosec = struct.unpack_from(self.e + "iI", self.p, off)
        self.values[name] = sec * 1_000_000_000 + nanosec
        self.numbers.append((name, "time", off, 1))
        self.off += 8

    def strings(self, name: str) -> None:
        count = self.count()
        if count > (len(self.p) - self.off) // 4:
            raise McapDecodeError(CORRUPT, f"CDR sequence of {count} strings is too long")
        self.values[name] = self.labels[name] = tuple(self.string() for _ in range(count))

    def float64_sequence(self, name: str) -> None:
        count = self.count()
        if count:  # no alignment before an empty sequence's (absent) elements
            self.off = self.align(8)
        off = self.off
        if off + 8 * count > len(self.p):
            raise McapDecodeError(CORRUPT, f"CDR sequence of {count} float64 too long")
        self.values[name] = struct.unpack_from(f"{self.e}{count}d", self.p, off)
        self.numbers.append((name, "f8[]", off, count))
        self.off += 8 * count

    def float64_run(self, name: str, count: int) -> None:
        self.off = off = self.align(8)
        self.values[name] = struct.unpack_from(f"{self.e}{count}d", self.p, off)
        self.numbers.append((name, "f8", off, count))
        self.off += 8 * count

    def float32(self, name: str) -> None:
        self.off = off = self.align(4)
        (self.values[name],) = struct.unpack_from(self.e + "f", self.p, off)
        self.numbers.append((name, "f4", off, 1))
        self.off += 4
