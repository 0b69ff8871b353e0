"""Finding the records in a chunk (or a block of the data section) without a MessageIndex: walk
records one by one until their (opcode, length) pattern repeats, then predict the following
record positions from that period and verify the predictions with one numpy gather, so that a
chunk of regular records costs a few vectorized steps instead of one Python step per record.
Every accepted record is verified."""

from __future__ import annotations

import numpy as np

from pipelines.ingest.mcap.records import _OP_NAMES, _RECORD
from pipelines.ingest.mcap.results import CORRUPT, OVER_LIMIT, McapDecodeError

_MAX_PERIOD = 8
_EMPTY = np.zeros(0, np.int64)


def _heads(raw: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(opcodes, lengths) of the records at `offsets` (each must have 9 bytes in raw)."""
    if not len(offsets):
        return np.zeros(0, np.uint8), np.zeros(0, np.int64)
    heads = np.ndarray((len(raw) - 8, 9), np.uint8, raw, 0, (1, 1))[offsets]
    return heads[:, 0], np.ascontiguousarray(heads[:, 1:]).view("<i8").ravel()


def scan_records(
    buf: bytes, start: int, end: int, *, partial: bool = False, max_records: int | None = None
) -> tuple:
    """Offsets, opcodes and lengths (int64 arrays) of the records in buf[start:end].

    With partial=False the records must fill the range exactly (chunk contents); with
    partial=True the scan stops before the first record that does not fit, and also returns
    where it stopped. Periodic runs of records are verified in vectorized steps (see above).
    More than `max_records` records raise McapDecodeError(OVER_LIMIT) as soon as they are seen,
    before their arrays cost memory (a flood of 9-byte records is 24 bytes each here).
    """
    budget = max_records if max_records is not None else end - start  # >= any record count
    found = 0  # records accepted in vectorized runs
    raw = np.frombuffer(buf, np.uint8)
    offs, ops, lens = [], [], []
    starts: list[int] = []  # records walked one by one since the last vectorized run
    keys: list[tuple[int, int]] = []  # their (opcode, length)
    seen: dict[tuple[int, int], int] = {}  # key -> its last index in keys
    pos, wait, backoff = start, 0, 1

    def flush() -> None:
        if starts:
            offs.append(np.array(starts, np.int64))
            ops.append(np.array([k[0] for k in keys], np.int64))
            lens.append(np.array([k[1] for k in keys], np.int64))
            starts.clear()
            keys.clear()
            seen.clear()

    while pos < end:
        if end - pos < 9:
            if partial:
                break
            raise McapDecodeError(CORRUPT, f"{end - pos} stray bytes at the end of a chunk")
        key = _RECORD.unpack_from(buf, pos)
        nxt = pos + 9 + key[1]
        if nxt > end:
            if partial:
                break
            name = _OP_NAMES.get(key[0], hex(key[0]))
            raise McapDecodeError(CORRUPT, f"{name} record runs past the end of its chunk")
        i = len(keys)
        if found + i >= budget:
            _over_limit(budget)
        starts.append(pos)
        keys.append(key)
        last, seen[key] = seen.get(key), i
        pos = nxt
        if wait:
            wait -= 1
            continue
        if last is None:
            continue
        period = i - last  # the same record one period ago: does the whole period repeat?
        if period > _MAX_PERIOD or i + 1 < 2 * period:
            continue
        pattern = keys[i + 1 - period :]
        if keys[i + 1 - 2 * period : i + 1 - period] != pattern:
            continue
        runs = _speculate(raw, pos, end, pattern, budget - found - i)
        if runs is None:
            wait, backoff = backoff, min(backoff * 2, 64)
            continue
        found += len(starts)
        flush()
        for run in runs:
            found += len(run[0])
            offs.append(run[0])
            ops.append(run[1])
            lens.append(run[2])
        pos = int(runs[-1][0][-1] + 9 + runs[-1][2][-1])
        backoff = 1
        if found > budget or (found == budget and pos < end):
            _over_limit(budget)
    flush()
    result = tuple(np.concatenate(x) if x else _EMPTY for x in (offs, ops, lens))
    return (*result, pos) if partial else result


def _over_limit(budget: int) -> None:
    raise McapDecodeError(
        OVER_LIMIT,
        f"a chunk holds more than {budget} records "
        "(ingest.decode_limits.max_records_per_chunk): a record flood",
    )


def _speculate(raw: np.ndarray, pos: int, end: int, pattern: list, budget: int) -> list | None:
    """Predict records from `pos` on as repetitions of `pattern` [(opcode, length)]; keep the
    verified prefix, at most about `budget` records. Returns [(offsets, opcodes, lengths)] of
    accepted runs, or None."""
    period = len(pattern)
    phase = np.cumsum([0] + [9 + length for _, length in pattern])
    stride = int(phase[-1])
    want_op = np.array([op for op, _ in pattern], np.int64)
    want_len = np.array([length for _, length in pattern], np.int64)
    runs, reps = [], 16
    while True:
        reps = min(reps, (end - pos) // stride, budget // period + 1)
        if reps <= 0:
            break
        starts = (pos + stride * np.arange(reps)[:, None] + phase[:-1]).ravel()
        op, length = _heads(raw, starts)
        bad = (op.reshape(reps, period) != want_op) | (length.reshape(reps, period) != want_len)
        good = int(np.argmax(bad)) if bad.any() else len(starts)  # first bad, row-major
        if good:
            budget -= good
            ops = np.broadcast_to(want_op, (reps, period)).ravel()[:good]
            lens = np.broadcast_to(want_len, (reps, period)).ravel()[:good]
            runs.append((starts[:good], ops, lens))
            pos = int(starts[good - 1] + 9 + lens[-1])
        if good < len(starts):
            break
        reps *= 4
    return runs or None
