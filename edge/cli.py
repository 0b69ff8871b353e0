"""`realloop-edge`: pull, roll back and inspect the model bundle on a cell's edge box.

argparse rather than typer, and no heavy imports at module level: the box runs this from
systemd timers and health checks, where start-up time matters.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from edge.errors import EdgeError, describe_os_error

PROG = "realloop-edge"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Install and inspect signed realloop releases on an edge box."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    init = commands.add_parser("init", help="enrol this box once: channel, cell, trusted root")
    init.add_argument("--channel", required=True, help="directory, file:// or s3://bucket/prefix")
    init.add_argument("--cell", required=True, help="cell id on the channel")
    _add_box(init)
    init.add_argument(
        "--root", type=Path, required=True, help="the channel's root.json, from its publisher"
    )
    _add_json(init)

    pull = commands.add_parser(
        "pull", help="install and activate the signed release the channel names for the cell"
    )
    _add_box(pull)
    _add_json(pull)

    rollback = commands.add_parser("rollback", help="swap the current and previous models")
    _add_box(rollback)
    _add_json(rollback)

    status = commands.add_parser("status", help="show the active model and its decision")
    _add_box(status)
    _add_json(status)
    return parser


def _add_box(parser: argparse.ArgumentParser) -> None:
    # --dest: the name before boxes were enrolled; kept so existing timers keep working.
    parser.add_argument(
        "--box",
        "--dest",
        dest="box",
        type=Path,
        required=True,
        help="this box's folder (models, trusted metadata)",
    )


def _add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = _run(args)
    except EdgeError as exc:
        return _fail(str(exc))
    except OSError as exc:
        return _fail(describe_os_error(exc))
    except KeyboardInterrupt:
        return _fail("interrupted", code=130)
    if getattr(args, "json", False):
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(_human(args.command, result))
    if result.get("intact") is False:  # never a success while the model differs from its hash
        return _fail(f"active model damaged: {result.get('damage')}; run pull to repair it")
    return 0


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from edge import agent  # after parsing, so `--help` stays instant

    if args.command == "init":
        from edge.tuf_client import enroll

        return enroll(args.channel, args.cell, args.box, args.root)
    if args.command == "pull":
        return agent.pull(args.box)
    if args.command == "rollback":
        return agent.rollback(args.box)
    return agent.status(args.box)


def _fail(message: str, code: int = 1) -> int:
    # One line, always: operators grep journald, and monitoring alerts show the first line.
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr)
    return code


def _human(command: str, result: dict[str, Any]) -> str:
    if command == "init":
        return (
            f"enrolled {result['box']} for cell {result['cell_id']} on {result['channel']} "
            f"(trusting root version {result['root_version']})"
        )
    headline = {
        "activated": "activated release {bundle_id}",
        "already_active": "release {bundle_id} is already active; nothing to do",
        "repaired": "re-fetched the damaged files of release {bundle_id}",
        "rolled_back": "rolled back to release {bundle_id}",
        "rolled_back_damaged": "active model damaged and not re-fetchable: rolled back to "
        "release {bundle_id}",
    }
    lines = [headline[result["action"]].format(**result)] if "action" in result else []
    previous = result["previous"]
    fields = {
        "release": result["bundle_id"],
        "model": f"{result['model_name']} version {result['model_version']}",
        "decision": _decision_line(result["decision"]),
        "dataset": result["dataset_version"],
        "mlflow run": result["mlflow_run_id"],
        "path": result["path"],
        "sha256": f"{result['sha256']}"
        + ("" if result["intact"] else "  (DAMAGED: pull to repair)"),
        "signed": "yes" if result["signed"] else "no",
        "published": result["created_at"],
        "activated": result["activated_at"],
        "previous": (
            f"{previous['bundle_id']} (model {previous['model_version']})" if previous else "none"
        ),
    }
    lines += [f"{name:<11}{value}" for name, value in fields.items()]
    return "\n".join(lines)


def _decision_line(decision: dict[str, Any]) -> str:
    kind = decision.get("kind")
    attested = decision.get("attestation") or {}
    if kind in ("override", "rollback"):
        return f"{kind} by {decision.get('by')} at {decision.get('at')}: {decision.get('reason')}"
    line = f"{kind}: gate {attested.get('verdict')} on trial request {attested.get('request_id')}"
    if kind == "approval":
        line += f", approved by {decision.get('by')} at {decision.get('at')}"
    return line


if __name__ == "__main__":
    sys.exit(main())
