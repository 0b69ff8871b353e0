"""`realloop keys init | rotate | refresh`: the signing keys of the release channel.

`init DIR` makes root (in DIR/offline/: move it off the publisher afterwards), the online keys
(timestamp, snapshot, targets, gate) and DIR/root.json, the file edge boxes are enrolled with;
with --channel it also writes the channel's first signed metadata. `rotate ROLE` replaces one
key and publishes the change so enrolled boxes follow it (root: N+1.root.json signed by the old
and the new root key). `refresh` re-signs the timestamp so boxes keep trusting a channel that
had no release for a while (run it more often than promote.timestamp_expiry_s).
The logic is edge.rotation's (the box's package, so the formats live in one place).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.console import CommandError, emit, fails_cleanly, stdout

app = typer.Typer(help="the release channel's signing keys (TUF)", no_args_is_help=True)
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]
ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
ChannelOpt = Annotated[
    str | None,
    typer.Option("--channel", help="the channel (default: promote.channel in params.yaml)"),
]
KeysOpt = Annotated[
    Path | None, typer.Option("--keys", help="keys folder (default: promote.keys in params)")
]


@app.command("init")
@fails_cleanly
def init_command(
    folder: Annotated[Path, typer.Argument(help="the keys folder to make")],
    channel: Annotated[
        str | None, typer.Option("--channel", help="also write the first metadata there")
    ] = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Make the keys (root offline, the rest online) and root.json; with --channel, the
    channel's first signed metadata."""
    from edge.rotation import init_keys

    expiry = _params(params_path).promote.timestamp_expiry_s
    with _edge_errors():
        payload = init_keys(folder, channel, expiry)
    emit(payload, as_json, _print_init)


@app.command("rotate")
@fails_cleanly
def rotate_command(
    role: Annotated[
        str, typer.Argument(help="root, timestamp, snapshot, targets, gate or a cell id")
    ],
    keys: KeysOpt = None,
    channel: ChannelOpt = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Replace one key and publish the change. root, timestamp, snapshot and targets change
    the root metadata: they need the offline root key back in KEYS/offline; gate and cell keys
    do not."""
    from edge.rotation import rotate_key

    folder, uri, expiry = _where(params_path, keys, channel)
    with _edge_errors():
        payload = rotate_key(folder, role, uri, expiry)
    emit(payload, as_json, _print_rotate)


@app.command("refresh")
@fails_cleanly
def refresh_command(
    keys: KeysOpt = None,
    channel: ChannelOpt = None,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Re-sign the channel's timestamp (same releases), so boxes do not see a frozen channel.
    `realloop serve` and `deploy-flows` run it every third of promote.timestamp_expiry_s."""
    payload = refresh_channel(params_path, keys, channel)
    emit(
        payload,
        as_json,
        lambda p: stdout.print(
            f"{p['channel']}: timestamp version {p['timestamp_version']}, valid "
            f"{p['expires_in_s']:.0f} s",
            highlight=False,
            soft_wrap=True,
        ),
    )


def refresh_channel(
    params_path: Path,
    keys: Path | None = None,
    channel: str | None = None,
    workspace: Path | None = None,
    skip_unpublished: bool = False,
) -> dict:
    """A new timestamp over the channel's current snapshot; what `refresh` prints.
    `skip_unpublished` (the schedule's): a workspace without keys or a channel without a
    first release has nothing a box trusts yet, so nothing to refresh (`skipped` says so)."""
    from edge.channels import open_channel
    from edge.keys import ROOT_METADATA
    from edge.tuf_repo import METADATA_PREFIX, Repository, publishing

    folder, uri, expiry = _where(params_path, keys, channel, workspace)
    if skip_unpublished:
        with _edge_errors():
            published = (folder / ROOT_METADATA).exists() and open_channel(uri).exists(
                METADATA_PREFIX + "timestamp.json"
            )
        if not published:
            return {"channel": uri, "skipped": "nothing published yet (realloop deploy --initial)"}
    with _edge_errors(), publishing(folder):
        version = Repository(open_channel(uri), folder, expiry).refresh_timestamp()
    return {"channel": uri, "timestamp_version": version, "expires_in_s": expiry}


def _params(params_path: Path):
    from pipelines.contract.params import load_params

    return load_params(params_path)


def _where(
    params_path: Path, keys: Path | None, channel: str | None, workspace: Path | None = None
) -> tuple[Path, str, float]:
    from pipelines.release import channel_location, keys_location

    params = _params(params_path)
    workspace = Path(workspace) if workspace is not None else Path.cwd()
    folder = keys if keys is not None else keys_location(params.promote.keys, workspace)
    uri = channel or channel_location(params.promote.channel, workspace)
    return folder, uri, params.promote.timestamp_expiry_s


class _edge_errors:
    """edge's one-line errors as the command's."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        from edge.errors import EdgeError

        if isinstance(exc, EdgeError):
            raise CommandError(str(exc)) from None
        return False


def _print_init(p: dict) -> None:
    made = ", ".join(p["made"]) if p["made"] else "none (the folder already had them)"
    lines = [
        f"keys in {p['keys']}: made {made}",
        f"root key in {p['offline']}: move it to offline storage; only rotations need it",
        f"enrol edge boxes with {p['root']} (realloop-edge init --root)",
    ]
    if "channel" in p:
        lines.append(f"channel {p['channel']}: signed metadata written")
    stdout.print("\n".join(lines), highlight=False, soft_wrap=True)


def _print_rotate(p: dict) -> None:
    stdout.print(
        f"{p['role']}: key {p['old_keyid'][:12]} replaced by {p['new_keyid'][:12]}; root "
        f"version {p['root_version']}, timestamp version {p['timestamp_version']} on "
        f"{p['channel']}",
        highlight=False,
        soft_wrap=True,
    )
