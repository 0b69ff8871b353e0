"""Shared by the ingest tests: one recorded shift per test session, ways to break its logs,
exports of its episodes, and an ingest run in a child process (to kill, or to race).

No tests here; the name only keeps it next to the tests it serves.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from mcap.reader import make_reader
from mcap.writer import Writer as McapWriter
from mcap_ros2.decoder import DecoderFactory
from mcap_ros2.writer import Writer

from pipelines.contract import schema
from pipelines.contract.params import load_params
from pipelines.ingest.exports import EXPORT_EPISODE_COLUMNS, EXPORT_SCHEMA, EXPORT_STEP_COLUMNS
from pipelines.ingest.landing import ingest_landing
from pipelines.ingest.shift_log import read_log
from refcell.cell import TrueState
from refcell.expert import Expert
from refcell.shift import record_shift
from refcell.world import load_world

ROOT = Path(__file__).resolve().parents[2]
PARAMS = ROOT / "params.yaml"
START = datetime(2026, 11, 30, 6, 0, tzinfo=UTC)
EPISODES, PER_FILE = 6, 2
RUN_TIME = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)  # a fixed ingested_at, for byte comparisons


class ObservingExpert:
    """The expert steering on what the cell perceives, idling now and then so that the
    operator takes over. It keeps every observation it is shown: the recorder's ground truth
    (run_episode passes the same observation to the controller and to the recorder)."""

    name = "observing-expert-0"

    def __init__(self):
        self.expert, self.calls, self.seen, self.recording = Expert(), 0, [], True

    def act(self, obs: np.ndarray) -> np.ndarray:
        if self.recording:
            self.seen.append(obs.copy())
        self.calls += 1
        if self.calls % 45 < 6:
            return np.zeros(2)
        state = TrueState(obs[0:2], obs[2:4], obs[4:6], float(obs[6]), np.zeros(2), obs[8:10], 0.03)
        return self.expert.act(state)


@functools.cache
def recorded_shift() -> tuple[Path, dict, np.ndarray]:
    """A tiny recorded shift, once per session (read-only: tests copy it before ingesting)."""
    params = load_params(PARAMS)
    out = Path(tempfile.mkdtemp(prefix="realloop-shift-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    controller = ObservingExpert()

    def stop_at_last_episode(done: int, total: int) -> None:
        controller.recording = done < total  # counterfactual replays come after

    summary = record_shift(
        load_world("line"),
        params.cell,
        dataclasses.replace(params.record, episodes_per_file=PER_FILE),
        controller,
        EPISODES,
        out,
        7,
        interventions=True,
        policy_version=controller.name,
        shift_start=START,
        progress=stop_at_last_episode,
    )
    return out, summary, np.array(controller.seen)


def abandoned(path: Path, hours: float = 1.0) -> Path:
    """Make `path` look untouched for `hours`: a cut log whose writer is gone (not one still
    being written, which ingest leaves alone until ingest.stale_after_s)."""
    then = datetime.now(UTC).timestamp() - hours * 3600
    os.utime(path, (then, then))
    return path


def copy_landing(shift, tmp_path: Path, captures: bool = True) -> Path:
    landing = tmp_path / "landing"
    shutil.copytree(shift[0], landing)
    if not captures:
        shutil.rmtree(landing / "captures")
    return landing


def ingest(tmp_path: Path, landing: Path, params, run_id="run-1", ingest_params=None, **kwargs):
    return ingest_landing(
        landing,
        tmp_path / "dataset",
        tmp_path / "quarantine",
        params.cell,
        ingest_params or params.ingest,
        run_id,
        **kwargs,
    )


def truth_rows(shift) -> list[dict]:
    path = Path(shift[1]["ground_truth"])
    return [json.loads(line) for line in path.read_text().splitlines()]


def good_logs(landing: Path) -> list[Path]:
    return sorted(landing.glob("*.mcap"))


# --- breaking logs ---------------------------------------------------------------------------


def rewrite(
    source: Path,
    dest: Path,
    *,
    drop_topic=None,
    metadata=True,
    events=None,
    keep=None,
    message=None,
):
    """Copy an MCAP log message by message (decoded, re-encoded), breaking what a test needs.

    `events(event, log_time)` returns (event, log_time) to write, or None to drop it;
    `keep(topic, log_time)` says whether to keep any other message;
    `message(topic, ros, log_time)` returns (ros, log_time) for any message, events included.
    """
    with source.open("rb") as stream:
        reader = make_reader(stream, decoder_factories=[DecoderFactory()])
        meta = {m.name: dict(m.metadata) for m in reader.iter_metadata()}
        messages = list(reader.iter_decoded_messages(log_time_order=False))
    with dest.open("wb") as out:
        writer = Writer(out)
        schemas = {}
        if metadata:
            for name, values in meta.items():
                writer.add_metadata(name, values)
        for schema_, channel, msg, ros in messages:
            body, t = ros, msg.log_time
            if channel.topic == drop_topic:
                continue
            if channel.topic == schema.TOPIC_EVENTS and events:
                changed = events(json.loads(ros.data), t)
                if changed is None:
                    continue
                body, t = {"data": json.dumps(changed[0])}, changed[1]
            elif keep and not keep(channel.topic, t):
                continue
            if message:
                body, t = message(channel.topic, body, t)
            if schema_.name not in schemas:
                schemas[schema_.name] = writer.register_msgdef(schema_.name, schema_.data.decode())
            writer.write_message(channel.topic, schemas[schema_.name], body, t)
        writer.finish()
    return dest


def raw_copy(
    source: Path, dest: Path, *, channel=None, extra_topic=None, cell_metadata=None
) -> Path:
    """Copy an MCAP log record for record, without decoding.

    `channel(topic, message_encoding, schema_name)` returns (message_encoding, schema_name)
    to write for that topic's channel; `extra_topic` = (topic, copied from, message encoding)
    adds a topic carrying the same payloads as another; `cell_metadata` is merged into the
    `realloop.cell` metadata record."""
    with source.open("rb") as stream:
        reader = make_reader(stream)
        summary = reader.get_summary()
        meta = {m.name: dict(m.metadata) for m in reader.iter_metadata()}
        messages = list(reader.iter_messages(log_time_order=False))
    if cell_metadata:
        meta[schema.METADATA_NAME] = meta[schema.METADATA_NAME] | cell_metadata
    with dest.open("wb") as out:
        writer = McapWriter(out)
        writer.start(profile="ros2", library="realloop-tests")
        schema_ids, channel_ids = {}, {}
        for name, values in meta.items():
            writer.add_metadata(name, values)

        def channel_for(topic, encoding, schema_):
            key = (topic, encoding, schema_.name)
            if key not in channel_ids:
                name = schema_.name
                if channel and topic != (extra_topic or ("",))[0]:
                    encoding, name = channel(topic, encoding, name)
                if name not in schema_ids:
                    schema_ids[name] = writer.register_schema(name, schema_.encoding, schema_.data)
                channel_ids[key] = writer.register_channel(topic, encoding, schema_ids[name])
            return channel_ids[key]

        for schema_, chan, msg in messages:
            cid = channel_for(chan.topic, chan.message_encoding, schema_)
            writer.add_message(cid, msg.log_time, msg.data, msg.publish_time, msg.sequence)
            if extra_topic and chan.topic == extra_topic[1]:
                eid = channel_for(extra_topic[0], extra_topic[2], schema_)
                writer.add_message(eid, msg.log_time, msg.data, msg.publish_time, msg.sequence)
        writer.finish()
    assert summary is not None
    return dest


def short_episode(source: Path, dest: Path, steps: int, dt_ns: int) -> Path:
    """Only the log's first episode, ended after `steps` control steps."""
    start = read_log(source).events[0][0]
    end_ns = start + steps * dt_ns
    ended = []

    def events(event, t):
        if event["event"] == "end" and not ended:
            ended.append(t)
            return {**event, "steps": steps}, end_ns
        return (event, t) if t < end_ns else None

    return rewrite(source, dest, events=events, keep=lambda topic, t: t < end_ns)


def step_times(path: Path) -> np.ndarray:
    """Log times of a log's control steps, in order."""
    return read_log(path).joint_time


def chunk_offsets(path: Path) -> list[tuple[int, int]]:
    """(byte offset, length) of each chunk record."""
    with path.open("rb") as stream:
        summary = make_reader(stream).get_summary()
    return sorted((c.chunk_start_offset, c.chunk_length) for c in summary.chunk_indexes)


def summary_start(path: Path) -> int:
    data = path.read_bytes()
    return int.from_bytes(data[-8 - 29 + 9 : -8 - 29 + 17], "little")


def flip_byte(path: Path, offset: int) -> Path:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    return path


def with_joint(ros, position=None, velocity=None):
    """A JointState body with its position/velocity replaced."""
    return {
        "header": ros.header,
        "name": list(ros.name),
        "position": list(position if position is not None else ros.position),
        "velocity": list(velocity if velocity is not None else ros.velocity),
        "effort": list(ros.effort),
    }


# --- exports ----------------------------------------------------------------------------------


def export_table(episodes: pa.Table, steps: pa.Table) -> pa.Table:
    """The export rows (EXPORT_SCHEMA) of ingested episodes and steps."""
    position = {e: i for i, e in enumerate(episodes.column("episode_id").to_pylist())}
    rows = episodes.take(pa.array([position[e] for e in steps.column("episode_id").to_pylist()]))
    columns = {n: rows.column(n) for n in EXPORT_EPISODE_COLUMNS}
    columns |= {n: steps.column(n) for n in EXPORT_STEP_COLUMNS}
    return pa.table(columns, schema=EXPORT_SCHEMA)


def write_parquet_export(table: pa.Table, path: Path) -> Path:
    """As a Parquet file; nullable vectors as variable lists (pyarrow cannot read back null
    fixed-size lists, apache/arrow#35692)."""
    fields = [
        pa.field(f.name, pa.list_(pa.float32()), f.nullable)
        if f.nullable and pa.types.is_fixed_size_list(f.type)
        else f
        for f in table.schema
    ]
    pq.write_table(table.cast(pa.schema(fields)), path, compression="zstd")
    return path


def write_jsonl_export(table: pa.Table, path: Path) -> Path:
    """One JSON object per step row; start_time as integer nanoseconds."""
    index = table.schema.get_field_index("start_time")
    table = table.set_column(index, "start_time", table.column("start_time").cast(pa.int64()))
    with path.open("w") as out:
        for row in table.to_pylist():
            out.write(json.dumps(row, allow_nan=True) + "\n")
    return path


def is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


# --- ingest in a child process ----------------------------------------------------------------

CHILD = r"""
import json, os, signal, sys, time
from datetime import datetime
from pathlib import Path

from pydantic import TypeAdapter

from pipelines.ingest import landing, store as ingest
from pipelines.contract.params import CellParams, IngestParams

args = json.loads(sys.argv[1])
cell = TypeAdapter(CellParams).validate_python(args["cell"])
ingest_params = TypeAdapter(IngestParams).validate_python(args["ingest"])
kill_at = args.get("kill_at")
calls = [0]


def deadly(function):
    def wrapper(*a, **k):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return function(*a, **k)

    return wrapper


if kill_at:
    os.replace, os.rename = deadly(os.replace), deadly(os.rename)
    ingest._append_line = deadly(ingest._append_line)
print("ready", flush=True)
go = args.get("go")
while go and not Path(go).exists():
    time.sleep(0.001)
report = landing.ingest_landing(
    Path(args["landing"]),
    Path(args["dataset"]),
    Path(args["quarantine"]),
    cell,
    ingest_params,
    args["run_id"],
    ingested_at=datetime.fromisoformat(args["ingested_at"]) if args.get("ingested_at") else None,
)
print(json.dumps(report.as_dict()), flush=True)
"""


def start_child(work: Path, landing: Path, params, run_id: str, **extra) -> subprocess.Popen:
    """An ingest run of `landing` into `work`/dataset in another process; it prints "ready"
    once imported, then waits for the file `go` if one is given."""
    args = {
        "cell": dataclasses.asdict(params.cell),
        "ingest": dataclasses.asdict(params.ingest),
        "landing": str(landing),
        "dataset": str(work / "dataset"),
        "quarantine": str(work / "quarantine"),
        "run_id": run_id,
        **extra,
    }
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, json.dumps(args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready", child.stderr.read()
    return child
