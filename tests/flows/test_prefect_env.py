"""configure_prefect: an ephemeral API kept in the workspace, and quiet while flows run."""

import sqlite3
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT, without_prefect_settings

FLOW_SCRIPT = textwrap.dedent(
    """
    import sys
    import time
    from pathlib import Path

    from flows.prefect_env import configure_prefect

    configure_prefect(Path(sys.argv[1]))

    from prefect import flow, get_run_logger, task


    @task(retries=1)
    def square(i: int) -> int:
        time.sleep(0.2)
        get_run_logger().info("squared %d", i)
        return i * i


    @flow(name="env-check")
    def env_check() -> int:
        total = sum(f.result() for f in square.map(range(6)))
        return total + square(6) + square(7)


    print(env_check())
    """
)


@pytest.mark.timeout(240)
def test_ephemeral_flow_run_is_quiet_and_kept_in_the_workspace(tmp_path):
    env = without_prefect_settings()
    run = subprocess.run(
        [sys.executable, "-c", FLOW_SCRIPT, str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )

    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip() == str(sum(i * i for i in range(8)))
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "database is locked" not in run.stderr, run.stderr[-3000:]

    database = tmp_path / ".prefect" / "prefect.db"
    assert database.is_file()
    with sqlite3.connect(database) as db:
        flow_runs = db.execute("SELECT state_type FROM flow_run").fetchall()
        task_runs = db.execute("SELECT state_type FROM task_run").fetchall()
    assert flow_runs == [("COMPLETED",)]
    assert sorted(task_runs) == [("COMPLETED",)] * 8
