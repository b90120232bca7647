"""An S3 server on 127.0.0.1 for the tests of snapshots on an object store: moto's, a real HTTP
server speaking S3's REST API, started and stopped by PID."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def s3_server(bucket: str = "snapshots") -> Iterator[dict[str, str]]:
    """Starts the server with `bucket` in it; yields the AWS variables that point a process at it."""
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    # Its log (a line per request) goes to a file: into a pipe nobody reads, it would fill the pipe
    # and block the server mid-run.
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise AssertionError(f"moto's S3 server exited: {log.read()[-2000:]}")
            assert time.monotonic() < deadline, "moto's S3 server did not answer within 60 s"
            try:
                opener.open(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=5).read()
                break
            except OSError:
                time.sleep(0.1)
        yield {"AWS_ENDPOINT_URL": endpoint, "AWS_REGION": "us-east-1", "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
