"""Which Prefect API realloop talks to, where its state lives, and how loud it is.

`configure_prefect(workspace)` runs before anything imports prefect heavily. It only sets
environment variables (with `setdefault`, so a value the user exported wins), because Prefect
reads its settings from the environment once and the ephemeral API server, a subprocess,
inherits them.

Which API
    - PREFECT_API_URL set (and not empty; exported, or from <workspace>/.realloop/services.env,
      which `realloop services up` writes and this loads first): that server is used as is.
      Only the client-side settings below apply; PREFECT_HOME and the user's profiles stay
      untouched.
    - Otherwise an ephemeral local API, with its state in the workspace:
      PREFECT_HOME=<workspace>/.prefect, so the SQLite database is <workspace>/.prefect/prefect.db
      and runs are still there after the process exits (`prefect server start` with the same
      PREFECT_HOME shows them). Moving PREFECT_HOME also moves the profiles file, so an API URL
      kept in ~/.prefect/profiles.toml is not used: a server is chosen with PREFECT_API_URL only.

Once per process
    Prefect 3.9 starts the ephemeral API lazily, on the first client call, as a uvicorn
    subprocess (`SubprocessASGIServer`, a per-process singleton that stops at exit). Every
    flow, subflow and task run of the process then shares it; checked by running two flows
    in one process ("Starting temporary server" printed once). Nothing here starts it early,
    so commands that never touch Prefect pay nothing. Another *process* starts its own
    server on the same SQLite file, which the settings below also keep quiet (two loaded
    flows at once in one workspace printed nothing).

Settings for the ephemeral server, and why (measured on 2 shared cores, prefect 3.9.1)
    PREFECT_SERVER_EPHEMERAL_ENABLED=true
        lets the client start the subprocess server when no API URL is set.
    PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS=90
        a cold start (migrations + block registration) took 19 s here, against a default
        limit of 20 s.
    PREFECT_SERVER_ANALYTICS_ENABLED=false
        the telemetry heartbeat runs at server start, reads then inserts a row in its own
        transaction and failed with 'database is locked' while the first flow run was being
        created: a deferred SQLite transaction cannot upgrade to a writer once another writer
        has committed, so the 60 s busy_timeout does not help. This printed two tracebacks on
        every cold start. It would also try to reach the internet, which this machine lacks.
    PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED=false
        automations (reactive and proactive triggers, actions) are not used by a CLI run;
        the periodic trigger evaluation is a known source of 'database is locked'
        (PrefectHQ/prefect#15170).
    PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED=false
        event retention runs as soon as the server starts, another writer racing the first
        flow run. The events table of a workspace grows instead (about three rows per task
        run); delete <workspace>/.prefect/prefect.db to start afresh.
    PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_{READ_BATCH_SIZE=50,BATCH_SIZE=200}
        the recorder turns task-run events into task runs. By default it commits one event
        per transaction and fell behind: a one-minute flow of 1,400 tasks left only ~600 task
        runs in the database, and stopping the server mid-backlog printed "Error flushing 1
        events" tracebacks. Batched, all 1,400 were recorded and nothing printed. Its flush
        interval stays at 5 s: a flush cut by the server's shutdown logs an error, so the
        rarer the periodic flushes, the rarer that is.
    PREFECT_SERVER_SERVICES_EVENT_PERSISTER_{READ_BATCH_SIZE=50,BATCH_SIZE=200,FLUSH_INTERVAL=1}
        the same for the event feed: with two loaded flows in one workspace, ~1,100 of 4,200
        events were lost at shutdown by default, none with these (this service is quiet when
        its flush is cut, so it may flush often).
    PREFECT_LOGGING_LOGGERS_PREFECT_SERVER_LEVEL=CRITICAL
        the one residue of the above: when the server is stopped at exit while the recorder
        is writing (seen with two loaded flows at once on one database), it logs "Error
        flushing 125 events (125 to retry, 0 dropped)" with a CancelledError traceback,
        then writes them in its final flush (all 1,400 task runs were there). The
        ephemeral server's own log is not something a user can act on: a failed API call
        reaches the flow as an error anyway. Only the `prefect.server` loggers are raised,
        not uvicorn's, so a server that cannot start still says why. Export
        PREFECT_LOGGING_LOGGERS_PREFECT_SERVER_LEVEL=WARNING to see them again.
    Left as it is: the SQLite busy timeout. Prefect already sets PRAGMA busy_timeout to 60 s
    (PREFECT_SERVER_DATABASE_TIMEOUT only sets the driver's, which that PRAGMA overrides);
    the errors above were not timeouts.

Settings for any API (client side)
    PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL=WARNING
        realloop commands print their own progress and summary, and `--json` callers read
        stdout while stderr carries one-line errors; a line per task state ("Task run
        'ingest-logs-0' - Finished in state Completed()") would bury both. Only the console
        handler is raised: flow and task logs still go to the API at INFO, so the Prefect UI
        shows complete run logs. `realloop serve` and a curious user can export
        PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL=INFO to see them in the terminal.
    DO_NOT_TRACK=1
        no SDK analytics (and no first-run notice on stderr); there is no internet here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from flows.services import load_services_env

API_URL = "PREFECT_API_URL"

CLIENT_SETTINGS: dict[str, str] = {
    "PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL": "WARNING",
    "DO_NOT_TRACK": "1",
}

EPHEMERAL_SERVER_SETTINGS: dict[str, str] = {
    "PREFECT_SERVER_EPHEMERAL_ENABLED": "true",
    "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED": "false",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_READ_BATCH_SIZE": "50",
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_READ_BATCH_SIZE": "50",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
    "PREFECT_LOGGING_LOGGERS_PREFECT_SERVER_LEVEL": "CRITICAL",
}


def api_url() -> str | None:
    """The Prefect server realloop uses, or None for the ephemeral local API."""
    return os.environ.get(API_URL) or None


def configure_prefect(workspace: Path) -> None:
    """Point Prefect at PREFECT_API_URL, or at an ephemeral API kept in <workspace>/.prefect."""
    load_services_env(workspace)  # `realloop services up` in this workspace: its servers
    for name, value in CLIENT_SETTINGS.items():
        os.environ.setdefault(name, value)
    if api_url() is None:
        os.environ.pop(API_URL, None)  # set but empty would read as "no server" anyway
        home = (Path(workspace) / ".prefect").resolve()
        home.mkdir(parents=True, exist_ok=True)
        os.environ["PREFECT_HOME"] = str(home)
        for name, value in EPHEMERAL_SERVER_SETTINGS.items():
            os.environ.setdefault(name, value)
    if "prefect.context" in sys.modules:  # imported already: make it re-read the environment
        from prefect.context import refresh_global_settings_context
        from prefect.logging.configuration import setup_logging

        refresh_global_settings_context()
        setup_logging()
