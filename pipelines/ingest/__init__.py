"""Ingest: decode ROS 2 MCAP cell logs, read the landing sources (folder, S3), keep the store
(batches, manifest, quarantine, locks) and version the dataset (DVC + git)."""
