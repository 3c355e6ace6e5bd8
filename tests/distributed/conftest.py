"""A local Ray cluster for the Ray back end's tests (started only by the modules that ask)."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    # also declared in pyproject.toml; repeated here so this folder runs on its own
    config.addinivalue_line(
        "markers",
        "ray: starts a local Ray cluster (run alone with -m ray; skipped without the ray extra)",
    )


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """One local cluster per module: 2 CPUs, no dashboard, bound to 127.0.0.1; shut down after.

    Ray >= 2.5x turns token authentication on for a new local cluster and,
    without a token, writes one to ~/.ray/auth_token; a token in the
    environment (one per test process) keeps the home directory untouched.
    Ray's session files go to a temporary directory removed at the end.
    """
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("a Ray cluster is already connected in this process")
    if not any(k in os.environ for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    tmp = tempfile.mkdtemp(prefix="fpray-")  # short: Ray's socket paths live under it
    ctx = ray.init(
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=200 * 2**20,
        log_to_driver=False,
        configure_logging=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=tmp,
        namespace="fastper-tests",
    )
    try:
        yield ctx
    finally:
        ray.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
