"""realloop edge: the software on a robot cell's edge inference box.

`edge.channels` is the transport shared by the publisher (promote stage) and the edge box (a
folder through `edge.channel`, an S3 prefix through `edge.s3`);
`edge.agent` installs, rolls back and reports bundles on the box; `edge.cli` is `realloop-edge`.
This package imports nothing from the rest of realloop so it installs alone on the box.
"""
