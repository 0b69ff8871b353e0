"""A vectorized ROS 2 MCAP decoder: MCAP records, chunks and CDR payloads of the standard
message types to numpy columns per topic. It knows nothing of the data contract.

The entry point is `decode.decode` (not re-exported here: the name is its module's)."""

from pipelines.ingest.mcap.decode import (
    MCAP_MAGIC,
    ChannelInfo,
    McapDecodeError,
    TopicArrays,
    iter_batches,
    scan_records,
)
from pipelines.ingest.mcap.limits import DecodeLimits

__all__ = [
    "MCAP_MAGIC",
    "ChannelInfo",
    "DecodeLimits",
    "McapDecodeError",
    "TopicArrays",
    "iter_batches",
    "scan_records",
]
