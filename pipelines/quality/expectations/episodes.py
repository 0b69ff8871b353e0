"""The episodes suite: one row per episode, checked row by row.

The frame is the episodes table with each vector reduced to its smallest component (NaN when
the vector or any component is null or NaN) and these per-episode columns derived by
pipelines.quality.validate (step_arrays, frames), vectorized with pyarrow:

    episode_id_well_formed  episode_id matches EPISODE_ID_PATTERN (pyarrow's regex engine)
    step_rows               rows of the episode in the steps table
    first_step              its smallest step index (NaN without rows)
    intervention_runs       runs of consecutive intervention steps in it
    cycle_time_error_s      cycle_time_s - steps / cell.control_hz
    outcome_consistent      success exactly when failure_cause is null
    stop_kind_consistent    safety_stops > 0 exactly when safety_stop_kind is set
    edge_case_consistent    edge_case exactly when edge_case_reasons lists a reason
"""

from __future__ import annotations

from pipelines.contract.schema import EPISODES_SCHEMA
from pipelines.quality.expectations.common import CRITICAL, WARNING, meta, param

TABLE = "episodes"
FAILURE_CAUSES = ("timeout", "part_lost", "safety_stop")  # docs/data-contract.md
SAFETY_STOP_KINDS = ("joint_limit", "speed", "contact_force")
EPISODE_ID_PATTERN = r"^.+-\d{8}T\d{6}Z-\d{5}$"  # <cell_id>-<shift_id>-<NNNNN>
DERIVED = (
    "episode_id_well_formed",
    "step_rows",
    "first_step",
    "intervention_runs",
    "cycle_time_error_s",
    "outcome_consistent",
    "stop_kind_consistent",
    "edge_case_consistent",
)


def expectations() -> list:
    """The suite, in a fixed order (stored results are keyed by a fingerprint of this code)."""
    return (
        _identity() + _counts() + _physics() + _outcome() + _takeovers_and_captures() + _not_null()
    )


def _check(severity, column, broke, describe, sources=()):
    return meta(severity, TABLE, column, broke, describe, sources)


def _identity() -> list:
    """Every column there, at least one episode, ids unique and well formed, one source."""
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectTableColumnsToMatchSet(
            column_set=list(EPISODES_SCHEMA.names),
            exact_match=False,  # extra columns are the schema check's to report
            **_check(CRITICAL, "", "columns missing", "every contract column is present"),
        ),
        gxe.ExpectTableRowCountToBeBetween(
            min_value=1,
            **_check(CRITICAL, "", "no episodes in the batch", "at least one episode", ("",)),
        ),
        gxe.ExpectColumnValuesToBeUnique(
            column="episode_id",
            **_check(CRITICAL, "episode_id", "duplicate ids", "episode ids are unique"),
        ),
        gxe.ExpectColumnValuesToBeInSet(
            column="episode_id_well_formed",
            value_set=[True],
            **_check(
                CRITICAL,
                "episode_id",
                "ids not of the form <cell_id>-<shift_id>-<NNNNN>",
                f"episode ids match {EPISODE_ID_PATTERN}: <cell_id>-<shift_id>-<NNNNN> "
                "(lineage parses them)",
            ),
        ),
        gxe.ExpectColumnValuesToBeInSet(
            column="source_sha256",
            value_set=param("batch"),
            **_check(
                CRITICAL,
                "source_sha256",
                "rows naming another source file",
                "every episode names this batch's source file",
            ),
        ),
    ]


def _counts() -> list:
    """Step counts within limits and equal to the steps table's rows; at most one stop."""
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectColumnValuesToBeBetween(
            column="steps",
            min_value=param("min_steps"),
            max_value=param("max_steps"),
            **_check(
                CRITICAL,
                "steps",
                "episodes outside {min_steps}..{max_steps} steps",
                "episodes last validate.min_steps to validate.max_steps control steps",
            ),
        ),
        gxe.ExpectColumnPairValuesToBeEqual(
            column_A="steps",
            column_B="step_rows",
            **_check(
                CRITICAL,
                "steps",
                "episodes whose step count differs from their rows in the steps table",
                "each episode's step count equals its rows in the steps table",
                ("steps", "episode_id", "steps.episode_id"),
            ),
        ),
        gxe.ExpectColumnValuesToBeBetween(
            column="first_step",
            min_value=0,
            max_value=0,
            **_check(
                CRITICAL,
                "steps",
                "episodes whose steps do not start at index 0",
                "each episode's steps start at index 0",
                ("episode_id", "steps.episode_id", "steps.step"),
            ),
        ),
        gxe.ExpectColumnValuesToBeBetween(
            column="safety_stops",
            min_value=0,
            max_value=1,
            **_check(
                CRITICAL,
                "safety_stops",
                "episodes outside 0..1 (a stop ends one)",
                "0 or 1 safety stops per episode (a stop ends it)",
            ),
        ),
    ]


def _physics() -> list:
    """Cycle times consistent with the step count and within the limits."""
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectColumnValuesToBeBetween(
            column="cycle_time_error_s",
            min_value=param("negative_cycle_time_tolerance_s"),
            max_value=param("cycle_time_tolerance_s"),
            **_check(
                CRITICAL,
                "cycle_time_s",
                "episodes whose cycle time differs from steps·{dt_s:g} s "
                "by more than {cycle_time_tolerance_s:g} s",
                "cycle_time_s = steps / cell.control_hz within validate.cycle_time_tolerance_s "
                "(the gate's cycle-time budget reads it)",
                ("cycle_time_s", "steps"),
            ),
        ),
        gxe.ExpectColumnValuesToBeBetween(
            column="cycle_time_s",
            min_value=param("min_cycle_time_s"),
            max_value=param("max_cycle_time_s"),
            **_check(
                CRITICAL,
                "cycle_time_s",
                "episodes outside {min_cycle_time_s:g}..{max_cycle_time_s:g} s",
                "cycle time within validate.min_steps..validate.max_steps control periods",
            ),
        ),
    ]


def _outcome() -> list:
    """Success, failure cause and safety stop kind agree, from known vocabularies."""
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectColumnValuesToBeInSet(
            column="outcome_consistent",
            value_set=[True],
            **_check(
                CRITICAL,
                "failure_cause",
                "episodes whose failure_cause contradicts success",
                "a failure_cause exactly on failed episodes (training reads success)",
                ("success", "failure_cause"),
            ),
        ),
        gxe.ExpectColumnValuesToBeInSet(
            column="failure_cause",
            value_set=list(FAILURE_CAUSES),
            **_check(
                WARNING,
                "failure_cause",
                f"episodes with a cause outside {', '.join(FAILURE_CAUSES)}",
                f"failure causes are {', '.join(FAILURE_CAUSES)}",
            ),
        ),
        gxe.ExpectColumnValuesToBeInSet(
            column="safety_stop_kind",
            value_set=list(SAFETY_STOP_KINDS),
            **_check(
                WARNING,
                "safety_stop_kind",
                f"episodes with a stop kind outside {', '.join(SAFETY_STOP_KINDS)}",
                f"safety stop kinds are {', '.join(SAFETY_STOP_KINDS)}",
            ),
        ),
        gxe.ExpectColumnValuesToBeInSet(
            column="stop_kind_consistent",
            value_set=[True],
            **_check(
                WARNING,
                "safety_stop_kind",
                "episodes whose stop kind contradicts safety_stops",
                "a safety_stop_kind exactly on episodes with a safety stop",
                ("safety_stops", "safety_stop_kind"),
            ),
        ),
    ]


def _takeovers_and_captures() -> list:
    """Takeovers match the intervention steps, the edge-case flag its reasons;
    part extents are positive."""
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectColumnPairValuesToBeEqual(
            column_A="interventions",
            column_B="intervention_runs",
            **_check(
                WARNING,
                "interventions",
                "episodes whose takeover count differs from their runs of intervention steps",
                "interventions = runs of consecutive intervention steps",
                ("interventions", "episode_id", "steps.episode_id", "steps.intervention"),
            ),
        ),
        gxe.ExpectColumnValuesToBeInSet(
            column="edge_case_consistent",
            value_set=[True],
            **_check(
                WARNING,
                "edge_case",
                "episodes whose edge_case flag contradicts edge_case_reasons",
                "edge_case exactly when edge_case_reasons lists a capture reason",
                ("edge_case", "edge_case_reasons"),
            ),
        ),
        gxe.ExpectColumnValuesToBeBetween(
            column="part_extent_m",
            min_value=0,
            strict_min=True,
            **_check(
                WARNING,
                "part_extent_m",
                "episodes with a part extent not above 0 m",
                "measured part extents are positive",
            ),
        ),
    ]


def _not_null() -> list:
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectColumnValuesToNotBeNull(
            column=field.name,
            **meta(
                CRITICAL,
                TABLE,
                field.name,
                "null or NaN values in a required column",
                f"{field.name} is never null (nor NaN)",
            ),
        )
        for field in EPISODES_SCHEMA
        if not field.nullable
    ]
