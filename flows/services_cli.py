"""`realloop services up | down | status`: the production profile (flows.services) as commands.

`up` starts what is not running, in dependency order (PostgreSQL and the S3 store, then the
Prefect and MLflow servers, then the work pool's workers), waits until each answers its health
check (pg_isready, S3 ListBuckets, Prefect /api/health, MLflow /health, the worker ONLINE in
the pool) with one line per part, and writes .realloop/services.env. `down` stops them in the
reverse order (workers first, PostgreSQL last with a fast shutdown) and removes the env file;
the data stays (PostgreSQL's cluster), so the next `up` finds every run again. `status` says
what runs, exit status 3 when a part is down (as `pg_ctl status` and `systemctl status` do).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from flows import services as sv
from flows.console import emit, fails_cleanly

app = typer.Typer(
    help="the production profile on this machine: PostgreSQL, Prefect and MLflow servers, "
    "S3-compatible store, a work pool with two workers",
    no_args_is_help=True,
)
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output on stdout")]


def _port_option(part: str) -> object:
    preferred = sv.PREFERRED_PORTS[part]
    return typer.Option(
        f"--{part}-port",
        help=f"{part}'s port (0: any free one; default: the one used last, else {preferred})",
    )


@dataclass(frozen=True)
class Part:
    """One part of the profile: how to start it, whether it answers, how to stop it."""

    name: str
    start: Callable[[sv.Profile], None]
    answers: Callable[[sv.Profile], bool]
    pid: Callable[[sv.Profile], int | None]
    stop: Callable[[sv.Profile], bool]
    url: Callable[[sv.Profile], str]
    ready: Callable[[sv.Profile], None] = lambda profile: None  # once it answers


def _start_postgres(profile: sv.Profile) -> None:
    sv.require_port(profile, "postgres")
    if not (profile.pg_data / "PG_VERSION").is_file():
        sv.init_cluster(profile)
    sv.start_postgres(profile)


def _start_s3(profile: sv.Profile) -> None:
    sv.require_port(profile, "s3")
    port = str(profile.ports["s3"])
    sv.spawn(
        profile, "s3", sv.python_tool("moto.server", "-H", "127.0.0.1", "-p", port), sv.base_env()
    )


def _s3_ready(profile: sv.Profile) -> None:
    """The objects saved by the last `down`, and the bucket MLflow's artifacts go to."""
    sv.restore_s3_snapshot(profile)
    client = sv.s3_client(profile)
    if sv.BUCKET not in {b["Name"] for b in client.list_buckets()["Buckets"]}:
        client.create_bucket(Bucket=sv.BUCKET)


def _prefect_env(profile: sv.Profile, **extra: str) -> dict[str, str]:
    # Its own PREFECT_HOME: ~/.prefect's profiles must not pick another API or database.
    return sv.base_env(PREFECT_HOME=str(profile.state / "prefect-home"), **extra)


def _start_prefect(profile: sv.Profile) -> None:
    sv.require_port(profile, "prefect")
    env = _prefect_env(
        profile,
        PREFECT_API_DATABASE_CONNECTION_URL=profile.database_url("prefect", "asyncpg"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",  # no internet here, nothing to report to
        # The UI calls the API at this URL from the browser; on a free port its default
        # (port 4200) answers nothing and every page says "Can't connect to Server API".
        PREFECT_UI_API_URL=f"{profile.url('prefect')}/api",
    )
    command = sv.python_tool("prefect", "server", "start", "--host", "127.0.0.1")
    sv.spawn(profile, "prefect", [*command, "--port", str(profile.ports["prefect"])], env)


def _create_work_pool(profile: sv.Profile) -> None:
    """`prefect work-pool create realloop --type process`, as a user would, once."""
    try:
        sv.prefect_api(profile, f"work_pools/{sv.WORK_POOL}")
        return
    except OSError:  # 404: not there yet
        pass
    command = sv.python_tool("prefect", "work-pool", "create", sv.WORK_POOL, "--type", "process")
    env = _prefect_env(profile, PREFECT_API_URL=f"{profile.url('prefect')}/api")
    import subprocess

    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise sv.CommandError(f"work pool {sv.WORK_POOL}: {done.stdout.strip()[-200:]}")


def _start_mlflow(profile: sv.Profile) -> None:
    sv.require_port(profile, "mlflow")
    env = sv.base_env(
        MLFLOW_BACKEND_STORE_URI=profile.database_url("mlflow", "psycopg2"),
        MLFLOW_S3_ENDPOINT_URL=profile.url("s3"),
        # The job runner serves GenAI features realloop does not use (online trace scoring,
        # trace archival): 8 more processes, 1.4 GB and 10 s at every stop, measured here.
        MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false",
        **sv.MOTO_CREDENTIALS,
    )
    # One uvicorn worker: each one is a full MLflow process (hundreds of MB); raise with
    # traffic (`mlflow server --workers`).
    command = sv.python_tool("mlflow", "server", "--host", "127.0.0.1")
    command += ["--port", str(profile.ports["mlflow"]), "--workers", "1"]
    sv.spawn(
        profile, "mlflow", [*command, "--artifacts-destination", sv.ARTIFACTS_DESTINATION], env
    )


def _worker(name: str) -> Part:
    def start(profile: sv.Profile) -> None:
        command = sv.python_tool("prefect", "worker", "start", "--pool", sv.WORK_POOL)
        # Flow runs inherit the worker's environment: the profile's URLs (over any exported
        # ones: the workers belong to this profile) and the rest of the shell that ran `up`.
        env = _prefect_env(profile, **profile.client_env())
        sv.spawn(profile, name, [*command, "--type", "process", "--name", name], env)

    return Part(
        name,
        start,
        lambda profile: name in sv.online_workers(profile),
        lambda profile: sv.running_pid(profile, name),
        lambda profile: sv.terminate(profile, name),
        lambda profile: f"pool {sv.WORK_POOL} at {profile.url('prefect')}",
    )


def _process_part(name: str, start, answers, url, ready=lambda profile: None) -> Part:
    return Part(
        name,
        start,
        answers,
        lambda profile: sv.running_pid(profile, name),
        lambda profile: sv.terminate(profile, name),
        url,
        ready,
    )


POSTGRES = Part(
    "postgres",
    _start_postgres,
    sv.postgres_ready,
    sv.postgres_pid,
    sv.stop_postgres,
    lambda p: f"postgresql://{sv.DB_ROLE}@127.0.0.1:{p.ports['postgres']}/{{prefect,mlflow}}",
    sv.ensure_databases,
)
S3 = Part(
    "s3",
    _start_s3,
    sv.s3_answers,
    lambda profile: sv.running_pid(profile, "s3"),
    sv.stop_s3,
    lambda p: f"{p.url('s3')} s3://{sv.BUCKET}",
    _s3_ready,
)
PREFECT = _process_part(
    "prefect",
    _start_prefect,
    lambda p: sv.http_answers(f"{p.url('prefect')}/api/health"),
    lambda p: f"{p.url('prefect')}/api",
    _create_work_pool,
)
MLFLOW = _process_part(
    "mlflow",
    _start_mlflow,
    lambda p: sv.http_answers(f"{p.url('mlflow')}/health"),
    lambda p: p.url("mlflow"),
)
# Started together, stage by stage: a stage needs the ones before it.
STAGES: tuple[tuple[Part, ...], ...] = (
    (POSTGRES, S3),
    (PREFECT, MLFLOW),
    tuple(_worker(name) for name in sv.WORKERS),
)
PARTS = tuple(part for stage in STAGES for part in stage)


# --- the commands --------------------------------------------------------------------------------


@app.command("up")
@fails_cleanly
def up_command(
    postgres_port: Annotated[int | None, _port_option("postgres")] = None,
    s3_port: Annotated[int | None, _port_option("s3")] = None,
    prefect_port: Annotated[int | None, _port_option("prefect")] = None,
    mlflow_port: Annotated[int | None, _port_option("mlflow")] = None,
    timeout_s: Annotated[float, typer.Option("--timeout", help="seconds each part may take")] = 300,
    as_json: JsonOpt = False,
) -> None:
    """Start the parts that are not running, wait until each answers, write
    .realloop/services.env (every realloop command run here then uses the profile)."""
    started = time.monotonic()
    sv.pg_bin()  # no PostgreSQL: say so before anything starts
    requested = dict(postgres=postgres_port, s3=s3_port, prefect=prefect_port, mlflow=mlflow_port)
    _refuse_port_change(sv.load_profile(Path.cwd()), requested)
    profile, notes = sv.prepare_profile(Path.cwd(), requested)
    for part, note in notes.items():
        _line(f"{part}: {note}, using {profile.ports[part]} instead")
    for stage in STAGES:
        fresh = [part for part in stage if part.pid(profile) is None]
        for part in fresh:
            part.start(profile)
        for part in stage:
            log = profile.state / f"{part.name}.log"
            sv.wait_until(lambda part=part: part.answers(profile), timeout_s, part.name, log)
            part.ready(profile)
            verb = "started" if part in fresh else "already running"
            elapsed = f"{time.monotonic() - started:.1f} s"
            _line(f"{part.name:<18} {verb:<16} {elapsed:>7}  pid {part.pid(profile)}")
    sv.write_services_env(profile)
    report = status_report(profile) | {"wall_s": round(time.monotonic() - started, 1)}
    emit(report, as_json, _print_status)


def _refuse_port_change(profile: sv.Profile | None, requested: dict[str, int | None]) -> None:
    """A running part keeps its port: moving it means stopping it first."""
    for part in (p for p in PARTS if p.name in requested and profile is not None):
        port = requested[part.name]
        if port is not None and port != profile.ports.get(part.name) and part.pid(profile):
            raise sv.CommandError(
                f"{part.name} runs on port {profile.ports[part.name]}: "
                "`realloop services down` first to move it"
            )


@app.command("down")
@fails_cleanly
def down_command(as_json: JsonOpt = False) -> None:
    """Stop every part (workers first, PostgreSQL last); the data stays for the next `up`."""
    started = time.monotonic()
    profile = sv.load_profile(Path.cwd())
    stopped = []
    if profile is not None:
        (profile.workspace / sv.ENV_FILE).unlink(missing_ok=True)
        for part in reversed(PARTS):
            if part.stop(profile):
                stopped.append(part.name)
                _line(f"{part.name:<18} stopped          {time.monotonic() - started:5.1f} s")
    report = {"stopped": stopped, "wall_s": round(time.monotonic() - started, 1)}
    emit(report, as_json, lambda r: print(f"stopped {len(stopped)} parts in {r['wall_s']} s"))


@app.command("status")
@fails_cleanly
def status_command(as_json: JsonOpt = False) -> None:
    """Each part: up or down, pid, URL, log file. Exit status 3 when a part is down."""
    profile = sv.load_profile(Path.cwd())
    if profile is None:
        report = {"workspace": str(Path.cwd()), "env_file": None, "all_up": False, "parts": []}
    else:
        report = status_report(profile)
    emit(report, as_json, _print_status)
    if not report["all_up"]:
        raise typer.Exit(3)


def status_report(profile: sv.Profile) -> dict:
    parts = []
    for part in PARTS:
        pid = part.pid(profile)
        state = "down" if pid is None else ("up" if part.answers(profile) else "not answering")
        parts.append(
            {
                "part": part.name,
                "state": state,
                "pid": pid,
                "url": part.url(profile),
                "log": str(profile.state / f"{part.name}.log"),
            }
        )
    env_file = profile.workspace / sv.ENV_FILE
    return {
        "workspace": str(profile.workspace),
        "env_file": str(env_file) if env_file.is_file() else None,
        "work_pool": sv.WORK_POOL,
        "all_up": all(p["state"] == "up" for p in parts),
        "parts": parts,
    }


def _line(text: str) -> None:
    """A progress line on stderr, whole (rich would wrap it at 80 columns in a pipe)."""
    print(text, file=sys.stderr, flush=True)


def _print_status(report: dict) -> None:
    if not report["parts"]:
        print("no services profile in this workspace: `realloop services up` starts one")
        return
    for part in report["parts"]:
        pid = part["pid"] or "-"
        print(f"{part['part']:<18} {part['state']:<14} {pid!s:>8}  {part['url']}")
    if report["env_file"]:
        print(f"{report['env_file']}: realloop commands run here use these servers")
        if not report["all_up"]:  # e.g. after a reboot: the file outlives the servers
            print("a part is down: `realloop services up` restarts it, `down` clears the file")
