"""Test set-up: 8 virtual CPU devices for the sharded tests, and the ``gpu`` marker's skip."""

import os

# Before JAX initialises its backends: the sharded tests run on 8 virtual CPU devices.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (jax.devices('gpu') is empty)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)
