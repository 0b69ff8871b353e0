"""The ROS 2 message types the decoder reads: their field programs for the CDR walker, and the
standard definitions (signatures) that a log's ros2msg schema text must match."""

from __future__ import annotations

import re

from pipelines.ingest.mcap.results import UNKNOWN_SCHEMA, McapDecodeError

# A program lists a message's fields in wire order: (kind, name). Kinds:
#   time: builtin_interfaces/Time (int32 sec, uint32 nanosec) -> int64 ns
#   string: a label; string[]: a label of tuples; f8[]: float64 sequence;
#   f8*N: N float64 in a row (nested structs of float64 only); f4: one float32.
_PROGRAMS: dict[str, tuple[tuple[str, str], ...]] = {
    "sensor_msgs/msg/JointState": (
        ("time", "stamp"),
        ("string", "frame_id"),
        ("string[]", "name"),
        ("f8[]", "position"),
        ("f8[]", "velocity"),
        ("f8[]", "effort"),
    ),
    "geometry_msgs/msg/PoseStamped": (
        ("time", "stamp"),
        ("string", "frame_id"),
        ("f8*3", "position"),
        ("f8*4", "orientation"),
    ),
    "geometry_msgs/msg/TwistStamped": (
        ("time", "stamp"),
        ("string", "frame_id"),
        ("f8*3", "linear"),
        ("f8*3", "angular"),
    ),
    "std_msgs/msg/Float32": (("f4", "data"),),
    "std_msgs/msg/String": (("string", "data"),),
}
SUPPORTED_TYPES = tuple(_PROGRAMS)

# Field lists (type, name) of each type and of its dependencies, as in the .msg files.
_SIGNATURES: dict[str, tuple[tuple[str, str], ...]] = {
    "JointState": (
        ("Header", "header"),
        ("string[]", "name"),
        ("float64[]", "position"),
        ("float64[]", "velocity"),
        ("float64[]", "effort"),
    ),
    "PoseStamped": (("Header", "header"), ("Pose", "pose")),
    "TwistStamped": (("Header", "header"), ("Twist", "twist")),
    "Float32": (("float32", "data"),),
    "String": (("string", "data"),),
    "Header": (("Time", "stamp"), ("string", "frame_id")),
    "Time": (("int32", "sec"), ("uint32", "nanosec")),
    "Pose": (("Point", "position"), ("Quaternion", "orientation")),
    "Point": (("float64", "x"), ("float64", "y"), ("float64", "z")),
    "Quaternion": (("float64", "x"), ("float64", "y"), ("float64", "z"), ("float64", "w")),
    "Twist": (("Vector3", "linear"), ("Vector3", "angular")),
    "Vector3": (("float64", "x"), ("float64", "y"), ("float64", "z")),
}
_SCHEMA_ENCODINGS = ("ros2msg", "ros2idl")
_SEPARATOR = re.compile(r"^={10,}\s*$", re.MULTILINE)


def normalize_type(name: str) -> str:
    """`pkg/Name` or `pkg/msg/Name` -> `pkg/msg/Name`."""
    parts = name.strip().split("/")
    if len(parts) == 2:
        return f"{parts[0]}/msg/{parts[1]}"
    return name.strip()


def check_schema(datatype: str, encoding: str, data: bytes) -> None:
    """Raise McapDecodeError(UNKNOWN_SCHEMA) unless the schema is the standard one.

    ros2msg text is compared field by field with the standard definitions (comments, constants
    and default values ignored; dependency sections that are left out are taken as standard).
    ros2idl schemas are accepted by name.
    """
    if datatype not in _PROGRAMS:
        raise McapDecodeError(UNKNOWN_SCHEMA, f"unsupported message type {datatype!r}")
    if encoding not in _SCHEMA_ENCODINGS:
        raise McapDecodeError(
            UNKNOWN_SCHEMA, f"schema {datatype!r} has encoding {encoding!r}, not ros2msg"
        )
    if encoding == "ros2idl":
        return
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise McapDecodeError(UNKNOWN_SCHEMA, f"schema {datatype!r} is not UTF-8 text") from None
    sections = _SEPARATOR.split(text)
    found = {datatype.rsplit("/", 1)[-1]: _msg_fields(sections[0])}
    for section in sections[1:]:
        lines = section.strip().splitlines()
        if lines and lines[0].startswith("MSG:"):
            found[lines[0][4:].strip().rsplit("/", 1)[-1]] = _msg_fields("\n".join(lines[1:]))
    for name, fields in found.items():
        expected = _SIGNATURES.get(name)
        if expected is not None and fields != expected:
            shown = ", ".join(f"{t} {n}" for t, n in fields)
            raise McapDecodeError(
                UNKNOWN_SCHEMA,
                f"schema {datatype!r}: {name} has fields ({shown}), not the standard definition",
            )


def _msg_fields(text: str) -> tuple[tuple[str, str], ...]:
    fields = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) < 2 or "=" in parts[1] or (len(parts) > 2 and parts[2].startswith("=")):
            continue  # a constant: no bytes on the wire
        ftype = parts[0]
        base, bracket, rest = ftype.partition("[")
        ftype = base.rsplit("/", 1)[-1] + bracket + rest
        fields.append((ftype, parts[1]))
    return tuple(fields)
