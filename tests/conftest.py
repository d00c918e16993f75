"""Test set-up: 8 virtual CPU devices for the sharded tests, the ``gpu`` marker's skip, and the
``spy`` fixture that counts a kernel's calls."""

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


@pytest.fixture
def spy(monkeypatch):
    """``spy(name, *modules)`` replaces the function ``name`` in each of ``modules`` (a kernel
    module, and the stage package that re-exports it) by one wrapper of the first module's, which
    records each call's keyword arguments and then calls it; returns the list of records. Undone
    after the test."""

    def install(name, *modules):
        calls = []
        real = getattr(modules[0], name)

        def wrapper(*args, **kwargs):
            calls.append(kwargs)
            return real(*args, **kwargs)

        for module in modules:
            monkeypatch.setattr(module, name, wrapper)
        return calls

    return install
