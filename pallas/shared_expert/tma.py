"""The shared expert's two GEMMs on Hopper's bulk tensor copies and warpgroup MMAs (Mosaic GPU).

The TMA schedule of ``shared_expert`` (``GemmConfig(64, block_k, split_k, 4, depth, tma=True)``,
B <= 64):

    kernel 1  hidden[B, S_r] = situ(bf16(x @ gate.T), bf16(x @ up.T))      one CTA per 64 gate rows
    kernel 2  shared[B, H]   = bf16(hidden @ down.T)                        one CTA per 64 H rows

Each CTA is one warpgroup that streams its weight rows over its ``K / split_k`` chunk (all of K at
tp1) through ``emit_pipeline``'s ring of ``depth`` TMA stages of ``block_k`` columns: the copy
engine keeps up to ``depth`` stages of the weight in flight per SM with no thread issuing loads,
which is what a weight read at the HBM rate needs (``streaming``'s Triton schedules hold their
bytes in flight in registers). The weight tile is wgmma's M operand and the batch, padded to ``Bp``
(a multiple of 8), its N: the float32 accumulator is the transposed output tile ``[64, Bp]``, one
warpgroup's registers. Batch rows past B are TMA
out-of-bounds reads (zero filled, no memory traffic) and are clipped from the stores. A TMA box holds
up to 8 rows or a multiple of 8, so a batch of 9-63 that is not a multiple of 8 is padded with zero
rows first and the output sliced back (one small XLA op each; ``_tma_rows``).

At tp1 no split of K, and so no partial sums, counters or second pass: the gate/up GEMM is
``S_r / 64 = 96`` CTAs (each 64 gate and the matching 64 up rows, two accumulators) and the down GEMM
``H / 64 = 112`` CTAs, one wave each on 132 SMs. A weight read bound by HBM needs bytes in flight,
not SMs: ``depth`` stages of ``2 * 64 * block_k`` bytes (gate/up: twice that) per CTA. The layout
needs ``S_r`` and ``H`` multiples of 64.

With ``batch_m`` the operands swap roles: ``x``'s copy is ``[64, block_k]`` (TMA_MAX_BATCH rows,
those past the array zero filled), wgmma's M, and the weight tile is its N, so a CTA's rows may be
any multiple of 8 (``GemmConfig.batch_m``): at tp1 48 gate rows (and the 48 up rows) make 128 CTAs
for the gate/up and 56 rows 128 for the down, where 64-row tiles make 96 and 112 and leave SMs idle.
The accumulators are ``[64, rows]`` and store straight into the ``[B, .]`` output (their first
``Bp`` rows; no transpose), the partials as ``[split_k, parts, Bp, rows]``. The tensor work is
that of a batch of 64 whatever B is, and below B=64 every step's ``x`` copy zero fills the rows
past B: on the H200 that made tp1 B=16/32 slower (74-84 us per call against 65.4-65.7), and at B=64
it tied with 64-row CTAs (66.9-67.2 against 67.0-67.1); on the H100 it gained 2.7-3.1 us at tp1 B=64
(92.3-95.0 against 95.0-98.1, three runs) and lost 0.2-0.6 us at B=32. The H100's table runs it at
tp1 B=64, the H200's nowhere (eighteenth and nineteenth sessions).

The epilogues run on the accumulator's registers: gate/up rounds gate and up to bfloat16 and applies
``reference.situ`` (the same float32 formula); down rounds to bfloat16. Each result tile is written
through a transposed shared-memory view into ``[Bp, 64]`` and TMA-stored at columns ``64 * tile`` of
the ``[B, .]`` output (rows past B clipped). Mosaic GPU in jax 0.11.2 stores a bfloat16 tile through
a transposed view, not a float32 one.

Every kernel waits for the kernel before it first thing (``LAUNCH_WITH_PDL``), so that it is
launched with programmatic dependent launch, as XLA launches its own kernels, and the gap between
the gate/up and the down closes.

Split K (``split_k > 1``: tp8's 768 gate rows are 12 CTAs, so K is split 8-16 ways) and float32
output (the partial sum under tp): the CTA ``(part, tile)`` stores its float32 accumulators, as they
lie, into partials ``[split_k, parts, rows, Bp]`` (``_partials``; Mosaic GPU in jax 0.11.2 has no
transposed float32 store), and XLA sums them over ``split_k`` and runs the epilogue. The gate/up's
epilogue leaves ``hidden`` in that layout, ``[S_r, Bp]`` (``gate_up_situ_t``): sum, rounding and
situ are then one XLA fusion, where a transpose to ``[B, S_r]`` split them into a reduction and a
transpose, 1.0-1.4 us more at tp8 (``benchmarks/split_epilogue_probe.py``, thirteenth session).
``shared_expert.shared_expert`` hands that ``hidden.T`` to its Triton down as it is;
``gate_up_situ`` returns it transposed. With ``batch_m`` the partials, and so ``hidden``, are
batch-major: ``gate_up_situ`` slices it, ``gate_up_situ_t`` transposes it, and
``shared_expert.shared_expert`` gives a Triton down ``hidden`` itself.

Cost per call (bf16 = 2 bytes; ``s1``, ``s2`` the kernels' split_k where they hand XLA partials):
  bytes = 2 * 2 * S_r * H + 2 * H * S_r    the two weights, each read once (264.2 MB at tp1, 33.0 MB
                                            at tp8): the bound
        + 2 * Bp * H * S_r / rows           x re-read from L2 by every gate/up CTA (not HBM; rows =
                                            block_rows, 64 unless batch_m)
        + 2 * Bp * S_r * H / rows           hidden re-read from L2 by every down CTA (not HBM)
        + 2 * B * S_r + 2 * B * H           hidden and shared written
        + 2 * 4 * Bp * (2 S_r s1 + H s2)    partials written and read back by XLA, where used
  FLOPs = 2 * Bp * 3 * S_r * H              on the tensor cores (Bp >= 8: 8x B's at B=1, free here;
                                            with batch_m 64 for Bp)
so a call is bound by the weight read: 56.8 us at tp1 at the H200's 4.65 TB/s.

Measured on the H200 (2026-12-04, twelfth session, CUPTI, weights rotated; benchmarks/RESULTS.md):
at tp1 the gate/up takes 41.6-42.2 us at B <= 8 (4.18-4.24 TB/s; XLA's row sum of the same weight
reads it at 4.51) and 44.4 at B=64; the down 21.3-21.6 us (4.07-4.13 TB/s) and 22.9. Both kernels
take 62.8-69.3 us per call at B = 1-64 against XLA's 67.7-86.5. At tp8 the split gate/up (8 ways)
takes 8.0-9.6 us at B = 4-64 with its epilogue fusion (thirteenth session, run 10), where the Triton
schedules took 9.9-15.5; there the Triton down (4.9-6.0 us) beat this one (5.4-6.8). The best rings
hold 4-6 stages of 128-256 columns. 128-row CTAs (half the CTAs, half the re-reads of ``x``) were
slower at every batch at tp1, and two steps of wgmmas behind the loads instead of one no faster
(``WGMMA_STEPS_IN_FLIGHT``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from moe_front_jax import reference
from moe_front_jax.pallas.gemm.schedule import TMA_MAX_BATCH, GemmConfig


def padded_batch(batch: int) -> int:
    """wgmma's N: the batch rounded up to a multiple of 8."""
    return -(-batch // 8) * 8


def _transforms(block_k: int) -> tuple:
    """Shared-memory tiling and swizzle of a ``[rows, block_k]`` bfloat16 stage, as wgmma reads it."""
    swizzle = plgpu.find_swizzle(block_k * 16)  # bits of one row of the stage
    return plgpu.TilingTransform((8, swizzle // 2)), plgpu.SwizzleTransform(swizzle)


WGMMA_STEPS_IN_FLIGHT = 1
"""K steps whose wgmmas may still run when the next step's are issued; each holds its ring slot until
they finish, so a ring of ``num_stages`` keeps ``num_stages - WGMMA_STEPS_IN_FLIGHT`` TMA stages
ahead."""


LAUNCH_WITH_PDL = True
"""Each kernel starts with ``griddepcontrol_wait``, before it reads anything: Mosaic GPU then
launches it with programmatic dependent launch, so that its CTAs are set up while the kernel before
it finishes, and the wait holds them until that kernel's writes are visible. XLA launches its own
kernels so. On an H100 (``benchmarks/pdl_probe.py``, twentieth session) the down started 1.2-2.5
us after the gate/up ended without it and 0.1-0.8 us before with it; a tp1 call's span, first
kernel start to last kernel end, went from 89.7-90.2 to 88.4 us at B=1 and from 95.5-96.8 to
94.1-94.2 at B=64, with the kernels' summed CUPTI time level (within 0.3 us). Not yet measured on
an H200."""


def _await_inputs(interpret: bool) -> None:
    """The kernel's first step (``LAUNCH_WITH_PDL``). Interpret mode runs kernels one after
    another and has no rule for the instruction: there it is left out."""
    if LAUNCH_WITH_PDL and not interpret:
        plgpu.griddepcontrol_wait()


def _stream(x_gmem, w_gmem, first_tiles, config: GemmConfig, bp: int, part=0):
    """The float32 accumulators of the weight's row tiles ``first_tiles`` (counted in
    ``block_rows``) against ``x`` over K chunk ``part`` of ``split_k``: ``num_stages`` TMA stages of
    ``block_k`` columns in flight. Each is ``[block_rows, bp]`` (the weight tile is wgmma's M), or
    with ``batch_m`` ``[TMA_MAX_BATCH, block_rows]`` (``x``'s rows are M, those past its own zero
    filled by the copy)."""
    rows, block_k, depth = config.block_rows, config.block_k, config.num_stages
    x_rows = TMA_MAX_BATCH if config.batch_m else bp
    steps = x_gmem.shape[1] // block_k // config.split_k
    first_step = part * steps
    transforms = _transforms(block_k)
    parts = len(first_tiles)

    def scope(*accs):
        def body(_, *smem):
            *w_smem, x_smem = smem
            for acc, w in zip(accs, w_smem):
                if config.batch_m:
                    plgpu.wgmma(acc, x_smem, w.T)
                else:
                    plgpu.wgmma(acc, w, x_smem.T)
            # The wgmmas of steps before the last WGMMA_STEPS_IN_FLIGHT are done: their slots may
            # be refilled.
            plgpu.wgmma_wait(parts * WGMMA_STEPS_IN_FLIGHT)

        w_specs = [
            plgpu.BlockSpec((rows, block_k), lambda k, t=t: (t, first_step + k),
                            transforms=transforms, delay_release=WGMMA_STEPS_IN_FLIGHT)
            for t in first_tiles
        ]
        x_spec = plgpu.BlockSpec((x_rows, block_k), lambda k: (0, first_step + k),
                                 transforms=transforms, delay_release=WGMMA_STEPS_IN_FLIGHT)
        plgpu.emit_pipeline(
            body, grid=(steps,), in_specs=[*w_specs, x_spec], max_concurrent_steps=depth
        )(*[w_gmem] * parts, x_gmem)
        return tuple(acc[...] for acc in accs)

    acc_shape = (x_rows, rows) if config.batch_m else (rows, bp)
    return pl.run_scoped(scope, *[plgpu.ACC(acc_shape, jnp.float32)] * parts)


def _store_transposed(tile_t, out_gmem, column):
    """A ``[rows, bp]`` bfloat16 tile, transposed through shared memory, TMA-stored into
    ``out_gmem[:, column : column + rows]`` (rows past the output's clipped)."""
    rows, bp = tile_t.shape

    def scope(smem):
        smem.T[...] = tile_t
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, out_gmem.at[pl.ds(0, bp), pl.ds(column, rows)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.SMEM((bp, rows), jnp.bfloat16))


def _store_rows(tile, out_gmem, column, bp: int):
    """The first ``bp`` rows of a ``[TMA_MAX_BATCH, rows]`` bfloat16 tile (``batch_m``), through
    shared memory, TMA-stored into ``out_gmem[:bp, column : column + rows]`` (rows past the
    output's clipped)."""
    m, rows = tile.shape

    def scope(smem):
        smem[...] = tile
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem.at[pl.ds(0, bp)],
                                out_gmem.at[pl.ds(0, bp), pl.ds(column, rows)])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.SMEM((m, rows), jnp.bfloat16))


def _store_partials(tiles, dst_gmem):
    """The float32 tiles through one shared-memory buffer, TMA-stored into ``dst_gmem``
    ``[len(tiles), m, n]`` (``[rows, bp]``, or ``[bp, rows]`` of ``[TMA_MAX_BATCH, rows]`` tiles
    with ``batch_m``): every tile is written before any copy starts, so no shared memory is
    rewritten while a copy may still read it."""
    m = dst_gmem.shape[1]

    def scope(smem):
        for i, tile in enumerate(tiles):
            smem.at[i][...] = tile
        plgpu.commit_smem()
        for i in range(len(tiles)):
            plgpu.copy_smem_to_gmem(smem.at[i, pl.ds(0, m)], dst_gmem.at[i])
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(scope, plgpu.SMEM((len(tiles), *tiles[0].shape), jnp.float32))


def _partials(x, w, parts: int, config: GemmConfig, interpret: bool, name: str):
    """Split-K (or float32-output) form of either kernel: CTA ``(part, tile)`` streams K chunk
    ``part`` of the ``parts`` row blocks of ``tile`` (gate/up: its gate rows and the up rows
    ``S_r`` below) and stores its float32 accumulators; XLA sums the ``[split_k, parts, rows / parts,
    bp]`` partials (``[split_k, parts, bp, rows / parts]`` with ``batch_m``) and runs the epilogue
    (one small fusion)."""
    rows = config.block_rows
    bp, tiles = padded_batch(x.shape[0]), w.shape[0] // parts // rows

    def kernel(x_gmem, w_gmem, out_gmem):
        _await_inputs(interpret)
        part, tile = lax.axis_index("part"), lax.axis_index("tile")
        accs = _stream(x_gmem, w_gmem, tuple(tile + p * tiles for p in range(parts)), config, bp,
                       part)
        columns = pl.ds(tile * rows, rows)
        _store_partials(accs, out_gmem.at[part, :, :, columns] if config.batch_m
                        else out_gmem.at[part, :, columns])

    shape = (bp, tiles * rows) if config.batch_m else (tiles * rows, bp)
    out = jax.ShapeDtypeStruct((config.split_k, parts, *shape), jnp.float32)
    return plgpu.kernel(
        kernel, out_type=out, grid=(config.split_k, tiles), grid_names=("part", "tile"),
        interpret=_interpret_params(interpret), kernel_name=name,
    )(x, w)


def _check(x, w, rows: int, config: GemmConfig, name: str) -> None:
    if not config.tma:
        raise ValueError(f"{name}: {config} is not a TMA schedule (tma=True)")
    batch, depth_k = x.shape
    if batch > TMA_MAX_BATCH:
        raise NotImplementedError(
            f"the TMA schedule covers B <= {TMA_MAX_BATCH}, got B={batch}; use another schedule"
        )
    if rows % config.block_rows:
        raise NotImplementedError(
            f"the TMA schedule of {name} needs its rows a multiple of block_rows="
            f"{config.block_rows}, got {rows}; use another schedule"
        )
    config.check_divides(depth_k, "K")


def _tma_rows(x: jax.Array) -> jax.Array:
    """``x`` as the TMA copies it: a tiled copy moves up to 8 rows or a multiple of 8, so another
    batch (9 <= B <= 63, not a multiple of 8) is padded with zero rows to its multiple of 8, and the
    kernels' outputs keep those rows until the caller's slice: two small XLA ops for such batches."""
    batch = x.shape[0]
    if batch <= 8 or batch % 8 == 0:
        return x
    return jnp.pad(x, ((0, padded_batch(batch) - batch), (0, 0)))


def _interpret_params(interpret: bool):
    """Mosaic GPU's interpret mode (a simulated GPU on the CPU) where ``interpret``, else None."""
    return plgpu.InterpretGPUParams() if interpret else None


def _split_hidden(x, gate_up, beta, linear_beta, config: GemmConfig, interpret: bool):
    """Kernel 1 with K split, on ``_tma_rows(x)``: ``hidden`` in the layout its partials lie in,
    ``hidden.T`` ``[S_r, Bp]`` (the batch minor; ``[Bp, S_r]`` with ``batch_m``), so that XLA's
    sum over the splits, rounding and situ are one fusion (a transpose makes it two, 1.0-1.4 us
    more at tp8: thirteenth session). Rows or columns past B are ``situ(0, 0) = 0``."""
    y = _partials(x, gate_up, 2, config, interpret, "shared_gate_up_tma_partials").sum(0)
    gate, up = (reference.round_to_bfloat16(y[p]) for p in range(2))
    return reference.situ(gate, up, beta, linear_beta)


def _hidden_t(x, gate_up, beta, linear_beta, config: GemmConfig, interpret: bool):
    """``hidden.T`` ``[S_r, Bp]`` from ``_split_hidden`` (a transpose with ``batch_m``)."""
    hidden = _split_hidden(x, gate_up, beta, linear_beta, config, interpret)
    return hidden.T if config.batch_m else hidden


def _gate_up(x, gate_up, beta, linear_beta, config: GemmConfig, interpret: bool):
    """Kernel 1 on ``_tma_rows(x)``: its rows of ``hidden``."""
    s_r = gate_up.shape[0] // 2
    rows = config.block_rows
    batch, bp, tiles = x.shape[0], padded_batch(x.shape[0]), s_r // rows
    if config.split_k > 1:
        hidden = _split_hidden(x, gate_up, beta, linear_beta, config, interpret)
        return hidden[:batch] if config.batch_m else hidden[:, :batch].T

    def kernel(x_gmem, w_gmem, out_gmem):
        _await_inputs(interpret)
        tile = lax.axis_index("tile")
        gate, up = _stream(x_gmem, w_gmem, (tile, tile + tiles), config, bp)
        hidden = reference.situ(gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16), beta,
                                linear_beta)
        if config.batch_m:
            _store_rows(hidden, out_gmem, tile * rows, bp)
        else:
            _store_transposed(hidden, out_gmem, tile * rows)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((batch, s_r), jnp.bfloat16), grid=(tiles,),
        grid_names=("tile",), interpret=_interpret_params(interpret),
        kernel_name="shared_gate_up_situ_tma",
    )(x, gate_up)


def _down(hidden, down, out_dtype, config: GemmConfig, interpret: bool):
    """Kernel 2 on ``_tma_rows(hidden)``: its rows of the product."""
    batch, rows, bp = hidden.shape[0], down.shape[0], padded_batch(hidden.shape[0])
    if config.split_k > 1 or jnp.dtype(out_dtype) != jnp.dtype(jnp.bfloat16):
        y = _partials(hidden, down, 1, config, interpret, "shared_down_tma_partials").sum(0)[0]
        return (y[:batch] if config.batch_m else y[:, :batch].T).astype(out_dtype)

    def kernel(h_gmem, w_gmem, out_gmem):
        _await_inputs(interpret)
        tile = lax.axis_index("tile")
        (acc,) = _stream(h_gmem, w_gmem, (tile,), config, bp)
        store = functools.partial(_store_rows, bp=bp) if config.batch_m else _store_transposed
        store(acc.astype(jnp.bfloat16), out_gmem, tile * config.block_rows)

    return plgpu.kernel(
        kernel, out_type=jax.ShapeDtypeStruct((batch, rows), jnp.bfloat16),
        grid=(rows // config.block_rows,),
        grid_names=("tile",), interpret=_interpret_params(interpret), kernel_name="shared_down_tma",
    )(hidden, down)


def gate_up_situ(x, gate_up, beta: float, linear_beta: float, *, config: GemmConfig,
                 interpret: bool = False):
    """Kernel 1: ``situ(bf16(x @ gate.T), bf16(x @ up.T))`` ``[B, S_r]`` bfloat16 from ``x``
    ``[B, H]`` and ``gate_up`` ``[2 S_r, H]`` (gate rows, then up rows), both bfloat16."""
    _check(x, gate_up, gate_up.shape[0] // 2, config, "gate_up")
    hidden = _gate_up(_tma_rows(x), gate_up, beta, linear_beta, config, interpret)
    return hidden[: x.shape[0]]


def gate_up_situ_t(x, gate_up, beta: float, linear_beta: float, *, config: GemmConfig,
                   interpret: bool = False):
    """Kernel 1 with K split (``config.split_k > 1``), transposed: ``hidden.T`` ``[S_r, Bp]``
    bfloat16 (``Bp`` = B rounded up to 8; its columns past B zero), for a down kernel that reads
    ``hidden`` so (``shared_expert.down_proj_t``); ``gate_up_situ`` is this, sliced and
    transposed."""
    _check(x, gate_up, gate_up.shape[0] // 2, config, "gate_up")
    if config.split_k == 1:
        raise ValueError(f"gate_up_situ_t needs K split (split_k > 1), got {config}")
    return _hidden_t(_tma_rows(x), gate_up, beta, linear_beta, config, interpret)


def down_proj(hidden, down, out_dtype=jnp.bfloat16, *, config: GemmConfig,
              interpret: bool = False):
    """Kernel 2: ``hidden @ down.T`` ``[B, H]`` in ``out_dtype`` from ``hidden`` ``[B, S_r]`` and
    ``down`` ``[H, S_r]``, both bfloat16, float32 accumulation."""
    _check(hidden, down, down.shape[0], config, "down")
    return _down(_tma_rows(hidden), down, out_dtype, config, interpret)[: hidden.shape[0]]


def shared_expert(x, gate_up, down, beta: float, linear_beta: float, out_dtype=jnp.bfloat16, *,
                  gate_up_config: GemmConfig, down_config: GemmConfig, interpret: bool = False):
    """Both kernels: ``down_proj(gate_up_situ(x, ...), ...)`` ``[B, H]`` in ``out_dtype``, with
    ``hidden`` passed between them in the rows the TMA copies (one pad and one slice at most)."""
    _check(x, gate_up, gate_up.shape[0] // 2, gate_up_config, "gate_up")
    hidden = _gate_up(_tma_rows(x), gate_up, beta, linear_beta, gate_up_config, interpret)
    _check(hidden, down, down.shape[0], down_config, "down")
    return _down(hidden, down, out_dtype, down_config, interpret)[: x.shape[0]]
