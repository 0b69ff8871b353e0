"""Hand-built MCAP files that ask the decoder for far more than their size: each is a valid
container (magic, header, data end, footer) around chunks an attacker or a broken writer made."""

from __future__ import annotations

import struct
from pathlib import Path

MAGIC = b"\x89MCAP0\r\n"
_HEADER, _FOOTER, _CHUNK, _DATA_END = 0x01, 0x02, 0x06, 0x0F


def record(opcode: int, body: bytes) -> bytes:
    return struct.pack("<BQ", opcode, len(body)) + body


def string(text: str) -> bytes:
    return struct.pack("<I", len(text)) + text.encode()


def chunk(uncompressed_size: int, compression: str, data: bytes) -> bytes:
    body = struct.pack("<QQQI", 0, 0, uncompressed_size, 0) + string(compression)
    return record(_CHUNK, body + struct.pack("<Q", len(data)) + data)


def write_mcap(path: Path, chunks: list[bytes] | bytes) -> Path:
    """A complete MCAP file holding `chunks` (records), without a summary section."""
    data = b"".join(chunks) if isinstance(chunks, list) else chunks
    content = (
        MAGIC
        + record(_HEADER, string("ros2") + string("bomb-maker"))
        + data
        + record(_DATA_END, struct.pack("<I", 0))
        + record(_FOOTER, struct.pack("<QQI", 0, 0, 0))
        + MAGIC
    )
    path.write_bytes(content)
    return path


def zstd_zeros(size: int) -> bytes:
    """`size` zero bytes as one zstd frame, compressed in 1 MiB steps (never all in memory)."""
    import zstandard

    compressor = zstandard.ZstdCompressor(level=3).compressobj(size=size)
    block, parts, left = bytes(1 << 20), [], size
    while left:
        step = min(left, len(block))
        parts.append(compressor.compress(block[:step]))
        left -= step
    parts.append(compressor.flush())
    return b"".join(parts)


def zip_bomb(path: Path, size: int = 1 << 30) -> Path:
    """One zstd chunk of zeros that inflates to `size` bytes (1 GiB from about 32 KB)."""
    return write_mcap(path, [chunk(size, "zstd", zstd_zeros(size))])


def record_flood(path: Path, records: int) -> Path:
    """One uncompressed chunk of `records` empty 9-byte records."""
    data = bytes(9 * records)
    return write_mcap(path, [chunk(len(data), "", data)])


def chunk_flood(path: Path, chunks: int) -> Path:
    """`chunks` empty chunks: 49 bytes each, nothing to decode, all to walk."""
    return write_mcap(path, chunk(0, "", b"") * chunks)


def ratio_bomb(path: Path, size: int = 60 << 20) -> Path:
    """Under the absolute chunk limit, but inflating zeros by a ratio no log reaches."""
    return write_mcap(path, [chunk(size, "zstd", zstd_zeros(size))])
