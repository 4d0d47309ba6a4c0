"""Shared fixtures. The environment is set first: jax reads it when it is imported."""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import functools

import pytest

from burncoll.backends import Backend, get_backend, installed_backends
from tests import shared

_installed = functools.cache(installed_backends)


def pytest_configure(config: pytest.Config) -> None:
    shared.configure(config)


@pytest.fixture(params=["numpy", "jax", "cupy", "torch"])
def backend_name(request: pytest.FixtureRequest) -> str:
    """Each backend name in turn; skips the backends whose library (or GPU) is missing."""
    name: str = request.param
    if name not in _installed():
        pytest.skip(f"backend {name!r} is not usable here (library or GPU missing)")
    return name


@pytest.fixture
def backend(backend_name: str) -> Backend:
    """The shared backend instance for ``backend_name``."""
    return get_backend(backend_name)
