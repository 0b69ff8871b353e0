"""Sign-off before promotion (`promote.require_approval`): after a passing gate, the loop's
flow run pauses with a typed form in the Prefect UI (approve or reject, who, why) and promotes
only on an approval. No answer within `promote.approval_timeout_s` rejects.

The pause is Prefect's `pause_flow_run(wait_for_input=...)` in the flow body: a task cannot
pause its flow. Prefect's open-source server knows no users, so the form asks who decides.
The decision is recorded like an override: an approval goes to promote as the release's
decision (kind "approval", on top of the gate's attestation), which tags the registry version
with it; a rejection or a timeout is tagged here (approval=false), and nothing is promoted.
"""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput
from prefect.runtime import flow_run
from pydantic import Field

from flows import artifacts, cycle
from pipelines.contract.params import Params

KIND = "approval"  # the decision's kind, as the channel and the registry record it
TIMED_OUT_BY = "timeout"  # who "decided" when nobody answered in time


class SignOff(RunInput):
    """The form the paused run shows (its fields are the UI's inputs)."""

    approve: bool = Field(
        default=False, description="On: promote. Off, or no answer in time: not promoted"
    )
    by: str = Field(min_length=1, description="Your name (recorded with the decision)")
    reason: str = Field(min_length=1, description="Why (recorded with the decision)")


def sign_off_cells(params: Params, steps: dict[str, dict], cells: list[str]) -> list[str]:
    """With `promote.require_approval`, in the flow body: a sign-off for each cell whose gate
    passed, kept in its steps as "approval"; the cells that go on to promotion (all but the
    rejected ones: a failed gate is refused by promote itself)."""
    if not params.promote.require_approval:
        return cells
    going = []
    for cell_id in cells:
        mine = steps[cell_id]
        if mine["gate"].get("passed") is True:
            mine["approval"] = sign_off(params, cell_id, mine["trained"], mine["gate"])
            if not mine["approval"]["approved"]:
                continue
        going.append(cell_id)
    return going


def sign_off(params: Params, cell_id: str, trained: dict, gate_record: dict) -> dict:
    """After `cell_id`'s gate passed: the decision (kind, approved, by, at, reason). A
    rejection is recorded here; an approval by promote, with the release."""
    decision = ask(params, cell_id, trained, gate_record)
    if not decision["approved"]:
        record_rejection(params, cell_id, trained, decision)
    sentence = sign_off_sentence(cell_id, trained, decision)
    artifacts.log(sentence)
    text = f"{form_text(cell_id, trained, gate_record)}\n\n**{sentence}**"
    artifacts.markdown(artifacts.key(cell_id, "sign-off"), text, f"{cell_id}: the sign-off")
    return decision


def ask(params: Params, cell_id: str, trained: dict, gate_record: dict) -> dict:
    """Pause this flow run until someone answers the form or the timeout passes."""
    timeout = params.promote.approval_timeout_s
    form = SignOff.with_initial_data(description=form_text(cell_id, trained, gate_record))
    get_run_logger().info(
        "%s: waiting up to %d s for a sign-off on version %s: %s, Resume",
        cell_id,
        timeout,
        trained["model_version"],
        _where_to_answer(),
    )
    try:
        # Polled this often: short timeouts (tests) are noticed at once, long ones cheaply.
        poll_s = max(1, min(10, timeout // 10))
        answer = pause_flow_run(
            wait_for_input=form, timeout=timeout, poll_interval=poll_s, key=f"sign-off-{cell_id}"
        )
    except FlowPauseTimeout:
        _run_again(f"no sign-off for {cell_id} within {timeout} s")
        return new_decision(False, TIMED_OUT_BY, f"no sign-off within {timeout} s")
    return new_decision(answer.approve, answer.by, answer.reason)


def new_decision(approved: bool, by: str, reason: str) -> dict:
    at = datetime.now(UTC).isoformat(timespec="seconds")
    return {"kind": KIND, "approved": approved, "by": by, "at": at, "reason": reason}


def sign_off_sentence(cell_id: str, trained: dict, decision: dict) -> str:
    verdict = "approved" if decision["approved"] else "not approved"
    return (
        f"{cell_id}: version {trained['model_version']} {verdict} "
        f"({decision['by']}, {decision['at']}): {decision['reason']}"
    )


def form_text(cell_id: str, trained: dict, gate_record: dict) -> str:
    """The form's description (markdown): what is being signed off and on what evidence. Kept
    short: the UI shows a few lines of it above the fields and cuts the rest."""
    # "<" escaped: the UI's markdown allows HTML, where "<= budget" could open a tag.
    reasons = "\n".join(f"- {r}".replace("<", "&lt;") for r in gate_record.get("reasons", []))
    return (
        f"### Promote version {trained['model_version']} to {cell_id}?\n\n"
        f"Trial request {gate_record.get('trial_request_id', '-')}: candidate "
        f"{cycle.format_trials(gate_record.get('candidate'))}, incumbent "
        f"{cycle.format_trials(gate_record.get('incumbent'))}.\n\n"
        f"{reasons}"
    )


@task(name="record-rejection", task_run_name="record rejection {cell_id}", cache_policy=NO_CACHE)
def record_rejection(params: Params, cell_id: str, trained: dict, decision: dict) -> None:
    """A rejected candidate's version and run carry the decision as promote records an
    approval (approval_by, _at, _reason, _cell), with `approval` = "false"."""
    from pipelines.release.promote import decision_tags
    from pipelines.training.tracking import mlflow_client

    model, version = params.train.registered_model, str(trained["model_version"])
    tags = decision_tags(cell_id, decision) | {KIND: "false"}
    client = mlflow_client(None)
    for key, value in tags.items():
        client.set_model_version_tag(model, version, key, value)
        client.set_tag(trained["mlflow_run_id"], key, value)


def _where_to_answer() -> str:
    """The run's page in the Prefect UI; under the ephemeral API, how to open one (a server
    on the workspace's Prefect home sees this run and can resume it)."""
    from flows.prefect_env import api_url

    server = api_url()
    if server is None:
        return "open this run in a UI served by `PREFECT_HOME=.prefect prefect server start`"
    return f"{server.removesuffix('/').removesuffix('/api')}/runs/flow-run/{flow_run.get_id()}"


def _run_again(message: str) -> None:
    """After a pause timed out, the run is still Paused on the server, and the server lets no
    task of a paused run start: set it Running again (forced: the expired pause would refuse a
    resume), so the cycle finishes and records the rejection."""
    from prefect.client.orchestration import get_client
    from prefect.states import Running

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run.get_id(), Running(message=message), force=True)
