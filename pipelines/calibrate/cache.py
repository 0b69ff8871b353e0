"""Which calibration a cell's calibrated policy is pretrained in, and where that policy is kept.

A pretrain costs minutes, and two calibrations of the same line differ by their sampling
error alone. So the loop keeps one calibrated policy per calibration, under
`<folder>/<hash>/` (the calibration file and the policy), named by the content hash of the
calibration's world and randomization, and `<folder>/current.json` names the calibration in
use. A new calibration replaces it only when some estimate moved by more than `sigmas`
standard errors (the larger of the two calibrations') and by more than `floor` of its value
(calibrate.randomization_floor: the pretrain randomizes at least that far around each
estimate, so a smaller move is inside what the cached policy trained on); otherwise the one
in use stands and its policy is reused: a cache hit, no pretrain.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from pipelines.calibrate.sensing import SAME_SIZE_M

CURRENT = "current.json"
CALIBRATION_FILE = "sim-calibration.yaml"
POLICY_DIR = "policy"
SAME_PART_SIZE_M = SAME_SIZE_M  # two calibrations name the same variant within this size


@dataclass(frozen=True)
class CachedCalibration:
    """The calibration a cell's calibrated candidate uses this cycle."""

    hash: str  # content hash of its world and randomization
    path: Path  # its calibration file (`realloop cell pretrain --calibration` reads it)
    policy: Path  # where its pretrained policy is (or goes)
    changed: list[str]  # what moved beyond its standard errors ([] : the old one stands)
    new: bool  # a calibration not in use before (then `changed` says why, or it is the first)

    @property
    def pretrained(self) -> bool:
        """The policy is there: a cache hit."""
        return (self.policy / "config.json").is_file()

    def as_dict(self) -> dict:
        return {
            "hash": self.hash,
            "path": str(self.path),
            "policy": str(self.policy),
            "changed": self.changed,
            "new": self.new,
            "cached_policy": self.pretrained,
        }


def calibration_hash(calibration: Mapping) -> str:
    """sha256 (16 hex digits) of what the sim takes from a calibration: `world` and
    `randomization`, as canonical JSON (diagnostics and provenance do not count)."""
    content = {k: calibration.get(k) for k in ("world", "randomization")}
    text = json.dumps(content, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def moved_estimates(new: Mapping, old: Mapping, sigmas: float, floor: float = 0.0) -> list[str]:
    """Dotted keys whose estimate moved by more than `sigmas` standard errors, and by more than
    `floor` of its old value, between two calibrations (`world` and `uncertainty` sections,
    as Calibration.as_dict writes them).
    An estimate without a standard error (not identified by the logs) never counts; the
    latency distribution counts through its mean delay."""
    moved = []
    for section, values in new["world"].items():
        if not isinstance(values, Mapping):  # parts: a list, compared by _moved_parts
            continue
        for key, value in values.items():
            before = old["world"].get(section, {}).get(key)
            errors = [u.get(section, {}).get(key) for u in (new["uncertainty"], old["uncertainty"])]
            errors = [e for e in errors if isinstance(e, int | float)]
            numbers = isinstance(value, int | float) and isinstance(before, int | float)
            if numbers and errors and _moved(value, before, sigmas * max(errors), floor):
                moved.append(f"{section}.{key}")
    delay_error = [
        u.get("latency", {}).get("mean_delay_steps")
        for u in (new["uncertainty"], old["uncertainty"])
    ]
    delay_error = [e for e in delay_error if isinstance(e, int | float)]
    delay_new, delay_old = (_mean_delay(c["world"]) for c in (new, old))
    if delay_error and _moved(delay_new, delay_old, sigmas * max(delay_error), floor):
        moved.append("latency.mean_delay_steps")
    return moved + _moved_parts(new, old, sigmas, floor)


def _moved_parts(new: Mapping, old: Mapping, sigmas: float, floor: float) -> list[str]:
    """The part mix moved: a variant appeared or went (matched by shape and size), or its
    share moved beyond `sigmas` standard errors. A calibration written before the mix was
    estimated has no parts: every variant of the new one counts as new."""
    mixes = [c["world"].get("parts") or [] for c in (new, old)]
    moved = [f"parts.{p['name']} (gone)" for p in mixes[1] if _same_part(p, mixes[0]) is None]
    for part in mixes[0]:
        before = _same_part(part, mixes[1])
        if before is None:
            moved.append(f"parts.{part['name']} (new)")
            continue
        errors = [
            (c["uncertainty"].get("parts") or {}).get(p["name"], {}).get("probability")
            for c, p in ((new, part), (old, before))
        ]
        errors = [e for e in errors if isinstance(e, int | float)]
        shares = part["probability"], before["probability"]
        if errors and _moved(*shares, sigmas * max(errors), floor):
            moved.append(f"parts.{part['name']}.probability")
    return moved


def _same_part(part: Mapping, mix: list[Mapping]) -> Mapping | None:
    return next(
        (
            p
            for p in mix
            if p.get("shape", "cylinder") == part.get("shape", "cylinder")
            and abs(p["size_m"] - part["size_m"]) < SAME_PART_SIZE_M
        ),
        None,
    )


def choose_calibration(
    folder: Path, calibration: Mapping, sigmas: float, write_file, floor: float = 0.0
) -> CachedCalibration:
    """The calibration to pretrain in: `calibration` (a Calibration.as_dict()) when it is the
    first, or moved beyond `sigmas` standard errors from the one in use; else the one in use.
    `write_file(path)` writes the new calibration file when it is taken (report's
    write_calibration, with its provenance). Records the choice in `<folder>/current.json`."""
    folder = Path(folder)
    in_use = _current(folder)
    if in_use is not None:
        old = yaml.safe_load((folder / in_use / CALIBRATION_FILE).read_text())
        changed = moved_estimates(calibration, old, sigmas, floor)
        if not changed:
            return _cached(folder, in_use, [], new=False)
    else:
        changed = ["first calibration"]
    digest = calibration_hash(calibration)
    path = folder / digest / CALIBRATION_FILE
    if not path.is_file():
        write_file(path)
    _write_current(folder, digest)
    return _cached(folder, digest, changed, new=True)


def current_calibration(folder: Path) -> CachedCalibration | None:
    """The calibration in use for a cell (None before its first)."""
    in_use = _current(Path(folder))
    return None if in_use is None else _cached(Path(folder), in_use, [], new=False)


def _cached(folder: Path, digest: str, changed: list[str], new: bool) -> CachedCalibration:
    return CachedCalibration(
        digest, folder / digest / CALIBRATION_FILE, folder / digest / POLICY_DIR, changed, new
    )


def _current(folder: Path) -> str | None:
    path = folder / CURRENT
    if not path.is_file():
        return None
    digest = json.loads(path.read_text()).get("hash")
    return digest if digest and (folder / digest / CALIBRATION_FILE).is_file() else None


def _write_current(folder: Path, digest: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{CURRENT}.partial"
    partial.write_text(json.dumps({"hash": digest}) + "\n")
    partial.replace(folder / CURRENT)  # atomically: a reader sees the old choice or the new


def _moved(new: float, old: float, errors: float, floor: float) -> bool:
    return abs(new - old) > max(errors, floor * abs(old), 1e-12)


def _mean_delay(world: Mapping) -> float:
    """Mean command delay in steps from a world's latency distribution ({steps: probability};
    YAML may have turned the keys into strings)."""
    steps = (world.get("latency") or {}).get("steps") or {}
    if not steps:
        return 0.0
    delays = np.array([float(k) for k in steps])
    weights = np.array([float(v) for v in steps.values()])
    return float((delays * weights).sum() / max(weights.sum(), 1e-12))
