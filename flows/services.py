"""The production profile on one machine: PostgreSQL, an S3-compatible store, a Prefect server
and an MLflow tracking server on Postgres, and a Prefect work pool with two process workers.

Each part runs the way its users run it: Debian's PostgreSQL binaries (`initdb`, `pg_ctl`,
`pg_isready`), `prefect server start`, `mlflow server`, `prefect worker start`, and moto's
S3-compatible server standing in for S3 (in memory: `down` loses its objects; see
docs/operations.md for what replaces it in a plant). Every server and worker is detached (a
session of its own), so it outlives the `realloop services up` that started it.

Layout, under the workspace (the folder `realloop` runs in):
    .realloop/services.env         the URLs every realloop command picks up (see load_services_env)
    .realloop/services/profile.json  ports and the database password (mode 0600)
    .realloop/services/postgres/   the cluster's data directory (owned by the `postgres` user
                                   when run as root: the server refuses to run as root);
                                   its unix socket lives there too
    .realloop/services/<part>.pid  {"pid", "started"}: the start time guards against a pid that
                                   was reused after a reboot, so `down` never kills a stranger
    .realloop/services/<part>.log  each part's output

Nothing here imports prefect, mlflow or boto3 at module level: `realloop --help` loads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from flows.console import CommandError

WORK_POOL = "realloop"  # the Prefect work pool the workers serve; deployments target it
WORKERS = ("realloop-worker-1", "realloop-worker-2")
ENV_FILE = Path(".realloop/services.env")
STATE_DIR = Path(".realloop/services")
BUCKET = "realloop"
ARTIFACTS_DESTINATION = f"s3://{BUCKET}/mlflow"
DB_ROLE = "realloop"
DATABASES = ("prefect", "mlflow")
# Where users of each tool expect it; a port taken by another program at the first `up` is
# replaced by a free one, and the choice is kept in profile.json so URLs stay stable.
PREFERRED_PORTS = {"postgres": 5432, "s3": 9000, "prefect": 4200, "mlflow": 5000}
PG_BIN_ENV = "REALLOOP_PG_BIN"
PG_BIN_GLOB = "/usr/lib/postgresql/*/bin"  # Debian's layout: pg_ctl is not on PATH there
# moto accepts any key; these are test values, never real credentials.
MOTO_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "realloop-moto",
    "AWS_SECRET_ACCESS_KEY": "realloop-moto",
    "AWS_DEFAULT_REGION": "us-east-1",
}
CLIENT_ENV_NAMES = (
    "PREFECT_API_URL",
    "PREFECT_UI_URL",
    "MLFLOW_TRACKING_URI",
    "REALLOOP_S3_ENDPOINT_URL",
    "AWS_ENDPOINT_URL",
    "MLFLOW_S3_ENDPOINT_URL",
    *MOTO_CREDENTIALS,
)
STOP_GRACE_S = 30.0  # SIGTERM, then SIGKILL: a worker finishes handing back its runs first


@dataclass
class Profile:
    """What one workspace's profile is: where it lives, its ports and database password."""

    workspace: Path
    ports: dict[str, int] = field(default_factory=dict)
    password: str = ""

    @property
    def state(self) -> Path:
        return self.workspace / STATE_DIR

    @property
    def pg_data(self) -> Path:
        return self.state / "postgres"

    def url(self, part: str) -> str:
        return f"http://127.0.0.1:{self.ports[part]}"

    def database_url(self, database: str, driver: str) -> str:
        port = self.ports["postgres"]
        return f"postgresql+{driver}://{DB_ROLE}:{self.password}@127.0.0.1:{port}/{database}"

    def client_env(self) -> dict[str, str]:
        """What realloop commands (and the workers' flow runs) need to use this profile."""
        s3 = self.url("s3")
        values = [f"{self.url('prefect')}/api", self.url("prefect"), self.url("mlflow"), s3, s3, s3]
        return dict(zip(CLIENT_ENV_NAMES, [*values, *MOTO_CREDENTIALS.values()], strict=True))


# --- the environment file every command reads ------------------------------------------------


def load_services_env(workspace: Path) -> list[str]:
    """Export <workspace>/.realloop/services.env into this process, never overriding a variable
    already set (what the user exported wins); return the names it set."""
    path = Path(workspace) / ENV_FILE
    if not path.is_file():
        return []
    from dotenv import dotenv_values

    loaded = []
    for name, value in dotenv_values(path).items():
        if value is not None and name not in os.environ:
            os.environ[name] = value
            loaded.append(name)
    return loaded


def write_services_env(profile: Profile) -> Path:
    path = profile.workspace / ENV_FILE
    lines = [
        "# written by `realloop services up`, removed by `services down`; every realloop",
        "# command run in this workspace loads it, and a variable you export wins over it.",
        "# The AWS_* keys are moto's test credentials for the loopback S3 store only.",
        *(f"{name}={value}" for name, value in profile.client_env().items()),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# --- the profile's ports and password ---------------------------------------------------------


def load_profile(workspace: Path) -> Profile | None:
    path = Path(workspace) / STATE_DIR / "profile.json"
    if not path.is_file():
        return None
    stored = json.loads(path.read_text())
    return Profile(Path(workspace), stored["ports"], stored["password"])


def prepare_profile(
    workspace: Path, requested: dict[str, int | None]
) -> tuple[Profile, dict[str, str]]:
    """The workspace's profile with `requested` ports (None: keep or prefer; 0: any free one);
    saved. Returns it with a note per part moved off a busy preferred port."""
    profile = load_profile(workspace) or Profile(Path(workspace), password=secrets.token_hex(16))
    notes = {}
    for part, preferred in PREFERRED_PORTS.items():
        wanted = requested.get(part)
        if wanted is None and part in profile.ports:
            continue
        port = preferred if wanted is None else wanted
        if wanted is None and not port_free(port):
            port = 0
            notes[part] = f"port {preferred} is in use by another program"
        profile.ports[part] = port or free_port()
    # Searchable, not listable, by others: the postgres user must reach its data folder.
    profile.state.mkdir(mode=0o711, parents=True, exist_ok=True)
    path = profile.state / "profile.json"
    path.touch(mode=0o600)
    path.write_text(json.dumps({"ports": profile.ports, "password": profile.password}, indent=1))
    return profile, notes


def port_free(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def require_port(profile: Profile, part: str) -> None:
    port = profile.ports[part]
    if not port_free(port):
        raise CommandError(
            f"{part}: port {port} (from {profile.state / 'profile.json'}) is in use by another "
            f"program: stop it, or pass --{part}-port 0 to `realloop services up` for a free one"
        )


# --- detached processes ------------------------------------------------------------------------


def _started(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else fields[19]


def running_pid(profile: Profile, part: str) -> int | None:
    """The part's pid when its process is alive and is the one we started."""
    path = profile.state / f"{part}.pid"
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return record["pid"] if _started(record["pid"]) == record["started"] else None


def spawn(profile: Profile, part: str, command: list[str], env: dict[str, str]) -> int:
    """Start `command` detached (own session, so it outlives us and a group signal reaches its
    children), output to <part>.log, pid recorded."""
    log = open(profile.state / f"{part}.log", "ab")  # noqa: SIM115 - the child keeps it open
    with log:
        process = subprocess.Popen(
            command,
            cwd=profile.workspace,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    record = {"pid": process.pid, "started": _started(process.pid), "command": command[:4]}
    (profile.state / f"{part}.pid").write_text(json.dumps(record))
    return process.pid


def terminate(profile: Profile, part: str, grace_s: float = STOP_GRACE_S) -> bool:
    """SIGTERM the part's process group, SIGKILL after `grace_s`; False if it was not running."""
    pid = running_pid(profile, part)
    if pid is None:
        (profile.state / f"{part}.pid").unlink(missing_ok=True)
        return False
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _started(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    if _started(pid) is not None:
        _signal_group(pid, signal.SIGKILL)
    (profile.state / f"{part}.pid").unlink(missing_ok=True)
    return True


def _signal_group(pid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
        os.killpg(pid, signum)


def python_tool(module: str, *args: str) -> list[str]:
    """A tool of this environment, run by this interpreter: no PATH lookup, no other venv."""
    return [sys.executable, "-m", module, *args]


def base_env(**extra: str) -> dict[str, str]:
    """This process's environment for a server, without the realloop client settings of a
    previous `up` (a server must not, say, send its artifacts to itself)."""
    env = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV_NAMES}
    env.update(DO_NOT_TRACK="1", **extra)
    return env


# --- health checks -----------------------------------------------------------------------------


def http_answers(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except OSError:
        return False


def wait_until(check, timeout_s: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            where = f"; see {log}" if log else ""
            raise CommandError(f"{what} did not answer within {timeout_s:.0f} s{where}")
        time.sleep(0.5)


def s3_client(profile: Profile):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=profile.url("s3"),
        aws_access_key_id=MOTO_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=MOTO_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        region_name=MOTO_CREDENTIALS["AWS_DEFAULT_REGION"],
        config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=5),
    )


def s3_answers(profile: Profile) -> bool:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        s3_client(profile).list_buckets()
    except (BotoCoreError, ClientError):
        return False
    return True


def prefect_api(profile: Profile, path: str, body: dict | None = None) -> object:
    """One call to the Prefect server's REST API (no prefect import: seconds saved per call)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        f"{profile.url('prefect')}/api/{path}",
        data=data,
        headers={"Content-Type": "application/json"},
        method="GET" if body is None else "POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read() or b"null")


def online_workers(profile: Profile) -> set[str]:
    try:
        workers = prefect_api(profile, f"work_pools/{WORK_POOL}/workers/filter", {})
    except OSError:
        return set()
    return {w["name"] for w in workers if w.get("status") == "ONLINE"}


# --- PostgreSQL ----------------------------------------------------------------------------------


def pg_bin() -> Path:
    """The folder of the PostgreSQL server binaries: REALLOOP_PG_BIN, else Debian's newest."""
    import glob

    if configured := os.environ.get(PG_BIN_ENV):
        candidates = [configured]
    else:
        candidates = sorted(
            glob.glob(PG_BIN_GLOB), key=lambda p: int(Path(p).parent.name), reverse=True
        )
    for folder in candidates:
        if (Path(folder) / "pg_ctl").is_file():
            return Path(folder)
    raise CommandError(
        f"PostgreSQL server binaries not found (pg_ctl in {PG_BIN_ENV} or {PG_BIN_GLOB}): "
        "install them with `apt-get install -y postgresql`, or set "
        f"{PG_BIN_ENV} to the folder holding pg_ctl"
    )


def as_postgres(*command: str | Path) -> list[str]:
    """PostgreSQL refuses to run as root: as root, run it as the `postgres` system user."""
    command = [str(c) for c in command]
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else command


def _own_for_postgres(path: Path) -> None:
    if os.geteuid() == 0:
        shutil.chown(path, "postgres", "postgres")


def pg_run(*command: str | Path) -> None:
    done = subprocess.run(as_postgres(*command), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        reason = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise CommandError(f"`{Path(str(command[0])).name}` failed: {reason[0]}")


def init_cluster(profile: Profile) -> None:
    """A new cluster in the workspace: local socket by peer/owner, TCP by password."""
    data = profile.pg_data
    if os.geteuid() == 0 and subprocess.run(as_postgres("test", "-x", profile.state)).returncode:
        raise CommandError(
            f"the postgres user cannot enter {profile.state} (a parent folder is private): "
            "make the workspace's parent folders world-searchable (chmod o+x) or use another"
        )
    data.mkdir(mode=0o700, parents=True, exist_ok=True)
    _own_for_postgres(data)
    superuser = profile.state / "postgres.pw"
    superuser.write_text(profile.password + "\n")
    _own_for_postgres(superuser)
    try:
        pg_run(
            pg_bin() / "initdb", "-D", data, "-U", "postgres", "--pwfile", superuser,
            "--auth-local=peer", "--auth-host=scram-sha-256", "--encoding=UTF8",
            "--no-instructions",
        )  # fmt: skip
    finally:
        superuser.unlink(missing_ok=True)


def start_postgres(profile: Profile) -> None:
    """`pg_ctl start` on 127.0.0.1 only; the socket in the data folder when its path fits."""
    data = profile.pg_data
    log = profile.state / "postgres.log"
    log.touch()
    _own_for_postgres(log)
    # A unix socket path is limited to 107 bytes; past that, TCP only (realloop uses TCP).
    socket_dir = str(data) if len(str(data / ".s.PGSQL.65535")) < 100 else ""
    options = f"-c listen_addresses=127.0.0.1 -p {profile.ports['postgres']}"
    options += f" -c unix_socket_directories='{socket_dir}'"
    pg_run(pg_bin() / "pg_ctl", "start", "-D", data, "-l", log, "-w", "-t", "120", "-o", options)


def postgres_ready(profile: Profile) -> bool:
    port = str(profile.ports["postgres"])
    command = [pg_bin() / "pg_isready", "-q", "-h", "127.0.0.1", "-p", port]
    return subprocess.run(command, check=False).returncode == 0


def postgres_pid(profile: Profile) -> int | None:
    """The postmaster's pid, from postmaster.pid, when that process is alive."""
    try:
        pid = int((profile.pg_data / "postmaster.pid").read_text().split()[0])
    except (FileNotFoundError, PermissionError, IndexError, ValueError):
        return None
    return pid if _started(pid) is not None else None


def ensure_databases(profile: Profile) -> None:
    """The `realloop` role and its databases, created once; the password follows profile.json."""
    import psycopg2

    connection = psycopg2.connect(
        host="127.0.0.1", port=profile.ports["postgres"], user="postgres",
        dbname="postgres", password=profile.password,
    )  # fmt: skip
    connection.autocommit = True  # CREATE DATABASE cannot run inside a transaction
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (DB_ROLE,))
            verb = "ALTER" if cursor.fetchone() else "CREATE"
            cursor.execute(f"{verb} ROLE {DB_ROLE} LOGIN PASSWORD %s", (profile.password,))
            for database in DATABASES:
                cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
                if not cursor.fetchone():
                    cursor.execute(f"CREATE DATABASE {database} OWNER {DB_ROLE}")
    finally:
        connection.close()


def stop_postgres(profile: Profile) -> bool:
    if postgres_pid(profile) is None:
        return False
    pg_run(pg_bin() / "pg_ctl", "stop", "-D", profile.pg_data, "-m", "fast", "-w", "-t", "120")
    return True


# --- the S3 store's objects across down/up -------------------------------------------------------
# moto keeps objects in memory. `down` copies every bucket to <state>/s3-snapshot and the next
# `up` puts them back, so MLflow's artifacts outlive a restart as its runs (in PostgreSQL) do.
# A crash of the store loses what was written since the last `down`; a plant's S3 has its own
# durability and needs none of this.


def save_s3_snapshot(profile: Profile) -> int:
    """Every object of every bucket to <state>/s3-snapshot/<bucket>/<key>; the count."""
    client, snapshot = s3_client(profile), profile.state / "s3-snapshot"
    partial = snapshot.with_name("s3-snapshot.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    count = 0
    for bucket in client.list_buckets()["Buckets"]:
        (partial / bucket["Name"]).mkdir()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket["Name"]):
            for item in page.get("Contents", []):
                target = _snapshot_path(partial / bucket["Name"], item["Key"])
                if target is not None:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    client.download_file(bucket["Name"], item["Key"], str(target))
                    count += 1
    shutil.rmtree(snapshot, ignore_errors=True)
    partial.rename(snapshot)
    return count


def restore_s3_snapshot(profile: Profile) -> int:
    """Put a saved snapshot back into an empty store (a store with objects is left alone)."""
    client, snapshot = s3_client(profile), profile.state / "s3-snapshot"
    buckets = [b["Name"] for b in client.list_buckets()["Buckets"]]
    if not snapshot.is_dir() or any(client.list_objects_v2(Bucket=b)["KeyCount"] for b in buckets):
        return 0
    count = 0
    for folder in sorted(p for p in snapshot.iterdir() if p.is_dir()):
        if folder.name not in buckets:
            client.create_bucket(Bucket=folder.name)
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            client.upload_file(str(path), folder.name, path.relative_to(folder).as_posix())
            count += 1
    return count


def _snapshot_path(folder: Path, key: str) -> Path | None:
    """Where an object's copy goes; None for a key that is no file name (a "folder/" marker,
    a key with `..` or an empty segment)."""
    parts = key.split("/")
    if any(part in ("", ".", "..") for part in parts):
        return None
    return folder.joinpath(*parts)


def stop_s3(profile: Profile) -> bool:
    if running_pid(profile, "s3") is not None and s3_answers(profile):
        save_s3_snapshot(profile)
    return terminate(profile, "s3")
