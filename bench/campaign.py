"""The campaign as a bench: the fleet over simulated days as the lines change (issue 13).

    .venv/bin/python -m bench.campaign [--cells 3] [--days 14] [--workspace DIR] [--json]

The same command as `realloop campaign` (flows/campaign.py; docs/operations.md, "The
campaign"): campaign.json's `targets` hold the issue's targets, computed from held-out figures,
and `wall_s` the wall time to hold against the 60-minute budget of `--cells 3 --days 14`.
"""

from __future__ import annotations

import typer

from flows.campaign import campaign_command


def main() -> None:
    typer.run(campaign_command)


if __name__ == "__main__":
    main()
