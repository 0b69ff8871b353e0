"""Sensor and perception noise, confidence and camera bias as they vary with lighting.

Every estimate uses a moment where the truth is known without seeing it:
- the part sits still until the pusher first reaches it, so perceived-pose scatter over
  that prefix is pure perception noise;
- within an episode the lighting is constant, so confidence scatter is its noise;
- lighting follows the shift clock, l = (1 - cos(2 pi phase)) / 2, the sim's lighting model;
  its amplitude cannot be told apart from the per-unit effects, so it is fixed at 1 and the
  confidence drop and bias drift carry the scale;
- while the pusher pushes, the part's centre sits exactly (pusher radius + part radius)
  from the pusher, whose joint sensors have no bias. The perceived offset from that circle is
  the camera bias: b = b0 + drift * l, fitted with a robust loss over all pushing steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from pipelines.calibrate.latency import LatencyFit, applied_commands
from pipelines.calibrate.logs import LoggedEpisode

APPROACH_MARGIN_M = 0.04  # beyond any camera bias we expect: the pusher is surely clear
PUSH_BAND_M = 0.015  # a pushing step: pusher-to-part distance within this of contact
MIN_PUSH_SPEED_MPS = 0.05
# Part sizes (radii) differ by 3 mm or more: fitted size groups closer than this are one part.
SAME_SIZE_M = 0.003
MAX_PART_SIZES = 6  # size groups the mixture may find on one line
JACKKNIFE_GROUPS = 10  # groups of episodes the camera bias's standard errors leave out in turn


def lighting(phase: float | np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 - np.cos(2.0 * np.pi * np.asarray(phase, float)))


def part_radius(episode: LoggedEpisode) -> float:
    return float(np.nanmean(episode.part_extent_m)) / 2.0


def size_clusters(episodes: list[LoggedEpisode]) -> list[list[LoggedEpisode]]:
    """Episodes grouped by measured part size, the most common size first; episodes with no
    size logged are left out. pipelines.calibrate.parts makes the part mix of them.

    A Gaussian mixture over the sizes, one variance for all groups (the gauge's noise is the
    same whatever the part), as many groups as the BIC chooses; fitted groups closer than
    SAME_SIZE_M are one part. Not single linkage at a fixed gap: the gauge's tails (about
    0.7 mm a reading) bridged a 30 mm and a 36 mm part in a third of the calibrations after a
    wide box came (5 of 15 in one campaign), and the calibrated sim then had one 32 mm part
    instead of two."""
    measured = [e for e in episodes if np.isfinite(part_radius(e))]
    if len(measured) < 2:
        return [measured] if measured else []
    labels = _size_labels(np.array([part_radius(e) for e in measured]))
    clusters = [[e for e, lab in zip(measured, labels, strict=True) if lab == label]
                for label in np.unique(labels)]  # fmt: skip
    return sorted(clusters, key=len, reverse=True)


def _size_labels(radii_m: np.ndarray) -> np.ndarray:
    """A size group per radius (see size_clusters); deterministic for the same radii."""
    from sklearn.mixture import GaussianMixture

    x = radii_m[:, None] * 1000.0  # mm: the mixture's variance floor is meant for unit scale
    fits = [
        GaussianMixture(k, covariance_type="tied", random_state=0).fit(x)
        for k in range(1, min(MAX_PART_SIZES, len(np.unique(x))) + 1)
    ]
    best = min(fits, key=lambda fit: fit.bic(x))
    means = best.means_[:, 0] / 1000.0
    order = np.argsort(means)
    # Adjacent groups closer than SAME_SIZE_M merge: one part whose readings the mixture split.
    part = np.cumsum(np.r_[0, np.diff(means[order]) >= SAME_SIZE_M])
    part_of_group = np.empty(len(means), dtype=int)
    part_of_group[order] = part
    return part_of_group[best.predict(x)]


def clear_of_part(episode: LoggedEpisode, pusher_radius_m: float) -> np.ndarray:
    """Steps where the pusher is surely not touching the part, whatever the camera bias."""
    reach = pusher_radius_m + part_radius(episode) * np.sqrt(2) + APPROACH_MARGIN_M
    return np.linalg.norm(episode.part_xy - episode.joint_position, axis=1) > reach


def rest_prefix(episode: LoggedEpisode, pusher_radius_m: float) -> int:
    """Number of leading steps before the pusher first comes near the part."""
    clear = clear_of_part(episode, pusher_radius_m)
    return int(np.argmin(clear)) if not clear.all() else episode.steps


@dataclass(frozen=True)
class Estimate:
    value: float
    std: float  # standard error of the estimate

    def as_dict(self) -> dict:
        return {"value": self.value, "std": self.std}


def pooled_std(groups: list[np.ndarray]) -> Estimate:
    """Within-group standard deviation (each group has its own mean), with its standard error."""
    groups = [g for g in groups if len(g) >= 3]
    squares = sum(float(((g - g.mean(0)) ** 2).sum()) for g in groups)
    dof = sum((len(g) - 1) * (g.shape[1] if g.ndim > 1 else 1) for g in groups)
    std = float(np.sqrt(squares / max(dof, 1)))
    return Estimate(std, std / np.sqrt(2 * max(dof, 1)))


def robust_std(values: np.ndarray) -> float:
    """Normal-consistent MAD: indifferent to the odd mis-modelled step."""
    return float(1.4826 * np.median(np.abs(values - np.median(values))))


def joint_noise(
    episodes: list[LoggedEpisode],
    latency: LatencyFit,
    free: list[np.ndarray],
    max_speed_mps: float,
    dt: float,
) -> dict[str, Estimate]:
    """Velocity noise from the servo model's residual; position noise from the position
    increment the servo model predicts over each step (exact first-order response)."""
    alpha, beta = latency.alpha, latency.beta
    velocity_noise = latency.sigma / np.sqrt(1.0 + alpha**2)
    tau = -dt / np.log(alpha)
    residuals = []
    for episode, ages, clear in zip(episodes, latency.applied_age, free, strict=True):
        applied = applied_commands(episode, ages, max_speed_mps)
        v_steady = beta / (1.0 - alpha) * applied
        v_now = episode.joint_velocity[:-1]
        travelled = v_steady * dt + (v_now - v_steady) * tau * (1.0 - alpha)
        moved = np.diff(episode.joint_position, axis=0)
        keep = clear[:-1] & clear[1:]
        residuals.append((moved - travelled)[keep].ravel())
    spread = robust_std(np.concatenate(residuals))
    from_velocity = velocity_noise * tau * (1.0 - alpha)
    position_noise = np.sqrt(max(spread**2 - from_velocity**2, 0.0) / 2.0)
    n = sum(len(r) for r in residuals)
    return {
        "joint_position_noise_m": Estimate(position_noise, position_noise / np.sqrt(n)),
        "joint_velocity_noise_mps": Estimate(
            velocity_noise, velocity_noise / np.sqrt(2 * len(latency.applied_age) * 50)
        ),
    }


def perception_noise(episodes: list[LoggedEpisode], pusher_radius_m: float) -> dict[str, Estimate]:
    prefixes = [rest_prefix(e, pusher_radius_m) for e in episodes]
    return {
        "pose_noise_m": pooled_std(
            [e.part_xy[:n] for e, n in zip(episodes, prefixes, strict=True)]
        ),
        "yaw_noise_rad": pooled_std(
            [e.part_yaw[:n] for e, n in zip(episodes, prefixes, strict=True)]
        ),
        "confidence_noise": pooled_std([e.confidence for e in episodes]),
    }


def confidence_model(episodes: list[LoggedEpisode]) -> dict[str, Estimate]:
    """Episode-mean confidence = base - drop * lighting, by least squares."""
    light = lighting([e.shift_phase for e in episodes])
    means = np.array([e.confidence.mean() for e in episodes])
    design = np.column_stack([np.ones_like(light), -light])
    (base, drop), covariance = _least_squares(design, means)
    return {
        "confidence_base": Estimate(float(base), float(np.sqrt(covariance[0, 0]))),
        "confidence_drop": Estimate(float(drop), float(np.sqrt(covariance[1, 1]))),
    }


def _least_squares(design: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    dof = max(len(y) - design.shape[1], 1)
    noise = float(((y - design @ coef) ** 2).sum()) / dof
    return coef, noise * np.linalg.pinv(design.T @ design)


def camera_bias(
    episodes: list[LoggedEpisode], pusher_radius_m: float, rounds: int = 3
) -> dict[str, Estimate]:
    """b = b0 + drift * lighting from the contact geometry of pushing steps; standard errors
    by the episodes (see _jackknife)."""
    reference = reference_part_episodes(episodes)
    if not reference:
        raise ValueError("no episode logged a part's size: the camera's bias has no reference")
    coef = np.zeros(4)  # bias_x, bias_y, drift_x, drift_y
    band = APPROACH_MARGIN_M
    for _ in range(rounds):
        steps = _pushing_steps(reference, pusher_radius_m, coef, band)
        coef, band = _fit_bias(coef, steps), PUSH_BAND_M
    covariance = _jackknife(coef, steps)
    names = ("bias_x_m", "bias_y_m", "bias_drift_x_m", "bias_drift_y_m")
    return {
        name: Estimate(float(value), float(np.sqrt(covariance[i, i])))
        for i, (name, value) in enumerate(zip(names, coef, strict=True))
    }


def reference_part_episodes(episodes: list[LoggedEpisode]) -> list[LoggedEpisode]:
    """Episodes with the most common part: their contact radius is known from the extent.
    That part is the largest cluster of measured sizes, and its episodes those within 2 mm
    of the cluster's median extent. Not the median of all episodes: where no part makes up
    half the line (cell-09 once a wide box came: its standard part under half) that median
    falls between two parts' sizes and selects no episode."""
    clusters = size_clusters(episodes)
    if not clusters:
        return []
    typical = np.nanmedian([np.nanmean(e.part_extent_m) for e in clusters[0]])
    return [e for e in episodes if abs(np.nanmean(e.part_extent_m) - typical) < 0.002]


@dataclass(frozen=True)
class _PushingSteps:
    """The steps where the pusher pushes the reference part, and the episode of each."""

    offsets: np.ndarray  # (n, 2) perceived part minus pusher, m
    radii: np.ndarray  # (n,) contact distance, m
    light: np.ndarray  # (n,) lighting level
    episode: np.ndarray  # (n,) index of the step's episode (int)

    def subset(self, keep: np.ndarray) -> _PushingSteps:
        return _PushingSteps(self.offsets[keep], self.radii[keep], self.light[keep],
                             self.episode[keep])  # fmt: skip


def _pushing_steps(episodes, pusher_radius_m, coef, band) -> _PushingSteps:
    offsets, radii, light, index = [], [], [], []
    for number, episode in enumerate(episodes):
        contact = pusher_radius_m + part_radius(episode)
        level = float(lighting(episode.shift_phase))
        bias = coef[:2] + coef[2:] * level
        offset = episode.part_xy - episode.joint_position
        distance = np.linalg.norm(offset - bias, axis=1)
        towards = (episode.joint_velocity * (offset - bias)).sum(1) / np.maximum(distance, 1e-9)
        pushing = (np.abs(distance - contact) < band) & (towards > MIN_PUSH_SPEED_MPS)
        offsets.append(offset[pushing])
        for values, value in ((radii, contact), (light, level), (index, number)):
            values.append(np.full(pushing.sum(), value))
    return _PushingSteps(*(np.concatenate(a) for a in (offsets, radii, light, index)))


def _fit_bias(start: np.ndarray, steps: _PushingSteps) -> np.ndarray:
    fit = least_squares(
        _contact_residual,
        start,
        args=(steps.offsets, steps.radii, steps.light),
        loss="soft_l1",
        f_scale=0.005,
    )
    return fit.x


def _contact_residual(coef, offsets, radii, light):
    bias = coef[:2] + coef[2:] * light[:, None]
    return np.linalg.norm(offsets - bias, axis=1) - radii


def _jackknife(coef: np.ndarray, steps: _PushingSteps) -> np.ndarray:
    """Covariance of the bias fit by the delete-a-group jackknife over episodes: refit with each
    of JACKKNIFE_GROUPS groups of episodes left out. Not the least-squares covariance of the
    steps: an episode's pushing steps share its contact point and pose error, so they are not
    independent draws; counted as such, the standard errors came out about half the spread
    between calibrations of separate shifts of one unchanged line (0.4 against 0.7-1.3 mm on
    cell-08), and every other calibration looked like a moved camera (a new pretrain)."""
    group_of_step = steps.episode % JACKKNIFE_GROUPS  # every group spans the shift's lighting
    present = np.unique(group_of_step)
    if len(present) < 2:
        return np.full((len(coef), len(coef)), np.inf)
    refits = np.array([_fit_bias(coef, steps.subset(group_of_step != g)) for g in present])
    deviations = refits - refits.mean(axis=0)
    return deviations.T @ deviations * (len(present) - 1) / len(present)
