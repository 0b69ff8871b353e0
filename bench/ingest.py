"""Decode throughput of a JointState-heavy ROS 2 MCAP log, three ways, through to Parquet.

    .venv/bin/python -m bench.ingest [--messages 1000000] [--baseline-messages 200000]
                                     [--repeat 1] [--parquet-compression snappy] [--json]
    .venv/bin/python -m bench.ingest --memory [--bytes 2000000000] [--json]

The log: `--messages` sensor_msgs/msg/JointState messages at 1 kHz on /joint_states, 7 joints
(smooth trajectories plus sensor noise), written with the official mcap-ros2-support writer
(zstd chunks of 1 MiB, message indexes and summary, as rosbag2 writes). Each way runs in its
own subprocess, pinned to one thread, from opening the file to a closed Parquet file of
(log_time, position[7], velocity[7], effort[7]) written with the same pyarrow settings:
(a) the official mcap reader with the mcap-ros2-support decoder, message by message;
(b) the rosbags library (AnyReader on the .mcap file, deserialize per message);
(c) realloop's pipelines.ingest.mcap.decode (iter_batches: one batch of column arrays per chunk).
(a) and (b) read the first `--baseline-messages` messages (a prefix: they are slow) and report
messages/s; (c) reads the whole file. The floor is reading and decompressing every chunk,
nothing else. (c)'s output is checked equal to (a)'s and (b)'s on their prefix. With
--repeat N each way runs N times and the fastest run counts (a shared machine is noisy).
Targets: (c) at least 1,000,000 messages/s on one core, at least 20x (a), ahead of (b).

--memory writes a log of about `--bytes` (2 GB by default; same messages, written with the
official low-level mcap writer from one encoded template, since the ROS 2 writer would take
minutes) and reports the peak RSS of (c) on it (target: under 1 GB). It checks free disk first.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# numpy and pyarrow are imported after this: the figures are per core.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "ARROW_NUM_THREADS"):
    os.environ[_var] = "1"

TOPIC = "/joint_states"
DATATYPE = "sensor_msgs/msg/JointState"
JOINTS = tuple(f"joint_{i}" for i in range(1, 8))
FRAME_ID = "base_link"
RATE_HZ = 1000
START_NS = 1_767_250_800_000_000_000  # 2026-01-01T07:00:00Z
TARGET_MESSAGES_PER_S = 1_000_000
TARGET_RATIO_OFFICIAL = 20.0
TARGET_RSS_BYTES = 1_000_000_000
ROW_GROUP_ROWS = 1 << 17
WAYS = ("official", "rosbags", "realloop")
VECTORS = ("position", "velocity", "effort")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.ingest", description=__doc__)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument(
        "--baseline-messages",
        type=int,
        default=200_000,
        help="prefix that (a) and (b) read (0: the whole file)",
    )
    parser.add_argument("--parquet-compression", default="snappy")
    parser.add_argument(
        "--repeat", type=int, default=1, help="runs per way; the fastest is reported"
    )
    parser.add_argument("--memory", action="store_true", help="peak RSS of (c) on a big log")
    parser.add_argument("--bytes", type=float, default=2e9, help="size of the --memory log")
    parser.add_argument("--dir", type=Path, default=None, help="folder for temporary files")
    parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    parser.add_argument("--worker", choices=(*WAYS, "floor"), help=argparse.SUPPRESS)
    parser.add_argument("--file", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0
    try:
        if args.memory:
            report = run_memory(int(args.bytes), args.parquet_compression, args.dir)
        else:
            report = run(
                args.messages,
                args.baseline_messages,
                args.parquet_compression,
                args.dir,
                args.repeat,
            )
    except (FileNotFoundError, ValueError, RuntimeError, OSError) as exc:
        print(f"bench.ingest: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.memory:
        print_memory_report(report)
    else:
        print_report(report)
    return 0


# --- the runs ----------------------------------------------------------------------------


def run(
    messages: int, baseline: int, compression: str, folder: Path | None, repeat: int = 1
) -> dict:
    if messages < 1:
        raise ValueError("--messages must be positive")
    with tempfile.TemporaryDirectory(prefix="bench-ingest-", dir=folder) as tmp:
        log = Path(tmp) / "joint_states.mcap"
        started = time.perf_counter()
        write_log(log, messages)
        write_s = time.perf_counter() - started
        prefix = min(baseline or messages, messages)
        floor = _best(repeat, "floor", log, Path(tmp) / "none", 0, compression)
        floor = {
            "chunks": floor["messages"],
            "seconds": floor["seconds"],
            "cpu_seconds": floor["cpu_seconds"],
            "messages_per_s": round(messages / floor["seconds"]),
            "runs_seconds": floor["runs_seconds"],
        }
        results = {}
        for way in WAYS:
            limit = 0 if way == "realloop" else prefix
            out = Path(tmp) / f"{way}.parquet"
            results[way] = _best(repeat, way, log, out, limit, compression)
        checked = _check_equal(Path(tmp), prefix)
        size = log.stat().st_size
    a, b, c = (results[w]["messages_per_s"] for w in WAYS)
    return {
        "log": {
            "messages": messages,
            "joints": len(JOINTS),
            "rate_hz": RATE_HZ,
            "bytes": size,
            "compression": "zstd",
            "write_s": round(write_s, 1),
        },
        "parquet_compression": compression,
        "baseline_prefix": prefix,
        "repeat": repeat,
        "floor": floor,
        **results,
        "ratio_realloop_official": round(c / a, 1),
        "ratio_realloop_rosbags": round(c / b, 1),
        "outputs_equal": checked,
        "targets": {
            "messages_per_s": TARGET_MESSAGES_PER_S,
            "ratio_official": TARGET_RATIO_OFFICIAL,
            "met_messages_per_s": c >= TARGET_MESSAGES_PER_S,
            "met_ratio_official": c / a >= TARGET_RATIO_OFFICIAL,
            "met_ahead_of_rosbags": c > b,
        },
    }


def run_memory(size: int, compression: str, folder: Path | None) -> dict:
    base = folder or Path(tempfile.gettempdir())
    free = shutil.disk_usage(base).free
    need = int(size * 2.5)  # the log, the Parquet output (about as big), and headroom
    if free < need:
        raise RuntimeError(f"{base}: {free / 1e9:.1f} GB free, --memory needs {need / 1e9:.1f}")
    with tempfile.TemporaryDirectory(prefix="bench-ingest-mem-", dir=folder) as tmp:
        log = Path(tmp) / "joint_states_big.mcap"
        started = time.perf_counter()
        messages = write_big_log(log, size)
        write_s = time.perf_counter() - started
        result = _subprocess("realloop", log, Path(tmp) / "out.parquet", 0, compression)
        log_bytes = log.stat().st_size
    return {
        "log": {"messages": messages, "bytes": log_bytes, "write_s": round(write_s, 1)},
        "parquet_compression": compression,
        "realloop": result,
        "target_rss_bytes": TARGET_RSS_BYTES,
        "met_rss": result["max_rss_bytes"] < TARGET_RSS_BYTES,
    }


def _best(repeat: int, way: str, *args) -> dict:
    """The fastest of `repeat` runs (the machine is shared), with every run's seconds."""
    runs = [_subprocess(way, *args) for _ in range(max(repeat, 1))]
    best = min(runs, key=lambda r: r["seconds"])
    return {**best, "runs_seconds": [r["seconds"] for r in runs]}


def _subprocess(way: str, log: Path, out: Path, limit: int, compression: str) -> dict:
    command = [
        sys.executable, "-m", "bench.ingest", "--worker", way, "--file", str(log),
        "--out", str(out), "--limit", str(limit), "--parquet-compression", compression,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        detail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{way} run failed: {detail}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _check_equal(folder: Path, prefix: int) -> bool:
    import numpy as np
    import pyarrow.parquet as pq

    ours = pq.read_table(folder / "realloop.parquet").slice(0, prefix)
    for way in ("official", "rosbags"):
        theirs = pq.read_table(folder / f"{way}.parquet")
        for name in ours.column_names:
            a = ours.column(name).combine_chunks()
            b = theirs.column(name).combine_chunks()
            if name != "log_time":
                a, b = a.flatten(), b.flatten()
            if not np.array_equal(a.to_numpy(), b.to_numpy()):
                return False
    return True


# --- the log -----------------------------------------------------------------------------


def _trajectories(first: int, count: int):
    """Smooth joint motion at 1 kHz plus sensor noise: (position, velocity, effort)."""
    import numpy as np

    rng = np.random.default_rng(first)
    t = (first + np.arange(count))[:, None] / RATE_HZ
    joint = np.arange(len(JOINTS))[None, :]
    omega = 2 * np.pi * (0.1 + 0.05 * joint)
    position = 0.8 * np.sin(omega * t + joint) + rng.normal(0, 1e-4, (count, len(JOINTS)))
    velocity = 0.8 * omega * np.cos(omega * t + joint) + rng.normal(0, 1e-3, (count, len(JOINTS)))
    effort = 5.0 * position + 0.3 * velocity + rng.normal(0, 0.02, (count, len(JOINTS)))
    return position, velocity, effort


def write_log(path: Path, messages: int) -> None:
    """The benchmark log, written message by message with mcap_ros2.writer.Writer."""
    from mcap_ros2.writer import Writer

    from refcell.rosmsgs import message_definition

    with path.open("wb") as stream:
        writer = Writer(stream)  # zstd chunks of 1 MiB, indexes and summary
        schema = writer.register_msgdef(DATATYPE, message_definition(DATATYPE))
        names = list(JOINTS)
        for first in range(0, messages, 100_000):
            count = min(100_000, messages - first)
            position, velocity, effort = (a.tolist() for a in _trajectories(first, count))
            for i in range(count):
                t = START_NS + (first + i) * (1_000_000_000 // RATE_HZ)
                message = {
                    "header": {
                        "stamp": {"sec": t // 1_000_000_000, "nanosec": t % 1_000_000_000},
                        "frame_id": FRAME_ID,
                    },
                    "name": names,
                    "position": position[i],
                    "velocity": velocity[i],
                    "effort": effort[i],
                }
                writer.write_message(TOPIC, schema, message, log_time=t)
        writer.finish()


def write_big_log(path: Path, size: int) -> int:
    """About `size` bytes of the same messages, fast: one message encoded by mcap-ros2, its
    numbers replaced per message at the offsets pipelines.ingest.mcap.decode finds in it, written
    with the
    official low-level mcap writer. Returns the message count."""
    import numpy as np
    from mcap.writer import Writer
    from mcap_ros2._dynamic import serialize_dynamic

    from pipelines.ingest.mcap.cdr_walk import _walk
    from refcell.rosmsgs import message_definition

    definition = message_definition(DATATYPE)
    encode = serialize_dynamic(DATATYPE, definition)[DATATYPE]
    zeros = [0.0] * len(JOINTS)
    template = encode(
        {
            "header": {"stamp": {"sec": 0, "nanosec": 0}, "frame_id": FRAME_ID},
            "name": list(JOINTS),
            "position": zeros,
            "velocity": zeros,
            "effort": zeros,
        }
    )
    layout = {name: off for name, _, off, _ in _walk(template, _PROGRAM)[1].numbers}
    block, written = 50_000, 0
    with path.open("wb") as stream:
        writer = Writer(stream)
        writer.start(profile="ros2", library="bench.ingest")
        schema = writer.register_schema(DATATYPE, "ros2msg", definition.encode())
        channel = writer.register_channel(TOPIC, "cdr", schema)
        while stream.tell() < size:
            rows = np.tile(np.frombuffer(template, np.uint8), (block, 1))
            t = START_NS + (written + np.arange(block)) * (1_000_000_000 // RATE_HZ)
            stamp = rows[:, layout["stamp"] : layout["stamp"] + 8].view("<u4")
            stamp[:, 0], stamp[:, 1] = t // 1_000_000_000, t % 1_000_000_000
            for name, values in zip(
                ("position", "velocity", "effort"), _trajectories(written, block), strict=True
            ):
                rows[:, layout[name] : layout[name] + 8 * len(JOINTS)].view("<f8")[:] = values
            for i, payload in enumerate(rows):
                writer.add_message(channel, int(t[i]), payload.tobytes(), int(t[i]))
            written += block
        writer.finish()
    return written


_PROGRAM = (
    ("time", "stamp"),
    ("string", "frame_id"),
    ("string[]", "name"),
    ("f8[]", "position"),
    ("f8[]", "velocity"),
    ("f8[]", "effort"),
)


# --- the workers (one per subprocess) ------------------------------------------------------


def _worker(args) -> dict:
    import pyarrow as pa

    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    run_way = {
        "official": _official,
        "rosbags": _rosbags,
        "realloop": _realloop,
        "floor": _floor,
    }[args.worker]
    _warm_imports(args.worker)
    wall, cpu = time.perf_counter(), time.process_time()
    messages, parquet_s = run_way(args.file, args.out, args.limit or None, args.parquet_compression)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {
        "messages": messages,
        "seconds": round(wall, 3),
        "cpu_seconds": round(cpu, 3),
        "messages_per_s": round(messages / wall),
        "messages_per_cpu_s": round(messages / cpu),
        "parquet_seconds": round(parquet_s, 3),  # of `seconds`: Arrow conversion and writing
        "decode_messages_per_s": round(messages / max(wall - parquet_s, 1e-9)),
        "max_rss_bytes": rss,
    }


def _warm_imports(way: str) -> None:
    """Import what a way uses before the clock starts."""
    import io

    import numpy as np
    import zstandard  # noqa: F401

    sink = _ParquetSink(io.BytesIO(), "snappy")  # pyarrow imports pandas on a first write
    sink.add(np.zeros(1, np.int64), *(np.zeros((1, len(JOINTS))) for _ in range(3)))
    sink.close()
    if way == "official":
        import mcap.reader  # noqa: F401
        import mcap_ros2.decoder  # noqa: F401
    elif way == "rosbags":
        import rosbags.highlevel  # noqa: F401
    elif way == "realloop":
        import pipelines.ingest.mcap.decode  # noqa: F401


class _ParquetSink:
    """Rows of (log_time, position, velocity, effort) to one Parquet file, in row groups."""

    def __init__(self, path: Path, compression: str):
        import pyarrow as pa
        import pyarrow.parquet as pq

        # Never null: declared so, which spares Parquet the definition levels of nulls.
        self.vector = pa.list_(pa.field("item", pa.float64(), nullable=False), len(JOINTS))
        self.schema = pa.schema(
            [pa.field("log_time", pa.int64(), nullable=False)]
            + [pa.field(name, self.vector, nullable=False) for name in VECTORS]
        )
        self.writer = pq.ParquetWriter(
            path, self.schema, compression=compression, use_dictionary=False
        )
        self.pending, self.rows = [], 0
        self.seconds = 0.0  # spent here, converting and writing

    def add(self, log_time, position, velocity, effort) -> None:
        import pyarrow as pa

        started = time.perf_counter()
        columns = [pa.array(log_time)] + [
            pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), type=self.vector)
            for a in (position, velocity, effort)
        ]
        self.pending.append(pa.RecordBatch.from_arrays(columns, schema=self.schema))
        self.rows += len(log_time)
        if self.rows >= ROW_GROUP_ROWS:
            self.flush()
        self.seconds += time.perf_counter() - started

    def flush(self) -> None:
        import pyarrow as pa

        if self.pending:
            self.writer.write_table(pa.Table.from_batches(self.pending), ROW_GROUP_ROWS)
        self.pending, self.rows = [], 0

    def close(self) -> None:
        started = time.perf_counter()
        self.flush()
        self.writer.close()
        self.seconds += time.perf_counter() - started


def _realloop(log: Path, out: Path, limit: int | None, compression: str) -> tuple[int, float]:
    from pipelines.ingest.mcap.decode import iter_batches

    sink, count = _ParquetSink(out, compression), 0
    for batch in iter_batches(log, topics={TOPIC}):
        joints = batch.get(TOPIC)
        if joints is None:
            continue
        names = joints.labels["name"]
        if names.values != [JOINTS] and any(names.values[c] != JOINTS for c in set(names.codes)):
            raise RuntimeError("unexpected joint names")
        f = joints.fields
        sink.add(joints.log_time, f["position"], f["velocity"], f["effort"])
        count += len(joints)
    sink.close()
    return count, sink.seconds


def _official(log: Path, out: Path, limit: int | None, compression: str) -> tuple[int, float]:
    import numpy as np
    from mcap.reader import make_reader
    from mcap_ros2.decoder import DecoderFactory

    times, position, velocity, effort = [], [], [], []
    with log.open("rb") as stream:
        reader = make_reader(stream, validate_crcs=True, decoder_factories=[DecoderFactory()])
        messages = reader.iter_decoded_messages(topics=[TOPIC], log_time_order=False)
        for _, _, message, ros in messages:
            if tuple(ros.name) != JOINTS:
                raise RuntimeError("unexpected joint names")
            times.append(message.log_time)
            position.append(ros.position)
            velocity.append(ros.velocity)
            effort.append(ros.effort)
            if limit and len(times) >= limit:
                break
    return _write_rows(out, compression, times, position, velocity, effort, np)


def _rosbags(log: Path, out: Path, limit: int | None, compression: str) -> tuple[int, float]:
    import numpy as np
    from rosbags.highlevel import AnyReader

    times, position, velocity, effort = [], [], [], []
    with AnyReader([log]) as reader:
        connections = [c for c in reader.connections if c.topic == TOPIC]
        for connection, t, raw in reader.messages(connections=connections):
            msg = reader.deserialize(raw, connection.msgtype)
            if tuple(msg.name) != JOINTS:
                raise RuntimeError("unexpected joint names")
            times.append(t)
            position.append(msg.position)
            velocity.append(msg.velocity)
            effort.append(msg.effort)
            if limit and len(times) >= limit:
                break
    return _write_rows(out, compression, times, position, velocity, effort, np)


def _write_rows(out, compression, times, position, velocity, effort, np) -> tuple[int, float]:
    sink = _ParquetSink(out, compression)
    for first in range(0, len(times), ROW_GROUP_ROWS):
        rows = slice(first, first + ROW_GROUP_ROWS)
        sink.add(
            np.asarray(times[rows], np.int64),
            *(np.asarray(a[rows], np.float64) for a in (position, velocity, effort)),
        )
    sink.close()
    return len(times), sink.seconds


def _floor(log: Path, out: Path, limit: int | None, compression: str) -> tuple[int, float]:
    """Read every Chunk record and decompress its records; nothing else."""
    import struct

    import zstandard

    decompressor, chunks = zstandard.ZstdDecompressor(), 0
    with log.open("rb", buffering=0) as stream:
        stream.seek(8)
        while True:
            head = stream.read(9)
            if len(head) < 9:
                break
            op, length = struct.unpack("<BQ", head)
            if op != 0x06:  # not a chunk
                if op == 0x0F:  # DataEnd
                    break
                stream.seek(length, 1)
                continue
            body = stream.read(length)
            size = struct.unpack_from("<Q", body, 16)[0]
            (n,) = struct.unpack_from("<I", body, 28)
            data = memoryview(body)[40 + n :]
            decompressor.decompress(data, max_output_size=size)
            chunks += 1
    return chunks, 0.0


# --- the report ----------------------------------------------------------------------------


def print_report(r: dict) -> None:
    log = r["log"]
    print(
        f"log: {log['messages']:,} JointState messages ({log['joints']} joints, {log['rate_hz']} "
        f"Hz), {log['bytes'] / 1e6:.1f} MB, zstd chunks; written in {log['write_s']} s"
    )
    print(
        f"Parquet: {r['parquet_compression']}; (a), (b) read the first "
        f"{r['baseline_prefix']:,}; fastest of {r['repeat']} run(s) per way"
    )
    floor = r["floor"]
    print(
        f"  floor: read + decompress {floor['chunks']} chunks {floor['seconds']:8.3f} s "
        f"{floor['messages_per_s']:>12,} msg/s"
    )
    labels = {
        "official": "(a) mcap + mcap-ros2",
        "rosbags": "(b) rosbags AnyReader",
        "realloop": "(c) realloop decode",
    }
    for way, label in labels.items():
        x = r[way]
        print(
            f"  {label:22s} {x['messages']:>9,} msgs {x['seconds']:8.3f} s "
            f"{x['messages_per_s']:>12,} msg/s  ({x['messages_per_cpu_s']:,}/cpu-s; "
            f"without Parquet {x['decode_messages_per_s']:,}/s; "
            f"peak RSS {x['max_rss_bytes'] / 1e6:.0f} MB)"
        )
    print(
        f"  ratios: c/a {r['ratio_realloop_official']}x, c/b {r['ratio_realloop_rosbags']}x; "
        f"outputs equal on the prefix: {r['outputs_equal']}"
    )
    t = r["targets"]
    for key, text in (
        ("met_messages_per_s", f">= {t['messages_per_s']:,} msg/s"),
        ("met_ratio_official", f">= {t['ratio_official']:.0f}x (a)"),
        ("met_ahead_of_rosbags", "ahead of (b)"),
    ):
        print(f"  target {text}: {'met' if t[key] else 'NOT met'}")


def print_memory_report(r: dict) -> None:
    log, x = r["log"], r["realloop"]
    print(f"log: {log['messages']:,} messages, {log['bytes'] / 1e9:.2f} GB (written in "
          f"{log['write_s']} s)")  # fmt: skip
    print(
        f"  (c) realloop decode -> Parquet: {x['seconds']:.1f} s, {x['messages_per_s']:,} msg/s, "
        f"peak RSS {x['max_rss_bytes'] / 1e6:.0f} MB"
    )
    verdict = "met" if r["met_rss"] else "NOT met"
    print(f"  target peak RSS < {r['target_rss_bytes'] / 1e9:.0f} GB: {verdict}")


if __name__ == "__main__":
    sys.exit(main())
