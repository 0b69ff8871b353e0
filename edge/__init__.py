"""realloop edge: the software on a robot cell's edge inference box.

`edge.channels` is the transport shared by the publisher (promote stage) and the edge box (a
folder through `edge.channel`, an S3 prefix through `edge.s3`). Releases on it are a TUF
repository: `edge.tuf_repo` and `edge.release` publish (keys: `edge.keys`, `edge.rotation`),
`edge.tuf_client` verifies on the box (tuf.ngclient), `edge.attestation` signs and checks the
gate's verdict. `edge.agent` installs, repairs, rolls back and reports releases on the box;
`edge.cli` is `realloop-edge`. This package imports nothing from the rest of realloop so it
installs alone on the box.
"""
