"""Release: hardware-trial requests, the gate on their results, promotion to the edge channel,
lineage."""

from pipelines.release.gate import decide, trial_stats
from pipelines.release.lineage import SOURCE_INDEX, file_lineage, model_lineage
from pipelines.release.prescreen import prescreen_correlation
from pipelines.release.promote import (
    attest_gate,
    channel_location,
    keys_location,
    named_decision,
    production_alias,
    promote,
)

__all__ = [
    "SOURCE_INDEX",
    "attest_gate",
    "channel_location",
    "decide",
    "file_lineage",
    "keys_location",
    "model_lineage",
    "named_decision",
    "prescreen_correlation",
    "production_alias",
    "promote",
    "trial_stats",
]
