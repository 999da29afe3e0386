"""A real S3 server on loopback for tests: moto's server on 127.0.0.1 with a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["S3Server", "free_port", "moto_server"]

CREDENTIALS = {"access_key_id": "testing", "secret_access_key": "testing"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class S3Server:
    """A running moto S3 server."""

    endpoint_url: str
    process: subprocess.Popen | None = None

    def client(self, access_key_id: str = "testing"):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=access_key_id,
            aws_secret_access_key="testing",
        )

    def new_bucket(self) -> str:
        """Create a bucket with a unique name and return the name."""
        name = f"test-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        urllib.request.urlopen(req, timeout=10).read()

    def options(self, **extra) -> dict:
        """Storage options for :func:`vcdask.open_store` pointing at this server."""
        return {"endpoint_url": self.endpoint_url, "region": "us-east-1", **CREDENTIALS, **extra}

    def icechunk_storage(self, bucket: str, prefix: str):
        """Icechunk's own storage for ``s3://bucket/prefix`` on this server (a store read, or a repository made,
        with Icechunk itself rather than through vcdask)."""
        import icechunk

        return icechunk.s3_storage(
            bucket=bucket,
            prefix=prefix,
            endpoint_url=self.endpoint_url,
            region="us-east-1",
            allow_http=True,
            force_path_style=True,
            access_key_id=CREDENTIALS["access_key_id"],
            secret_access_key=CREDENTIALS["secret_access_key"],
        )


@contextmanager
def moto_server(*, auth: bool = False) -> Iterator[S3Server]:
    """Run ``moto_server`` in a child process on 127.0.0.1 and a free port.

    With ``auth=True`` the server checks request signatures against its IAM users
    (``INITIAL_NO_AUTH_ACTION_COUNT=0``), so unknown credentials are refused.
    """
    port = free_port()
    env = dict(os.environ)
    if auth:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    exe = os.path.join(os.path.dirname(sys.executable), "moto_server")
    cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "moto.server"]
    proc = subprocess.Popen(
        [*cmd, "-H", "127.0.0.1", "-p", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    server = S3Server(f"http://127.0.0.1:{port}", proc)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on port {port}") from None
                time.sleep(0.1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
