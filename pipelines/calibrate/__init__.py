"""Real-to-sim calibration: the line's latency, noise, perception and physics from its logs.

`calibrate` returns a `Calibration` whose `world` section uses exactly the keys and units of
the simulator's world file, so an estimate can be held against the line's true value and the sim
can load it. See docs/calibration.md for the method and what the logs cannot identify.
"""

from pipelines.calibrate.fit import Calibration, calibrate
from pipelines.calibrate.physics import ReplayBatch, ReplayResult, Simulator
from pipelines.calibrate.report import (
    plot_profiles,
    plot_replay,
    replay_comparison,
    write_calibration,
)

__all__ = [
    "Calibration",
    "ReplayBatch",
    "ReplayResult",
    "Simulator",
    "calibrate",
    "plot_profiles",
    "plot_replay",
    "replay_comparison",
    "write_calibration",
]
