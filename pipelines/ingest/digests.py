"""Is an episode the same episode? A content digest per episode id, over what happened (not
where the row came from), the same for a log and an export of it. Ingest compares them to
skip an episode the dataset holds already and to quarantine one whose id is taken."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.contract import schema
from pipelines.ingest.tables import _numeric_matrix

# Episode columns that say where a row came from rather than what happened: left out of the
# digest that decides whether two episodes with one id are the same episode.
_NOT_CONTENT = {
    "source_uri",
    "source_sha256",
    "source_chunk",
    "ingest_run_id",
    "ingested_at",
    "realloop_version",
    "edge_case",
    "edge_case_reasons",
    "attachments",
}


def episode_digests(episodes: pa.Table, steps: pa.Table) -> dict[str, str]:
    """sha256 per episode id over what happened (its episode row without provenance or
    edge-case columns, and its steps), the same for a log and an export of it."""
    content = [n for n in episodes.schema.names if n not in _NOT_CONTENT]
    rows = episodes.select(content)
    if "start_time" in content:
        index = rows.schema.get_field_index("start_time")
        rows = rows.set_column(index, "start_time", rows.column("start_time").cast(pa.int64()))
    codes, names = _codes(steps.column("episode_id"))
    if not _grouped(codes, steps.column("step").to_numpy()):
        order = pc.sort_indices(steps, [("episode_id", "ascending"), ("step", "ascending")])
        steps = steps.take(order)
        codes, names = _codes(steps.column("episode_id"))
    columns = []
    for name in steps.schema.names:
        if name == "episode_id":
            continue
        matrix, valid = _numeric_matrix(steps.column(name))
        columns += [np.ascontiguousarray(matrix), np.ascontiguousarray(valid)]
    bounds = {}
    if len(codes):
        firsts = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
        lasts = np.r_[firsts[1:], len(codes)]
        bounds = {names[codes[a]]: (a, b) for a, b in zip(firsts, lasts, strict=True)}
    digests = {}
    for row in rows.to_pylist():
        h = hashlib.sha256(json.dumps(_content(row), sort_keys=True, default=str).encode())
        a, b = bounds.get(row["episode_id"], (0, 0))
        for column in columns:
            h.update(column[a:b].tobytes())
        digests[row["episode_id"]] = h.hexdigest()
    return digests


def _content(row: dict) -> dict:
    """The row without null trial columns: a production episode's digest is the one it had
    before those columns existed, so digests cached by earlier runs still match."""
    return {k: v for k, v in row.items() if v is not None or k not in schema.TRIAL_COLUMNS}


def _codes(column) -> tuple[np.ndarray, list[str]]:
    """A string column as integer codes and the strings they stand for."""
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    encoded = array.dictionary_encode()
    return encoded.indices.to_numpy(zero_copy_only=False), encoded.dictionary.to_pylist()


def _grouped(ids: np.ndarray, step: np.ndarray) -> bool:
    """Each episode's rows together and in step order (as ingest builds them)?"""
    if len(ids) < 2:
        return True
    change = ids[1:] != ids[:-1]
    if len(set(ids[np.r_[True, change]])) != int(change.sum()) + 1:
        return False
    return bool(np.all(change | (np.diff(step) > 0)))
