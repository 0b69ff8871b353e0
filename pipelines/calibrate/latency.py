"""Action latency from the gantry's velocity response: a mixture model fitted by EM.

Each control step the drives apply the newest command that has arrived; every command
travels with its own random delay, and a block of the shift runs under load with extra
delay. What the logs show is the measured gantry velocity one step later, which a velocity
servo pulls towards the applied command:

    v[k+1] = alpha * v[k] + beta * max_speed * command[k - age[k]] + noise

`age[k]` is hidden. For independent per-command delays with CDF F, the age of the applied
command has P(age > a) = prod_{j<=a} (1 - F(j)), so the age distribution identifies the
delay distribution exactly (and back: `delays_from_ages`). Episodes are the unit of load:
each is either normal or under load (ages shifted by `load_extra_steps`), a latent class
whose likelihood accumulates over all of its steps. EM alternates responsibilities (per
step over ages, per episode over load) with closed-form updates of the age distribution,
the load share and (alpha, beta, sigma) by weighted least squares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipelines.calibrate.logs import LoggedEpisode

MAX_AGE = 7  # control steps; ages beyond this have no support on any cell we know of


@dataclass(frozen=True)
class Transitions:
    """Every logged step transition, stacked: what EM fits."""

    candidates: np.ndarray  # (N, MAX_AGE, 2) the command (m/s) applied at each age
    v_before: np.ndarray  # (N, 2) measured velocity at step k
    v_after: np.ndarray  # (N, 2) measured velocity at step k + 1
    episode: np.ndarray  # (N,) index into the episode list
    free: np.ndarray  # (N,) the pusher is clear of the part: no push slows the drives


@dataclass(frozen=True)
class LatencyFit:
    delay_pmf: np.ndarray  # P(delay = d) for d = 0..MAX_AGE-1, normal operation
    load_extra_steps: int
    load_fraction: float
    under_load: np.ndarray  # (episodes,) posterior probability of running under load
    applied_age: list[np.ndarray]  # per episode: most likely age of the applied command
    episode_ids: tuple[str, ...]
    alpha: float
    beta: float
    sigma: float  # residual std of the velocity model, per axis
    log_likelihood: dict[int, float]  # per candidate load_extra_steps

    @property
    def ages_by_episode(self) -> dict[str, np.ndarray]:
        return dict(zip(self.episode_ids, self.applied_age, strict=True))

    def steps_dict(self, min_probability: float = 0.005) -> dict[int, float]:
        """`latency.steps` as the world file writes it: delay -> probability."""
        kept = {d: float(p) for d, p in enumerate(self.delay_pmf) if p >= min_probability}
        total = sum(kept.values())
        return {d: round(p / total, 3) for d, p in kept.items()}


def applied_commands(episode: LoggedEpisode, ages: np.ndarray, max_speed_mps: float) -> np.ndarray:
    """The drive command (m/s) during each step, given the age of the applied command
    (zero before any command has arrived)."""
    issued = np.arange(len(ages)) - ages
    return np.where(
        (issued >= 0)[:, None], episode.command[np.maximum(issued, 0)] * max_speed_mps, 0.0
    )


def transitions(
    episodes: list[LoggedEpisode], max_speed_mps: float, free: list[np.ndarray]
) -> Transitions:
    parts = []
    for n, episode in enumerate(episodes):
        command = np.vstack([np.zeros((MAX_AGE, 2)), episode.command * max_speed_mps])
        k = np.arange(episode.steps - 1)
        ages = np.arange(MAX_AGE)
        # Before any command arrives the drives hold zero: the padding rows.
        candidates = command[MAX_AGE + k[:, None] - ages[None, :]]
        parts.append(
            (
                candidates,
                episode.joint_velocity[:-1],
                episode.joint_velocity[1:],
                np.full(len(k), n),
                free[n][:-1],
            )
        )
    return Transitions(*(np.concatenate(column) for column in zip(*parts, strict=True)))


def fit_latency(
    data: Transitions,
    episode_ids: Sequence[str],
    extra_candidates=(0, 1, 2, 3),
    iterations: int = 200,
) -> LatencyFit:
    """The most likely load_extra_steps, and the EM fit under it."""
    n_episodes = len(episode_ids)
    fits = {extra: _em(data, n_episodes, extra, iterations) for extra in extra_candidates}
    best = max(fits, key=lambda extra: fits[extra]["log_likelihood"])
    fit = fits[best]
    if fit["load_fraction"] < 0.01:  # no load block worth the name
        best, fit = 0, fits[0]
    return LatencyFit(
        delay_pmf=delays_from_ages(fit["ages"]),
        load_extra_steps=best,
        load_fraction=float(fit["load_fraction"]) if best else 0.0,
        under_load=fit["under_load"] if best else np.zeros(n_episodes),
        applied_age=_map_ages(data, fit, n_episodes),
        episode_ids=tuple(episode_ids),
        alpha=fit["alpha"],
        beta=fit["beta"],
        sigma=fit["sigma"],
        log_likelihood={e: round(float(f["log_likelihood"]), 1) for e, f in fits.items()},
    )


def delays_from_ages(age_pmf: np.ndarray) -> np.ndarray:
    """Invert P(age > a) = prod_{j<=a} (1 - F(j)) for the delay pmf."""
    survive_age = np.clip(1.0 - np.cumsum(age_pmf), 0.0, 1.0)
    previous = np.r_[1.0, survive_age[:-1]]
    survive_delay = np.where(previous > 1e-9, survive_age / np.maximum(previous, 1e-9), 0.0)
    cdf = np.maximum.accumulate(1.0 - survive_delay)
    return np.clip(np.diff(np.r_[0.0, cdf]), 0.0, None)


def _shifted(pmf: np.ndarray, extra: int) -> np.ndarray:
    return np.r_[np.zeros(extra), pmf[: len(pmf) - extra]]


def _em(data: Transitions, n_episodes: int, extra: int, iterations: int) -> dict:
    ages = np.full(MAX_AGE, 1.0 / MAX_AGE)
    load, alpha, beta, sigma = 0.3 if extra else 0.0, 0.1, 0.8, 0.05
    previous = -np.inf
    for _ in range(iterations):
        step_lik = _step_likelihoods(data, alpha, beta, sigma)
        normal, loaded, log_likelihood, p_load = _responsibilities(
            step_lik, data, ages, extra, load, n_episodes
        )
        if log_likelihood - previous < 1e-3:  # EM never decreases it: converged
            break
        previous = log_likelihood
        weights = (1 - p_load)[data.episode, None] * normal + p_load[data.episode, None] * loaded
        ages = _age_update(normal, loaded, p_load[data.episode], extra)
        load = float(np.clip(p_load.mean(), 1e-3, 1 - 1e-3)) if extra else 0.0
        alpha, beta, sigma = _servo_update(data, weights, np.ones(len(weights), bool))
    # A push slows the drives a little: the servo itself is measured on free steps only.
    alpha, beta, sigma = _servo_update(data, weights, data.free)
    return {
        "ages": ages,
        "load_fraction": load,
        "under_load": p_load,
        "alpha": alpha,
        "beta": beta,
        "sigma": sigma,
        "log_likelihood": log_likelihood,
        "weights": weights,
    }


def _step_likelihoods(data: Transitions, alpha, beta, sigma) -> tuple[np.ndarray, np.ndarray]:
    """(scaled likelihood per step and age, log scale per step); contact steps are flat."""
    predicted = alpha * data.v_before[:, None, :] + beta * data.candidates
    log_lik = -((data.v_after[:, None, :] - predicted) ** 2).sum(-1) / (2 * sigma**2)
    log_lik -= np.log(2 * np.pi * sigma**2)
    peak = log_lik.max(1, keepdims=True)
    return np.exp(log_lik - peak), peak[:, 0]


def _responsibilities(step_lik, data, ages, extra, load, n_episodes):
    scaled, peak = step_lik
    loaded_ages = _shifted(ages, extra)
    per_normal, per_loaded = scaled * ages, scaled * loaded_ages
    log_normal = np.log(per_normal.sum(1) + 1e-300) + peak
    log_loaded = np.log(per_loaded.sum(1) + 1e-300) + peak
    episode_normal = np.bincount(data.episode, log_normal, n_episodes) + np.log(1 - load + 1e-12)
    episode_loaded = np.bincount(data.episode, log_loaded, n_episodes) + np.log(load + 1e-12)
    both = np.logaddexp(episode_normal, episode_loaded)
    p_load = np.exp(episode_loaded - both) if extra else np.zeros(n_episodes)
    normal = per_normal / np.maximum(per_normal.sum(1, keepdims=True), 1e-300)
    loaded = per_loaded / np.maximum(per_loaded.sum(1, keepdims=True), 1e-300)
    return normal, loaded, float(both.sum()), p_load


def _age_update(normal, loaded, p_load_steps, extra) -> np.ndarray:
    """Pool both classes on the normal age scale: loaded ages are shifted back by `extra`."""
    back = np.hstack([loaded[:, extra:], np.zeros((len(loaded), extra))])
    pooled = ((1 - p_load_steps)[:, None] * normal + p_load_steps[:, None] * back).sum(0)
    return pooled / pooled.sum()


def _servo_update(data: Transitions, weights: np.ndarray, free: np.ndarray):
    v0, v1, w, cand = data.v_before[free], data.v_after[free], weights[free], data.candidates[free]
    applied = (w[:, :, None] * cand).sum(1)
    applied_sq = (w[:, :, None] * cand**2).sum(1)
    normal_eq = np.array(
        [[(v0**2).sum(), (v0 * applied).sum()], [(v0 * applied).sum(), applied_sq.sum()]]
    )
    alpha, beta = np.linalg.solve(normal_eq, [(v0 * v1).sum(), (applied * v1).sum()])
    residual = v1[:, None, :] - alpha * v0[:, None, :] - beta * cand
    sigma = np.sqrt((w * (residual**2).sum(-1)).sum() / (2 * len(v1)))
    return float(alpha), float(beta), float(sigma)


def _map_ages(data: Transitions, fit: dict, n_episodes: int) -> list[np.ndarray]:
    """Per episode, the most likely age at every step (contact steps take the prior mode)."""
    best = fit["weights"].argmax(1)
    return [best[data.episode == n] for n in range(n_episodes)]
