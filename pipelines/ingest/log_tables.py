"""The contract's mapping of a decoded shift log onto the episodes and steps tables.

Episodes come from the start/end events on the events topic; each control step is one
message time of the per-step topics, aligned to its episode's start at the control rate.
Every departure from docs/data-contract.md raises ContractViolation with a one-line reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from pipelines.contract import schema
from pipelines.contract.params import CellParams
from pipelines.ingest.decoded import (
    METADATA_KEYS,
    PER_STEP_TOPICS,
    ContractViolation,
    DecodedLog,
    check_channels,
)
from pipelines.ingest.tables import (
    Provenance,
    _finish_episodes,
    _vectors,
    conform,
    trial_problem,
)


@dataclass
class _Episode:
    episode_id: str
    start_ns: int
    start: dict
    end_ns: int = -1
    end: dict | None = None
    interventions: list[dict] = field(default_factory=list)
    safety_stops: list[dict] = field(default_factory=list)


def build_tables(
    log: DecodedLog,
    cell: CellParams,
    min_steps: int,
    provenance: Provenance,
    *,
    max_clock_jump_s: float | None = None,
) -> tuple[pa.Table, pa.Table]:
    """The episodes and steps tables of one decoded log, conforming to the schemas.

    Edge-case columns are left empty here (`edge_case` false, lists null); see
    `mark_edge_cases`. Values are checked by `check_values`. Raises ContractViolation with a
    one-line reason.
    """
    check_channels(log.channels)
    meta = cell_metadata(log)
    missing = [t for t in schema.REQUIRED_TOPICS if log.topic_counts.get(t, 0) == 0]
    if missing:
        raise ContractViolation(f"missing required topic(s): {', '.join(missing)}")
    dt_ns = int(1e9 / int(meta["control_hz"]))
    episodes = _episodes_from_events(log.events)
    rows = _align_steps(log, episodes, dt_ns, min_steps, max_clock_jump_s)
    steps = _steps_table(log, episodes, rows, cell)
    return _episodes_table(log, episodes, meta, provenance), steps


def cell_metadata(log: DecodedLog) -> dict[str, str]:
    """The `realloop.cell` metadata record: provenance, the control rate and, in a trial
    log, the trial's request, arm and attempt (all three or none)."""
    meta = log.metadata.get(schema.METADATA_NAME)
    if meta is None:
        found = ", ".join(sorted(log.metadata)) or "none"
        raise ContractViolation(
            f"no MCAP metadata record '{schema.METADATA_NAME}' (cell provenance); "
            f"metadata records found: {found}"
        )
    lacking = [k for k in METADATA_KEYS if not meta.get(k)]
    if lacking:
        raise ContractViolation(f"metadata '{schema.METADATA_NAME}' lacks {', '.join(lacking)}")
    try:
        hz = int(meta["control_hz"])
    except ValueError:
        hz = 0
    if hz <= 0:
        raise ContractViolation(f"metadata control_hz={meta['control_hz']!r} is not a positive int")
    problem = trial_problem(meta)
    if problem:
        raise ContractViolation(f"metadata '{schema.METADATA_NAME}': {problem}")
    return meta


def _episodes_from_events(events: list[tuple[int, str]]) -> list[_Episode]:
    by_id: dict[str, _Episode] = {}
    for t, text in events:
        try:
            event = json.loads(text)
            kind, episode_id = event["event"], event["episode_id"]
        except (json.JSONDecodeError, TypeError, KeyError):
            raise ContractViolation(
                f"{schema.TOPIC_EVENTS} at log time {t}: not a JSON object with event and "
                "episode_id"
            ) from None
        if not isinstance(episode_id, str) or not episode_id:
            raise ContractViolation(
                f"{schema.TOPIC_EVENTS} at log time {t}: episode_id {episode_id!r} is not a string"
            )
        episode = by_id.get(episode_id)
        if kind == "start":
            if episode is not None:
                raise ContractViolation(f"episode {episode_id}: two start events")
            by_id[episode_id] = _Episode(episode_id, t, event)
        elif episode is None:
            if kind in ("end", "intervention", "safety_stop"):
                raise ContractViolation(f"episode {episode_id}: {kind} event before its start")
        elif kind == "end":
            if episode.end is not None:
                raise ContractViolation(f"episode {episode_id}: two end events")
            episode.end_ns, episode.end = t, event
        elif kind == "intervention":
            episode.interventions.append(event)
        elif kind == "safety_stop":
            episode.safety_stops.append(event)
    episodes = sorted(by_id.values(), key=lambda e: e.start_ns)
    if not episodes:
        raise ContractViolation("no episodes: the log has no start events")
    for episode, following in zip(episodes, [*episodes[1:], None], strict=True):
        if episode.end is None:
            raise ContractViolation(f"episode {episode.episode_id}: start event without an end")
        if following is not None and following.start_ns < episode.end_ns:
            raise ContractViolation(
                f"episodes {episode.episode_id} and {following.episode_id} overlap"
            )
    return episodes


@dataclass
class _Rows:
    """Per control step: the episode (index into the episode list) and the step index."""

    episode: np.ndarray
    step: np.ndarray
    time_ns: np.ndarray
    offsets: np.ndarray  # first row of each episode


def _align_steps(
    log: DecodedLog,
    episodes: list[_Episode],
    dt_ns: int,
    min_steps: int,
    max_clock_jump_s: float | None = None,
) -> _Rows:
    t = log.joint_time
    per_step = {
        schema.TOPIC_JOINT_STATES: t,
        schema.TOPIC_PART_POSE: log.pose_time,
        schema.TOPIC_PART_CONFIDENCE: log.confidence_time,
        schema.TOPIC_COMMAND: log.command_time,
    }
    _check_time_order(log, per_step, episodes)
    for topic, other in per_step.items():
        if not np.array_equal(t, other):
            raise ContractViolation(
                f"per-step topics not aligned: {len(t)} {schema.TOPIC_JOINT_STATES} vs "
                f"{len(other)} {topic} messages, or their log times differ"
            )
    starts = np.array([e.start_ns for e in episodes], dtype=np.int64)
    ends = np.array([e.end_ns for e in episodes], dtype=np.int64)
    episode = np.searchsorted(starts, t, side="right") - 1
    if max_clock_jump_s is not None:
        _check_clock_jumps(t, episode, starts, episodes, max_clock_jump_s)
    outside = (episode < 0) | (t >= ends[np.clip(episode, 0, None)])
    if outside.any():
        raise ContractViolation(
            f"{int(outside.sum())} control steps lie outside every episode window "
            f"(first at log time {int(t[outside][0])})"
        )
    counts = np.bincount(episode, minlength=len(episodes))
    for ep, n in zip(episodes, counts, strict=True):
        declared = ep.end.get("steps")
        if not isinstance(declared, int) or declared != n:
            raise ContractViolation(
                f"episode {ep.episode_id}: end event says {declared!r} steps but the log has "
                f"{int(n)} step timestamps"
            )
    for ep, n in zip(episodes, counts, strict=True):
        if n < min_steps:
            raise ContractViolation(
                f"episode {ep.episode_id} has {int(n)} steps, fewer than ingest.min_steps "
                f"({min_steps})"
            )
    offsets = np.cumsum(counts) - counts
    relative = t - starts[episode]
    step = (relative + dt_ns // 2) // dt_ns  # round((log_time - start) / dt_ns)
    expected = np.arange(len(t)) - offsets[episode]
    if not np.array_equal(step, expected):
        bad = int(np.flatnonzero(step != expected)[0])
        raise ContractViolation(
            f"episode {episodes[episode[bad]].episode_id}: step timestamps are not one per "
            f"{dt_ns / 1e6:g} ms from its start (row {int(expected[bad])} falls on step "
            f"{int(step[bad])})"
        )
    return _Rows(episode, step.astype(np.int32), relative, offsets)


def _check_time_order(
    log: DecodedLog, per_step: dict[str, np.ndarray], episodes: list[_Episode]
) -> None:
    """Log times that go back in file order, then log times that repeat."""
    for topic in (*PER_STEP_TOPICS, schema.TOPIC_EVENTS):
        count, at, before = log.time_backsteps.get(topic, (0, 0, 0))
        if count:
            raise ContractViolation(
                f"non-monotonic timestamps: {count} {topic} message(s) earlier than the one "
                f"before them in the file (first at log time {at}, after {before}"
                f"{_in_episode(episodes, at)})"
            )
    for topic, times in per_step.items():
        repeats = np.flatnonzero(np.diff(times) == 0)
        if repeats.size:
            at = int(times[repeats[0]])
            raise ContractViolation(
                f"duplicate timestamps: {repeats.size} {topic} message(s) repeat the log time "
                f"of the one before (first at log time {at}{_in_episode(episodes, at)})"
            )


def _in_episode(episodes: list[_Episode], t: int) -> str:
    for episode in episodes:
        if episode.start_ns <= t <= episode.end_ns:
            return f", in episode {episode.episode_id}"
    return ""


def _check_clock_jumps(
    t: np.ndarray,
    episode: np.ndarray,
    starts: np.ndarray,
    episodes: list[_Episode],
    max_clock_jump_s: float,
) -> None:
    """A gap between consecutive control steps of one episode (or between its start event
    and its first step) longer than max_clock_jump_s: the clock stepped, not the cell."""
    if not len(t):
        return
    first = np.r_[True, episode[1:] != episode[:-1]]
    previous = np.where(first, starts[np.clip(episode, 0, None)], np.r_[0, t[:-1]])
    gap = t - previous
    over = np.flatnonzero((episode >= 0) & (gap > int(max_clock_jump_s * 1e9)))
    if not over.size:
        return
    i = int(over[0])
    index = int(episode[i])
    step = i - int(np.flatnonzero(episode == index)[0])
    where = "its start event and its first step" if first[i] else f"steps {step - 1} and {step}"
    raise ContractViolation(
        f"clock jump: log time jumps {gap[i] / 1e9:.3f} s between {where} of episode "
        f"{episodes[index].episode_id} (over ingest.max_clock_jump_s = {max_clock_jump_s:g} s)"
    )


def _steps_table(
    log: DecodedLog, episodes: list[_Episode], rows: _Rows, cell: CellParams
) -> pa.Table:
    n = len(rows.step)
    intervention = np.zeros(n, dtype=bool)
    corrected = np.zeros((n, 2), dtype=np.float32)
    for index, ep in enumerate(episodes):
        steps = ep.end["steps"]
        for event in ep.interventions:
            step, action = event.get("step"), event.get("corrected_action")
            if not isinstance(step, int) or not 0 <= step < steps:
                raise ContractViolation(
                    f"episode {ep.episode_id}: intervention event at step {step!r} is outside "
                    f"its {steps} steps"
                )
            if not _is_vector(action, 2):
                raise ContractViolation(
                    f"episode {ep.episode_id}: intervention at step {step} lacks a "
                    "corrected_action [vx, vy]"
                )
            row = rows.offsets[index] + step
            intervention[row] = True
            corrected[row] = action
    yaw = 2.0 * np.arctan2(log.pose_zw[:, 0], log.pose_zw[:, 1])
    part_pose = np.column_stack([log.pose_xy, yaw])
    action = log.command_mps / cell.max_speed_mps
    ids = pa.array([e.episode_id for e in episodes], pa.string())
    table = pa.table(
        {
            "episode_id": pa.DictionaryArray.from_arrays(
                pa.array(rows.episode.astype(np.int32)), ids
            ).cast(pa.string()),
            "step": pa.array(rows.step, pa.int32()),
            "time_s": pa.array(rows.time_ns / 1e9, pa.float64()),
            "joint_position": _vectors(log.joint_position),
            "joint_velocity": _vectors(log.joint_velocity),
            "part_pose": _vectors(part_pose),
            "part_confidence": pa.array(log.confidence, pa.float32()),
            "action": _vectors(action),
            "intervention": pa.array(intervention, pa.bool_()),
            "corrected_action": _vectors(corrected, null=~intervention),
        }
    )
    return conform(table, schema.STEPS_SCHEMA, "steps")


def _episodes_table(
    log: DecodedLog, episodes: list[_Episode], meta: dict[str, str], prov: Provenance
) -> pa.Table:
    n = len(episodes)
    starts = [e.start_ns for e in episodes]
    ends = [e.end for e in episodes]
    columns = {
        "episode_id": [e.episode_id for e in episodes],
        **{key: [meta[key]] * n for key in METADATA_KEYS if key != "control_hz"},
        **{key: pa.array([meta.get(key)] * n, pa.string()) for key in schema.TRIAL_COLUMNS},
        "source_chunk": [_byte_range(log.chunks, e.start_ns, e.end_ns) for e in episodes],
        "start_time": pa.array(np.array(starts, dtype=np.int64), pa.int64()).cast(
            pa.timestamp("ns", tz="UTC")
        ),
        "target": _vectors(np.array([_target(log, e) for e in episodes]).reshape(n, 2)),
        "part_extent_m": pa.array(
            [_optional_vector(e.start.get("part_extent_m"), 2) for e in episodes],
            pa.list_(pa.float32(), 2),
        ),
        "success": [_end_field(e, "outcome", str) == "success" for e in episodes],
        "failure_cause": [
            _optional_text(e, end, "failure_cause") for e, end in zip(episodes, ends, strict=True)
        ],
        "safety_stops": [_end_field(e, "safety_stops", int) for e in episodes],
        "safety_stop_kind": [
            _text(e.safety_stops[-1].get("limit")) if e.safety_stops else None for e in episodes
        ],
        "interventions": [_end_field(e, "interventions", int) for e in episodes],
        "steps": [end["steps"] for end in ends],
        "cycle_time_s": [float(_end_field(e, "cycle_time_s", (int, float))) for e in episodes],
    }
    return _finish_episodes(columns, n, prov)


def _target(log: DecodedLog, episode: _Episode) -> list[float]:
    """/target_pose at the episode start (full precision), else the start event's target."""
    i = int(np.searchsorted(log.target_time, episode.start_ns))
    if i < len(log.target_time) and log.target_time[i] == episode.start_ns:
        return log.target_xy[i].tolist()
    target = episode.start.get("target")
    if not _is_vector(target, 2):
        raise ContractViolation(f"episode {episode.episode_id}: no target at its start")
    return [float(x) for x in target]


def _end_field(episode: _Episode, name: str, kind):
    value = episode.end.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ContractViolation(
            f"episode {episode.episode_id}: end event field {name}={value!r} is missing or "
            "of the wrong type"
        )
    return value


def _optional_text(episode: _Episode, event: dict, name: str) -> str | None:
    value = event.get(name)
    if value is not None and not isinstance(value, str):
        raise ContractViolation(
            f"episode {episode.episode_id}: event field {name}={value!r} is not a string"
        )
    return value


def _text(value) -> str | None:
    return value if isinstance(value, str) else None


def _byte_range(chunks: list[tuple[int, int, int, int]], start: int, end: int) -> str | None:
    """HTTP-style inclusive byte range of the chunks holding the episode's messages."""
    spans = [
        (off, off + length) for first, last, off, length in chunks if first <= end and last >= start
    ]
    if not spans:
        return None
    return f"bytes={min(s for s, _ in spans)}-{max(e for _, e in spans) - 1}"


def _is_vector(value, size: int) -> bool:
    return (
        isinstance(value, list)
        and len(value) == size
        and all(isinstance(x, int | float) and not isinstance(x, bool) for x in value)
    )


def _optional_vector(value, size: int) -> list[float] | None:
    return [float(x) for x in value] if _is_vector(value, size) else None
