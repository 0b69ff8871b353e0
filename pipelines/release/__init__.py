"""Release: the gate on hardware-trial results, promotion to the edge channel, lineage."""
