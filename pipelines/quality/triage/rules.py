"""Triage rules: checked in a fixed order, the first that holds decides (`classify`); the
verdict keeps the rule's name and the signal values that decided it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from pipelines.contract.params import TriageParams
from pipelines.quality.triage.signals import Signals, rounded

PERCEPTION, CONTROL, PHYSICS, NOVEL_PART, SAFETY = (
    "perception",
    "control",
    "physics",
    "novel_part",
    "safety",
)
CLASSES = (PERCEPTION, CONTROL, PHYSICS, NOVEL_PART, SAFETY)


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
            "value": rounded(self.value),
            "test": self.test,
            "limit": self.limit,
            "strength": rounded(self.strength),
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
            "severity": rounded(self.severity),
            "evidence": [e.as_dict() for e in self.evidence],
            "also": list(self.also),
        }


# The rules in the order they are checked; the first that holds decides.
RULES = (
    ("safety_stop", SAFETY),
    ("novel_part_replayed", NOVEL_PART),  # a standard part placed in the calibrated sim
    ("novel_part_with_small_camera_offset", NOVEL_PART),  # snapshots measured the camera
    ("novel_part_with_healthy_perception", NOVEL_PART),  # without snapshots
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
            _above(
                "part_radius_offset_m",
                abs(_radius_offset(s, params)),
                params.part_radius_tolerance_m,
            ),
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


def _radius_offset(s: Signals, params: TriageParams) -> float:
    """The part's radius in its snapshot against the standard part's (NaN without one)."""
    return s.part_radius_m - params.nominal_part_extent_m / 2


def _under(signal: str, value: float, limit: float) -> Evidence:
    """For a signal that must stay under its limit for a rule to hold; strength > 1 there."""
    strength = limit / value if np.isfinite(value) and value > 0 else float(np.isfinite(value))
    return Evidence(signal, value, "<", limit, float(strength))


def _part_seen_to_blame(s: Signals, shape: list[Evidence], params: TriageParams) -> list[Evidence]:
    """With snapshots: the evidence that blames the part, or [] (docs/triage.md, rule 2).

    The snapshots measured the camera's offset at this episode's light (`camera_offset_m`).
    Above `max_camera_offset_m` a standard part fails as well: the camera is to blame. Below
    it, a standard part would have made it, and the part is blamed where the logs show how:
    a larger part whose extra size adds to the camera's offset along the push (`push_gap_m`
    >= `min_push_gap_m`), or a box (smaller in its snapshot, or turning) that did not swing
    round so far that the policy was chasing it round the table (`yaw_turn_rad` <=
    `max_box_turn_rad`), as it would have chased a cylinder.
    """
    if np.isfinite(s.standard_part_success):
        return _replay_blames(s, shape, params)
    if not s.camera_offset_m <= params.max_camera_offset_m:
        return []
    tolerance = params.part_radius_tolerance_m
    if np.isfinite(s.part_radius_m):  # the snapshot decides the kind of part
        larger = _radius_offset(s, params) > tolerance
        box = _radius_offset(s, params) < -tolerance
    else:  # no snapshot of this episode: the camera's extent, and how the part turned
        larger = s.extent_offset_m > params.extent_tolerance_m
        box = not larger and (
            s.extent_offset_m < -params.extent_tolerance_m
            or s.yaw_turn_rad > params.max_part_turn_rad
        )
    offset = _under("camera_offset_m", s.camera_offset_m, params.max_camera_offset_m)
    size = [e for e in shape if e.signal in ("part_radius_offset_m", "extent_offset_m")][:1]
    if larger and np.isfinite(s.push_gap_m) and s.push_gap_m >= params.min_push_gap_m:
        detail = f"push_gap_m {s.push_gap_m:.4f} >= {params.min_push_gap_m}"
        return [dataclasses.replace(e, detail=detail) for e in size] + [offset]
    if box and not s.yaw_turn_rad > params.max_box_turn_rad:
        turn = f"yaw_turn_rad {s.yaw_turn_rad:.3f} <= {params.max_box_turn_rad}"
        return [dataclasses.replace(e, detail=turn) for e in size or shape[:1]] + [offset]
    return []


def _replay_blames(s: Signals, shape: list[Evidence], params: TriageParams) -> list[Evidence]:
    """With a replay in the calibrated sim (triage/counterfactual.py): the part is blamed when
    a standard part, from the episode's start, placed in more than `min_standard_part_success`
    of the replays. The replay asks the ground truth's own question, so it replaces the
    geometry's proxies (push gap, box turn) for the episodes it ran on."""
    limit = params.min_standard_part_success
    if not s.standard_part_success > limit:
        return []
    share = s.standard_part_success
    replayed = Evidence("standard_part_success", share, ">", limit, share / limit)
    return [*shape[:1], replayed]


def _part_to_blame(s: Signals, shape: list[Evidence], params: TriageParams) -> list[Evidence]:
    """Without snapshots: the part-shape evidence that blames the part, with a healthy
    camera; [] if none.

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
    - novel_part: the part is not the one the cell was built for, and a standard part would
      not have failed so: replayed in the calibrated sim, a standard part placed from the
      episode's start (`_replay_blames`); with snapshots, the camera's offset they measured is
      one a standard part tolerates, and the part's extra size adds to it, or the box was not
      chased round (`_part_seen_to_blame`); without, a larger part, perception looks healthy,
      and the camera's offset along the push does not cancel its extra size
      (`_part_to_blame`).
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
    if holds[NOVEL_PART] and np.isfinite(s.camera_offset_m):
        blamed = _part_seen_to_blame(s, holds[NOVEL_PART], params)
        replayed = np.isfinite(s.standard_part_success)
        rule = "novel_part_replayed" if replayed else "novel_part_with_small_camera_offset"
        if blamed:
            return verdict(rule, NOVEL_PART, blamed)
    elif holds[NOVEL_PART] and not holds[PERCEPTION]:
        blamed = _part_to_blame(s, holds[NOVEL_PART], params)
        if blamed:
            return verdict("novel_part_with_healthy_perception", NOVEL_PART, blamed)
    for rule, cls in RULES[4:7]:
        if holds[cls]:
            return verdict(rule, cls, holds[cls])
    # The part's shape never decides on its own: it was checked, with its conditions, above.
    strongest = max(
        (PERCEPTION, CONTROL, PHYSICS),
        key=lambda c: max((e.strength for e in evidence[c]), default=0.0),
    )
    decided = sorted(evidence[strongest], key=lambda e: -e.strength)[:1]
    return verdict("strongest_evidence", strongest, decided)
