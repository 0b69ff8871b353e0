"""What every realloop expectation carries, whatever its suite.

Every expectation carries a severity, both as GX's own `severity` field and in its meta:

- critical: the batch cannot be trusted for training (broken structure, impossible physics,
  a dataset that references what it does not hold). A batch failing one is excluded from
  training until someone re-admits it (`realloop admit`).
- warning: reported in the results and the Data Docs, never excludes a batch.

The meta also says how a failure reads in one line (`broke`, formatted with the suite
parameters) and which contract columns the check needs (`sources`: a check on a column that
is missing or mistyped is not reported, since the schema check already names the cause).
`description` is what the Data Docs show for the expectation. docs/validation.md lists them all.
"""

from __future__ import annotations

from typing import Any

CRITICAL, WARNING = "critical", "warning"
SEVERITIES = (CRITICAL, WARNING)


def param(name: str) -> dict:
    """A suite parameter, filled in from params.yaml (and the batch) at each run."""
    return {"$PARAMETER": name}


def meta(
    severity: str,
    table: str,
    column: str,
    broke: str,
    describe: str,
    sources: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Keyword arguments every realloop expectation takes: severity, meta and description."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, not {severity!r}")
    return {
        "severity": severity,
        "description": f"[{severity}] {describe}",
        "meta": {
            "severity": severity,
            "table": table,
            "column": column,
            "broke": broke,
            "sources": list(sources or (column,)),
        },
    }
