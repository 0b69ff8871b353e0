"""The `keys-refresh` deployment's flow: re-sign the channel's timestamp on a schedule.

A box refuses a channel whose timestamp is older than promote.timestamp_expiry_s (a freeze
attack looks the same as a publisher that stopped), so a channel without a release for that
long would stop every box from updating and from running trials. `realloop serve` and
`realloop deploy-flows` run this every third of the expiry: two refreshes can fail in a row
before a box notices.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.keys_cli import refresh_channel


def refresh_interval_s(timestamp_expiry_s: float) -> float:
    return timestamp_expiry_s / 3


@flow(name="keys-refresh")
def keys_refresh_flow(params_path: str = "params.yaml", workspace: str = ".") -> dict:
    """A new signed timestamp over the same releases; returns `realloop keys refresh --json`'s
    payload. The keys folder and channel in params.yaml are relative to `workspace`."""
    root = Path(workspace).resolve()
    return refresh_channel(Path(params_path), workspace=root, skip_unpublished=True)
