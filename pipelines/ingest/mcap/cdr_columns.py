"""Payloads of one message type -> numpy columns. Payloads are grouped by length; the first of
a group is walked in full (the template), the others are checked against its structural bytes
in one vectorized comparison and their numbers read as views at its offsets. Payloads that do
not match get templates of their own, and past a few templates a per-message slow path."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from pipelines.ingest.mcap.byte_rows import _rows
from pipelines.ingest.mcap.cdr_walk import _Layout, _walk
from pipelines.ingest.mcap.results import Labels, TopicArrays
from pipelines.ingest.mcap.ros2_types import _PROGRAMS

_MAX_TEMPLATES = 8  # distinct layouts tried per (channel, length) group before the slow path


@dataclass
class _Piece:
    rows: np.ndarray | None  # indices into the messages decoded together; None: all, in order
    numbers: dict[str, np.ndarray]
    labels: dict[str, np.ndarray | int]  # name -> codes (n,), or one code for all rows
    lengths: dict[str, np.ndarray | int] = field(default_factory=dict)  # of float sequences


class _TypeDecoder:
    """Decodes the payloads of one message type; keeps the label tables of one topic."""

    def __init__(self, datatype: str):
        self.datatype = datatype
        self.program = _PROGRAMS[datatype]
        self.strings = datatype == "std_msgs/msg/String"  # free text: one str per message
        self.label_names = [
            n for k, n in self.program if k in ("string", "string[]") and not self.strings
        ]
        self.tables: dict[str, dict] = {n: {} for n in self.label_names}

    def code(self, name: str, value) -> int:
        table = self.tables[name]
        code = table.get(value)
        if code is None:
            code = table[value] = len(table)
        return code

    def decode(self, data: bytes, data_off: np.ndarray, data_len: np.ndarray) -> _Piece:
        """The payloads at data[data_off[i] : data_off[i] + data_len[i]], in this order."""
        if self.strings:
            return self._strings(data, data_off, data_len)
        raw = np.frombuffer(data, np.uint8)
        if data_len.min() == data_len.max():
            return self._group(data, raw, data_off, int(data_len[0]))
        lengths = np.unique(data_len)
        pieces = []
        for length in lengths.tolist():
            rows = np.flatnonzero(data_len == length)
            piece = self._group(data, raw, data_off[rows], length)
            piece.rows = rows if piece.rows is None else rows[piece.rows]
            pieces.append(piece)
        return _merge(pieces, len(data_off))

    def _group(self, data: bytes, raw: np.ndarray, data_off: np.ndarray, length: int) -> _Piece:
        """Payloads of one length: a template, a vectorized check, views at its offsets; the
        payloads that do not match get templates of their own, then the slow path."""
        total = len(data_off)
        pieces, todo = [], np.arange(total)
        for _ in range(_MAX_TEMPLATES):
            if not len(todo):
                break
            start = int(data_off[todo[0]])
            template = data[start : start + length]
            _, layout = _walk(template, self.program)
            matrix, match = _match(raw, data_off[todo], length, template, layout)
            if match.all():
                pieces.append(self._piece(todo, matrix, layout, total))
                todo = todo[:0]
            else:
                pieces.append(self._piece(todo[match], matrix[match], layout, total))
                todo = todo[~match]
        for i in todo.tolist():  # odd payloads: one by one
            start = int(data_off[i])
            pieces.append(self._slow(np.array([i]), data[start : start + length]))
        return pieces[0] if len(pieces) == 1 else _merge(pieces, total)

    def _piece(self, rows: np.ndarray, matrix: np.ndarray, layout: _Layout, total: int) -> _Piece:
        e = "<" if layout.little_endian else ">"
        numbers = {}
        for name, kind, off, count in layout.numbers:
            col = off + 4  # matrix rows start 4 bytes before the payload
            if kind == "time":
                words = matrix.view(e + "u4")
                sec = words[:, col // 4].view(e + "i4").astype(np.int64)
                numbers[name] = sec * 1_000_000_000 + words[:, col // 4 + 1]
            elif kind in ("f8", "f8[]"):
                view = matrix.view(e + "f8")[:, col // 8 : col // 8 + count]
                numbers[name] = np.ascontiguousarray(view, dtype=np.float64)
            else:  # f4
                numbers[name] = np.ascontiguousarray(matrix.view(e + "f4")[:, col // 4], np.float32)
        labels = {name: self.code(name, value) for name, value in layout.labels.items()}
        lengths = {name: count for name, kind, _, count in layout.numbers if kind == "f8[]"}
        return _Piece(None if len(rows) == total else rows, numbers, labels, lengths)

    def _slow(self, rows: np.ndarray, payload: bytes) -> _Piece:
        values, _ = _walk(payload, self.program)
        numbers, labels, lengths = {}, {}, {}
        for kind, name in self.program:
            value = values[name]
            if kind == "f8[]":
                lengths[name] = len(value)
            if kind in ("string", "string[]"):
                labels[name] = self.code(name, value)
            elif kind == "time":
                numbers[name] = np.array([value], np.int64)
            elif kind == "f4":
                numbers[name] = np.array([value], np.float32)
            else:
                numbers[name] = np.array([value], np.float64).reshape(1, -1)
        return _Piece(rows, numbers, labels, lengths)

    def _strings(self, data: bytes, data_off: np.ndarray, data_len: np.ndarray) -> _Piece:
        out = np.empty(len(data_off), dtype=object)
        for i, (start, length) in enumerate(zip(data_off.tolist(), data_len.tolist(), strict=True)):
            payload = data[start : start + length]
            if length >= 8 and payload[:2] == b"\x00\x01":
                n = int.from_bytes(payload[4:8], "little")
                if 8 + n <= length:
                    try:
                        out[i] = payload[8 : 7 + n].decode() if n else ""
                        continue
                    except UnicodeDecodeError:
                        pass
            out[i] = _walk(payload, self.program)[0]["data"]  # raises the precise error
        return _Piece(None, {"data": out}, {})


def _match(raw, data_off, length, template, layout) -> tuple[np.ndarray, np.ndarray]:
    """(matrix, match): the payloads as rows starting 4 bytes before each payload, padded to a
    multiple of 8 bytes so that CDR-aligned numbers are aligned views; match says which rows
    have the template's structural bytes."""
    width, mask_w, tpl_w, runs = _plan(length, layout.const, template)
    matrix = _rows(raw, data_off - 4, width)
    words = matrix.view("<u8")
    diffs = []
    for w0, w1 in runs:  # runs of words holding structural bytes (not the numbers between)
        diff = words[:, w0:w1] & mask_w[w0:w1]
        diff ^= tpl_w[w0:w1]
        diffs.append(diff)
    if not any(d.any() for d in diffs):  # the usual case: all have the template's layout
        return matrix, np.ones(len(matrix), bool)
    bad = np.zeros(len(matrix), bool)
    for diff in diffs:
        bad |= diff.any(axis=1)
    return matrix, ~bad


@functools.lru_cache(maxsize=256)
def _plan_cached(length: int, const: tuple, structural: bytes):
    width = (length + 4 + 7) // 8 * 8
    mask = np.zeros(width, np.uint8)
    tpl = np.zeros(width, np.uint8)
    at = 0
    for a, b in const:
        mask[a + 4 : b + 4] = 0xFF
        tpl[a + 4 : b + 4] = np.frombuffer(structural[at : at + b - a], np.uint8)
        at += b - a
    mask_w, tpl_w = mask.view("<u8"), tpl.view("<u8")
    return width, mask_w, tpl_w, _runs(np.flatnonzero(mask_w))


def _plan(length: int, const: tuple, template: bytes):
    """Row width, word mask and template words of the structural bytes, and their runs."""
    structural = b"".join(template[a:b] for a, b in const)
    return _plan_cached(length, const, structural)


def _runs(words: np.ndarray) -> list[tuple[int, int]]:
    """Sorted word indices -> [(first, last + 1)] of runs, bridging gaps of one word."""
    breaks = np.flatnonzero(np.diff(words) > 2)
    starts = np.concatenate(([words[0]], words[breaks + 1]))
    ends = np.concatenate((words[breaks], [words[-1]])) + 1
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def _merge(pieces: list[_Piece], n: int) -> _Piece:
    """Pieces covering rows 0..n-1 between them -> one piece in row order."""
    numbers: dict[str, np.ndarray] = {}
    labels: dict[str, np.ndarray] = {}
    order = [np.arange(n) if p.rows is None else p.rows for p in pieces]
    for name in pieces[0].numbers:
        parts = [p.numbers[name] for p in pieces]
        numbers[name] = _scatter(parts, order, n)
    lengths: dict[str, np.ndarray] = {}
    for out, key in ((labels, "labels"), (lengths, "lengths")):
        for name in getattr(pieces[0], key):
            codes = np.empty(n, np.int32)
            for p, rows in zip(pieces, order, strict=True):
                codes[rows] = getattr(p, key)[name]
            out[name] = codes
    return _Piece(None, numbers, labels, lengths)


def _scatter(parts: list[np.ndarray], order: list[np.ndarray], n: int) -> np.ndarray:
    first = parts[0]
    if first.dtype == object:
        out = np.empty(n, dtype=object)
        for part, rows in zip(parts, order, strict=True):
            out[rows] = part
        return out
    dtype = np.result_type(*[p.dtype for p in parts]).newbyteorder("=")
    if first.ndim == 1:
        out = np.empty(n, dtype)
        for part, rows in zip(parts, order, strict=True):
            out[rows] = part
        return out
    width = max(p.shape[1] for p in parts)
    same = all(p.shape[1] == width for p in parts)
    out = np.empty((n, width), dtype) if same else np.full((n, width), np.nan, dtype)
    for part, rows in zip(parts, order, strict=True):
        out[rows, : part.shape[1]] = part
    return out


def _arrays(topic: str, decoder: _TypeDecoder, log_time: np.ndarray, piece: _Piece) -> TopicArrays:
    n = len(log_time)

    def column(codes) -> np.ndarray:
        return codes if isinstance(codes, np.ndarray) else np.full(n, codes, np.int32)

    labels = {
        name: Labels(list(decoder.tables[name]), column(piece.labels[name]))
        for name in decoder.label_names
    }
    lengths = {name: column(value) for name, value in piece.lengths.items()}
    return TopicArrays(topic, decoder.datatype, log_time, dict(piece.numbers), labels, lengths)
