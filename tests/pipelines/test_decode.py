"""pipelines.ingest.mcap: fast MCAP/CDR decoding equals the official reader, fails precisely."""

from __future__ import annotations

import dataclasses
import json
import struct
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
from mcap.reader import make_reader
from mcap.writer import CompressionType, IndexType
from mcap.writer import Writer as McapWriter
from mcap_ros2._dynamic import serialize_dynamic
from mcap_ros2.decoder import DecoderFactory
from mcap_ros2.writer import Writer as Ros2Writer

from pipelines.ingest.decoded import ContractViolation, DecodedLog, decode_log
from pipelines.ingest.mcap import byte_rows, cdr_walk, decode, ros2_types
from pipelines.ingest.mcap.decode import McapDecodeError, iter_batches, scan_records
from pipelines.ingest.shift_log import read_log
from refcell.cell import Cell, TrueState
from refcell.expert import Expert
from refcell.recorder import CellIdentity, ShiftRecorder
from refcell.rosmsgs import DATATYPES, message_definition, stamp
from refcell.runner import Operator, run_episode
from refcell.world import load_world

START = datetime(2026, 12, 1, 6, 0, tzinfo=UTC)
T0 = 1_780_000_000_000_000_000
JOINT_STATE = "sensor_msgs/msg/JointState"
SEVEN = [f"joint_{i}" for i in range(1, 8)]


# --- helpers -----------------------------------------------------------------------------


class Wobbly:
    """Acts on what the cell perceives and drifts off now and then: the operator takes over,
    so the logs carry intervention events (strings of varying length) too."""

    name = "wobbly-0"

    def __init__(self):
        self.expert, self.calls = Expert(), 0

    def act(self, obs: np.ndarray) -> np.ndarray:
        self.calls += 1
        if self.calls % 30 < 8:
            return np.array([-1.0, 1.0])
        state = TrueState(obs[0:2], obs[2:4], obs[4:6], float(obs[6]), np.zeros(2), obs[8:10], 0.03)
        return self.expert.act(state)


@pytest.fixture(scope="module")
def refcell_logs(params, tmp_path_factory) -> list[Path]:
    """Three short episodes recorded by refcell's recorder, two per file: two logs."""
    out = tmp_path_factory.mktemp("refcell-logs")
    record = dataclasses.replace(params.record, episodes_per_file=2)
    identity = CellIdentity.from_params(params.cell, Wobbly.name)
    recorder = ShiftRecorder(out, params.cell, record, identity, START)
    cell, controller = Cell(load_world("line"), params.cell), Wobbly()
    operator = Operator(params.record.operator)
    for index in range(3):
        run_episode(cell, controller, 11, index, 3, operator, observers=(recorder,))
    return recorder.close()


def official(path: Path) -> dict[str, list]:
    """Every message through the official reader and decoder: topic -> [(log_time, msg)]."""
    out: dict[str, list] = {}
    with path.open("rb") as stream:
        reader = make_reader(stream, decoder_factories=[DecoderFactory()])
        for _, channel, message, ros in reader.iter_decoded_messages(log_time_order=False):
            out.setdefault(channel.topic, []).append((message.log_time, ros))
    for messages in out.values():
        messages.sort(key=lambda m: m[0])
    return out


def joint_state(t: int, names, position, velocity, effort, frame="base_link") -> dict:
    return {
        "header": {"stamp": stamp(t), "frame_id": frame},
        "name": list(names),
        "position": list(position),
        "velocity": list(velocity),
        "effort": list(effort),
    }


def mixed_messages(n: int):
    """Several topics; a few odd layouts (another frame, other names, a longer array)."""
    rng = np.random.default_rng(3)
    for i in range(n):
        t = T0 + i * 1_000_000
        names = SEVEN if i % 97 else [*SEVEN[:6], "joint_X"]
        velocity = rng.normal(size=7 if i % 41 else 8)
        frame = "base_link" if i % 53 else "base"
        message = joint_state(t, names, rng.normal(size=7), velocity, rng.normal(size=7), frame)
        yield "/joint_states", JOINT_STATE, message, t
        yield "/confidence", "std_msgs/msg/Float32", {"data": float(rng.random())}, t
        if i % 5 == 0:
            pose = {
                "header": {"stamp": stamp(t), "frame_id": "table"},
                "pose": {
                    "position": {"x": float(i), "y": 1.5, "z": -2.0},
                    "orientation": {"x": 0.0, "y": 0.1, "z": 0.2, "w": 0.9},
                },
            }
            yield "/pose", "geometry_msgs/msg/PoseStamped", pose, t
            twist = {
                "header": {"stamp": stamp(t), "frame_id": ""},
                "twist": {
                    "linear": {"x": 0.5, "y": float(-i), "z": 0.0},
                    "angular": {"x": 0.0, "y": 0.0, "z": 3.0},
                },
            }
            yield "/cmd", "geometry_msgs/msg/TwistStamped", twist, t
        if i % 13 == 0:
            text = json.dumps({"event": "x", "i": i, "note": "é" * (i % 7)})
            yield "/events", "std_msgs/msg/String", {"data": text}, t


def write_mcap(path: Path, messages, **options) -> Path:
    """Write with mcap's low-level Writer (all its options) and mcap-ros2's CDR encoder."""
    encoders = {t: serialize_dynamic(t, message_definition(t))[t] for t in DATATYPES}
    with path.open("wb") as stream:
        writer = McapWriter(stream, **options)
        writer.start("ros2", "test")
        schemas = {
            t: writer.register_schema(t, "ros2msg", message_definition(t).encode())
            for t in DATATYPES
        }
        channels: dict[str, int] = {}
        writer.add_metadata("realloop.cell", {"cell_id": "cell-01"})
        for topic, datatype, body, t in messages:
            if topic not in channels:
                channels[topic] = writer.register_channel(topic, "cdr", schemas[datatype])
            writer.add_message(channels[topic], t, encoders[datatype](body), t)
        writer.finish()
    return path


def assert_equal_to_official(path: Path) -> decode.DecodedMcap:
    ours, theirs = decode.decode(path), official(path)
    assert ours.topic_counts == {topic: len(m) for topic, m in theirs.items()}
    for topic, messages in theirs.items():
        arrays = ours.topics[topic]
        assert arrays.log_time.tolist() == [t for t, _ in messages]
        for i, (_, msg) in enumerate(messages):
            assert_message(arrays, i, msg)
    return ours


def assert_message(arrays: decode.TopicArrays, i: int, msg) -> None:
    f, labels = arrays.fields, arrays.labels
    if arrays.datatype == "std_msgs/msg/String":
        assert f["data"][i] == msg.data
        return
    if arrays.datatype == "std_msgs/msg/Float32":
        assert f["data"][i] == np.float32(msg.data)
        return
    header = msg.header
    assert f["stamp"][i] == header.stamp.sec * 1_000_000_000 + header.stamp.nanosec
    assert labels["frame_id"][i] == header.frame_id
    if arrays.datatype == JOINT_STATE:
        assert labels["name"][i] == tuple(msg.name)
        for name in ("position", "velocity", "effort"):
            row, values = f[name][i], list(getattr(msg, name))
            assert row[: len(values)].tolist() == values
            assert np.isnan(row[len(values) :]).all()
    elif arrays.datatype == "geometry_msgs/msg/PoseStamped":
        p, o = msg.pose.position, msg.pose.orientation
        assert f["position"][i].tolist() == [p.x, p.y, p.z]
        assert f["orientation"][i].tolist() == [o.x, o.y, o.z, o.w]
    else:
        lin, ang = msg.twist.linear, msg.twist.angular
        assert f["linear"][i].tolist() == [lin.x, lin.y, lin.z]
        assert f["angular"][i].tolist() == [ang.x, ang.y, ang.z]


# --- refcell logs: decode_log is read_log ---------------------------------------------------


def assert_same_log(ours: DecodedLog, theirs: DecodedLog) -> None:
    for f in dataclasses.fields(DecodedLog):
        a, b = getattr(ours, f.name), getattr(theirs, f.name)
        if isinstance(b, np.ndarray):
            assert isinstance(a, np.ndarray), f.name
            assert (a.dtype, a.shape) == (b.dtype, b.shape), f.name
            assert np.array_equal(a, b), f.name
        else:
            assert a == b, f.name


def test_decode_log_equals_read_log_on_refcell_logs(refcell_logs):
    assert len(refcell_logs) == 2
    events = []
    for path in refcell_logs:
        ours, theirs = decode_log(path), read_log(path)
        assert_same_log(ours, theirs)
        assert ours.joint_time.size > 50
        events += [json.loads(text)["event"] for _, text in ours.events]
    assert {"start", "end", "intervention"} <= set(events)
    captures = sorted((refcell_logs[0].parent / "captures").glob("*.mcap"))
    assert captures  # edge-case windows: the same topics plus an attachment
    for path in captures[:3]:
        assert_same_log(decode_log(path), read_log(path))
    (attachment,) = decode.decode(captures[0]).attachments
    assert attachment.media_type == "image/png" and attachment.data_size > 0


def test_refcell_logs_equal_the_official_decoder_message_by_message(refcell_logs):
    ours = assert_equal_to_official(refcell_logs[0])
    assert ours.profile == "ros2"
    assert ours.topics["/joint_states"].labels["name"].values == [("gantry_x", "gantry_y")]


def test_refcell_log_without_message_index_scans_the_chunks(refcell_logs, tmp_path):
    """Same log with the MessageIndex records removed (and no summary): the fallback scan."""
    source = refcell_logs[0]
    stripped = strip_records(source, tmp_path / "stripped.mcap", drop={0x07})
    ours, theirs = decode_log(stripped), decode_log(source)
    assert [c[:2] for c in ours.chunks] == [c[:2] for c in theirs.chunks]
    assert_same_log(dataclasses.replace(ours, chunks=theirs.chunks), theirs)
    # ingest reads such a file too: read_log decodes through decode_log
    assert_same_log(dataclasses.replace(read_log(stripped), chunks=theirs.chunks), theirs)


def test_an_index_that_leaves_a_message_out_is_not_trusted(tmp_path):
    """MessageIndex records are checked against the chunk: one entry short, the chunk is
    scanned instead, and no message is lost."""
    path = write_mcap(tmp_path / "log.mcap", mixed_messages(300), chunk_size=16384)
    expected = decode.decode(path)
    data, out = path.read_bytes(), bytearray(decode.MCAP_MAGIC)
    for pos, op, length in records(data):
        if op == 0x0F:
            out += struct.pack("<BQI", 0x0F, 4, 0)
            break
        if op == 0x07:  # channel id, entries: drop the last entry
            channel, size = struct.unpack_from("<HI", data, pos + 9)
            entries = data[pos + 15 : pos + 15 + size - 16]
            out += struct.pack("<BQHI", 0x07, 6 + len(entries), channel, len(entries)) + entries
        else:
            out += data[pos : pos + 9 + length]
    out += struct.pack("<BQQQI", 0x02, 20, 0, 0, 0) + decode.MCAP_MAGIC
    shortened = tmp_path / "short-index.mcap"
    shortened.write_bytes(bytes(out))
    ours = decode.decode(shortened)
    assert ours.topic_counts == expected.topic_counts
    for topic, arrays in expected.topics.items():
        assert np.array_equal(ours.topics[topic].log_time, arrays.log_time)


# --- every way MCAP allows ------------------------------------------------------------------

NO_SUMMARY = {
    "repeat_channels": False,
    "repeat_schemas": False,
    "use_statistics": False,
    "use_summary_offsets": False,
    "index_types": IndexType.NONE,
}


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"compression": CompressionType.ZSTD}, id="zstd"),
        pytest.param({"compression": CompressionType.LZ4}, id="lz4"),
        pytest.param({"compression": CompressionType.NONE}, id="none"),
        pytest.param({"index_types": IndexType.ALL & ~IndexType.MESSAGE}, id="no-message-index"),
        pytest.param(NO_SUMMARY, id="no-summary-no-index"),
        pytest.param({"compression": CompressionType.LZ4, **NO_SUMMARY}, id="lz4-no-summary"),
        pytest.param({"use_chunking": False}, id="unchunked"),
        pytest.param({"use_chunking": False, **NO_SUMMARY}, id="unchunked-no-summary"),
        pytest.param({"chunk_size": 4096, "enable_data_crcs": True}, id="small-chunks-data-crc"),
    ],
)
def test_every_layout_decodes_like_the_official_reader(tmp_path, options):
    path = write_mcap(tmp_path / "log.mcap", mixed_messages(600), **options)
    ours = assert_equal_to_official(path)
    joints = ours.topics["/joint_states"]
    assert joints.fields["position"].shape == (600, 7)
    assert joints.fields["velocity"].shape == (600, 8)  # padded with NaN where 7
    # label values in order of first appearance (message 0 has the odd names)
    assert joints.labels["name"].values == [(*SEVEN[:6], "joint_X"), tuple(SEVEN)]
    assert ours.metadata == {"realloop.cell": {"cell_id": "cell-01"}}


def test_joint_states_with_seven_joints_from_the_ros2_writer(tmp_path):
    path = tmp_path / "seven.mcap"
    rng = np.random.default_rng(0)
    expected = rng.normal(size=(3, 2500, 7))
    with path.open("wb") as stream:
        writer = Ros2Writer(stream, chunk_size=64 * 1024)
        schema = writer.register_msgdef(JOINT_STATE, message_definition(JOINT_STATE))
        for i in range(2500):
            t = T0 + i * 1_000_000
            body = joint_state(t, SEVEN, *(expected[k, i] for k in range(3)))
            writer.write_message("/joint_states", schema, body, log_time=t)
        writer.finish()
    ours = decode.decode(path)
    joints = ours.topics["/joint_states"]
    assert len(ours.chunks) > 10
    assert joints.log_time.dtype == np.int64
    assert np.array_equal(joints.log_time, T0 + np.arange(2500) * 1_000_000)
    assert np.array_equal(joints.fields["stamp"], joints.log_time)
    for k, name in enumerate(("position", "velocity", "effort")):
        assert joints.fields[name].dtype == np.float64
        assert np.array_equal(joints.fields[name], expected[k])
    assert joints.labels["name"].values == [tuple(SEVEN)]
    assert joints.labels["frame_id"].values == ["base_link"]
    batches = list(iter_batches(path))
    assert len(batches) == len(ours.chunks)
    assert sum(len(b["/joint_states"]) for b in batches) == 2500


def test_big_endian_cdr_and_empty_strings(tmp_path):
    """CDR_BE payloads and a zero-length string (some serializers) decode like CDR_LE."""
    little = serialize_dynamic(JOINT_STATE, message_definition(JOINT_STATE))[JOINT_STATE]
    body = joint_state(T0, ["a", "bb"], [1.5, -2.0], [0.25], [])
    payload = little(body)
    values, _ = cdr_walk._walk(payload, ros2_types._PROGRAMS[JOINT_STATE])
    big = big_endian_joint_state(T0, "", ["a", "bb"], [1.5, -2.0], [0.25], [])
    big_values, layout = cdr_walk._walk(big, ros2_types._PROGRAMS[JOINT_STATE])
    assert not layout.little_endian
    assert {**big_values, "frame_id": "base_link"} == values
    path = tmp_path / "be.mcap"
    write_raw_messages(path, JOINT_STATE, [big] * 20 + [payload] * 5)
    joints = decode.decode(path).topics["/t"]
    assert joints.fields["position"].tolist() == [[1.5, -2.0]] * 25
    assert joints.labels["frame_id"].values == ["", "base_link"]


def big_endian_joint_state(t, frame, names, position, velocity, effort) -> bytes:
    """CDR_BE by hand, with the empty frame_id written as length 0 (no terminator)."""
    out = bytearray(b"\x00\x00\x00\x00")
    out += struct.pack(">iI", t // 1_000_000_000, t % 1_000_000_000)

    def align(n):
        out.extend(b"\x00" * ((-(len(out) - 4)) % n))

    out += struct.pack(">I", len(frame.encode()) + 1 if frame else 0) + (
        frame.encode() + b"\x00" if frame else b""
    )
    align(4)
    out += struct.pack(">I", len(names))
    for name in names:
        align(4)
        out += struct.pack(">I", len(name) + 1) + name.encode() + b"\x00"
    for values in (position, velocity, effort):
        align(4)
        out += struct.pack(">I", len(values))
        if values:
            align(8)
            out += struct.pack(f">{len(values)}d", *values)
    return bytes(out)


def write_raw_messages(path: Path, datatype: str, payloads, topic="/t", encoding="cdr"):
    with path.open("wb") as stream:
        writer = McapWriter(stream)
        writer.start("ros2", "test")
        schema = writer.register_schema(datatype, "ros2msg", message_definition(datatype).encode())
        channel = writer.register_channel(topic, encoding, schema)
        for i, payload in enumerate(payloads):
            writer.add_message(channel, T0 + i, payload, T0 + i)
        writer.finish()
    return path


def test_scan_verifies_every_predicted_record():
    """The periodic scan accepts a predicted record only if its opcode and length match."""
    records = b"".join(
        struct.pack("<BQ", 5, n) + b"\x05" * n for n in [30] * 40 + [31] + [30] * 20 + [7, 9]
    )
    offs, ops, lens = scan_records(records, 0, len(records))
    walked, pos = [], 0
    while pos < len(records):
        walked.append(pos)
        pos += 9 + struct.unpack_from("<Q", records, pos + 1)[0]
    assert offs.tolist() == walked
    assert lens.tolist() == [30] * 40 + [31] + [30] * 20 + [7, 9]
    assert set(ops.tolist()) == {5}
    with pytest.raises(McapDecodeError, match="runs past the end"):
        scan_records(records[:-3], 0, len(records) - 3)


# --- errors ---------------------------------------------------------------------------------


@pytest.fixture
def good_log(tmp_path) -> Path:
    return write_mcap(tmp_path / "good.mcap", mixed_messages(300), chunk_size=8192)


def kind_of(path: Path) -> McapDecodeError:
    with pytest.raises(McapDecodeError) as caught:
        decode.decode(path)
    message = str(caught.value)
    assert "\n" not in message and message
    return caught.value


def test_empty_and_bad_magic(tmp_path):
    empty = tmp_path / "empty.mcap"
    empty.write_bytes(b"")
    assert kind_of(empty).kind == decode.EMPTY
    bad = tmp_path / "bad.mcap"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    error = kind_of(bad)
    assert error.kind == decode.BAD_MAGIC and "not an MCAP file" in str(error)


def test_cut_mid_chunk(good_log, tmp_path):
    data = good_log.read_bytes()
    chunk_at = find_chunk(data, compression=b"zstd")
    cut = tmp_path / "cut.mcap"
    cut.write_bytes(data[: chunk_at + 200])
    error = kind_of(cut)
    assert error.kind == decode.TRUNCATED
    assert "cut mid-chunk" in str(error)
    writer_died = tmp_path / "partial.mcap"  # everything up to a record boundary, no footer
    writer_died.write_bytes(data[:chunk_at])
    assert "did not finish" in str(kind_of(writer_died))


def test_chunk_crc_mismatch(good_log, tmp_path):
    data = bytearray(good_log.read_bytes())
    at = find_chunk(data, compression=b"zstd")
    crc_at = at + 9 + 24
    data[crc_at : crc_at + 4] = struct.pack("<I", struct.unpack_from("<I", data, crc_at)[0] ^ 1)
    bad = tmp_path / "crc.mcap"
    bad.write_bytes(bytes(data))
    error = kind_of(bad)
    assert error.kind == decode.CRC_MISMATCH and f"chunk at byte {at}" in str(error)
    decode.decode(bad, validate_crcs=False)  # the data itself is fine


def test_corrupt_chunk_data(good_log, tmp_path):
    data = bytearray(good_log.read_bytes())
    at = find_chunk(data, compression=b"zstd")
    data[at + 60 : at + 90] = b"\xff" * 30
    bad = tmp_path / "garbled.mcap"
    bad.write_bytes(bytes(data))
    assert kind_of(bad).kind in (decode.CORRUPT, decode.CRC_MISMATCH)


def test_unknown_compression(tmp_path):
    path = write_mcap(tmp_path / "log.mcap", mixed_messages(50), compression=CompressionType.LZ4)
    data = bytearray(path.read_bytes())
    at = find_chunk(data, compression=b"lz4")
    data[at + 9 + 32 : at + 9 + 35] = b"bz2"
    path.write_bytes(bytes(data))
    error = kind_of(path)
    assert error.kind == decode.UNKNOWN_COMPRESSION and "'bz2'" in str(error)


def test_unknown_message_encoding(tmp_path):
    path = write_raw_messages(
        tmp_path / "json.mcap", "std_msgs/msg/Float32", [b"{}"], encoding="json"
    )
    error = kind_of(path)
    assert error.kind == decode.UNKNOWN_ENCODING and "'json'" in str(error)


def test_unknown_cdr_variant(tmp_path):
    xcdr2 = b"\x00\x07\x00\x00" + struct.pack("<f", 1.0)
    error = kind_of(write_raw_messages(tmp_path / "x.mcap", "std_msgs/msg/Float32", [xcdr2]))
    assert error.kind == decode.UNKNOWN_ENCODING and "0x0007" in str(error)


def test_unknown_and_altered_schemas(tmp_path):
    path = tmp_path / "other.mcap"
    with path.open("wb") as stream:
        writer = McapWriter(stream)
        writer.start("ros2", "test")
        schema = writer.register_schema("tf2_msgs/msg/TFMessage", "ros2msg", b"int32 x\n")
        channel = writer.register_channel("/tf", "cdr", schema)
        writer.add_message(channel, T0, b"\x00\x01\x00\x00\x01\x00\x00\x00", T0)
        writer.finish()
    counted = decode.decode(path)  # an extra topic of another type: counted, not decoded
    assert counted.topic_counts == {"/tf": 1} and counted.topics == {}
    with pytest.raises(McapDecodeError) as caught:
        decode.decode(path, unknown_types="raise")
    assert caught.value.kind == decode.UNKNOWN_SCHEMA
    altered = message_definition("std_msgs/msg/Float32").replace("float32", "float64")
    assert "not the standard definition" in schema_error(altered)
    commented = "# a comment\nfloat32 data  # the value\nint8 CONSTANT=3\n"
    decode.check_schema("std_msgs/msg/Float32", "ros2msg", commented.encode())


def schema_error(definition: str) -> str:
    with pytest.raises(McapDecodeError) as caught:
        decode.check_schema("std_msgs/msg/Float32", "ros2msg", definition.encode())
    assert caught.value.kind == decode.UNKNOWN_SCHEMA
    return str(caught.value)


def test_decode_log_contract_errors(tmp_path):
    wrong_names = joint_state(T0, ["x", "y"], [0.0, 0.0], [0.0, 0.0], [], "gantry")
    payload = serialize_dynamic(JOINT_STATE, message_definition(JOINT_STATE))[JOINT_STATE]
    path = write_raw_messages(
        tmp_path / "names.mcap", JOINT_STATE, [payload(wrong_names)], topic="/joint_states"
    )
    with pytest.raises(ContractViolation, match=r"joint names \['x', 'y'\]"):
        decode_log(path)
    float32 = b"\x00\x01\x00\x00" + struct.pack("<f", 0.5)
    path = write_raw_messages(tmp_path / "t.mcap", "std_msgs/msg/Float32", [float32], "/cmd_vel")
    with pytest.raises(ContractViolation, match="unknown schema on topic /cmd_vel"):
        decode_log(path)


# --- byte surgery ---------------------------------------------------------------------------


def records(data: bytes, start: int = 8):
    pos = start
    while pos + 9 <= len(data) - 8:
        op, length = struct.unpack_from("<BQ", data, pos)
        yield pos, op, length
        pos += 9 + length


def find_chunk(data: bytes, compression: bytes) -> int:
    for pos, op, _ in records(bytes(data)):
        if op == 0x06 and data[pos + 9 + 32 : pos + 9 + 32 + len(compression)] == compression:
            return pos
    raise AssertionError("no chunk")


def strip_records(source: Path, dest: Path, drop: set[int]) -> Path:
    """Copy the data section without the `drop` opcodes; end with DataEnd and an empty
    summary (footer summary_start 0)."""
    data = source.read_bytes()
    out = bytearray(data[:8])
    for pos, op, length in records(data):
        if op == 0x0F:  # DataEnd: no data-section CRC any more
            out += struct.pack("<BQI", 0x0F, 4, 0)
            break
        if op not in drop:
            out += data[pos : pos + 9 + length]
    out += struct.pack("<BQQQI", 0x02, 20, 0, 0, 0) + decode.MCAP_MAGIC
    dest.write_bytes(bytes(out))
    return dest


def test_rows_views_or_gathers_the_same_bytes():
    data = bytes(range(256)) * 4
    raw = np.frombuffer(data, np.uint8)
    for starts in ([3, 40, 77, 114], [3, 40, 78], [1000, 1008, 1016]):  # spaced, not, past end
        rows = byte_rows._rows(raw, np.array(starts), 16)
        for row, start in zip(rows, starts, strict=True):
            expected = data[start : start + 16]
            assert row.tobytes() == expected + b"\x00" * (16 - len(expected))


def test_decode_log_reports_log_times_that_step_back(tmp_path):
    """Out-of-order log times per topic, in file order, as read_log counts them."""
    gantry = ["gantry_x", "gantry_y"]

    def messages():
        for i, step in enumerate([5, 3, 4, 1, 9, 9, 2]):
            t = T0 + step * 1_000_000
            yield "/joint_states", JOINT_STATE, joint_state(t, gantry, [i, 0], [0, i], []), t
            if i % 2:
                yield "/extra", "std_msgs/msg/Float32", {"data": 1.0}, T0 - i

    path = write_mcap(tmp_path / "back.mcap", messages(), chunk_size=200)
    ours, theirs = decode_log(path), read_log(path)
    assert_same_log(ours, theirs)
    assert ours.time_backsteps == {
        "/joint_states": (3, T0 + 3_000_000, T0 + 5_000_000),
        "/extra": (2, T0 - 3, T0 - 1),
    }
    assert ours.joint_position[:, 0].tolist() == [3, 6, 1, 2, 0, 4, 5]  # sorted by log time
