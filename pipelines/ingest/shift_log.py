"""An MCAP shift log file → a DecodedLog: the container checks first (magic at both ends, the
footer, the summary and data-section CRCs, and where a truncated file was cut), then the
vectorized decoder of decode.py. Every failure is an UnreadableLog or a ContractViolation whose
message is the one-line quarantine reason."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

from pipelines.ingest.decoded import (
    ContractViolation,
    DecodedLog,
    QuarantineError,
    UnreadableLog,
    decode_log,
)
from pipelines.ingest.mcap import MCAP_MAGIC, DecodeLimits, McapDecodeError

_READ_BLOCK = 1 << 20


def read_log(path: Path, limits: DecodeLimits | None = None) -> DecodedLog:
    """Decode one MCAP shift log: container checks (incl. the summary CRC), then the
    vectorized decoder of pipelines/ingest/mcap/decode.py on the contract's topics (extra topics are
    only counted), held to `limits` (default DecodeLimits()).

    Raises UnreadableLog for anything that is not a complete, intact MCAP file,
    ContractViolation for a contract topic with another encoding or message type.
    """
    path = Path(path)
    check_container(path)
    try:
        return decode_log(path, limits)
    except QuarantineError:
        raise
    except McapDecodeError as exc:
        message = str(exc).splitlines()[0]
        if exc.kind in ("unknown_encoding", "unknown_schema"):
            raise ContractViolation(message) from None
        prefix = _PREFIXES.get(exc.kind, "corrupt MCAP")
        raise UnreadableLog(
            message if message.startswith(prefix) else f"{prefix}: {message}"
        ) from None
    except Exception as exc:  # untrusted bytes: any failure to decode means unreadable
        raise UnreadableLog(_decode_failure(exc)) from None


_PREFIXES = {"truncated": "truncated MCAP", "over_limit": "refused MCAP"}


def _decode_failure(exc: Exception) -> str:
    detail = (str(exc).splitlines() or [""])[0][:200]
    kind = type(exc)
    if kind.__name__ == "CRCValidationError":
        expected, actual = getattr(exc, "expected", 0), getattr(exc, "actual", 0)
        return (
            f"corrupt MCAP: chunk CRC mismatch (stored {expected:#010x}, computed "
            f"{actual:#010x}): bytes damaged after writing"
        )
    if kind.__module__.split(".")[0] in ("zstandard", "zstd", "lz4", "backports"):
        return f"corrupt MCAP: a chunk does not decompress ({kind.__name__}: {detail})"
    return f"unreadable MCAP ({kind.__name__}: {detail})"


_OPCODES = {
    0x01: "header",
    0x02: "footer",
    0x03: "schema",
    0x04: "channel",
    0x05: "message",
    0x06: "chunk",
    0x07: "message index",
    0x08: "chunk index",
    0x09: "attachment",
    0x0A: "attachment index",
    0x0B: "statistics",
    0x0C: "metadata",
    0x0D: "metadata index",
    0x0E: "summary offset",
    0x0F: "data end",
}
_OP_FOOTER, _OP_CHUNK, _OP_DATA_END = 0x02, 0x06, 0x0F
_RECORD_HEAD = struct.Struct("<BQ")  # opcode, content length
_FOOTER = struct.Struct("<BQQQI")  # opcode, length, summary start, summary offset start, crc
_DATA_END = struct.Struct("<BQI")  # opcode, length, data section crc


def check_container(path: Path) -> None:
    """The MCAP container around the records: magic at both ends, a footer, and the CRCs
    that cover the summary and (when the writer computed it) the data section.

    Cheap: reads the ends of the file, plus the whole data section only when it carries a
    CRC. Chunk CRCs are the decoder's to check as it decompresses. Raises UnreadableLog.
    """
    size = path.stat().st_size
    if size == 0:
        raise UnreadableLog("empty file (0 bytes)")
    with path.open("rb") as stream:
        head = stream.read(len(MCAP_MAGIC))
        if head != MCAP_MAGIC:
            raise UnreadableLog(
                f"not an MCAP file: starts with {head[:8]!r}, not the MCAP magic {MCAP_MAGIC!r}"
            )
        stream.seek(max(size - len(MCAP_MAGIC), 0))
        if size < 2 * len(MCAP_MAGIC) + _FOOTER.size or stream.read() != MCAP_MAGIC:
            raise UnreadableLog(_truncation(stream, size))
        footer_at = size - len(MCAP_MAGIC) - _FOOTER.size
        stream.seek(footer_at)
        opcode, length, summary_start, _, summary_crc = _FOOTER.unpack(stream.read(_FOOTER.size))
        if opcode != _OP_FOOTER or length != _FOOTER.size - _RECORD_HEAD.size:
            raise UnreadableLog("corrupt MCAP: no footer record before the closing magic")
        if summary_start and not len(MCAP_MAGIC) < summary_start <= footer_at:
            raise UnreadableLog(
                f"corrupt MCAP: footer points to a summary at byte {summary_start}, outside "
                f"the file's {size} bytes"
            )
        if summary_start and summary_crc:
            computed = _crc32(stream, summary_start, size - len(MCAP_MAGIC) - 4)
            if computed != summary_crc:
                raise UnreadableLog(
                    f"corrupt MCAP: summary CRC mismatch (stored {summary_crc:#010x}, computed "
                    f"{computed:#010x}): bytes damaged after writing"
                )
        data_end_at = (summary_start or footer_at) - _DATA_END.size
        if data_end_at < len(MCAP_MAGIC):
            return
        stream.seek(data_end_at)
        opcode, length, data_crc = _DATA_END.unpack(stream.read(_DATA_END.size))
        if opcode != _OP_DATA_END or length != 4 or not data_crc:
            return  # no data-section CRC to check (rosbag2 and most writers leave it 0)
        computed = _crc32(stream, 0, data_end_at)
        if computed != data_crc:
            raise UnreadableLog(
                f"corrupt MCAP: data section CRC mismatch (stored {data_crc:#010x}, computed "
                f"{computed:#010x}): bytes damaged after writing"
            )


def _truncation(stream, size: int) -> str:
    """Why a file without its closing magic is incomplete: walk its records to the cut."""
    at = len(MCAP_MAGIC)
    while at + _RECORD_HEAD.size <= size:
        stream.seek(at)
        opcode, length = _RECORD_HEAD.unpack(stream.read(_RECORD_HEAD.size))
        end = at + _RECORD_HEAD.size + length
        if end > size:
            if opcode == _OP_CHUNK:
                return (
                    f"truncated MCAP: cut mid-chunk at byte {size} (the chunk at byte {at} "
                    f"needs {end - at} bytes; file cut off mid-write?)"
                )
            kind = _OPCODES.get(opcode, f"unknown (opcode {opcode:#04x})")
            return (
                f"truncated MCAP: cut inside a {kind} record at byte {size} (the record at "
                f"byte {at} needs {end - at} bytes; file cut off mid-write?)"
            )
        at = end
    return (
        f"truncated MCAP: {size} bytes end without the footer and closing magic "
        "(file cut off mid-write?)"
    )


def _crc32(stream, start: int, end: int) -> int:
    stream.seek(start)
    crc, left = 0, end - start
    while left > 0:
        block = stream.read(min(_READ_BLOCK, left))
        if not block:
            break
        crc = zlib.crc32(block, crc)
        left -= len(block)
    return crc
