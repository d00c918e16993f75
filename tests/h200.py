"""Lowering for an H200 from a host without a GPU.

The CPU tests run the kernels in interpret mode, which accepts operations that the GPU lowering
rejects; lowering the jitted function for ``cuda`` under an abstract H200 mesh proves, without a
GPU, that each kernel gets through Pallas' GPU lowering (and MLIR's verifier).
"""

import contextlib

import jax
from jax._src.pallas.triton import pallas_call_registration
from jax.sharding import AbstractDevice, AbstractMesh

H200 = AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")


def lower_for_h200(fn, *args, **kwargs) -> str:
    """Lower ``jax.jit(fn)(*args, **kwargs)`` for an H200; returns the StableHLO text.

    The arrays in ``args`` must exist before the call (they are created on the CPU).
    """
    mesh = AbstractMesh((1,), ("x",), abstract_device=H200)
    with jax.sharding.use_abstract_mesh(mesh), verified_triton_modules():
        lowered = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=("cuda",))
    return lowered.as_text()


@contextlib.contextmanager
def verified_triton_modules():
    """Run MLIR's verifier on every Triton module Pallas lowers (raising on a malformed one): on the
    GPU XLA rejects such a module when it parses it, after the lowering has succeeded here."""
    lowering = pallas_call_registration.lowering
    lower = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        result.module.operation.verify()
        return result

    lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = lower


def triton_ir_for_h200(fn, *args) -> list[str]:
    """The Triton IR (TTIR text) of each Pallas kernel of ``jax.jit(fn)(*args)`` lowered for an H200,
    for Triton to compile without a GPU."""
    captured = []
    lowering = pallas_call_registration.lowering
    lower = lowering.lower_jaxpr_to_triton_module

    def capture(*lower_args, **lower_kwargs):
        result = lower(*lower_args, **lower_kwargs)
        captured.append(result.module.operation.get_asm())
        return result

    lowering.lower_jaxpr_to_triton_module = capture
    try:
        lower_for_h200(fn, *args)
    finally:
        lowering.lower_jaxpr_to_triton_module = lower
    return captured
