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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.contract.params import CellParams, TriageParams
from pipelines.ingest import read_dataset
from pipelines.quality.triage.counterfactual import Counterfactual, logged_starts
from pipelines.quality.triage.rules import (
    CLASSES,
    CONTROL,
    NOVEL_PART,
    PERCEPTION,
    PHYSICS,
    SAFETY,
    Verdict,
    classify,
)
from pipelines.quality.triage.signals import Signals, episode_signals, rounded, yaw_turns
from pipelines.quality.triage.snapshots import read_snapshots, snapshot_evidence

# The review queue puts rare and actionable classes first: a safety stop is reviewed before a
# new kind of part, which comes before the line's known, systematic perception problem.
QUEUE_CLASS_ORDER = (SAFETY, NOVEL_PART, CONTROL, PHYSICS, PERCEPTION)
# Part kinds (`part_kinds`) that are not the part the cell was built for.
NOVEL_PART_KINDS = ("larger", "smaller")
# ...and among captures of one class, the reasons a person most needs to see first (the box's
# `novel_part`: a part the running policy never trained on, judged before it was pushed).
QUEUE_REASON_ORDER = (
    "safety_stop",
    "novel_part",
    "operator_flag",
    "near_failure",
    "retry",
    "low_confidence",
)


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
    # By episode id, every episode: "standard", "larger", "smaller" (the part as its snapshot
    # draws it, else as the camera measured it), or "unknown" (neither).
    parts: dict[str, str] = dataclasses.field(default_factory=dict)

    def novel_part_episodes(self) -> list[str]:
        """Episodes with a part the cell was not built for, failed or not, and the failures
        triage blamed on the part: what data selection keeps and weights (docs/triage.md,
        "Novel parts for data selection")."""
        other = {e for e, kind in self.parts.items() if kind in NOVEL_PART_KINDS}
        blamed = {v.episode_id for v in self.verdicts if v.failure_class == NOVEL_PART}
        return sorted(other | blamed)

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

    def replayed(self) -> int:
        """Failed episodes replayed with the standard part (`counterfactual`)."""
        return sum(bool(np.isfinite(s.standard_part_success)) for s in self.signals.values())

    def as_dict(self, per_class: int) -> dict:
        capture_counts = Counter(c["class"] for c in self.captures)
        return {
            "episodes": self.episodes,
            "failed_episodes": len(self.verdicts),
            "counts": self.counts(),
            "rules": dict(sorted(Counter(v.rule for v in self.verdicts).items())),
            "captures": len(self.captures),
            "capture_counts": {c: capture_counts.get(c, 0) for c in CLASSES},
            "parts": dict(sorted(Counter(self.parts.values()).items())),
            "replayed": self.replayed(),
            "novel_part_episodes": self.novel_part_episodes(),
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
    captures_dir: Path | None = None,
    counterfactual: Counterfactual | None = None,
) -> TriageReport:
    """Classify every failed episode, and every capture (listed in `captures`, or else
    taken from the episodes' `edge_case_reasons`), and sort the captures for review. With
    `captures_dir`, the captures' snapshots there measure the part and the camera's offset
    (`snapshots`); with `counterfactual` too, failures of another part are replayed with the
    standard part in the calibrated sim (`counterfactual`)."""
    success = episodes.column("success").to_numpy(zero_copy_only=False)
    failed = episodes.filter(pa.array(~success))
    ids = episodes.column("episode_id").to_pylist()
    refs = list(captures) or _captures_from_episodes(episodes)
    refs = [r for r in refs if r.episode_id in set(ids)]
    seen = _snapshot_evidence(refs, captures_dir, steps, ids, params)
    signals = {
        s.episode_id: _with_snapshots(s, seen) for s in episode_signals(failed, steps, cell, params)
    }
    unmeasured = [e for e in ids if not np.isfinite(seen.get(e, (np.nan, np.nan))[0])]
    kinds = part_kinds(episodes, seen, params, yaw_turns(steps, unmeasured))
    if counterfactual is not None:
        signals = _with_replays(signals, kinds, episodes, steps, cell, params, counterfactual)
    verdicts = [classify(signals[e], params) for e in failed.column("episode_id").to_pylist()]
    by_id = {v.episode_id: v for v in verdicts}
    judged = _capture_verdicts(
        episodes, steps, cell, params, refs, by_id, capture_window_steps, seen
    )
    causes = dict(zip(ids, episodes.column("failure_cause").to_pylist(), strict=True))
    queue = [
        _capture_row(ref, verdict, ref.episode_id in by_id, causes[ref.episode_id])
        for ref, verdict in zip(refs, judged, strict=True)
    ]
    queue.sort(key=_queue_key)
    for rank, row in enumerate(queue, start=1):
        row["rank"] = rank
    return TriageReport(episodes.num_rows, verdicts, signals, queue, kinds)


def part_kinds(
    episodes: pa.Table,
    seen: Mapping[str, tuple[float, float]],
    params: TriageParams,
    turns: Mapping[str, float] | None = None,
) -> dict[str, str]:
    """Each episode's part: its snapshot's radius against half the nominal extent where a
    snapshot was measured (exact: the snapshot draws the true part), else the camera's
    extent measurement against the nominal extent (noisier: a box measures within 3 sigma
    of the standard part, so some boxes read as standard; with `turns`, the episode's
    `yaw_turn_rad`, one that read standard but swung round past `max_part_turn_rad` is a
    box, "smaller")."""
    out = {}
    turns = turns or {}
    ids = episodes.column("episode_id").to_pylist()
    extents = episodes.column("part_extent_m").to_pylist()
    for episode_id, extent in zip(ids, extents, strict=True):
        radius = seen.get(episode_id, (float("nan"), 0.0))[0]
        if np.isfinite(radius):
            off, tolerance = (
                radius - params.nominal_part_extent_m / 2,
                params.part_radius_tolerance_m,
            )
        elif extent:
            off, tolerance = (
                float(np.mean(extent)) - params.nominal_part_extent_m,
                params.extent_tolerance_m,
            )
        else:
            out[episode_id] = "unknown"
            continue
        kind = "larger" if off > tolerance else "smaller" if off < -tolerance else "standard"
        turned = turns.get(episode_id, 0.0) > params.max_part_turn_rad
        if kind == "standard" and turned and not np.isfinite(radius):
            kind = "smaller"  # the extent missed a box; how it turned did not
        out[episode_id] = kind
    return out


def _snapshot_evidence(
    refs: list[CaptureRef],
    captures_dir: Path | None,
    steps: pa.Table,
    ids: list[str],
    params: TriageParams,
) -> dict[str, tuple[float, float]]:
    if captures_dir is None:
        return {}
    listed = [(r.episode_id, r.step, r.attachments) for r in refs]
    snapshots = read_snapshots(listed, Path(captures_dir), params.snapshot_half_width_m)
    return snapshot_evidence(snapshots, steps, ids, params)


def _with_snapshots(s: Signals, seen: Mapping[str, tuple[float, float]]) -> Signals:
    if s.episode_id not in seen:
        return s
    radius, offset = seen[s.episode_id]
    return dataclasses.replace(s, part_radius_m=radius, camera_offset_m=offset)


def _with_replays(
    signals: dict[str, Signals],
    kinds: Mapping[str, str],
    episodes: pa.Table,
    steps: pa.Table,
    cell: CellParams,
    params: TriageParams,
    counterfactual: Counterfactual,
) -> dict[str, Signals]:
    """`signals` with `standard_part_success` for each failure of another part whose
    camera's offset (from the snapshots) is at most `replay_max_camera_offset_m` (beyond it a
    standard part fails as well, and no replay is needed to say so), run by the replay's
    policy."""
    versions = dict(
        zip(
            episodes.column("episode_id").to_pylist(),
            episodes.column("policy_version").to_pylist(),
            strict=True,
        )
    )
    chosen = [
        e
        for e, s in signals.items()
        if kinds.get(e) in NOVEL_PART_KINDS
        and s.safety_stops == 0
        and s.camera_offset_m <= params.replay_max_camera_offset_m
        and counterfactual.ran(versions[e])
    ]
    confidence = {e: signals[e].confidence_mean for e in chosen}
    starts = logged_starts(episodes, steps, confidence, chosen)
    shares = counterfactual.standard_part_success(starts, cell, params)
    return {
        e: dataclasses.replace(s, standard_part_success=shares[e]) if e in shares else s
        for e, s in signals.items()
    }


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
    seen: Mapping[str, tuple[float, float]],
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
                judged[(s.episode_id, batch[s.episode_id].reason)] = classify(
                    _with_snapshots(s, seen), params
                )
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
        "severity": rounded(verdict.severity),
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
    counterfactual: Counterfactual | None = None,
) -> TriageReport:
    """`triage` over a canonical dataset folder, captures' sidecars read from `captures_dir`."""
    episodes, steps = read_dataset(Path(dataset))
    if episodes.num_rows == 0:
        raise FileNotFoundError(f"{dataset}: no episodes in the dataset; run `realloop ingest`")
    refs = read_capture_sidecars(captures_dir, episodes) if captures_dir else []
    return triage(
        episodes, steps, cell, params, refs, capture_window_steps, captures_dir, counterfactual
    )
