"""bench/validate's pyarrow.compute floor and the GX suites count the same offending rows."""

from __future__ import annotations

from bench.validate import BATCH, break_rows, suite_counts, write_batch
from bench.validate_floor import pyarrow_checks
from pipelines.contract.schema import EPISODES_SCHEMA, STEPS_SCHEMA
from pipelines.quality.validate import run as validate


def test_suites_and_the_pyarrow_floor_agree_check_by_check(params, tmp_path):
    dataset, landing = write_batch(tmp_path, 3000, 4, params.cell)
    episodes = validate._read_table(dataset / "episodes" / f"{BATCH}.parquet", EPISODES_SCHEMA)
    steps = validate._read_table(dataset / "steps" / f"{BATCH}.parquet", STEPS_SCHEMA)
    where = (params.cell, params.validate, landing / "captures", dataset / "attachments")
    assert set(pyarrow_checks(episodes, steps, BATCH, *where).values()) == {0}

    episodes, steps = break_rows(episodes, steps)
    result, gx_results = validate._check_batch(episodes, steps, BATCH, *where)
    ours, floor = suite_counts(gx_results), pyarrow_checks(episodes, steps, BATCH, *where)
    assert ours == floor
    broken = {key for key, count in ours.items() if count}
    assert len(broken) >= 15 and not result.passed
    assert {key.rsplit(":", 1)[1] for key in broken} == {"critical", "warning"}
