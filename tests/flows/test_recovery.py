"""The automations that crash and rerun a flow run whose worker died (flows/recovery.py), as
the server would evaluate them; no server. tests/faults/test_worker_killed.py kills a worker
for real."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from flows import recovery
from tests.flows.test_deployments import server_trigger

OURS, OTHER = str(uuid.uuid4()), str(uuid.uuid4())


def flow_run_event(name: str, deployment: str = OURS, **labels: str):
    """A prefect.flow-run.<name> event as the server emits it for a state change."""
    from prefect.server.events.schemas.events import ReceivedEvent

    resource = {"prefect.resource.id": f"prefect.flow-run.{uuid.uuid4()}", **labels}
    related = [
        {
            "prefect.resource.id": f"prefect.deployment.{deployment}",
            "prefect.resource.role": "deployment",
        }
    ]
    return ReceivedEvent(
        occurred=datetime.now(UTC), event=f"prefect.flow-run.{name}", resource=resource,
        related=related, id=uuid.uuid4(),
    )  # fmt: skip


@pytest.fixture
def heartbeat_40s():
    """Through Prefect's settings context, not the environment: once another test has entered
    a settings context, get_current_settings() no longer reads the environment."""
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: 40}):
        yield


def test_a_silent_run_of_our_deployments_is_crashed_after_missed_heartbeats(heartbeat_40s):
    crash, _ = recovery.recovery_automations([OURS])
    trigger = server_trigger(crash.trigger)
    assert trigger.posture == "Proactive" and trigger.within == timedelta(seconds=100)
    assert trigger.covers(flow_run_event("heartbeat"))
    assert not trigger.covers(flow_run_event("heartbeat", deployment=OTHER))
    # A suspended loop run sends no heartbeats: its Suspended event satisfies the trigger.
    assert {"prefect.flow-run.Suspended", "prefect.flow-run.Paused"} <= trigger.expect
    assert [(a.type, a.state.value) for a in crash.actions] == [
        ("change-flow-run-state", "CRASHED")
    ]


def test_only_a_run_crashed_for_want_of_heartbeats_is_rerun_and_at_most_twice(heartbeat_40s):
    crash, rerun = recovery.recovery_automations([OURS])
    trigger = server_trigger(rerun.trigger)
    ours = crash.actions[0].message
    assert ours.startswith(recovery.NO_HEARTBEAT)
    for count in ("1", "2"):
        assert trigger.covers(
            flow_run_event("Crashed", **{"prefect.state-message": ours, "prefect.run-count": count})
        )
    reported = "Flow run infrastructure exited with non-zero status code -9."
    for name, deployment, message, count in (
        ("Crashed", OURS, ours, "3"),  # the third death: left Crashed
        ("Crashed", OURS, reported, "1"),  # its worker saw it crash: likely to again
        ("Crashed", OTHER, ours, "1"),  # not one of ours
        ("Failed", OURS, ours, "1"),
    ):
        labels = {"prefect.state-message": message, "prefect.run-count": count}
        assert not trigger.covers(flow_run_event(name, deployment, **labels)), (name, message)
    (action,) = rerun.actions
    assert (action.state.value, action.name, action.force) == ("SCHEDULED", "AwaitingRetry", True)
