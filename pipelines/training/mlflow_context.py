"""What MLflow's fluent API adds around a run, for runs made through an MlflowClient: the
context tags of `mlflow.start_run` (user, source, git), its system-metrics sampler, and the
process-wide tracking URI that MLflow's model logging reads, set for one block at a time.

Each takes the store's URI from the caller (`tracking.tracking_uri`), so that this module
imports nothing of realloop's and tracking can import it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SYSTEM_METRICS_INTERVAL_S = 2.0  # MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL overrides it

_process_store = threading.Lock()  # one in_process_store block at a time: it is process state


def run_context_tags(description: str | None = None, parent_run_id: str | None = None) -> dict:
    """What `mlflow.start_run` records about where a run comes from (user, source, git
    commit, branch, repository URL, dirty), plus the description (`mlflow.note.content`) and
    the parent run. The git facts are those of the realloop code that runs, wherever it is run
    from; there are none where that code is not a git checkout."""
    from mlflow.tracking.context.registry import resolve_tags
    from mlflow.utils import mlflow_tags as names

    tags = dict(resolve_tags())  # user and source type, as start_run resolves them
    # start_run's source name is argv[0] as given, often an absolute path of this machine.
    tags[names.MLFLOW_SOURCE_NAME] = Path(sys.argv[0]).name or "python"
    tags.update(_git_tags())
    if description:
        tags[names.MLFLOW_RUN_NOTE] = description
    if parent_run_id:
        tags[names.MLFLOW_PARENT_RUN_ID] = parent_run_id
    return tags


def _git_tags() -> dict[str, str]:
    from mlflow.utils import git_utils
    from mlflow.utils import mlflow_tags as names

    code = str(Path(__file__).resolve().parent)
    commit = git_utils.get_git_commit(code)
    if commit is None:
        return {}
    tags = {names.MLFLOW_GIT_COMMIT: commit}
    for name, value in (
        (names.MLFLOW_GIT_BRANCH, git_utils.get_git_branch(code)),
        (names.MLFLOW_GIT_REPO_URL, git_utils.get_git_repo_url(code)),
    ):
        if value:
            tags[name] = value
    try:
        import git

        dirty = git.Repo(code, search_parent_directories=True).is_dirty()
    except Exception:
        return tags
    tags[names.MLFLOW_GIT_DIRTY] = "true" if dirty else "false"
    return tags


def system_metrics(run_id: str, tracking_uri: str) -> Any:
    """MLflow's own system-metrics sampler (what `start_run(log_system_metrics=True)` starts)
    on the run, started; call `.finish()` at the end. None where it cannot sample."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(
            run_id, sampling_interval=SYSTEM_METRICS_INTERVAL_S, tracking_uri=tracking_uri
        )
    except Exception as exc:
        logging.getLogger(__name__).warning("no system metrics for run %s: %s", run_id, exc)
        return None
    monitor.start()
    return monitor


@contextmanager
def in_process_store(tracking_uri: str) -> Iterator[None]:
    """MLflow's process-wide tracking URI set to `tracking_uri` for the block.

    For MLflow's own model logging and registration of a logged model, which build their
    clients from that URI and take no parameter for it. What was set before, the
    MLFLOW_TRACKING_URI variable included, is back after the block; one block runs at a time."""
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    with _process_store:
        if os.environ.get("MLFLOW_TRACKING_URI"):  # what the process already uses
            yield
            return
        with _use_tracking_uri(tracking_uri):
            yield
