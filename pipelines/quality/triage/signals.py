"""Triage signals: per episode (or per capture window) a few numbers a person can check by
hand, computed vectorised from the steps table (`episode_signals`). docs/triage.md explains
each one."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.contract.params import CellParams, TriageParams

_SMOOTH_STEPS = 5  # moving-average window for perceived part motion and yaw
_MIN_PUSH_STEPS = 3  # fewer pushing steps than this: no push gap (NaN)


@dataclass(frozen=True)
class Signals:
    """What the logs say about one episode (or one capture window of it).

    Lengths in metres, speeds in m/s, latency in control steps; NaN where the window is too
    short to tell.
    """

    episode_id: str
    steps: int  # control steps in the window
    success: bool
    failure_cause: str | None  # as the cell reported it
    safety_stops: int
    safety_stop_kind: str | None
    interventions: int
    part_extent_m: float  # mean of the measured extent (x, y)
    extent_offset_m: float  # part_extent_m - triage.nominal_part_extent_m
    yaw_turn_rad: float  # range of the smoothed perceived yaw (mod 90°: box symmetry)
    confidence_mean: float
    confidence_min: float
    pose_jitter_m: float  # std of perceived position noise per axis, part at rest
    penetration_m: float  # deepest the pusher appears inside the perceived part
    push_gap_m: float  # perceived gap between pusher and part while it pushes (signed)
    latency_steps: float  # command-to-velocity lag that best cross-correlates them
    tracking_error_mps: float  # RMS of measured minus commanded velocity at that lag
    slide_m: float  # distance the part moved other than with the pusher (slip)
    final_distance_m: float  # perceived part to target at the window's end
    # From the capture snapshots (`snapshots.snapshot_evidence`); NaN without them.
    part_radius_m: float = float("nan")  # the part's radius as the snapshots draw it
    camera_offset_m: float = float("nan")  # the camera's offset at this episode's light
    # From a replay in the calibrated sim (`counterfactual`); NaN where none was run.
    standard_part_success: float = float("nan")  # share of standard-part replays placed

    def as_dict(self) -> dict:
        return {k: rounded(v) for k, v in asdict(self).items()}


def rounded(value):
    if isinstance(value, float):
        return None if np.isnan(value) else round(value, 5)
    return value


def episode_signals(
    episodes: pa.Table,
    steps: pa.Table,
    cell: CellParams,
    params: TriageParams,
    until_step: Mapping[str, int] | None = None,
    window_steps: int | None = None,
) -> list[Signals]:
    """Signals of every episode in `episodes` from its rows in `steps`.

    With `until_step`, each listed episode is cut to the window that ends at that step
    (inclusive) and starts `window_steps` earlier: what a capture saw.
    """
    if episodes.num_rows == 0:
        return []
    ids = episodes.column("episode_id").to_pylist()
    rows = steps.filter(pc.is_in(steps.column("episode_id"), pa.array(ids, pa.string())))
    rows = rows.sort_by([("episode_id", "ascending"), ("step", "ascending")])
    row_ids = rows.column("episode_id").to_numpy(zero_copy_only=False)
    starts = {}
    if len(row_ids):
        unique, first = np.unique(row_ids, return_index=True)
        bounds = np.append(first, len(row_ids))
        starts = {e: (int(bounds[i]), int(bounds[i + 1])) for i, e in enumerate(unique)}
    step_index = rows.column("step").to_numpy()
    arrays = {
        "joint_position": _matrix(rows.column("joint_position"), 2),
        "joint_velocity": _matrix(rows.column("joint_velocity"), 2),
        "part_pose": _matrix(rows.column("part_pose"), 3),
        "part_confidence": rows.column("part_confidence").to_numpy().astype(np.float64),
        "action": _matrix(rows.column("action"), 2),
    }
    out = []
    for row in episodes.to_pylist():
        episode_id = row["episode_id"]
        lo, hi = starts.get(episode_id, (0, 0))
        if until_step is not None and episode_id in until_step:
            last = until_step[episode_id]
            keep = (step_index[lo:hi] <= last) & (
                step_index[lo:hi] > last - (window_steps or last + 1)
            )
            picked = np.flatnonzero(keep) + lo
        else:
            picked = np.arange(lo, hi)
        window = {k: v[picked] for k, v in arrays.items()}
        out.append(_signals(row, window, cell, params))
    return out


def yaw_turns(steps: pa.Table, episode_ids: list[str]) -> dict[str, float]:
    """`yaw_turn_rad` of each listed episode over all its steps (NaN if too short): the one
    signal that tells a box from a cylinder without a snapshot, read alone because it is
    cheap (data selection runs it on every cycle's episodes)."""
    if not episode_ids:
        return {}
    rows = steps.filter(pc.is_in(steps.column("episode_id"), pa.array(episode_ids, pa.string())))
    rows = rows.sort_by([("episode_id", "ascending"), ("step", "ascending")])
    ids = rows.column("episode_id").to_numpy(zero_copy_only=False)
    yaw = _matrix(rows.column("part_pose"), 3)[:, 2]
    unique, first = np.unique(ids, return_index=True)
    bounds = np.append(first, len(ids))
    out = dict.fromkeys(episode_ids, float("nan"))
    for i, episode_id in enumerate(unique):
        out[episode_id] = _yaw_turn(yaw[bounds[i] : bounds[i + 1]])
    return out


def _matrix(column: pa.ChunkedArray, width: int) -> np.ndarray:
    flat = pc.list_flatten(column.combine_chunks()) if column.num_chunks else pa.array([])
    return np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.float64).reshape(-1, width)


def _signals(
    row: dict, w: dict[str, np.ndarray], cell: CellParams, params: TriageParams
) -> Signals:
    n = len(w["part_confidence"])
    extent = row["part_extent_m"]
    part_extent = float(np.mean(extent)) if extent else float("nan")
    pusher, part = w["joint_position"], w["part_pose"][:, :2]
    target = np.asarray(row["target"], dtype=np.float64)
    contact = cell.pusher_radius_m + (part_extent if extent else params.nominal_part_extent_m) / 2
    latency, tracking = _latency(w["action"] * cell.max_speed_mps, w["joint_velocity"], params)
    return Signals(
        episode_id=row["episode_id"],
        steps=n,
        success=bool(row["success"]),
        failure_cause=row["failure_cause"],
        safety_stops=int(row["safety_stops"]),
        safety_stop_kind=row["safety_stop_kind"],
        interventions=int(row["interventions"]),
        part_extent_m=part_extent,
        extent_offset_m=part_extent - params.nominal_part_extent_m,
        yaw_turn_rad=_yaw_turn(w["part_pose"][:, 2]),
        confidence_mean=float(np.mean(w["part_confidence"])) if n else float("nan"),
        confidence_min=float(np.min(w["part_confidence"])) if n else float("nan"),
        pose_jitter_m=_pose_jitter(part, pusher, contact, params),
        penetration_m=_penetration(part, pusher, contact),
        push_gap_m=_push_gap(part, pusher, w["joint_velocity"], contact, cell.dt, params),
        latency_steps=latency,
        tracking_error_mps=tracking,
        slide_m=_slide(part, w["joint_velocity"], cell.dt, params),
        final_distance_m=float(np.linalg.norm(part[-1] - target)) if n else float("nan"),
    )


def _smooth(values: np.ndarray, width: int = _SMOOTH_STEPS) -> np.ndarray:
    """Centred moving average along axis 0 (valid part only)."""
    if len(values) < width:
        return values[:0]
    kernel = np.ones(width) / width
    if values.ndim == 1:
        return np.convolve(values, kernel, mode="valid")
    return np.stack([np.convolve(c, kernel, mode="valid") for c in values.T], axis=1)


def _yaw_turn(yaw: np.ndarray) -> float:
    """How far the part turned: a cylinder pushed through its centre barely turns, a box
    pushed on a face swings round. Yaw is taken modulo 90° (a square looks the same)."""
    if len(yaw) < 2 * _SMOOTH_STEPS:
        return float("nan")
    quarter = np.unwrap(4.0 * yaw) / 4.0
    smoothed = _smooth(quarter)
    return float(np.ptp(smoothed))


def _pose_jitter(
    part: np.ndarray, pusher: np.ndarray, contact: float, params: TriageParams
) -> float:
    """Perceived-position noise per axis while the part rests (the pusher well clear of it):
    second differences remove steady motion, var(x[t+1] - 2x[t] + x[t-1]) = 6 sigma^2 for
    white noise, and the median keeps a stray bump out."""
    if len(part) < 3:
        return float("nan")
    gap = np.linalg.norm(part - pusher, axis=1) - contact
    clear = gap[1:-1] > params.jitter_clearance_m
    second = part[2:] - 2 * part[1:-1] + part[:-2]
    if clear.sum() >= params.min_clear_steps:
        second = second[clear]
    # median |N(0, s)| = 0.6745 s
    return float(np.median(np.abs(second)) / 0.6745 / np.sqrt(6.0))


def _penetration(part: np.ndarray, pusher: np.ndarray, contact: float) -> float:
    """The pusher can never be inside the part, so a pusher that appears inside the
    perceived part measures (a lower bound on) the camera's offset. Averaged over 3 steps so
    that one noisy pose does not count."""
    if len(part) < 3:
        return float("nan")
    distance = _smooth(np.linalg.norm(part - pusher, axis=1), 3)
    return float(max(0.0, contact - float(np.min(distance))))


def _push_gap(
    part: np.ndarray,
    pusher: np.ndarray,
    pusher_velocity: np.ndarray,
    contact: float,
    dt: float,
    params: TriageParams,
) -> float:
    """The perceived gap between the pusher's surface and the part's edge while the pusher
    pushes the part, signed: the median over the steps where the part moves away from the
    pusher and the pusher moves towards it, the two within `jitter_clearance_m`. In contact
    the true gap is 0, so this is the camera's offset along the push: > 0 when the camera
    places the part further along the push than the pusher can be touching it, < 0 when the
    pusher appears inside it (`penetration_m` sees only that side). NaN with fewer than
    `_MIN_PUSH_STEPS` such steps."""
    if len(part) < 2 * _SMOOTH_STEPS:
        return float("nan")
    part_s, pusher_s, pushing_v = _smooth(part), _smooth(pusher), _smooth(pusher_velocity)
    towards = part_s - pusher_s
    distance = np.linalg.norm(towards, axis=1)
    normal = towards / np.maximum(distance, 1e-9)[:, None]
    velocity = np.gradient(part_s, dt, axis=0)
    speed = np.linalg.norm(velocity, axis=1)
    gap = distance - contact
    pushed = (
        (speed > params.slide_speed_mps)
        & (np.sum(pushing_v * normal, axis=1) > params.slide_speed_mps)
        & (np.sum(velocity * normal, axis=1) > 0.5 * speed)  # away from the pusher
        & (gap < params.jitter_clearance_m)
    )
    if pushed.sum() < _MIN_PUSH_STEPS:
        return float("nan")
    return float(np.median(gap[pushed]))


def _latency(
    command: np.ndarray, velocity: np.ndarray, params: TriageParams
) -> tuple[float, float]:
    """The lag k (control steps) maximising the correlation of the commanded velocity at
    t - k with the measured joint velocity at t, and the RMS velocity error at that lag."""
    max_lag = params.max_lag_steps
    n = len(command)
    if n < max_lag + params.min_clear_steps:
        return float("nan"), float("nan")
    scores = []
    for k in range(max_lag + 1):
        c, v = command[: n - k], velocity[k:]
        c, v = c - c.mean(axis=0), v - v.mean(axis=0)
        denominator = np.sqrt((c * c).sum() * (v * v).sum())
        scores.append(float((c * v).sum() / denominator) if denominator > 0 else -np.inf)
    lag = int(np.argmax(scores))
    error = velocity[lag:] - command[: n - lag]
    return float(lag), float(np.sqrt(np.mean(np.sum(error**2, axis=1))))


def _slide(part: np.ndarray, pusher_velocity: np.ndarray, dt: float, params: TriageParams) -> float:
    """Distance the part moved other than with the pusher: while the part moves, how fast it
    moves relative to the pusher, summed over time. A part carried by the pusher scores 0;
    one that glides on after a push, or slips sideways off the pusher, scores its slip."""
    if len(part) < 2 * _SMOOTH_STEPS:
        return float("nan")
    velocity = np.gradient(_smooth(part), dt, axis=0)
    pushing = _smooth(pusher_velocity)  # the same window, so both are averaged alike
    speed = np.linalg.norm(velocity, axis=1)
    relative = np.linalg.norm(velocity - pushing, axis=1)
    free = (speed > params.slide_speed_mps) & (relative > params.slide_speed_mps)
    return float(np.sum(relative[free]) * dt)
