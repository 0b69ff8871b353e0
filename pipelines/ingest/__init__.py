"""Ingest: decode ROS 2 MCAP cell logs, read the landing sources (folder, S3), keep the store
(batches, manifest, quarantine, locks) and version the dataset (DVC + git)."""

from pipelines.ingest.captures import ingest_captures
from pipelines.ingest.git_state import check_can_version
from pipelines.ingest.in_place import requeue_completed
from pipelines.ingest.landing import ALREADY_INGESTED, ingest_file
from pipelines.ingest.landing_layout import CAPTURES_DIR
from pipelines.ingest.quarantine import quarantine_file
from pipelines.ingest.report import FileResult, IngestReport
from pipelines.ingest.sources import (
    LandingFolder,
    ObjectGone,
    S3Prefix,
    SeenFiles,
    SourceError,
    SourceFile,
    TransientSourceError,
    landing_entries,
    local_file,
    open_source,
    safe_parts,
)
from pipelines.ingest.store import (
    MANIFEST_NAME,
    read_dataset,
    record_in_manifest,
    sha256_file,
    storage_schema,
)
from pipelines.ingest.versioning import (
    checkout_version,
    current_version,
    describe_versions,
    ensure_workspace,
    list_versions,
    require_latest,
    version_dataset,
    version_sources,
    versions_holding,
)

__all__ = [
    "ALREADY_INGESTED",
    "CAPTURES_DIR",
    "MANIFEST_NAME",
    "FileResult",
    "IngestReport",
    "LandingFolder",
    "ObjectGone",
    "S3Prefix",
    "SeenFiles",
    "SourceError",
    "SourceFile",
    "TransientSourceError",
    "check_can_version",
    "checkout_version",
    "current_version",
    "describe_versions",
    "ensure_workspace",
    "ingest_captures",
    "ingest_file",
    "landing_entries",
    "list_versions",
    "local_file",
    "open_source",
    "quarantine_file",
    "read_dataset",
    "record_in_manifest",
    "requeue_completed",
    "require_latest",
    "safe_parts",
    "sha256_file",
    "storage_schema",
    "version_dataset",
    "version_sources",
    "versions_holding",
]
