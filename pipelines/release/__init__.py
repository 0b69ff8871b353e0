"""Release: the gate on hardware-trial results, promotion to the edge channel, lineage."""

from pipelines.release.gate import decide, trial_stats
from pipelines.release.lineage import SOURCE_INDEX, file_lineage, model_lineage
from pipelines.release.promote import promote

__all__ = ["SOURCE_INDEX", "decide", "file_lineage", "model_lineage", "promote", "trial_stats"]
