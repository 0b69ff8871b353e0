"""The captures suite: one row per edge-case capture of the batch's episodes.

A capture is a reason an episode lists in `edge_case_reasons`, joined with its JSON sidecar
when one is found in `<landing>/captures/`, plus every such sidecar whose reason the episode
does not list (a capture that landed after its log was ingested).
pipelines.quality.validate derives:

    in_dataset           the episode lists the capture's reason
    has_sidecar          its sidecar was found (null when no captures folder was given)
    step_in_episode      the sidecar's step lies within 0..steps-1 of its episode
    sidecar_consistent   the sidecar names the episode's cell, an ISO 8601 UTC time, an
                         integer step and log_time_ns
    attachments_listed   the sidecar's attachment files exist and their sha256 are listed
                         in the episode's `attachments`
    attachments_stored   every sha256 the episode lists is in `<dataset>/attachments/` and
                         the stored file's content hashes to it (null without a store)

Captures do not feed training, so only a dataset that references an attachment it does not
hold (provenance broken: "nothing is lost") is critical; the rest are warnings.
"""

from __future__ import annotations

from pipelines.quality.expectations.common import CRITICAL, WARNING, meta

TABLE = "captures"
# `ood`: the edge box handed a step to the fallback; `novel_part`: it handed an episode whose
# part the policy never trained on; `rollback`: its health check rolled a newly activated model
# back (refcell/process/health.py; docs/data-contract.md).
CAPTURE_REASONS = (
    "low_confidence",
    "operator_flag",
    "safety_stop",
    "near_failure",
    "retry",
    "ood",
    "novel_part",
    "rollback",
)
COLUMNS = (
    "episode_id",
    "reason",
    "in_dataset",
    "has_sidecar",
    "step_in_episode",
    "sidecar_consistent",
    "attachments_listed",
    "attachments_stored",
)


def expectations() -> list:
    """The suite, in a fixed order (stored results are keyed by a fingerprint of this code)."""
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectTableColumnsToMatchSet(
            column_set=list(COLUMNS),
            exact_match=True,
            **meta(CRITICAL, TABLE, "", "columns missing", "the captures frame is complete", ("",)),
        ),
        _holds(
            "attachments_stored",
            CRITICAL,
            "captures whose episode lists an attachment missing from the dataset or corrupt",
            "every attachment sha256 an episode lists is stored in the dataset, content intact",
            "attachments",
        ),
        gxe.ExpectColumnValuesToBeInSet(
            column="reason",
            value_set=list(CAPTURE_REASONS),
            **meta(
                WARNING,
                TABLE,
                "reason",
                f"captures with a reason outside {', '.join(CAPTURE_REASONS)}",
                f"capture reasons are {', '.join(CAPTURE_REASONS)}",
                ("",),
            ),
        ),
        _holds(
            "has_sidecar",
            WARNING,
            "captures without their JSON sidecar in the landing folder",
            "every capture the dataset lists has its sidecar in <landing>/captures/",
        ),
        _holds(
            "in_dataset",
            WARNING,
            "captures in the landing folder that their episode does not list "
            "(landed after ingest?)",
            "every sidecar's reason is listed in its episode's edge_case_reasons",
        ),
        _holds(
            "step_in_episode",
            WARNING,
            "captures whose step lies outside their episode",
            "a capture's step lies within its episode (0..steps - 1)",
            "step",
        ),
        _holds(
            "sidecar_consistent",
            WARNING,
            "sidecars with a wrong cell, time, step or log time",
            "a sidecar names its episode's cell, an ISO 8601 UTC time, an integer step",
            "sidecar",
        ),
        _holds(
            "attachments_listed",
            WARNING,
            "captures whose attachment files are missing or not listed with their episode",
            "a sidecar's attachment files exist and their sha256 is listed with the episode",
            "attachments",
        ),
    ]


def _holds(column, severity, broke, describe, label="reason"):
    """A derived flag is True on every capture."""
    import great_expectations.expectations as gxe

    return gxe.ExpectColumnValuesToBeInSet(
        column=column,
        value_set=[True],
        **meta(severity, TABLE, label, broke, describe, ("",)),
    )
