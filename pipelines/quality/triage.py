"""Failure-mode triage: why did a line episode fail, told from its logs alone.

docs/triage.md is the reference for every signal, threshold and rule here; change them
together. Inputs are the canonical `episodes` and `steps` tables and the capture sidecars
(docs/data-contract.md). Nothing here knows the cell's true parameters or its simulator.

Each failed episode, and each edge-case capture, gets one of `CLASSES`:

- signals: per episode (or per capture window) a few numbers a person can check by hand,
  computed vectorised from the steps table (`episode_signals`);
- rules: checked in a fixed order, the first that holds decides (`classify`); the verdict
  keeps the rule's name and the signal values that decided it;
- report: counts by class, the worst episodes of each class, and a review queue of
  captures sorted by priority (`triage_dataset`).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.contract.params import CellParams, TriageParams

PERCEPTION, CONTROL, PHYSICS, NOVEL_PART, SAFETY = (
    "perception",
    "control",
    "physics",
    "novel_part",
    "safety",
)
CLASSES = (PERCEPTION, CONTROL, PHYSICS, NOVEL_PART, SAFETY)
# The review queue puts rare and actionable classes first: a safety stop is reviewed before a
# new kind of part, which comes before the line's known, systematic perception problem.
QUEUE_CLASS_ORDER = (SAFETY, NOVEL_PART, CONTROL, PHYSICS, PERCEPTION)
# ...and among captures of one class, the reasons a person most needs to see first.
QUEUE_REASON_ORDER = ("safety_stop", "operator_flag", "near_failure", "retry", "low_confidence")
CAPTURES_DIR = "captures"
_SMOOTH_STEPS = 5  # moving-average window for perceived part motion and yaw
_MIN_PUSH_STEPS = 3  # fewer pushing steps than this: no push gap (NaN)


# --- signals -----------------------------------------------------------------------------


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

    def as_dict(self) -> dict:
        return {k: _round(v) for k, v in asdict(self).items()}


def _round(value):
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
    contact = params.pusher_radius_m + (part_extent if extent else params.nominal_part_extent_m) / 2
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


# --- rules ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evidence:
    """One signal measured against its limit; `strength` > 1 means the limit is passed."""

    signal: str
    value: float
    test: str  # ">" or "<": the signal is bad above (below) its limit
    limit: float
    strength: float
    detail: str | None = None  # what else the logs say (the kind of safety stop)

    def as_dict(self) -> dict:
        out = {
            "signal": self.signal,
            "value": _round(self.value),
            "test": self.test,
            "limit": self.limit,
            "strength": _round(self.strength),
        }
        return out | ({"detail": self.detail} if self.detail else {})


@dataclass(frozen=True)
class Verdict:
    episode_id: str
    failure_class: str
    rule: str  # the rule that decided, see RULES
    severity: float  # strength of the deciding evidence (for ranking within a class)
    evidence: list[Evidence]  # the signals that decided it
    also: list[str] = field(default_factory=list)  # other classes whose evidence was present

    def as_dict(self) -> dict:
        return {
            "episode_id": self.episode_id,
            "class": self.failure_class,
            "rule": self.rule,
            "severity": _round(self.severity),
            "evidence": [e.as_dict() for e in self.evidence],
            "also": list(self.also),
        }


# The rules in the order they are checked; the first that holds decides.
RULES = (
    ("safety_stop", SAFETY),
    ("novel_part_with_healthy_perception", NOVEL_PART),
    ("perception_off", PERCEPTION),
    ("control_off", CONTROL),
    ("physics_off", PHYSICS),
    ("strongest_evidence", None),  # nothing passed its limit: the strongest signal decides
)


def _above(signal: str, value: float, limit: float) -> Evidence:
    strength = value / limit if np.isfinite(value) and limit > 0 else 0.0
    return Evidence(signal, value, ">", limit, float(strength))


def _below(signal: str, value: float, limit: float) -> Evidence:
    """For a signal that is bad when low (confidence): distance from 1 against the limit's."""
    strength = (1.0 - value) / (1.0 - limit) if np.isfinite(value) and limit < 1 else 0.0
    return Evidence(signal, value, "<", limit, float(strength))


def class_evidence(s: Signals, params: TriageParams) -> dict[str, list[Evidence]]:
    """Every class's signals measured against their limits (safety and part shape too)."""
    return {
        # Any stop decides: strength 2 per stop, so one stop passes (strength > 1).
        SAFETY: [
            Evidence(
                "safety_stops", s.safety_stops, ">", 0, 2.0 * s.safety_stops, s.safety_stop_kind
            )
        ],
        NOVEL_PART: [
            _above("extent_offset_m", abs(s.extent_offset_m), params.extent_tolerance_m),
            _above("yaw_turn_rad", s.yaw_turn_rad, params.max_part_turn_rad),
        ],
        PERCEPTION: [
            _below("confidence_mean", s.confidence_mean, params.min_confidence),
            _above("penetration_m", s.penetration_m, params.max_penetration_m),
            _above("pose_jitter_m", s.pose_jitter_m, params.max_pose_jitter_m),
        ],
        CONTROL: [
            _above("latency_steps", s.latency_steps, params.max_latency_steps),
            _above("tracking_error_mps", s.tracking_error_mps, params.max_tracking_error_mps),
        ],
        PHYSICS: [_above("slide_m", s.slide_m, params.max_slide_m)],
    }


def _part_to_blame(s: Signals, shape: list[Evidence], params: TriageParams) -> list[Evidence]:
    """The part-shape evidence that blames the part, with a healthy camera; [] if none.

    Only a part larger than nominal is blamed, and only when the camera's offset along the
    push does not cancel its extra size. The policy places its pusher for the nominal part,
    so a larger part meets the pusher early, as if the camera saw the part further along the
    push; a camera offset that way (`push_gap_m` >= `min_push_gap_m`) adds to it, and a
    standard part, met where the policy expects it, would not have had that error. An offset
    the other way cancels the extra size: the failure is the offset's, which a standard part
    suffers alike. Without pushing steps to measure the gap, the part is not blamed. A part
    that only turns (a box) is not blamed either: no logged signal tells whether a cylinder
    would have made it (docs/triage.md, "Limits"); it is listed in `also`.
    """
    larger = s.extent_offset_m > params.extent_tolerance_m
    if larger and np.isfinite(s.push_gap_m) and s.push_gap_m >= params.min_push_gap_m:
        detail = f"push_gap_m {s.push_gap_m:.4f} >= {params.min_push_gap_m}"
        return [
            dataclasses.replace(e, detail=detail) for e in shape if e.signal == "extent_offset_m"
        ]
    return []


def classify(s: Signals, params: TriageParams) -> Verdict:
    """One class for a failed episode or a capture window: the first rule of RULES that holds.

    - safety: the cell stopped on a safety limit. Certain, and nothing else matters.
    - novel_part: the part is larger than the one the cell was built for, perception looks
      healthy, and the camera's offset along the push does not cancel the part's extra size:
      a standard part would not have suffered that error (`_part_to_blame`).
    - perception: the camera was unsure, noisy, or offset (the pusher appears inside the part).
    - control: commands reached the gantry late, or it tracked them poorly.
    - physics: the part slid other than with the pusher (a slippery table, a heavier part).
    Perception is checked before control and physics because its errors cause the others'
    symptoms (a policy steering at a wrong pose commands late corrections and loses the part),
    never the reverse.
    """
    evidence = class_evidence(s, params)
    holds = {c: [e for e in evidence[c] if e.strength > 1.0] for c in CLASSES}
    present = [c for c in (NOVEL_PART, PERCEPTION, CONTROL, PHYSICS) if holds[c]]

    def verdict(rule: str, cls: str, decided: list[Evidence]) -> Verdict:
        severity = max((e.strength for e in decided), default=0.0)
        also = [c for c in present if c != cls]
        return Verdict(s.episode_id, cls, rule, severity, decided, also)

    if holds[SAFETY]:
        return verdict("safety_stop", SAFETY, holds[SAFETY])
    if holds[NOVEL_PART] and not holds[PERCEPTION]:
        blamed = _part_to_blame(s, holds[NOVEL_PART], params)
        if blamed:
            return verdict("novel_part_with_healthy_perception", NOVEL_PART, blamed)
    for rule, cls in RULES[2:5]:
        if holds[cls]:
            return verdict(rule, cls, holds[cls])
    # The part's shape never decides on its own: it was checked, with its conditions, above.
    strongest = max(
        (PERCEPTION, CONTROL, PHYSICS),
        key=lambda c: max((e.strength for e in evidence[c]), default=0.0),
    )
    decided = sorted(evidence[strongest], key=lambda e: -e.strength)[:1]
    return verdict("strongest_evidence", strongest, decided)


# --- the report -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CaptureRef:
    """An edge-case capture of an episode in the dataset, with what its sidecar adds."""

    episode_id: str
    reason: str
    step: int | None  # the trigger step, when the sidecar was found
    time: str | None
    operator_note: str | None
    attachments: tuple[str, ...] = ()


@dataclass
class TriageReport:
    episodes: int  # in the dataset
    verdicts: list[Verdict]  # one per failed episode
    signals: dict[str, Signals]  # by episode id, failed episodes
    captures: list[dict]  # the review queue, sorted by priority

    def counts(self) -> dict[str, int]:
        found = Counter(v.failure_class for v in self.verdicts)
        return {c: found.get(c, 0) for c in CLASSES}

    def worst(self, per_class: int) -> dict[str, list[dict]]:
        """Per class, the episodes with the strongest deciding evidence, then the furthest
        from their target."""
        out: dict[str, list[dict]] = {}
        for cls in CLASSES:
            mine = [v for v in self.verdicts if v.failure_class == cls]
            mine.sort(
                key=lambda v: (-v.severity, -_finite(self.signals[v.episode_id].final_distance_m))
            )
            out[cls] = [
                v.as_dict() | {"signals": self.signals[v.episode_id].as_dict()}
                for v in mine[:per_class]
            ]
        return out

    def as_dict(self, per_class: int) -> dict:
        capture_counts = Counter(c["class"] for c in self.captures)
        return {
            "episodes": self.episodes,
            "failed_episodes": len(self.verdicts),
            "counts": self.counts(),
            "rules": dict(sorted(Counter(v.rule for v in self.verdicts).items())),
            "captures": len(self.captures),
            "capture_counts": {c: capture_counts.get(c, 0) for c in CLASSES},
            "worst": self.worst(per_class),
            "queue": self.captures,
        }


def _finite(value: float) -> float:
    return value if np.isfinite(value) else 0.0


def triage(
    episodes: pa.Table,
    steps: pa.Table,
    cell: CellParams,
    params: TriageParams,
    captures: Iterable[CaptureRef] = (),
    capture_window_steps: int | None = None,
) -> TriageReport:
    """Classify every failed episode, and every capture (listed in `captures`, or else
    taken from the episodes' `edge_case_reasons`), and sort the captures for review."""
    success = episodes.column("success").to_numpy(zero_copy_only=False)
    failed = episodes.filter(pa.array(~success))
    signals = {s.episode_id: s for s in episode_signals(failed, steps, cell, params)}
    verdicts = [classify(signals[e], params) for e in failed.column("episode_id").to_pylist()]
    by_id = {v.episode_id: v for v in verdicts}
    refs = list(captures) or _captures_from_episodes(episodes)
    ids = episodes.column("episode_id").to_pylist()
    refs = [r for r in refs if r.episode_id in set(ids)]
    judged = _capture_verdicts(episodes, steps, cell, params, refs, by_id, capture_window_steps)
    causes = dict(zip(ids, episodes.column("failure_cause").to_pylist(), strict=True))
    queue = [
        _capture_row(ref, verdict, ref.episode_id in by_id, causes[ref.episode_id])
        for ref, verdict in zip(refs, judged, strict=True)
    ]
    queue.sort(key=_queue_key)
    for rank, row in enumerate(queue, start=1):
        row["rank"] = rank
    return TriageReport(episodes.num_rows, verdicts, signals, queue)


def _captures_from_episodes(episodes: pa.Table) -> list[CaptureRef]:
    refs = []
    ids = episodes.column("episode_id").to_pylist()
    reasons = episodes.column("edge_case_reasons").to_pylist()
    for episode_id, listed in zip(ids, reasons, strict=True):
        refs += [CaptureRef(episode_id, reason, None, None, None) for reason in listed or ()]
    return refs


def _capture_verdicts(
    episodes: pa.Table,
    steps: pa.Table,
    cell: CellParams,
    params: TriageParams,
    refs: list[CaptureRef],
    episode_verdicts: Mapping[str, Verdict],
    window_steps: int | None,
) -> list[tuple[Verdict, str]]:
    """A capture of a failed episode takes the episode's verdict: it is evidence of that
    failure. A capture of an episode that succeeded is judged on its own window: the steps
    the capture holds, up to its trigger step."""
    own = [r for r in refs if r.episode_id not in episode_verdicts]
    judged: dict[tuple[str, str], Verdict] = {}
    if own:
        wanted = pa.array(sorted({r.episode_id for r in own}), pa.string())
        rows = episodes.filter(pc.is_in(episodes.column("episode_id"), wanted))
        by_episode: dict[str, list[CaptureRef]] = {}
        for ref in own:
            by_episode.setdefault(ref.episode_id, []).append(ref)
        # One pass per "k-th capture of an episode", so each pass cuts each episode once.
        for k in range(max(len(v) for v in by_episode.values())):
            batch = {e: listed[k] for e, listed in by_episode.items() if len(listed) > k}
            until = {e: r.step for e, r in batch.items() if r.step is not None}
            subset = rows.filter(pc.is_in(rows.column("episode_id"), pa.array(sorted(batch))))
            for s in episode_signals(subset, steps, cell, params, until, window_steps):
                judged[(s.episode_id, batch[s.episode_id].reason)] = classify(s, params)
    out = []
    for ref in refs:
        if ref.episode_id in episode_verdicts:
            out.append((episode_verdicts[ref.episode_id], "episode"))
        else:
            out.append((judged[(ref.episode_id, ref.reason)], "window"))
    return out


def _capture_row(ref: CaptureRef, judged: tuple[Verdict, str], failed: bool, cause) -> dict:
    verdict, decided_by = judged
    urgent = verdict.failure_class in (SAFETY, NOVEL_PART, CONTROL, PHYSICS)
    if ref.reason == "safety_stop" or (failed and urgent):
        priority = "high"
    elif failed:
        priority = "medium"
    else:
        priority = "low"
    return {
        "rank": 0,
        "priority": priority,
        "episode_id": ref.episode_id,
        "reason": ref.reason,
        "step": ref.step,
        "time": ref.time,
        "operator_note": ref.operator_note,
        "episode_failed": failed,
        "failure_cause": cause,
        "class": verdict.failure_class,
        "rule": verdict.rule,
        "decided_by": decided_by,
        "severity": _round(verdict.severity),
        "evidence": [e.as_dict() for e in verdict.evidence],
        "attachments": list(ref.attachments),
    }


def _queue_key(row: dict) -> tuple:
    """Failed episodes first; then safety, novel parts, control, physics, perception; then
    the capture's reason; then the strongest evidence; then by episode and step."""
    reason = row["reason"]
    last = len(QUEUE_REASON_ORDER)
    reason_rank = QUEUE_REASON_ORDER.index(reason) if reason in QUEUE_REASON_ORDER else last
    return (
        not row["episode_failed"],
        QUEUE_CLASS_ORDER.index(row["class"]),
        reason_rank,
        -(row["severity"] or 0.0),
        row["episode_id"],
        row["step"] if row["step"] is not None else -1,
    )


def read_capture_sidecars(captures_dir: Path, episodes: pa.Table) -> list[CaptureRef]:
    """The captures the episodes' `edge_case_reasons` list, with step, time and note from
    their sidecars `<captures_dir>/<episode_id>_<reason>.json` where those can be read."""
    refs = []
    for ref in _captures_from_episodes(episodes):
        sidecar = Path(captures_dir) / f"{ref.episode_id}_{ref.reason}.json"
        try:
            meta = json.loads(sidecar.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            refs.append(ref)  # the capture is known from the dataset, its sidecar is not
            continue
        meta = meta if isinstance(meta, dict) else {}
        step, attachments = meta.get("step"), meta.get("attachments")
        refs.append(
            CaptureRef(
                ref.episode_id,
                ref.reason,
                step if isinstance(step, int) and not isinstance(step, bool) else None,
                _text(meta, "time"),
                _text(meta, "operator_note"),
                tuple(a for a in attachments if isinstance(a, str))
                if isinstance(attachments, list)
                else (),
            )
        )
    return refs


def _text(meta: dict, key: str) -> str | None:
    value = meta.get(key)
    return value if isinstance(value, str) else None


def triage_dataset(
    dataset: Path,
    captures_dir: Path | None,
    cell: CellParams,
    params: TriageParams,
    capture_window_steps: int,
) -> TriageReport:
    """`triage` over a canonical dataset folder, captures' sidecars read from `captures_dir`."""
    from pipelines.ingest.store import read_dataset

    episodes, steps = read_dataset(Path(dataset))
    if episodes.num_rows == 0:
        raise FileNotFoundError(f"{dataset}: no episodes in the dataset; run `realloop ingest`")
    refs = read_capture_sidecars(captures_dir, episodes) if captures_dir else []
    return triage(episodes, steps, cell, params, refs, capture_window_steps)
