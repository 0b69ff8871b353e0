"""`realloop gc`: remove what interrupted writes left in the edge channel and the landing zone.

A publish or an upload killed mid-write leaves a `*.partial` file (or, on S3, an unfinished
multipart upload) that nothing reads and nothing else removes. Each publish sweeps its channel
of those older than an hour; `realloop gc` sweeps both the channel and the landing zone, with
the age limit given, from cron or by hand.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from flows.console import emit, fails_cleanly, stdout

ParamsOpt = Annotated[Path, typer.Option("--params", help="params.yaml to read")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]
OlderThan = Annotated[
    float,
    typer.Option(
        "--older-than",
        min=0,
        help="seconds a *.partial must have gone untouched (younger: a write in flight)",
    ),
]


@fails_cleanly
def gc_command(
    older_than_s: OlderThan = 3600.0,
    params_path: ParamsOpt = Path("params.yaml"),
    as_json: JsonOpt = False,
) -> None:
    """Remove interrupted writes (*.partial, unfinished S3 uploads) from the channel and landing."""
    from edge.channels import EdgeError, open_channel
    from pipelines.contract.params import load_params
    from pipelines.release import channel_location

    params = load_params(params_path)
    workspace = Path.cwd()
    places = {
        "channel": channel_location(params.promote.channel, workspace),
        "landing": channel_location(params.ingest.landing, workspace),
    }
    swept = {}
    for role, uri in places.items():
        try:
            swept[role] = {"uri": uri, "removed": open_channel(uri).sweep_partials(older_than_s)}
        except EdgeError as exc:
            raise ValueError(f"{role} {uri}: {exc}") from None
    emit({"older_than_s": older_than_s, **swept}, as_json, _print_gc)


def _print_gc(result: dict) -> None:
    for role in ("channel", "landing"):
        place = result[role]
        stdout.print(
            f"{role} {place['uri']}: removed {len(place['removed'])} interrupted write(s) "
            f"older than {result['older_than_s']:g} s",
            soft_wrap=True,
        )
        for key in place["removed"]:
            stdout.print(f"  {key}", soft_wrap=True)
