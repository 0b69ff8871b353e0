"""The ingest flow: landing folder → canonical Parquet dataset (DVC-versioned)."""

from __future__ import annotations

from prefect import flow


@flow(name="ingest", log_prints=False)
def ingest_flow(params_path: str = "params.yaml") -> dict:
    """Ingest everything new in the landing folder; returns the ingest summary."""
    raise NotImplementedError("wired in by the loop issue")
