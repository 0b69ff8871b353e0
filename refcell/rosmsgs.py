"""ROS 2 message definitions, concatenated the way rosbag2 stores them in MCAP schemas."""

from __future__ import annotations

_SEPARATOR = "=" * 80
_DEPENDENCIES = {
    "builtin_interfaces/Time": "int32 sec\nuint32 nanosec\n",
    "std_msgs/Header": "builtin_interfaces/Time stamp\nstring frame_id\n",
    "geometry_msgs/Vector3": "float64 x\nfloat64 y\nfloat64 z\n",
    "geometry_msgs/Twist": "Vector3 linear\nVector3 angular\n",
    "geometry_msgs/Point": "float64 x\nfloat64 y\nfloat64 z\n",
    "geometry_msgs/Quaternion": "float64 x 0\nfloat64 y 0\nfloat64 z 0\nfloat64 w 1\n",
    "geometry_msgs/Pose": "Point position\nQuaternion orientation\n",
}
_MESSAGES = {
    "sensor_msgs/msg/JointState": (
        "std_msgs/Header header\nstring[] name\nfloat64[] position\nfloat64[] velocity\n"
        "float64[] effort\n",
        ["std_msgs/Header", "builtin_interfaces/Time"],
    ),
    "geometry_msgs/msg/TwistStamped": (
        "std_msgs/Header header\nTwist twist\n",
        [
            "std_msgs/Header",
            "builtin_interfaces/Time",
            "geometry_msgs/Twist",
            "geometry_msgs/Vector3",
        ],
    ),
    "geometry_msgs/msg/PoseStamped": (
        "std_msgs/Header header\nPose pose\n",
        [
            "std_msgs/Header",
            "builtin_interfaces/Time",
            "geometry_msgs/Pose",
            "geometry_msgs/Point",
            "geometry_msgs/Quaternion",
        ],
    ),
    "std_msgs/msg/Float32": ("float32 data\n", []),
    "std_msgs/msg/String": ("string data\n", []),
}


def message_definition(datatype: str) -> str:
    """The full definition text of `datatype`, dependencies appended after separators."""
    body, dependencies = _MESSAGES[datatype]
    parts = [body]
    for name in dependencies:
        parts.append(f"{_SEPARATOR}\nMSG: {name}\n{_DEPENDENCIES[name]}")
    return "\n".join(parts)


def stamp(time_ns: int) -> dict:
    return {"sec": time_ns // 1_000_000_000, "nanosec": time_ns % 1_000_000_000}


DATATYPES = tuple(_MESSAGES)
