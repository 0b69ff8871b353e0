"""The box's runtime: the active bundle's ONNX policy, its out-of-distribution screen, and a
swap to a newly activated bundle between episodes.

A bundle the runtime can run holds, next to the safetensors weights, `policy.onnx` (the
exported network, checked against torch when it was written) and `ood.json` (statistics of
the policy's training observations and a threshold calibrated on held-out ones, and the part
footprints the policy trained on). Per step the cell asks `screen(observation, footprint)`: a
part whose measured footprint is none the policy trained on (the signal triage's novel_part
class reads from the same log field), beyond the OOD threshold, or below the perception
confidence the box trusts, the step goes to the cell's fallback instead of the policy.

Standard library, numpy and onnxruntime only: the box installs without torch.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ONNX_FILE = "policy.onnx"
OOD_FILE = "ood.json"
EXPORT_FILE = "export.json"
CONFIG_FILE = "config.json"
OOD_FORMAT = 1
OBS_SIZE = 12  # pipelines.contract.schema.OBS_SIZE; the box cannot import it
CONFIDENCE_INDEX = 7
FEATURES = "relative-v1"  # the name of `ood_features` below, recorded in ood.json

OOD, LOW_CONFIDENCE, NOVEL_PART = "ood", "low_confidence", "novel_part"


class RuntimeLoadError(ValueError):
    """A bundle folder the runtime cannot run; the message names the file and what to do."""


def ood_features(obs: np.ndarray) -> np.ndarray:
    """(..., 12) observations -> (..., 12) float64 features the OOD score is computed on.

    Where things are relative to each other (as the policy sees them), how fast the gantry
    moves against what it was told (a heavier or larger part slows it), the part's distance
    and orientation (a different part sits further from the pusher in contact, and a box
    turns), and the perception confidence (it drops with the light)."""
    obs = np.asarray(obs, dtype=np.float64)
    pusher, velocity = obs[..., 0:2], obs[..., 2:4]
    part, yaw, confidence = obs[..., 4:6], obs[..., 6:7], obs[..., 7:8]
    target, last_action = obs[..., 8:10], obs[..., 10:12]
    to_part = part - pusher
    return np.concatenate(
        [
            to_part,
            np.linalg.norm(to_part, axis=-1, keepdims=True),
            target - part,
            velocity,
            last_action,
            confidence,
            np.sin(4 * yaw),
            np.cos(4 * yaw),
        ],
        axis=-1,
    )


# A policy may see more than the newest observation (pipelines.training.policy.PolicyConfig
# `history`): its input is then that observation and the `history - 1` before it, newest
# first. Training data, the torch policy and this box all build that input here, so they
# cannot disagree on it.
def stacked_inputs(
    frames: np.ndarray,
    history: int,
    episode_first: np.ndarray | None = None,
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """(M, 12) observations in time order -> (len(rows), history * 12) policy inputs.

    `episode_first`: (M,) the row each frame's episode starts at (default: all one episode);
    before it there is nothing to remember, so that first frame stands in (its last command
    is zero). `rows`: the frames to build inputs for (default: all)."""
    frames = np.asarray(frames, dtype=np.float32)
    first = np.zeros(len(frames), np.int64) if episode_first is None else episode_first
    rows = np.arange(len(frames)) if rows is None else np.asarray(rows)
    index = np.maximum(rows[:, None] - np.arange(history)[None, :], first[rows][:, None])
    return frames[index].reshape(len(rows), history * OBS_SIZE)


class EpisodeInputs:
    """One episode's policy inputs, a step at a time: `begin()` when an episode starts, then
    `push(observation)` on every step, whoever drives it, for the input now."""

    def __init__(self, history: int = 1):
        self.history = int(history)
        self.size = self.history * OBS_SIZE
        self.begin()

    def begin(self) -> None:
        self._frames = np.zeros((0, OBS_SIZE), np.float32)  # the newest `history`, oldest first

    def push(self, observation: np.ndarray) -> np.ndarray:
        frame = np.asarray(observation, dtype=np.float32).reshape(1, OBS_SIZE)
        self._frames = np.concatenate([self._frames, frame])[-self.history :]
        newest = np.array([len(self._frames) - 1])
        return stacked_inputs(self._frames, self.history, rows=newest)[0]


@dataclass(frozen=True)
class OodModel:
    """A Mahalanobis distance under the training observations' mean and covariance: the
    distance is |W (f(x) - mean)| with W the inverse Cholesky factor of the covariance."""

    mean: np.ndarray
    whitening: np.ndarray
    threshold: float
    confidence_floor: float = 0.0  # the training confidence's lower tail (ood.py)
    # The footprints (m, the part's measured extent) of the parts the policy trained on, and
    # how far a measured one may be from the nearest. Empty (bundles exported before the
    # footprints were recorded): no part screen.
    part_footprints_m: tuple[float, ...] = ()
    footprint_tolerance_m: float = math.inf

    @classmethod
    def from_record(cls, record: Any, where: str) -> OodModel:
        try:
            if record.get("format") != OOD_FORMAT or record.get("features") != FEATURES:
                raise ValueError(
                    f"format {record.get('format')} / features {record.get('features')!r}, "
                    f"this box reads format {OOD_FORMAT} / {FEATURES!r}"
                )
            mean = np.asarray(record["mean"], dtype=np.float64)
            whitening = np.asarray(record["whitening"], dtype=np.float64)
            threshold = float(record["threshold"])
            floor = float(record["confidence_floor"])
            footprints = tuple(float(v) for v in record.get("part_footprints_m", ()))
            tolerance = float(record.get("footprint_tolerance_m", math.inf))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise RuntimeLoadError(
                f"{where}: not an OOD model ({exc}); re-export the policy"
            ) from None
        if footprints and not (
            all(math.isfinite(v) and v > 0 for v in footprints) and 0 < tolerance < math.inf
        ):
            raise RuntimeLoadError(
                f"{where}: part_footprints_m must be positive lengths and footprint_tolerance_m "
                f"a positive finite length (got {list(footprints)}, {tolerance}); re-export"
            )
        size = ood_features(np.zeros(OBS_SIZE)).shape[-1]
        if mean.shape != (size,) or whitening.shape != (size, size) or not math.isfinite(threshold):
            raise RuntimeLoadError(
                f"{where}: mean/whitening/threshold do not fit {size} features; re-export"
            )
        return cls(mean, whitening, threshold, floor, footprints, tolerance)

    def scores(self, observations: np.ndarray) -> np.ndarray:
        """The distance of each of (n, 12) observations (vectorised: benches, calibration)."""
        centred = ood_features(observations) - self.mean
        return np.linalg.norm(centred @ self.whitening.T, axis=-1)

    def score(self, observation: np.ndarray) -> float:
        return float(self.scores(np.asarray(observation)[None, :])[0])

    def footprint_distance(self, footprint_m: np.ndarray | None) -> float:
        """How far the part's measured footprint (its extent per axis, m; the mean is taken)
        is from the nearest footprint the policy trained on; 0 where there is nothing to
        compare (no footprints recorded, or no measurement)."""
        if not self.part_footprints_m or footprint_m is None:
            return 0.0
        measured = float(np.mean(footprint_m))
        return min(abs(measured - known) for known in self.part_footprints_m)


@dataclass(frozen=True)
class Fallback:
    """Why a step went to the fallback: `reason` is `novel_part`, `ood` or `low_confidence`.
    `score` and `threshold` are the reason's own: the footprint distance and tolerance (m)
    for `novel_part`, the OOD score and its threshold otherwise."""

    reason: str
    score: float
    threshold: float
    confidence: float


class PolicySession:
    """One bundle folder, loaded completely: the ONNX session, the OOD model, the name.

    `min_confidence`: the box's own floor on perception confidence (params); the bundle's
    floor (the training data's lower tail) applies too, whichever is higher."""

    def __init__(self, folder: str | Path, min_confidence: float):
        self.folder = Path(folder)
        self.min_confidence = float(min_confidence)
        for name in (ONNX_FILE, OOD_FILE, CONFIG_FILE):
            if not (self.folder / name).is_file():
                raise RuntimeLoadError(
                    f"{self.folder / name}: missing; the box runs bundles exported with "
                    f"{ONNX_FILE} and {OOD_FILE} (re-train or re-promote the model)"
                )
        config = _read_json(self.folder / CONFIG_FILE)
        self.name = str(config.get("version", self.folder.name))
        self.ood_model = OodModel.from_record(
            _read_json(self.folder / OOD_FILE), str(self.folder / OOD_FILE)
        )
        self.episode = _episode_inputs(config, self.folder / CONFIG_FILE)
        self._session, self._input = _onnx_session(self.folder / ONNX_FILE, self.episode.size)
        self.confidence_floor = max(self.min_confidence, self.ood_model.confidence_floor)

    def begin_episode(self) -> None:
        """A new episode: nothing of the last one is remembered."""
        self.episode.begin()

    def observe(self, observation: np.ndarray) -> np.ndarray:
        """A step the fallback drives still counts as seen: the policy's frames keep step."""
        return self.episode.push(observation)

    def act(self, observation: np.ndarray) -> np.ndarray:
        x = self.observe(observation).reshape(1, self.episode.size)
        return self._session.run(None, {self._input: x})[0][0].astype(np.float64)

    def act_batch(self, inputs: np.ndarray) -> np.ndarray:
        """Actions for (n, history * 12) policy inputs (stacked_inputs): benches, the
        export's parity check."""
        x = np.ascontiguousarray(inputs, dtype=np.float32).reshape(-1, self.episode.size)
        return self._session.run(None, {self._input: x})[0]

    def ood(self, observation: np.ndarray) -> tuple[float, bool]:
        score = self.ood_model.score(observation)
        return score, score > self.ood_model.threshold

    def screen(
        self, observation: np.ndarray, part_footprint_m: np.ndarray | None = None
    ) -> Fallback | None:
        """None: the policy may act on this observation; else why the fallback must.
        `part_footprint_m`: the episode's part as the camera measured it at pick-up."""
        confidence = float(observation[CONFIDENCE_INDEX])
        distance = self.ood_model.footprint_distance(part_footprint_m)
        if distance > self.ood_model.footprint_tolerance_m:
            tolerance = self.ood_model.footprint_tolerance_m
            return Fallback(NOVEL_PART, distance, tolerance, confidence)
        score, is_ood = self.ood(observation)
        if confidence < self.confidence_floor:
            return Fallback(LOW_CONFIDENCE, score, self.ood_model.threshold, confidence)
        if is_ood:
            return Fallback(OOD, score, self.ood_model.threshold, confidence)
        return None


class EdgeRuntime:
    """What the cell's controller calls: the session of the episode under way.

    `prepare` loads a new bundle completely (a failure leaves the running session as it was);
    the prepared session takes over at the next `begin_episode`, so an episode never changes
    model halfway and no step waits on a load."""

    def __init__(self, session: PolicySession):
        self._active = session
        self._pending: PolicySession | None = None
        self._lock = threading.Lock()

    @property
    def session(self) -> PolicySession:
        return self._active

    @property
    def name(self) -> str:
        return self._active.name

    def prepare(self, folder: str | Path) -> PolicySession:
        session = PolicySession(folder, self._active.min_confidence)
        with self._lock:
            self._pending = session
        return session

    def begin_episode(self) -> PolicySession:
        with self._lock:
            if self._pending is not None:
                self._active, self._pending = self._pending, None
        self._active.begin_episode()
        return self._active

    def act(self, observation: np.ndarray) -> np.ndarray:
        return self._active.act(observation)

    def observe(self, observation: np.ndarray) -> np.ndarray:
        return self._active.observe(observation)

    def screen(
        self, observation: np.ndarray, part_footprint_m: np.ndarray | None = None
    ) -> Fallback | None:
        return self._active.screen(observation, part_footprint_m)


def has_runtime_files(folder: str | Path) -> bool:
    """True when the bundle carries what the runtime needs (older bundles do not)."""
    return all((Path(folder) / name).is_file() for name in (ONNX_FILE, OOD_FILE))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RuntimeLoadError(f"{path}: unreadable ({exc}); pull the bundle again") from None
    if not isinstance(value, dict):
        raise RuntimeLoadError(f"{path}: not a JSON object; pull the bundle again")
    return value


def _episode_inputs(config: dict[str, Any], where: Path) -> EpisodeInputs:
    history = config.get("history", 1)
    if not (isinstance(history, int) and not isinstance(history, bool) and 1 <= history <= 64):
        raise RuntimeLoadError(
            f"{where}: history {history!r} is not a number of frames this box can stack "
            "(1-64); pull the bundle again"
        )
    return EpisodeInputs(history)


def _onnx_session(path: Path, width: int):
    import onnxruntime as ort  # about 0.3 s to import: only once there is a model

    options = ort.SessionOptions()
    # One step at a time on a shared box: one thread has the lowest latency (bench/edge.py).
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.log_severity_level = 3  # errors only: warnings would flood the cell's log
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types, undocumented
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RuntimeLoadError(f"{path}: not a loadable ONNX model ({first})") from None
    inputs = session.get_inputs()
    if len(inputs) != 1 or inputs[0].shape[-1] != width:
        raise RuntimeLoadError(
            f"{path}: expects {inputs[0].shape[-1] if len(inputs) == 1 else '?'} input values, "
            f"its config.json says {width}; re-export the policy"
        )
    return session, inputs[0].name
