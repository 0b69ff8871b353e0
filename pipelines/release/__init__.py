"""Release: hardware-trial requests, the gate on their results, promotion to the edge channel,
lineage."""

from pipelines.release.gate import decide, trial_stats
from pipelines.release.lineage import SOURCE_INDEX, file_lineage, model_lineage
from pipelines.release.promote import channel_location, production_alias, promote

__all__ = [
    "SOURCE_INDEX",
    "channel_location",
    "decide",
    "file_lineage",
    "model_lineage",
    "production_alias",
    "promote",
    "trial_stats",
]
