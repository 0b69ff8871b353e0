"""The steps suite: every control step, checked through the column extremes.

A 1,000,000-step batch is too many rows for GX's per-row machinery, so pipelines.quality.validate
hands GX a three-row frame per batch instead: each column's minimum, its maximum, and a null
in the third row when the column holds any null or NaN (the minimum again otherwise). Vectors
reduce over all their components. For the expectations used here (values between two
bounds, values in {True}, not null) that frame passes exactly when the full table does:
all values lie within bounds iff the smallest and the largest do, and a column has no null
iff the third row has none. The exact count of offending steps, per vector axis, and the
first offending step come from the full arrays (pyarrow/numpy) whenever an expectation fails.

Derived per-step columns (NaN on an episode's first step where a previous step is needed):

    episode_listed               the step's episode is in the episodes table
    time_advance_s               time_s minus the previous step's, within the episode
    step_advance                 step minus the previous step's, within the episode
    time_step_error_s            time_advance_s - step_advance / cell.control_hz: sampling jitter
    correction_iff_intervention  corrected_action is set exactly on intervention steps
    correction_gap               on intervention steps, max |action - corrected_action|
"""

from __future__ import annotations

from pipelines.contract.schema import STEPS_SCHEMA
from pipelines.quality.expectations.common import CRITICAL, WARNING, meta, param

TABLE = "steps"
TIMING = ("time_s", "step", "episode_id")
DERIVED = (
    "episode_listed",
    "time_advance_s",
    "step_advance",
    "time_step_error_s",
    "correction_iff_intervention",
    "correction_gap",
)


def expectations() -> list:
    """The suite, in a fixed order (stored results are keyed by a fingerprint of this code)."""
    return _structure() + _sampling() + _limits() + _corrections() + _not_null()


def _check(severity, column, broke, describe, sources=()):
    return meta(severity, TABLE, column, broke, describe, sources)


def _between(column, low, high, severity, broke, describe, sources=(), **kw):
    import great_expectations.expectations as gxe

    # A failure is reported under the first source column (the derived column otherwise).
    return gxe.ExpectColumnValuesToBeBetween(
        column=column,
        min_value=low,
        max_value=high,
        **kw,
        **_check(severity, sources[0] if sources else column, broke, describe, sources),
    )


def _structure() -> list:
    """Every column there; steps belong to listed episodes and advance one index at a
    time, forward in time."""
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectTableColumnsToMatchSet(
            column_set=list(STEPS_SCHEMA.names),
            exact_match=False,
            **_check(CRITICAL, "", "columns missing", "every contract column is present"),
        ),
        gxe.ExpectColumnValuesToBeInSet(
            column="episode_listed",
            value_set=[True],
            **_check(
                CRITICAL,
                "episode_id",
                "steps of an episode missing from the episodes table",
                "every step's episode is in the episodes table",
                ("episode_id", "episodes.episode_id"),
            ),
        ),
        _between(
            "step",
            0,
            param("max_step_index"),
            CRITICAL,
            "steps with an index outside 0..{max_step_index}",
            "step indices within 0..validate.max_steps - 1",
        ),
        _between(
            "step_advance",
            1,
            1,
            CRITICAL,
            "steps whose index is not the previous step's + 1 in their episode",
            "within an episode, each step's index is the previous one's + 1",
            ("step", "time_s", "episode_id"),
        ),
        _between(
            "time_advance_s",
            0,
            None,
            CRITICAL,
            "steps not later than the previous step of their episode",
            "within an episode, time_s strictly increases",
            TIMING,
            strict_min=True,
        ),
    ]


def _sampling() -> list:
    """Each step comes one control period after the previous one (missed periods are
    critical, jitter a warning); no negative time."""
    return [
        _between(
            "time_step_error_s",
            param("negative_max_time_step_error_s"),
            param("max_time_step_error_s"),
            CRITICAL,
            "steps whose time advance differs from (step advance)·{dt_s:g} s "
            "by more than {max_time_step_error_s:g} s",
            "sampling: each step comes (step advance) / cell.control_hz after the previous one, "
            "within validate.max_time_step_error_s (else the control loop missed its period)",
            TIMING,
        ),
        _between(
            "time_step_error_s",
            param("negative_time_step_tolerance_s"),
            param("time_step_tolerance_s"),
            WARNING,
            "steps with sampling jitter beyond ±{time_step_tolerance_s:g} s "
            "(advance vs (step advance)·{dt_s:g} s)",
            "sampling jitter within validate.time_step_tolerance_s",
            TIMING,
        ),
        _between(
            "time_s",
            0,
            None,
            CRITICAL,
            "steps with a negative time",
            "time_s (since the episode start) is not negative",
        ),
    ]


def _limits() -> list:
    """Confidence, commands, corrections and joint readings within their physical ranges."""
    return [
        _between(
            "part_confidence",
            0,
            1,
            CRITICAL,
            "steps with a confidence outside [0, 1]",
            "perception confidence within [0, 1]",
        ),
        _between(
            "action",
            -1,
            1,
            CRITICAL,
            "steps with a command outside [-1, 1]",
            "commanded actions within the actuator limits [-1, 1] (normalised)",
        ),
        _between(
            "corrected_action",
            -1,
            1,
            CRITICAL,
            "steps with a correction outside [-1, 1]",
            "operator corrections within the actuator limits [-1, 1] (normalised)",
        ),
        _between(
            "joint_position",
            param("negative_joint_limit_m"),
            param("joint_limit_m"),
            CRITICAL,
            "steps with a joint reading beyond ±{joint_limit_m:g} m",
            "joint readings within ±(cell.safety.joint_limit_m + "
            "validate.joint_reading_margin_m): the gantry's travel plus sensor noise",
        ),
    ]


def _corrections() -> list:
    """Corrections exactly on intervention steps, and the command sent is the correction."""
    import great_expectations.expectations as gxe

    return [
        gxe.ExpectColumnValuesToBeInSet(
            column="correction_iff_intervention",
            value_set=[True],
            **_check(
                CRITICAL,
                "corrected_action",
                "steps whose correction contradicts the intervention flag",
                "corrected_action is set exactly on intervention steps (the training labels)",
                ("corrected_action", "intervention"),
            ),
        ),
        _between(
            "correction_gap",
            0,
            param("action_match_tolerance"),
            WARNING,
            "intervention steps whose command differs from the correction "
            "by more than {action_match_tolerance:g}",
            "on intervention steps the command sent is the operator's correction "
            "(within validate.action_match_tolerance)",
            ("action", "corrected_action", "intervention"),
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
                "steps with a null or NaN value in a required column",
                f"{field.name} is never null (nor NaN)",
            ),
        )
        for field in STEPS_SCHEMA
        if not field.nullable
    ]
