"""Lowering for an H200 from a host without a GPU (DESIGN.md, "Tests and checks").

Interpret mode accepts operations that the GPU lowering rejects; lowering the jitted function for
``cuda`` proves that each kernel gets through Pallas' GPU lowering.
"""

import jax
from jax.sharding import AbstractDevice, AbstractMesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def lower_for_h200(fn, *args, **kwargs) -> str:
    """Lower ``jax.jit(fn)(*args, **kwargs)`` for an H200; returns the StableHLO text.

    The arrays in ``args`` must exist before the call (they are created on the CPU).
    """
    mesh = AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh):
        lowered = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    return lowered.as_text()
