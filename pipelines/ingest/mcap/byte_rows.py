"""Fixed-width rows of a byte buffer as one numpy array: a strided view when the rows are
equally spaced, else one gather (shared by the record heads and the CDR payload matrix)."""

from __future__ import annotations

import numpy as np


def _rows(raw: np.ndarray, starts: np.ndarray, width: int) -> np.ndarray:
    """raw[s : s + width] for each start s, as an (n, width) array (zero past the end).

    Equally spaced starts (one channel with one message size) are a strided view of raw,
    no copy; numpy's constructor refuses a view that would reach past the buffer.
    """
    size, n = len(raw), len(starts)
    step = int(starts[1] - starts[0]) if n > 1 else 0
    if step >= width and int(starts[-1]) + width <= size and (np.diff(starts) == step).all():
        return np.ndarray((n, width), np.uint8, raw, int(starts[0]), (step, 1))
    if size >= width:
        window = np.ndarray((size - width + 1, width), np.uint8, raw, 0, (1, 1))
        inside = starts <= size - width
        if inside.all():
            return window[starts]
        out = np.zeros((n, width), np.uint8)
        out[inside] = window[starts[inside]]
    else:
        out, inside = np.zeros((n, width), np.uint8), np.zeros(n, bool)
    for i in np.flatnonzero(~inside):  # at most the chunk's last record
        s = int(starts[i])
        out[i, : size - s] = raw[s:]
    return out
