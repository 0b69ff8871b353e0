"""Fitting the box's out-of-distribution score on a policy's training observations.

The score is a Mahalanobis distance (edge.runtime.OodModel) under the mean and covariance of
the training observations' features. A distance over twelve features hardly moves when one of
them does, and the one that matters most at the edge of the training data is the perception
confidence (it falls with the light), so that one also gets a floor of its own. The two share
the false-alarm budget: the distance's threshold is the (1 - false_alarm / 2) quantile on
held-out training observations, the confidence floor their false_alarm / 2 quantile, so at most
about `false_alarm` of in-distribution steps go to the fallback.

The record also names the part footprints the policy trained on (config.json's
`trained_on.part_footprints_m`: `part_footprints`, below) and how far a measured part may be
from them: the box hands an episode with an unfamiliar part to the fallback from its first
step, as triage would later call its failure novel_part.

Held out are whole blocks of consecutive rows (about an episode each): the steps of one
episode look alike, and a threshold calibrated on their twins would be too low.

The fitted numbers are rounded to SIGNIFICANT_DIGITS of each array's largest value: the linear
algebra's last bits depend on the CPU's BLAS kernels, and ood.json is part of a model folder
that `dvc repro` must rebuild byte for byte on any machine.
"""

from __future__ import annotations

import numpy as np

from edge.runtime import CONFIDENCE_INDEX, FEATURES, OOD_FORMAT, OodModel, ood_features

HOLDOUT_FRACTION = 0.2
BLOCK_ROWS = 100  # consecutive rows held out together: one episode is 100 control steps
MIN_ROWS = 30  # fewer: no covariance of 12 features worth the name
RIDGE = 1e-6  # relative to the mean variance: a feature that never varied stays invertible
SIGNIFICANT_DIGITS = 9  # far above the score's needs, far below the BLAS kernels' differences
# Episodes of a footprint a fine-tune must have trained on before the policy counts as knowing
# the part: a handful of stray measurements is not a part the policy has learned.
MIN_FOOTPRINT_EPISODES = 10
FOOTPRINT_DECIMALS = 4  # 0.1 mm: the camera measures to about 2 mm


def fit_ood(
    observations: np.ndarray,
    false_alarm: float,
    seed: int = 0,
    part_footprints_m: tuple[float, ...] = (),
    footprint_tolerance_m: float | None = None,
) -> dict:
    """The ood.json record for (n, 12) training observations, calibrated at `false_alarm`;
    with `part_footprints_m` and `footprint_tolerance_m`, the box's part screen too."""
    observations = np.asarray(observations, dtype=np.float64)
    if len(observations) < MIN_ROWS:
        raise ValueError(
            f"{len(observations)} training observations: the OOD score needs at least {MIN_ROWS}"
        )
    fit_rows, held_rows = _split(len(observations), seed)
    features = ood_features(observations[fit_rows])
    mean = features.mean(axis=0)
    covariance = np.cov(features, rowvar=False)
    covariance += np.eye(len(mean)) * RIDGE * float(np.trace(covariance)) / len(mean)
    mean, whitening = _rounded(mean), _rounded(np.linalg.inv(np.linalg.cholesky(covariance)))
    held = OodModel(mean, whitening, np.inf).scores(observations[held_rows])
    threshold = float(_rounded(np.quantile(held, 1.0 - false_alarm / 2, method="higher")))
    confidence = observations[held_rows, CONFIDENCE_INDEX]
    floor = float(np.quantile(confidence, false_alarm / 2, method="lower"))
    flagged = (held > threshold) | (confidence < floor)
    parts = {}
    if part_footprints_m and footprint_tolerance_m is not None:
        parts = {
            "part_footprints_m": sorted(
                round(float(v), FOOTPRINT_DECIMALS) for v in part_footprints_m
            ),
            "footprint_tolerance_m": footprint_tolerance_m,
        }
    return {
        "format": OOD_FORMAT,
        "features": FEATURES,
        "score": "mahalanobis",
        "mean": mean.tolist(),
        "whitening": whitening.tolist(),
        "threshold": threshold,
        "confidence_floor": floor,
        "false_alarm": false_alarm,
        "fit_rows": len(fit_rows),
        "calibration_rows": len(held_rows),
        "calibration_false_alarm": float(np.mean(flagged)),
        **parts,
    }


def part_footprints(trained_on: dict) -> tuple[float, ...]:
    """The footprints a policy trained on, from its config's `trained_on` (a fine-tune's own,
    else its base's, recursively); () for a policy that does not record them."""
    while trained_on:
        if "part_footprints_m" in trained_on:
            return tuple(trained_on["part_footprints_m"])
        trained_on = trained_on.get("base_trained_on") or {}
    return ()


def learned_footprints(
    known: tuple[float, ...], measured: np.ndarray, tolerance: float
) -> tuple[float, ...]:
    """`known` plus the footprints of line episodes a fine-tune trained on: measured
    footprints (one per episode, m) that are further than `tolerance` from every known one
    and come MIN_FOOTPRINT_EPISODES or more within `tolerance` of each other, each group as
    its median. () where nothing is known (a base that did not record its parts)."""
    if not known:
        return ()
    unfamiliar = np.sort(
        [v for v in np.asarray(measured, dtype=float) if _far(v, known, tolerance)]
    )
    groups = np.split(unfamiliar, np.flatnonzero(np.diff(unfamiliar) > tolerance) + 1)
    new = [float(np.median(g)) for g in groups if len(g) >= MIN_FOOTPRINT_EPISODES]
    return tuple(sorted(round(v, FOOTPRINT_DECIMALS) for v in (*known, *new)))


def _far(value: float, known: tuple[float, ...], tolerance: float) -> bool:
    return all(abs(value - k) > tolerance for k in known)


def _rounded(values: np.ndarray | float) -> np.ndarray:
    """`values` rounded to SIGNIFICANT_DIGITS of their largest magnitude (so a whitening
    matrix's 1e-17 round-off becomes 0), negative zeros made positive."""
    values = np.asarray(values, dtype=np.float64)
    largest = float(np.max(np.abs(values), initial=0.0))
    if largest == 0.0 or not np.isfinite(largest):
        return values
    decimals = SIGNIFICANT_DIGITS - 1 - int(np.floor(np.log10(largest)))
    return np.round(values, decimals) + 0.0


def _split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Row indexes (fit, held out): whole blocks of BLOCK_ROWS, HOLDOUT_FRACTION of them."""
    # Small training sets (tests, a first cycle) still get five or more blocks.
    blocks = np.arange(n) // max(1, min(BLOCK_ROWS, n // 5))
    count = int(blocks[-1]) + 1
    held_blocks = max(1, round(count * HOLDOUT_FRACTION))
    chosen = np.random.default_rng(seed).permutation(count)[:held_blocks]
    held = np.isin(blocks, chosen)
    return np.flatnonzero(~held), np.flatnonzero(held)
