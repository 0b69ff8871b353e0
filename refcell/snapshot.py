"""The review image an edge-case capture keeps: a labelled top-down view of the table.

A reviewer opening a capture must see at a glance why it was kept and what the cell believed:
the true part, where perception put it (with its yaw), the pusher with the motion it was
commanded, the target, and in words the reason, the log time and the perception confidence.
480 x 360 pixels, large enough to read without zooming.

Everything that never changes (the table, its ticks and labels, the legend) is drawn once per
thread and kept as a background; each snapshot restores it and draws only the cell's state and
the caption over it (matplotlib's blitting). The text of a full figure is most of its cost:
drawn each time, the snapshots took 60% of a recorded shift's CPU (docs/benchmarks.md,
bench/refcell).
"""

from __future__ import annotations

import io
import threading

import numpy as np

from refcell.cell import PART_LIMIT_M, Cell
from refcell.runner import StepRecord

SIZE_PX = (480, 360)
_DPI = 80
# Where the pusher would be after this long at the commanded velocity: long enough to see.
_ARROW_HORIZON_S = 0.5
# Observation layout (refcell.cell.Cell.observation): perceived part x, y, yaw, confidence.
_PART_XY, _PART_YAW, _CONFIDENCE = slice(4, 6), 6, 7
# The drawing's styles, shared by the artists and their legend entries.
_TARGET = {"color": "tab:green", "alpha": 0.5}
_PART = {"color": "tab:blue"}
_PERCEIVED = {"fill": False, "ls": "--", "lw": 1.5, "color": "navy"}
_PUSHER = {"color": "tab:red"}
_PUSHER_RADIUS_M = 0.012
_COMMAND_ARROW = {"arrowstyle": "->", "color": "tab:red", "lw": 1.5}

_local = threading.local()  # a matplotlib figure is not to be shared between threads


def snapshot_png(cell: Cell, record: StepRecord, caption: str) -> bytes:
    """The labelled snapshot of the cell at `record`'s step as PNG bytes."""
    if not hasattr(_local, "drawing"):
        _local.drawing = _Drawing()
    return _local.drawing.png(cell, record, caption)


class _Drawing:
    """The figure with its background drawn; `png` draws one snapshot over it."""

    def __init__(self) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.figure = Figure(figsize=(SIZE_PX[0] / _DPI, SIZE_PX[1] / _DPI), dpi=_DPI)
        self.canvas = FigureCanvasAgg(self.figure)
        self.axes = self.figure.add_axes((0.09, 0.07, 0.56, 0.70))
        _draw_table(self.axes)
        self.canvas.draw()
        self.background = self.canvas.copy_from_bbox(self.figure.bbox)

    def png(self, cell: Cell, record: StepRecord, caption: str) -> bytes:
        from PIL import Image

        self.canvas.restore_region(self.background)
        artists = _draw_state(self.axes, cell, record)
        artists.append(
            self.figure.text(0.02, 0.98, caption, fontsize=9, va="top", family="monospace")
        )
        renderer = self.canvas.get_renderer()
        try:
            for artist in sorted(artists, key=lambda a: a.get_zorder()):  # as a full draw would
                artist.draw(renderer)
        finally:
            for artist in artists:
                artist.remove()
        pixels = np.asarray(self.canvas.buffer_rgba())[..., :3]
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        return buffer.getvalue()


def _draw_table(axes) -> None:
    """The background: the table's face and scales, and the legend of what `_draw_state` draws."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    limit = PART_LIMIT_M
    axes.set_xlim(-limit, limit)
    axes.set_ylim(-limit, limit)
    axes.set_aspect("equal")
    axes.set_facecolor("0.93")
    axes.tick_params(labelsize=7)
    axes.set_xlabel("x (m)", fontsize=7)
    axes.set_ylabel("y (m)", fontsize=7)
    entries = [
        Patch(**_TARGET, label="target"),
        Patch(**_PART, label="part (true)"),
        Patch(**_PERCEIVED, label="part (perceived)"),
        Patch(**_PUSHER, label="pusher"),
        Line2D([], [], color=_PUSHER["color"], label=f"commanded ({_ARROW_HORIZON_S:g} s)"),
    ]
    axes.legend(
        handles=entries, loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False
    )


def _draw_state(axes, cell: Cell, record: StepRecord) -> list:
    """The cell at `record`'s step on the table, as artists of `axes` (not drawn yet)."""
    from matplotlib.patches import Circle

    state = cell.true_state()
    size = cell.part.size_m
    perceived = record.observation[_PART_XY]
    yaw = float(record.observation[_PART_YAW])
    heading = perceived + size * np.array([np.cos(yaw), np.sin(yaw)])
    motion = record.commanded * cell.params.max_speed_mps * _ARROW_HORIZON_S
    patches = [
        Circle(state.target, cell.params.success_tolerance_m, **_TARGET),
        Circle(state.part, size, **_PART),
        Circle(perceived, size, **_PERCEIVED),
        Circle(state.pusher, _PUSHER_RADIUS_M, **_PUSHER),
    ]
    artists = [axes.add_patch(patch) for patch in patches]
    artists += axes.plot(*zip(perceived, heading, strict=True), color="navy", lw=1.5)
    artists.append(
        axes.annotate("", xy=state.pusher + motion, xytext=state.pusher, arrowprops=_COMMAND_ARROW)
    )
    return artists


def caption(reason: str, time_iso: str, record: StepRecord, note: str) -> str:
    """The words on the snapshot: why it was kept, when, and what perception reported."""
    x, y = (float(v) for v in record.observation[_PART_XY])
    vx, vy = (float(v) for v in record.commanded)
    return (
        f"{reason} at step {record.index}, {time_iso}\n{note}\n"
        f"perceived part ({x:+.3f}, {y:+.3f}) m, "
        f"confidence {float(record.observation[_CONFIDENCE]):.2f}\n"
        f"commanded ({vx:+.2f}, {vy:+.2f}) of max speed"
    )
