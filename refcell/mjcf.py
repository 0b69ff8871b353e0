"""The cell's MJCF: a two-axis gantry whose spherical pusher slides a part across a table."""

from __future__ import annotations

import mujoco

from refcell.world import PartVariant

PUSHER_RADIUS_M = 0.012
PART_HALF_HEIGHT_M = 0.015
GANTRY_TRAVEL_M = 0.30
SUBSTEP_S = 0.002
PART_MASS_IN_MJCF = 0.1  # rescaled per episode, with its inertia
ACTUATOR_GAIN = 20.0  # velocity servo gain kv, N per (m/s) of tracking error

# The part slides in the table plane (x, y, yaw joints). Table friction is modelled as
# Coulomb friction on those joints (frictionloss = mu * m * g), which keeps the contact
# dynamics stable for every part shape; the pusher touches only the part.
_TEMPLATE = """
<mujoco model="refcell_gantry_pusher">
  <option timestep="{substep}" integrator="implicitfast"/>
  <worldbody>
    <light pos="0 0 1.5"/>
    <geom name="table" type="plane" size="0.5 0.5 0.01" contype="0" conaffinity="0"/>
    <body name="gantry" pos="0 0 {pusher_z}">
      <joint name="gantry_x" type="slide" axis="1 0 0" range="-{travel} {travel}" damping="1"/>
      <joint name="gantry_y" type="slide" axis="0 1 0" range="-{travel} {travel}" damping="1"/>
      <geom name="pusher" type="sphere" size="{pusher_r}" mass="0.5" contype="2" conaffinity="1"
            friction="0.3 0.005 0.0001"/>
    </body>
    <body name="part" pos="0 0 {part_z}">
      <joint name="part_x" type="slide" axis="1 0 0"/>
      <joint name="part_y" type="slide" axis="0 1 0"/>
      <joint name="part_yaw" type="hinge" axis="0 0 1"/>
      <geom name="part" {part_geom} mass="{part_mass}" contype="1" conaffinity="2"
            friction="0.3 0.005 0.0001"/>
    </body>
  </worldbody>
  <actuator>
    <velocity name="drive_x" joint="gantry_x" kv="{kv}" ctrlrange="-1 1"/>
    <velocity name="drive_y" joint="gantry_y" kv="{kv}" ctrlrange="-1 1"/>
  </actuator>
</mujoco>
"""


def part_geom_attributes(part: PartVariant) -> str:
    if part.shape == "cylinder":
        return f'type="cylinder" size="{part.size_m} {PART_HALF_HEIGHT_M}"'
    if part.shape == "box":
        return f'type="box" size="{part.size_m} {part.size_m} {PART_HALF_HEIGHT_M}"'
    raise ValueError(f"unknown part shape {part.shape!r}: use cylinder or box")


def build_model(part: PartVariant) -> mujoco.MjModel:
    xml = _TEMPLATE.format(
        substep=SUBSTEP_S,
        pusher_z=PART_HALF_HEIGHT_M,
        travel=GANTRY_TRAVEL_M,
        pusher_r=PUSHER_RADIUS_M,
        part_z=PART_HALF_HEIGHT_M,
        part_geom=part_geom_attributes(part),
        kv=ACTUATOR_GAIN,
        part_mass=PART_MASS_IN_MJCF,
    )
    return mujoco.MjModel.from_xml_string(xml)
