"""What a capture's snapshot shows that the logs do not: where the part really was, and how
large it really is (docs/triage.md, "Snapshots").

A capture's snapshot (docs/data-contract.md, "Edge-case captures") is a top-down view of the
table at the trigger step: the table is the axes' face (light grey), spanning
`triage.snapshot_half_width_m` either side of the centre on both axes; the part is a filled disc
in the cell's part colour at its true position and true size, drawn under the perceived outline,
the pusher and the arrows. The perception pose logged at the same step is where the camera put
the part, so the two together measure the camera's offset at that step; the disc's radius is
the part's size as the image shows it, independent of the camera's extent measurement.

Reading is plain pixel work (Pillow decodes, numpy measures): the face's bounding box gives the
scale; the disc's edge pixels that border the table (not an occluding line) are fitted with a
circle (least squares, twice, the second time without the edge pixels the first fit left more
than a pixel off).
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from pipelines.contract.params import TriageParams

# The snapshot's colours (refcell/snapshot.py, the cell contract's drawing): the table's face
# ("0.93" grey) and the true part's fill (matplotlib "tab:blue").
_FACE_RGB = (237, 237, 237)
_PART_RGB = (31, 119, 180)
_LIGHTER_THAN = 400  # sum of RGB: the part colour is 330, the face 711, the darkest line 128
_COLOUR_TOLERANCE = 24  # per channel: antialiased edge pixels are blends, not matches
_MIN_EDGE_PIXELS = 12  # fewer free edge pixels: the disc is too hidden to fit
_OUTLIER_PX = 1.0


@dataclass(frozen=True)
class SnapshotPart:
    """The part as one snapshot shows it, in table metres."""

    x_m: float
    y_m: float
    radius_m: float
    edge_pixels: int  # how many edge pixels the fit used (its support)


def read_snapshot(image: bytes | Path, half_width_m: float) -> SnapshotPart | None:
    """The part's true centre and radius in the snapshot `image` (PNG bytes or a file), or
    None when the image cannot be decoded or shows no table or no measurable part."""
    from PIL import Image, UnidentifiedImageError

    try:
        source = io.BytesIO(image) if isinstance(image, bytes) else Path(image)
        with Image.open(source) as decoded:
            rgb = np.asarray(decoded.convert("RGB"), dtype=np.int16)
    except (OSError, UnidentifiedImageError, ValueError):
        return None
    return measure_part(rgb, half_width_m)


def _near(
    rgb: np.ndarray, colour: tuple[int, int, int], tolerance: int = _COLOUR_TOLERANCE
) -> np.ndarray:
    # Channel by channel: several times faster than a reduction over the last axis of 3,
    # which matters when every cycle reads hundreds of snapshots.
    near = np.abs(rgb[..., 0] - colour[0]) <= tolerance
    for channel in (1, 2):
        near &= np.abs(rgb[..., channel] - colour[channel]) <= tolerance
    return near


def measure_part(rgb: np.ndarray, half_width_m: float) -> SnapshotPart | None:
    """`read_snapshot` on decoded pixels (rows top-down, RGB)."""
    face = _near(rgb, _FACE_RGB, 0)
    # The face fills the axes' interior, and its rows and columns are mostly face; a stray
    # grey pixel of antialiased text elsewhere is not.
    by_row, by_col = face.sum(axis=1), face.sum(axis=0)
    rows = np.flatnonzero(by_row >= 0.5 * by_row.max(initial=0))
    cols = np.flatnonzero(by_col >= 0.5 * by_col.max(initial=0))
    if len(rows) < 10 or len(cols) < 10:
        return None
    # Its outer pixel edges are the axes' limits.
    top, bottom, left, right = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    metres_per_px = 2 * half_width_m / (right - left)
    table = rgb[top:bottom, left:right]  # the legend's swatch of the part colour is outside
    part = _near(table, _PART_RGB)
    # Whatever is lighter than the part colour is table, target or the antialiased blend of
    # the disc into them; the dark lines drawn over the disc (outline, pusher) are not.
    lighter = ~part & (table[..., 0] + table[..., 1] + table[..., 2] > _LIGHTER_THAN)
    edge = part & _touches(lighter)
    ys, xs = np.nonzero(edge)
    fit = _fit_circle(xs + 0.5 + left, ys + 0.5 + top)
    if fit is None:
        return None
    cx, cy, radius, used = fit
    # The edge pixels' centres lie within a pixel inside the outline (half of one where the
    # image is antialiased, as the cell's are): the radius reads up to a pixel small.
    return SnapshotPart(
        x_m=float(-half_width_m + (cx - left) * metres_per_px),
        y_m=float(half_width_m - (cy - top) * 2 * half_width_m / (bottom - top)),
        radius_m=float(radius * metres_per_px),
        edge_pixels=used,
    )


def _touches(mask: np.ndarray) -> np.ndarray:
    """Pixels with a 4-neighbour in `mask`."""
    out = np.zeros_like(mask)
    out[1:] |= mask[:-1]
    out[:-1] |= mask[1:]
    out[:, 1:] |= mask[:, :-1]
    out[:, :-1] |= mask[:, 1:]
    return out


def _fit_circle(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float, int] | None:
    """Least-squares circle (Kåsa) through the points, refitted once without the points the
    first fit left more than `_OUTLIER_PX` off."""
    keep = np.ones(len(x), dtype=bool)
    for _ in range(2):
        if keep.sum() < _MIN_EDGE_PIXELS:
            return None
        a = np.column_stack([x[keep], y[keep], np.ones(keep.sum())])
        b = x[keep] ** 2 + y[keep] ** 2
        (p, q, r), *_ = np.linalg.lstsq(a, b, rcond=None)
        cx, cy = p / 2, q / 2
        radius = float(np.sqrt(max(r + cx * cx + cy * cy, 0.0)))
        keep = np.abs(np.hypot(x - cx, y - cy) - radius) <= _OUTLIER_PX
    if keep.sum() < _MIN_EDGE_PIXELS:
        return None
    return float(cx), float(cy), radius, int(keep.sum())


def read_snapshots(
    captures: Iterable[tuple[str, int | None, Iterable[str]]],
    captures_dir: Path,
    half_width_m: float,
) -> list[tuple[str, int, SnapshotPart]]:
    """(episode id, trigger step, part) for the first measurable snapshot of each episode,
    from its captures' (episode id, trigger step, attachment names): one per episode is
    enough (its part and its light do not change within it), and reading is the slow part."""
    out, seen = [], set()
    for episode_id, step, attachments in captures:
        if episode_id in seen or step is None:
            continue
        for name in attachments:
            if not name.lower().endswith(".png") or Path(name).name != name:
                continue  # a sidecar names files in captures/, nothing elsewhere
            part = read_snapshot(Path(captures_dir) / name, half_width_m)
            if part is not None:
                out.append((episode_id, step, part))
                seen.add(episode_id)
                break
    return out


def snapshot_evidence(
    snapshots: list[tuple[str, int, SnapshotPart]],
    steps: pa.Table,
    episode_ids: list[str],
    params: TriageParams,
) -> dict[str, tuple[float, float]]:
    """Per episode of `episode_ids`: (the part's radius in its snapshot, NaN without one; the
    camera's offset at the episode's light, NaN when fewer than `min_snapshots` could be
    measured).

    The offset is perceived minus true position at each snapshot (the pose logged on the step
    after the trigger: the snapshot shows the part after the trigger step's motion). The line's
    camera offset follows its lighting, and so does perception confidence, so the offset is
    fitted per axis as a line in the episode's mean confidence (least squares, refitted once
    without the snapshots more than three robust deviations off) and read at each episode's
    mean confidence: a snapshot measures the light it was taken in, the fit carries it to
    every episode, with or without a capture.
    """
    wanted = sorted(set(episode_ids) | {e for e, _, _ in snapshots})
    rows = steps.filter(pc.is_in(steps.column("episode_id"), pa.array(wanted, pa.string())))
    ids = rows.column("episode_id").to_numpy(zero_copy_only=False)
    step = rows.column("step").to_numpy()
    pose = np.asarray(
        pc.list_flatten(rows.column("part_pose").combine_chunks()).to_numpy(zero_copy_only=False)
        if rows.num_rows
        else [],
        dtype=np.float64,
    ).reshape(-1, 3)
    confidence = rows.column("part_confidence").to_numpy().astype(np.float64)
    unique, inverse = np.unique(ids, return_inverse=True)
    mean_confidence = dict(
        zip(unique, np.bincount(inverse, confidence) / np.bincount(inverse), strict=True)
    )
    where = {(e, int(s)): i for i, (e, s) in enumerate(zip(ids, step, strict=True))}
    x, offsets = [], []
    for episode_id, trigger, part in snapshots:
        i = where.get((episode_id, trigger + 1), where.get((episode_id, trigger)))
        if i is not None:
            x.append(mean_confidence[episode_id])
            offsets.append(pose[i, :2] - (part.x_m, part.y_m))
    fit = _fit_offset(np.asarray(x), np.asarray(offsets).reshape(-1, 2), params.min_snapshots)
    radius = {e: p.radius_m for e, _, p in snapshots}
    out = {}
    for episode_id in episode_ids:
        light = mean_confidence.get(episode_id)
        offset = float("nan")
        if fit is not None and light is not None:
            offset = float(np.linalg.norm(fit[0] + fit[1] * light))
        out[episode_id] = (radius.get(episode_id, float("nan")), offset)
    return out


def _fit_offset(
    confidence: np.ndarray, offsets: np.ndarray, min_points: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Intercept and slope (2-vectors) of offset against confidence, or None."""
    keep = np.ones(len(confidence), dtype=bool)
    for _ in range(2):
        if keep.sum() < max(min_points, 3) or np.ptp(confidence[keep]) == 0:
            return None
        design = np.column_stack([np.ones(keep.sum()), confidence[keep]])
        coef, *_ = np.linalg.lstsq(design, offsets[keep], rcond=None)
        predicted = np.column_stack([np.ones(len(confidence)), confidence]) @ coef
        residual = np.linalg.norm(offsets - predicted, axis=1)
        spread = 1.4826 * np.median(residual[keep]) + 1e-9
        keep = residual <= 3 * spread
    return coef[0], coef[1]
