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
        prog=PROG, description="Install and inspect realloop model bundles on an edge box."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    pull = commands.add_parser(
        "pull", help="install and activate the bundle the channel's CURRENT.json names"
    )
    pull.add_argument("--channel", required=True, help="directory, file:// or s3://bucket/prefix")
    pull.add_argument("--cell", required=True, help="cell id on the channel")
    _add_dest(pull)
    pull.add_argument(
        "--public-key",
        type=Path,
        help="Ed25519 public key PEM; when given, unsigned or wrongly signed bundles are refused",
    )
    _add_json(pull)

    rollback = commands.add_parser("rollback", help="swap the current and previous models")
    _add_dest(rollback)
    _add_json(rollback)

    status = commands.add_parser("status", help="show the active model")
    _add_dest(status)
    _add_json(status)

    keygen = commands.add_parser("keygen", help="write a new Ed25519 signing key pair")
    keygen.add_argument("--private-key", type=Path, required=True, help="for the publisher")
    keygen.add_argument("--public-key", type=Path, required=True, help="for the edge boxes")
    return parser


def _add_dest(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dest", type=Path, required=True, help="model folder on this box")


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
    return 0


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from edge import agent  # after parsing, so `--help` stays instant

    if args.command == "pull":
        return agent.pull(args.channel, args.cell, args.dest, args.public_key)
    if args.command == "rollback":
        return agent.rollback(args.dest)
    if args.command == "status":
        return agent.status(args.dest)
    from edge.integrity import generate_keypair  # the only command left: keygen

    generate_keypair(args.private_key, args.public_key)
    return {"private_key": str(args.private_key), "public_key": str(args.public_key)}


def _fail(message: str, code: int = 1) -> int:
    # One line, always: operators grep journald, and monitoring alerts show the first line.
    print(f"{PROG}: {' '.join(message.split())}", file=sys.stderr)
    return code


def _human(command: str, result: dict[str, Any]) -> str:
    if command == "keygen":
        return (
            f"wrote private key {result['private_key']} (keep it on the publisher only) "
            f"and public key {result['public_key']} (copy it to the edge boxes)"
        )
    headline = {
        "activated": "activated bundle {bundle_id}",
        "already_active": "bundle {bundle_id} is already active; nothing to do",
        "rolled_back": "rolled back to bundle {bundle_id}",
    }
    lines = [headline[result["action"]].format(**result)] if "action" in result else []
    previous = result["previous"]
    fields = {
        "bundle": result["bundle_id"],
        "model": f"{result['model_name']} version {result['model_version']}",
        "dataset": result["dataset_version"],
        "mlflow run": result["mlflow_run_id"],
        "path": result["path"],
        "sha256": result["sha256"] + ("" if result["intact"] else "  (DOES NOT MATCH MANIFEST)"),
        "signed": "yes" if result["signed"] else "no",
        "published": result["created_at"],
        "activated": result["activated_at"],
        "previous": (
            f"{previous['bundle_id']} (model {previous['model_version']})" if previous else "none"
        ),
    }
    lines += [f"{name:<11}{value}" for name, value in fields.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
