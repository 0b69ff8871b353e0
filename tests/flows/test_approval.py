"""Sign-off before promotion (flows/approval.py) against a real Prefect API (the tests'
ephemeral one): a flow pauses with the form; another thread answers it as the UI would, with
`resume_flow_run(..., run_input=...)`; no answer rejects at the timeout and the run goes on."""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid

import pytest
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName
from prefect.flow_runs import resume_flow_run

from flows import approval
from tests.pipelines.test_promote import _workspace_store, candidate  # noqa: F401  (fixtures)

TRAINED = {"model_version": "7"}
GATE = {
    "passed": True,
    "reasons": ["pass: success lower bound 0.700 (Wilson 95%) >= incumbent success 0.400"],
    "trial_request_id": "req-1",
    "candidate": {"successes": 18, "n": 20, "success_rate": 0.9, "interval": [0.7, 0.97]},
    "incumbent": {"successes": 8, "n": 20, "success_rate": 0.4, "interval": [0.22, 0.61]},
}


@task
def after_the_pause() -> str:
    return "ran"  # a task can start: the run is Running again


@flow
def signing(params, run_name: str) -> dict:
    decision = approval.ask(params, "cell-07", TRAINED, GATE)
    return decision | {"then": after_the_pause()}


def with_timeout(params, seconds: int):
    promote = dataclasses.replace(params.promote, require_approval=True, approval_timeout_s=seconds)
    return dataclasses.replace(params, promote=promote)


def answer_when_paused(run_name: str, run_input: dict, seen: dict) -> threading.Thread:
    """As a person in the UI: wait for the run's pause, read its form, resume with input."""

    def answer() -> None:
        deadline = time.monotonic() + 180  # the first test in a session starts the API
        while time.monotonic() < deadline:
            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[run_name]))
                )
            if runs and runs[0].state and runs[0].state.is_paused():
                keyset = runs[0].state.state_details.run_input_keyset
                with get_client(sync_client=True) as client:
                    seen["form"] = client.read_flow_run_input(runs[0].id, keyset["description"])
                resume_flow_run(runs[0].id, run_input=run_input)
                return
            time.sleep(0.3)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("approve", [True, False])
def test_a_person_approves_or_rejects_through_the_form(params, approve):
    run_name = f"sign-off-{uuid.uuid4().hex[:8]}"
    seen: dict = {}
    answer = {"approve": approve, "by": "ana", "reason": "trials look right"}
    thread = answer_when_paused(run_name, answer, seen)
    decision = signing.with_options(flow_run_name=run_name)(with_timeout(params, 20), run_name)
    thread.join(timeout=5)
    assert decision["kind"] == "approval" and decision["approved"] is approve
    assert (decision["by"], decision["reason"]) == ("ana", answer["reason"])
    assert decision["then"] == "ran"
    # The form told the person what they sign off: the cell, the version, the trials.
    assert "Promote version 7 to cell-07?" in seen["form"]
    assert "18/20 90% (70%–97%)" in seen["form"]


def test_no_answer_rejects_at_the_timeout_and_the_run_goes_on(params):
    run_name = f"sign-off-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    decision = signing.with_options(flow_run_name=run_name)(with_timeout(params, 2), run_name)
    assert 2 <= time.monotonic() - started < 30
    assert (decision["approved"], decision["by"]) == (False, approval.TIMED_OUT_BY)
    assert decision["then"] == "ran"
    assert decision["reason"] == "no sign-off within 2 s"


def test_the_form_needs_a_name_and_a_reason():
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        approval.SignOff(approve=True, by="", reason="ok")
    assert approval.SignOff(approve=True, by="ana", reason="ok").approve is True


@pytest.mark.slow  # the registered candidate takes ~6 s to make
def test_a_rejection_is_tagged_on_the_version_and_its_run(candidate, params):  # noqa: F811
    from pipelines.training.tracking import mlflow_client, use_workspace

    use_workspace(candidate.workspace)
    decision = approval.new_decision(False, "ana", "too few trials for a new part")
    trained = {"model_version": candidate.version, "mlflow_run_id": candidate.run_id}
    approval.record_rejection.fn(params, "cell-07", trained, decision)
    client = mlflow_client(candidate.workspace)
    tags = client.get_model_version(candidate.model, candidate.version).tags
    assert tags["approval"] == "false" and tags["approval_cell"] == "cell-07"
    assert (tags["approval_by"], tags["approval_reason"]) == ("ana", decision["reason"])
    assert client.get_run(candidate.run_id).data.tags["approval_at"] == decision["at"]
