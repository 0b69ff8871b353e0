"""A flow run whose worker died is marked Crashed and run again, by the Prefect server itself.

A process worker starts each flow run as a child process. When the worker's machine or
container dies (or both processes are killed), nobody is left to report the run: Prefect
keeps it Running for ever, and it holds the deployment's concurrency slot, so the loop
deployment (limit 1) would never start again and an ingest tick would be dropped each time.
Flow runs send a heartbeat event every PREFECT_FLOWS_HEARTBEAT_FREQUENCY seconds (Prefect's
default 180; the minimum is 30). Two automations, registered by `realloop deploy-flows`, put
this right: the first (the one Prefect's docs describe for "zombie" flow runs) marks a run
Crashed when its heartbeats stop without a final state or a pause (a suspended loop run sends
none); the second schedules a run crashed that way again (AwaitingRetry), at most MAX_RERUNS
times, so a live worker of the pool runs it (its run count goes up). A run whose worker
reported its crash (an out-of-memory kill, a segfault: likely to happen again) is left
Crashed: its Crashed state's message is the worker's, not ours.

Running again is safe for ingest: it skips every landed file the dead run finished (by
sha256 in the manifest) and writes one dataset version. A loop run starts its cycle again (its
lock, flows/loop_lock.py, died with its process): a fine-tune that ended before the crash is
done again, so the registry may hold a candidate version that was never trialled; nothing is
promoted twice. The workers and `deploy-flows` must see the same heartbeat setting (`realloop
services up` passes its environment to the workers).
"""

from __future__ import annotations

from datetime import timedelta

CRASH_AUTOMATION = "realloop: crash flow runs whose worker died"
RERUN_AUTOMATION = "realloop: rerun flow runs whose worker died"
MISSED_HEARTBEATS = 2.5  # heartbeats missed before a run counts as dead (one late is normal)
MAX_RERUNS = 2  # a run whose machine keeps dying is left Crashed after its third attempt
NO_HEARTBEAT = "no heartbeat for"  # how the Crashed state's message starts: the rerun keys on it
QUIET_EVENTS = (  # a run in one of these states sends no heartbeats, and is no zombie
    "Completed",
    "Failed",
    "Cancelled",
    "Crashed",
    "Paused",
    "Suspended",
)


def heartbeat_s() -> int:
    """The heartbeat period of flow runs started with this process's settings (the workers
    of `realloop services up` are started with the same environment)."""
    from prefect.settings import get_current_settings

    return int(get_current_settings().flows.heartbeat_frequency or 180)


def recovery_automations(deployment_ids: list[str]) -> list:
    """Two automations, for runs of these deployments: a silent run is marked Crashed, and a
    run crashed that way is scheduled again. Two, not one with two actions: the actions of one
    automation run concurrently, so AwaitingRetry could land before Crashed."""
    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    after_s = int(MISSED_HEARTBEATS * heartbeat_s())
    ours = ResourceSpecification(
        {
            "prefect.resource.role": "deployment",
            "prefect.resource.id": [f"prefect.deployment.{i}" for i in deployment_ids],
        }
    )
    crash = Automation(
        name=CRASH_AUTOMATION,
        description=f"A flow run of realloop's deployments silent for {after_s} s: Crashed",
        trigger=EventTrigger(
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *(f"prefect.flow-run.{s}" for s in QUIET_EVENTS)},
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            match_related=ours,
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=after_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"{NO_HEARTBEAT} {after_s} s: its worker or machine died",
            )
        ],
    )
    rerun = Automation(
        name=RERUN_AUTOMATION,
        description=(
            f"A flow run crashed for want of heartbeats runs again, at most {MAX_RERUNS} times"
        ),
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match=ResourceSpecification(
                {
                    "prefect.resource.id": "prefect.flow-run.*",
                    "prefect.state-message": f"{NO_HEARTBEAT}*",
                    # The event carries the runs so far: 1 after the first attempt.
                    "prefect.run-count": [str(n) for n in range(1, MAX_RERUNS + 1)],
                }
            ),
            match_related=ours,
            posture=Posture.Reactive,
            threshold=1,
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.SCHEDULED,
                name="AwaitingRetry",
                message="run again: its worker died (realloop's flows are idempotent)",
                force=True,  # out of Crashed, a final state
            )
        ],
    )
    return [crash, rerun]
