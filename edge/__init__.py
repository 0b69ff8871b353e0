"""realloop edge: the software on a robot cell's edge inference box.

`edge.channel` is the transport shared by the publisher (promote stage) and the edge box;
`edge.agent` installs, rolls back and reports bundles on the box; `edge.cli` is `realloop-edge`.
This package imports nothing from the rest of realloop so it installs alone on the box.
"""
