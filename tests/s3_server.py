"""A local S3 server (moto's, on 127.0.0.1) and the ``AWS_*`` variables that point pyarrow at it."""

from __future__ import annotations

import contextlib
import os
import socket

import pyarrow.fs as pafs

from pipeline.data.locations import s3_options
from tests.dev_extra import require_dev


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(*buckets: str):
    """moto's S3 server with ``buckets`` created; the ``AWS_*`` variables set in ``os.environ`` while
    it runs (restored afterwards). Yields those variables (for Ray workers and subprocesses)."""
    server_mod = require_dev("moto.server")
    port = _free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for bucket in buckets:
            pafs.S3FileSystem(**s3_options(), allow_bucket_creation=True).create_dir(bucket)
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        server.stop()
