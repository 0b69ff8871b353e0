"""The review image an edge-case capture keeps: a labelled top-down view of the table.

A reviewer opening a capture must see at a glance why it was kept and what the cell believed:
the true part, where perception put it (with its yaw), the pusher with the motion it was
commanded, the target, and in words the reason, the log time and the perception confidence.
480 x 360 pixels, large enough to read without zooming.
"""

from __future__ import annotations

import io

import numpy as np

from refcell.cell import PART_LIMIT_M, Cell
from refcell.runner import StepRecord

SIZE_PX = (480, 360)
_DPI = 80
# Where the pusher would be after this long at the commanded velocity: long enough to see.
_ARROW_HORIZON_S = 0.5
# Observation layout (refcell.cell.Cell.observation): perceived part x, y, yaw, confidence.
_PART_XY, _PART_YAW, _CONFIDENCE = slice(4, 6), 6, 7


def snapshot_png(cell: Cell, record: StepRecord, caption: str) -> bytes:
    """The labelled snapshot of the cell at `record`'s step as PNG bytes."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(SIZE_PX[0] / _DPI, SIZE_PX[1] / _DPI), dpi=_DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_axes((0.09, 0.07, 0.56, 0.70))
    _draw_table(axes, cell, record)
    figure.text(0.02, 0.98, caption, fontsize=9, va="top", family="monospace")
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, frameon=False)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=_DPI)
    return buffer.getvalue()


def _draw_table(axes, cell: Cell, record: StepRecord) -> None:
    from matplotlib.patches import Circle

    state = cell.true_state()
    limit = PART_LIMIT_M
    axes.set_xlim(-limit, limit)
    axes.set_ylim(-limit, limit)
    axes.set_aspect("equal")
    axes.set_facecolor("0.93")
    axes.tick_params(labelsize=7)
    axes.set_xlabel("x (m)", fontsize=7)
    axes.set_ylabel("y (m)", fontsize=7)
    tolerance = cell.params.success_tolerance_m
    axes.add_patch(Circle(state.target, tolerance, color="tab:green", alpha=0.5, label="target"))
    axes.add_patch(Circle(state.part, cell.part.size_m, color="tab:blue", label="part (true)"))
    perceived = record.observation[_PART_XY]
    axes.add_patch(
        Circle(
            perceived,
            cell.part.size_m,
            fill=False,
            ls="--",
            lw=1.5,
            color="navy",
            label="part (perceived)",
        )
    )
    yaw = float(record.observation[_PART_YAW])
    heading = perceived + cell.part.size_m * np.array([np.cos(yaw), np.sin(yaw)])
    axes.plot(*zip(perceived, heading, strict=True), color="navy", lw=1.5)
    axes.add_patch(Circle(state.pusher, 0.012, color="tab:red", label="pusher"))
    motion = record.commanded * cell.params.max_speed_mps * _ARROW_HORIZON_S
    axes.annotate(
        "",
        xy=state.pusher + motion,
        xytext=state.pusher,
        arrowprops={"arrowstyle": "->", "color": "tab:red", "lw": 1.5},
    )
    axes.plot([], [], color="tab:red", label=f"commanded ({_ARROW_HORIZON_S:g} s)")


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
