"""What every bench's `main` ends with: run it, then a one-line error or the report."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable


def report_or_error(
    name: str,
    produce: Callable[[], dict],
    print_report: Callable[[dict], None],
    as_json: bool,
    errors: tuple[type[BaseException], ...] = (FileNotFoundError, ValueError),
) -> int:
    """The exit code: 1 with `bench.<name>: <first line>` on stderr for an expected failure
    (a missing file, a bad value), else 0 with the report as JSON or as text."""
    try:
        report = produce()
    except errors as exc:
        print(f"bench.{name}: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return 0
