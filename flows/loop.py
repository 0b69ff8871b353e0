"""The loop flow: collect → ingest → validate → fine-tune → trials → gate → promote."""

from __future__ import annotations

from prefect import flow


@flow(name="retrain-loop", log_prints=False)
def loop_flow(params_path: str = "params.yaml") -> dict:
    """One cycle of the continual-retraining loop; returns the loop summary."""
    raise NotImplementedError("wired in by the loop issue")
