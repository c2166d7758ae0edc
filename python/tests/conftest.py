"""Fixtures shared by the test modules.

- ``s3_server``: one SeaweedFS on loopback for the whole session (``s3_server.py``).
- ``ckpt_root``: where a test's checkpoints go, so that the test runs twice: ``local`` (its
  ``tmp_path``) and ``s3`` (a fresh prefix on ``s3_server``, the ``AWS_*`` variables pointing
  at it for the test; processes the test starts inherit them). ``ckpt_root / "c"`` is a
  ``Path`` or an ``s3://`` URL; every API taking a checkpoint path takes either.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from s3_server import BUCKET, s3_server  # noqa: F401  (the session fixture, shared here)


class S3Root:
    """A fresh prefix on the test server: ``root / "c"`` is ``s3://<bucket>/<prefix>/c``."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __truediv__(self, name: str) -> str:
        return f"s3://{BUCKET}/{self.prefix}/{name}"

    def __str__(self) -> str:
        return f"s3://{BUCKET}/{self.prefix}"


def is_local(root) -> bool:
    """True when ``root`` (a ``ckpt_root``) is a local directory."""
    return isinstance(root, Path)


@pytest.fixture(params=["local", "s3"])
def ckpt_root(request, tmp_path, monkeypatch):
    if request.param == "local":
        return tmp_path
    server = request.getfixturevalue("s3_server")
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    return S3Root(f"py-{uuid.uuid4().hex[:16]}")
