"""Which S3 endpoint realloop talks to: the S3 source reads landed files from it and a DVC
remote on s3:// pushes dataset versions to it (None: AWS itself)."""

from __future__ import annotations

import os

ENDPOINT_ENV_VARS = ("REALLOOP_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL")


def s3_endpoint_url() -> str | None:
    """The S3 endpoint from REALLOOP_S3_ENDPOINT_URL or AWS_ENDPOINT_URL (None: AWS)."""
    return next((os.environ[name] for name in ENDPOINT_ENV_VARS if os.environ.get(name)), None)
