"""Drift features: what is compared, read from the dataset tables, and one feature's drift.

Features, each with a measure suited to it (`FEATURES`):

- perception confidence, per step: PSI and KS;
- perceived-pose jitter, per step: the step-to-step change of the perceived part position
  while the pusher is clear of the part (so the part stands still and only noise moves it): KS;
- estimated action latency, per episode: the lag that best cross-correlates the commanded
  velocity with the measured joint velocity, a small integer: JS over the lag distribution;
- joint tracking error, per step: |action·max_speed − measured velocity one step later|: KS, PSI;
- contact offset, per pushing step, x and y: where the camera puts the part's centre relative
  to the circle on which it must sit while the pusher pushes it (pusher radius + half the
  part's measured extent). The pusher's joint sensors have no bias, so a knocked camera moves
  these offsets by its bias along the push, whatever else the policy does: KS;
- part size, per episode: the mean of the part's measured extent (x, y): NOVEL (sizes the
  baseline never showed: a new part variant) and KS (the mix of known variants changed);
- cycle time, per episode: KS;
- failure mode, per episode (`none` on success): JS over the categories.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.contract.params import CellParams, DriftParams
from pipelines.quality.drift.measures import JS, KS, NOVEL, PSI, Measure, measure

PERCEPTION_CONFIDENCE = "perception_confidence"
POSE_JITTER = "pose_jitter_m"
ACTION_LATENCY = "action_latency_steps"
TRACKING_ERROR = "joint_tracking_error_mps"
CONTACT_OFFSET_X = "contact_offset_x_m"
CONTACT_OFFSET_Y = "contact_offset_y_m"
PART_SIZE = "part_size_m"
CYCLE_TIME = "cycle_time_s"
FAILURE_MODE = "failure_mode"
NO_FAILURE = "none"  # the failure-mode category of a successful episode
MIN_LATENCY_PAIRS = 10  # command/velocity pairs an episode needs for a latency estimate
MIN_COMMAND_VARIANCE = 1e-8  # (m/s)^2: a constant command says nothing about latency
MIN_PUSH_SPEED_MPS = 0.05  # a pushing step: the pusher moves towards the part at least this fast


@dataclass(frozen=True)
class Feature:
    name: str
    unit: str  # what one sample is: "step" or "episode"
    categorical: bool
    measures: tuple[str, ...]
    description: str


FEATURES = (
    Feature(
        PERCEPTION_CONFIDENCE, "step", False, (PSI, KS), "perception confidence [0, 1] per step"
    ),
    Feature(
        POSE_JITTER,
        "step",
        False,
        (KS,),
        "change of the perceived part position (m) between two steps with the pusher clear",
    ),
    Feature(
        ACTION_LATENCY,
        "episode",
        True,
        (JS,),
        "control steps from command to the best-correlated measured velocity, minus one",
    ),
    Feature(
        TRACKING_ERROR,
        "step",
        False,
        (KS, PSI),
        "|action * max_speed - measured joint velocity at the next step| (m/s)",
    ),
    *(
        Feature(
            name,
            "step",
            False,
            (KS,),
            f"perceived part centre minus its contact circle around the pusher, along {axis} (m), "
            "while pushing",
        )
        for name, axis in ((CONTACT_OFFSET_X, "x"), (CONTACT_OFFSET_Y, "y"))
    ),
    Feature(
        PART_SIZE,
        "episode",
        False,
        (NOVEL, KS),
        "the part's measured extent (m), mean of x and y; episodes without one are left out",
    ),
    Feature(CYCLE_TIME, "episode", False, (KS,), "episode cycle time (s)"),
    Feature(
        FAILURE_MODE,
        "episode",
        True,
        (JS,),
        "failure_cause as logged (safety stops by kind), 'none' on success",
    ),
)
FEATURE_BY_NAME = {f.name: f for f in FEATURES}


@dataclass(frozen=True)
class Samples:
    """One feature's values over a set of episodes."""

    values: np.ndarray  # float64, or categories (int lags, str failure modes)
    episodes: int  # episodes that contributed at least one value


# --- features from the dataset tables ---------------------------------------------------------


def extract_features(
    episodes: pa.Table, steps: pa.Table, cell: CellParams, params: DriftParams
) -> dict[str, Samples]:
    """Every feature's samples from an `episodes` and a `steps` table (schema.py)."""
    steps = steps.take(pc.sort_indices(steps, [("episode_id", "ascending"), ("step", "ascending")]))
    ids = steps.column("episode_id").combine_chunks()
    encoded = pc.dictionary_encode(ids)
    codes = encoded.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    episode_ids = encoded.dictionary.to_pylist()
    step_index = steps.column("step").to_numpy().astype(np.int64)
    action = _matrix(steps.column("action"), 2) * cell.max_speed_mps
    velocity = _matrix(steps.column("joint_velocity"), 2)
    confidence = steps.column("part_confidence").to_numpy().astype(np.float64)
    half_extent = _half_extents(episodes, episode_ids)[codes]
    offset_x, offset_y = _contact_offsets(steps, codes, half_extent, cell, params)
    return {
        PERCEPTION_CONFIDENCE: Samples(confidence, len(np.unique(codes))),
        POSE_JITTER: _pose_jitter(episodes, steps, codes, step_index, episode_ids, params),
        ACTION_LATENCY: _action_latency(codes, step_index, action, velocity, params),
        TRACKING_ERROR: _tracking_error(codes, step_index, action, velocity),
        CONTACT_OFFSET_X: offset_x,
        CONTACT_OFFSET_Y: offset_y,
        PART_SIZE: _part_sizes(episodes),
        CYCLE_TIME: Samples(
            episodes.column("cycle_time_s").to_numpy().astype(np.float64), episodes.num_rows
        ),
        FAILURE_MODE: Samples(failure_modes(episodes), episodes.num_rows),
    }


def failure_modes(episodes: pa.Table) -> np.ndarray:
    """Per episode: 'none' on success, 'safety_stop:<kind>' for a safety stop, else the
    logged failure_cause ('unknown' when the cell logged none)."""
    success = episodes.column("success").to_pylist()
    causes = episodes.column("failure_cause").to_pylist()
    kinds = episodes.column("safety_stop_kind").to_pylist()
    stops = episodes.column("safety_stops").to_pylist()
    modes = []
    for ok, cause, kind, stopped in zip(success, causes, kinds, stops, strict=True):
        if ok:
            modes.append(NO_FAILURE)
        elif stopped or kind:
            modes.append(f"safety_stop:{kind or 'unknown'}")
        else:
            modes.append(cause or "unknown")
    return np.array(modes, dtype=object)


def _matrix(column: pa.ChunkedArray, width: int) -> np.ndarray:
    flat = pc.list_flatten(column)
    return np.asarray(flat.to_numpy(), dtype=np.float64).reshape(-1, width)


def _consecutive(codes: np.ndarray, step_index: np.ndarray, lag: int) -> np.ndarray:
    """Row pairs (t, t + lag) that are `lag` control steps apart in one episode."""
    if len(codes) <= lag:
        return np.zeros(0, dtype=bool)
    return (codes[lag:] == codes[:-lag]) & (step_index[lag:] - step_index[:-lag] == lag)


def _pose_jitter(
    episodes: pa.Table,
    steps: pa.Table,
    codes: np.ndarray,
    step_index: np.ndarray,
    episode_ids: list[str],
    params: DriftParams,
) -> Samples:
    # Clear of the part: the pusher is at least jitter_clearance_m outside the part's footprint
    # (half its larger measured extent) at both steps, so the part was not being pushed.
    half_extent = _half_extents(episodes, episode_ids, np.max)
    part = _matrix(steps.column("part_pose"), 3)[:, :2]
    pusher = _matrix(steps.column("joint_position"), 2)
    gap = np.linalg.norm(pusher - part, axis=1) - half_extent[codes]
    clear = gap > params.jitter_clearance_m
    pairs = _consecutive(codes, step_index, 1)
    pairs &= clear[1:] & clear[:-1]
    jitter = np.linalg.norm(np.diff(part, axis=0), axis=1)[pairs]
    return Samples(jitter, len(np.unique(codes[1:][pairs])))


def _part_sizes(episodes: pa.Table) -> Samples:
    sizes = 2 * _half_extents(episodes, episodes.column("episode_id").to_pylist())
    measured = sizes[sizes > 0]
    return Samples(measured, len(measured))


def _half_extents(episodes: pa.Table, episode_ids: list[str], reduce=np.mean) -> np.ndarray:
    """Half the part's measured extent per episode, in `episode_ids` order (0: not measured)."""
    extents = dict(
        zip(
            episodes.column("episode_id").to_pylist(),
            episodes.column("part_extent_m").to_pylist(),
            strict=True,
        )
    )
    return np.array([reduce(extents.get(e) or [0.0]) / 2 for e in episode_ids], float)


def _contact_offsets(
    steps: pa.Table,
    codes: np.ndarray,
    half_extent: np.ndarray,
    cell: CellParams,
    params: DriftParams,
) -> tuple[Samples, Samples]:
    """Per pushing step, the perceived part centre's offset (x, y) from the point on its contact
    circle nearest to it. A pushing step: the perceived centre within drift.contact_band_m of
    the circle and the pusher moving towards it; the band is wider than any bias we expect, so
    a knocked camera's steps stay in it, offset by the bias along the push."""
    part = _matrix(steps.column("part_pose"), 3)[:, :2]
    pusher = _matrix(steps.column("joint_position"), 2)
    velocity = _matrix(steps.column("joint_velocity"), 2)
    offset = part - pusher
    distance = np.maximum(np.linalg.norm(offset, axis=1), 1e-9)
    towards = (velocity * offset).sum(axis=1) / distance
    contact = cell.pusher_radius_m + half_extent
    pushing = (half_extent > 0) & (np.abs(distance - contact) < params.contact_band_m)
    pushing &= towards > MIN_PUSH_SPEED_MPS
    residual = offset - (contact / distance)[:, None] * offset
    episodes = len(np.unique(codes[pushing]))
    return Samples(residual[pushing, 0], episodes), Samples(residual[pushing, 1], episodes)


def _tracking_error(
    codes: np.ndarray, step_index: np.ndarray, action: np.ndarray, velocity: np.ndarray
) -> Samples:
    # A row holds the state measured before its command: the command's earliest effect is the
    # next row's velocity. Latency shows up here too (the drive still follows older commands).
    pairs = _consecutive(codes, step_index, 1)
    error = np.linalg.norm(action[:-1] - velocity[1:], axis=1)[pairs]
    return Samples(error, len(np.unique(codes[1:][pairs])))


def _action_latency(
    codes: np.ndarray,
    step_index: np.ndarray,
    action: np.ndarray,
    velocity: np.ndarray,
    params: DriftParams,
) -> Samples:
    """Per episode, the lag k in 1..max_lag_steps+1 maximising the Pearson correlation of the
    command at row t with the measured velocity at row t + k (both axes, each centred), minus
    the one row by which a zero-latency response shows (see _tracking_error). Vectorised over
    episodes: per-episode sums via bincount."""
    n_episodes = int(codes.max()) + 1 if len(codes) else 0
    scores = np.full((n_episodes, params.max_lag_steps + 1), -np.inf)
    for k in range(1, params.max_lag_steps + 2):
        pairs = _consecutive(codes, step_index, k)
        who = codes[:-k][pairs]
        x, y = action[:-k][pairs], velocity[k:][pairs]
        n = np.bincount(who, minlength=n_episodes).astype(float)
        cov = var_x = var_y = np.zeros(n_episodes)
        with np.errstate(divide="ignore", invalid="ignore"):
            for axis in range(2):
                sx = np.bincount(who, x[:, axis], n_episodes)
                sy = np.bincount(who, y[:, axis], n_episodes)
                cov = cov + np.bincount(who, x[:, axis] * y[:, axis], n_episodes) - sx * sy / n
                var_x = var_x + np.bincount(who, x[:, axis] ** 2, n_episodes) - sx**2 / n
                var_y = var_y + np.bincount(who, y[:, axis] ** 2, n_episodes) - sy**2 / n
            corr = cov / np.sqrt(var_x * var_y)
        usable = (n >= MIN_LATENCY_PAIRS) & (var_x > MIN_COMMAND_VARIANCE * n) & (var_y > 0)
        scores[:, k - 1] = np.where(usable & np.isfinite(corr), corr, -np.inf)
    estimated = np.isfinite(scores).any(axis=1)
    lags = np.argmax(scores[estimated], axis=1).astype(np.int64)
    return Samples(lags, int(estimated.sum()))


# --- one feature's drift ---------------------------------------------------------------------


@dataclass(frozen=True)
class FeatureDrift:
    name: str
    unit: str
    description: str
    n_baseline: int  # samples (steps or episodes, see unit)
    n_current: int
    episodes_baseline: int
    episodes_current: int
    assessed: bool  # enough episodes on both sides to judge (drift.min_episodes)
    drifted: bool
    measures: list[Measure]
    baseline: dict  # summary: mean/median/p95, or category shares
    current: dict
    plot: str | None = None

    def as_dict(self) -> dict:
        return asdict(self)


def compare(
    baseline: dict[str, Samples], current: dict[str, Samples], params: DriftParams
) -> list[FeatureDrift]:
    return [compare_feature(f, baseline[f.name], current[f.name], params) for f in FEATURES]


def compare_feature(
    feature: Feature, baseline: Samples, current: Samples, params: DriftParams
) -> FeatureDrift:
    """One feature's measures. Without samples on a side there is nothing to measure; with
    fewer than drift.min_episodes episodes on a side the measures are shown but not judged."""
    measures = []
    if len(baseline.values) and len(current.values):
        measures = [measure(m, baseline.values, current.values, params) for m in feature.measures]
    assessed = min(baseline.episodes, current.episodes) >= params.min_episodes and bool(measures)
    summary = _shares if feature.categorical else _summary
    return FeatureDrift(
        name=feature.name,
        unit=feature.unit,
        description=feature.description,
        n_baseline=len(baseline.values),
        n_current=len(current.values),
        episodes_baseline=baseline.episodes,
        episodes_current=current.episodes,
        assessed=assessed,
        drifted=assessed and any(m.drifted for m in measures),
        measures=measures,
        baseline=summary(baseline.values),
        current=summary(current.values),
    )


def _summary(values: np.ndarray) -> dict:
    if not len(values):
        return {"mean": None, "median": None, "p95": None}
    return {
        "mean": float(np.mean(values)),
        "median": float(np.median(values)),
        "p95": float(np.percentile(values, 95)),
    }


def _shares(values: np.ndarray) -> dict:
    counts = Counter(np.asarray(values).tolist())
    total = sum(counts.values())
    return {str(k): counts[k] / total for k in sorted(counts)}
