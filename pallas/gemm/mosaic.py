"""What the Mosaic GPU weight streams share (the shared expert's TMA schedule, the streaming engine):
the launch with programmatic dependent launch, the shared-memory layout of a stage as wgmma reads it,
the ring's wgmmas in flight, interpret mode, and ``x``'s rows as a tiled TMA copy moves them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

LAUNCH_WITH_PDL = True
"""Each kernel starts with ``griddepcontrol_wait``, before it reads anything: Mosaic GPU then
launches it with programmatic dependent launch, as XLA launches its own kernels, so that its CTAs
are set up while the kernel before it finishes and the wait holds them until that kernel's writes
are visible: the span of a call's kernels is shorter (docs/findings.md, PDL)."""

WGMMA_M = 64
"""One warpgroup's wgmma M: a TMA CTA's weight rows, or the batch rows (``x`` zero-filled to them)
where the batch is M."""
WGMMA_MAX_N = 256
"""wgmma's largest N."""
WGMMA_N_STEP = 8
"""wgmma's N is a multiple of this."""
WGMMA_STEPS_IN_FLIGHT = 1
"""K steps whose wgmmas may still run when the next step's are issued; each holds its ring slot until
they finish, so a ring of ``num_stages`` keeps ``num_stages - WGMMA_STEPS_IN_FLIGHT`` TMA stages
ahead."""


def await_inputs(interpret: bool) -> None:
    """The kernel's first step (``LAUNCH_WITH_PDL``). Interpret mode runs kernels one after
    another and has no rule for the instruction: there it is left out."""
    if LAUNCH_WITH_PDL and not interpret:
        plgpu.griddepcontrol_wait()


def release_dependents(interpret: bool) -> None:
    """Let the next kernel launch (``griddepcontrol_launch_dependents``): it launches once every
    CTA has called this or exited, so its CTAs take the SMs this kernel frees and run up to their
    own ``await_inputs``, which still waits for all of this kernel. Left out where
    ``await_inputs`` is."""
    if LAUNCH_WITH_PDL and not interpret:
        plgpu.griddepcontrol_launch_dependents()


def interpret_params(interpret: bool, *, inline_mgpu: bool = True):
    """Mosaic GPU's interpret mode (a simulated GPU on the CPU) where ``interpret``, else None;
    ``inline_mgpu`` False: it leaves out ``plgpu.inline_mgpu`` code (barriers a CTA of one thread
    does not need)."""
    if not interpret:
        return None
    return plgpu.InterpretGPUParams() if inline_mgpu else plgpu.InterpretGPUParams(
        inline_mgpu="ignore")


def stage_transforms(block_k: int) -> tuple:
    """Shared-memory tiling and swizzle of a ``[rows, block_k]`` bfloat16 stage, as wgmma reads it."""
    swizzle = plgpu.find_swizzle(block_k * 16)  # bits of one row of the stage
    return plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)


def tma_rows(batch: int) -> int:
    """The rows of ``x`` a kernel takes: B where B <= 8 or a multiple of 8, else B rounded up to 8
    (a tiled TMA copy moves up to 8 rows or a multiple of 8)."""
    return batch if batch <= 8 or batch % 8 == 0 else -(-batch // 8) * 8


def pad_rows(x: jax.Array) -> jax.Array:
    """``x`` with zero rows up to ``tma_rows``: for 9 <= B <= 63 not a multiple of 8, a pad here and
    the caller's slice of the outputs, two small XLA ops."""
    rows = tma_rows(x.shape[0])
    return x if rows == x.shape[0] else jnp.pad(x, ((0, rows - x.shape[0]), (0, 0)))
