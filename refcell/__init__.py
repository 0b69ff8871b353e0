"""The reference cell: a MuJoCo gantry pusher in two worlds, `sim` and `line`.

It is the test double for the physical world. The pipeline learns about the line only from
the logs that `refcell.recorder` writes; nothing outside refcell reads `worlds/line.yaml`.
"""
