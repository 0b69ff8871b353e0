"""How much work one MCAP file may ask of the decoder, checked before the work is done.

A file's size says little about what decoding it costs: a 37 KB zstd chunk of zeros declares
about 1 GB uncompressed, and the record scan of that gigabyte would build offset arrays several
times larger; 100,000 one-message chunks make 25 MB take half a minute. So every chunk is held
to an absolute size and to a ratio over its compressed bytes before it is decompressed (which
also bounds a file's total output by ratio x file size), a scan stops at a record count, and a
file at a chunk count. Writers use chunks of about 1 MiB (rosbag2: 768 KiB) with a few thousand
records each, compressing joint states and poses 3-10x: the defaults leave them far inside.
"""

from __future__ import annotations

from dataclasses import dataclass

# Chunks this small may compress by any ratio: they cannot cost memory, and a short chunk of
# repetitive messages legitimately shrinks to a few bytes.
RATIO_EXEMPT_BYTES = 1 << 16


@dataclass(frozen=True)
class DecodeLimits:
    max_chunk_bytes: int = 64 << 20  # uncompressed bytes of one chunk
    max_compression_ratio: float = 100.0  # uncompressed / compressed bytes of one chunk
    max_records_per_chunk: int = 500_000
    max_chunks_per_file: int = 10_000

    def chunk_refusal(self, uncompressed: int, compressed: int) -> str | None:
        """Why a chunk declaring `uncompressed` bytes from `compressed` must not be inflated."""
        if uncompressed > self.max_chunk_bytes:
            return (
                f"declares {uncompressed} bytes uncompressed, over the "
                f"{self.max_chunk_bytes}-byte chunk limit (ingest.decode_limits.max_chunk_bytes)"
            )
        ratio = uncompressed / max(compressed, 1)
        if uncompressed > RATIO_EXEMPT_BYTES and ratio > self.max_compression_ratio:
            return (
                f"would inflate {compressed} bytes to {uncompressed} (ratio {ratio:.0f}, over "
                f"ingest.decode_limits.max_compression_ratio {self.max_compression_ratio:g}): "
                "a decompression bomb"
            )
        return None
