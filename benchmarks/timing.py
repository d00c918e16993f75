"""What the benchmarks and tuners share (GPU, except the span parsing): shapes, rotated weights,
CUPTI timing, the float64 contract, and a call's span from a profiler trace.

Times are CUPTI kernel times (every kernel a call launches, summed), per call, over weight copies
rotated past the L2: each call reads a weight no earlier call left in cache, as a decode step reads
each layer's weight once. ``span`` measures what CUPTI's sums leave out, the gaps between a call's
kernels: XLA and the Mosaic GPU kernels that wait first thing launch with programmatic dependent
launch, so each starts as the one before ends; the Triton kernels do not.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import moe_front_jax as mf
from moe_front_jax import params as mfp
from moe_front_jax.pallas import device

ROTATION_BYTES = 256 << 20
"""Weight copies per shape add up to at least this (over 4x the L2)."""
READ_CEILING_TBS = device.READ_CEILING_TBS
"""The floor is the weight bytes over this (a bfloat16 sum over 2 GiB on the H200, 2026-12-02)."""


@dataclasses.dataclass(frozen=True)
class RankShape:
    """One rank's share of K3 at ``tp`` (``FrontShape(tp)``); the sizes follow from ``cfg``."""

    tp: int

    @property
    def cfg(self) -> mf.FrontConfig:
        return mf.KIMI_K3.with_tp(self.tp)

    @property
    def hidden(self) -> int:
        return self.cfg.hidden


class FrontShape(RankShape):
    """One rank's front GEMM: ``valid`` router rows, zero rows up to ``split``, ``shard`` latent
    rows."""

    @property
    def valid(self) -> int:
        return self.cfg.experts_per_rank

    @property
    def split(self) -> int:
        return mfp.padded_split(self.valid)

    @property
    def shard(self) -> int:
        return self.cfg.latent_per_rank

    @property
    def rows(self) -> int:
        return self.split + self.shard

    @property
    def weight_bytes(self) -> int:
        """Bytes a kernel that skips the padding rows reads (the floor's numerator)."""
        return 2 * (self.valid + self.shard) * self.hidden

    @property
    def packed_bytes(self) -> int:
        return 2 * self.rows * self.hidden

    def floor_us(self) -> float:
        return self.weight_bytes / (READ_CEILING_TBS * 1e12) * 1e6


def packed_weights(shape: FrontShape, seed: int = 0) -> list[jax.Array]:
    """``random_copies`` of a packed weight ``[rows, H]``, its padding rows zero."""
    row = jnp.arange(shape.rows)
    keep = ((row < shape.valid) | (row >= shape.split))[:, None]
    return random_copies((shape.rows, shape.hidden), shape.hidden, shape.packed_bytes, seed, keep)


LOGITS_RTOL = 1e-5
"""The logits' bound against a float64 product, relative to ``max(|y|, the row's RMS)``;
the latent's is one bfloat16 ulp at that magnitude. The GPU test holds the kernel to the same."""


def float64_product(x: jax.Array, w: jax.Array) -> np.ndarray:
    return np.asarray(x, np.float64) @ np.asarray(w, np.float64).T


def contract_errors(logits, latent, y: np.ndarray, split: int) -> tuple[float, float]:
    """(logits, latent) errors against the float64 product ``y`` ``[B, rows]``, in units of their
    bounds: the largest ``|err| / (LOGITS_RTOL * mag)`` and ``|err| / ulp_bf16(mag)``, with ``mag =
    max(|y|, the row's RMS)``; both at most 1 within the contract."""
    mag = np.maximum(np.abs(y), np.sqrt((y**2).mean(axis=1, keepdims=True)))
    valid = logits.shape[1]
    err_l = np.abs(np.asarray(logits, np.float64) - y[:, :valid]) / (LOGITS_RTOL * mag[:, :valid])
    ulp = np.exp2(np.floor(np.log2(np.maximum(mag[:, split:], 2.0**-126))) - 7)
    err_t = np.abs(np.asarray(latent.astype(jnp.float32), np.float64) - y[:, split:]) / ulp
    return float(err_l.max()), float(err_t.max())


def cupti_us_per_call(fn, x, weights, rounds: int = 2) -> tuple[float, list[str]]:
    """Median over calls of the summed CUPTI kernel time of ``fn(x, w)``, rotating ``weights``.

    ``fn`` is compiled; it is called ``rounds * len(weights)`` times. Returns (microseconds, the names
    of the kernels one call launches).
    """
    per_kernel = cupti_us_per_kernel(fn, x, weights, rounds)
    return statistics.median(map(sum, zip(*per_kernel.values()))), list(per_kernel)


def cupti_us_per_kernel(fn, x, weights, rounds: int = 2, attempts: int = 3
                        ) -> dict[str, list[float]]:
    """The CUPTI time of each kernel ``fn(x, w)`` launches, in launch order: name -> microseconds
    per call, over ``rounds * len(weights)`` calls rotating ``weights``.

    CUPTI also records kernels that other threads launch meanwhile (XLA autotuning the variants a
    tuner compiles beside the timing): where the calls' records then disagree (their count is not a
    multiple of the calls, or a call's kernel names differ from the first call's), the calls are
    timed again, up to ``attempts`` times in all."""
    from jax._src.lib import mosaic_gpu as mosaic_gpu_lib  # GPU jaxlib only

    jax.block_until_ready(fn(x, weights[0]))
    ext = mosaic_gpu_lib._mosaic_gpu_ext
    calls = rounds * len(weights)
    for _ in range(attempts):
        ext._cupti_init()
        try:
            outs = [fn(x, weights[i % len(weights)]) for i in range(calls)]
            jax.block_until_ready(outs)
        finally:
            timings = ext._cupti_get_timings(True)
        if timings and len(timings) % calls == 0:
            per = len(timings) // calls
            names = [name for name, _ in timings[:per]]
            if all([name for name, _ in timings[c * per:(c + 1) * per]] == names
                   for c in range(calls)):
                break
    else:
        raise RuntimeError(f"{len(timings or [])} kernels over {calls} calls, {attempts} times")
    if len(set(names)) < per:  # the same kernel twice a call: number the repeats
        names = [f"{name}#{i}" for i, name in enumerate(names)]
    return {name: [timings[c * per + i][1] * 1e3 for c in range(calls)]
            for i, name in enumerate(names)}


TUNE_SMEM_BUDGET = 200 * 1024
"""The tuners' candidates keep their pipeline buffers under this (a Hopper SM has 227 KiB of shared
memory)."""


def config_label(config: dict) -> str:
    """A tuning-table config (``gemm.schedule.config_to_json``'s form) in one short line: its
    implementation, then its fields."""
    fields = " ".join(f"{k}={v}" for k, v in config.items() if k != "implementation")
    return f"{config.get('implementation')} {fields}"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def vector_schedules(tiles, k: int, parts: int, batch: int, cores: int = 132
                     ) -> list[tuple[int, int, int]]:
    """``(block_rows, block_k, num_warps)`` of the vector schedules worth timing for a batch of at
    most ``gemm.schedule.VECTOR_MAX_BATCH``: 1 to 16 rows per program where ``tiles(rows)`` programs give
    every one of ``cores`` SMs one; K steps of 256 to 1024 that divide ``k`` (one to four 16-byte
    loads a thread per row); 2, 4 or 8 warps; at most 64 float32 accumulator registers a thread
    (``parts`` row blocks x ``batch`` rows x ``block_rows x block_k`` over the threads)."""
    return [(bn, bk, warps)
            for bn in (1, 2, 4, 8, 16) if tiles(bn) >= cores
            for bk in (256, 512, 1024) if k % bk == 0
            for warps in (2, 4, 8) if parts * batch * bn * bk <= 64 * 32 * warps]


def xla_dot(x, w):
    """XLA's ``dot_general`` over the packed weight, bf16 x bf16 -> f32 (the anchor of docs/findings.md's
front GEMM)."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def tbs(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e12


# The shared expert: gate_up [2 S_r, H], down [H, S_r]


class SharedShape(RankShape):
    """One rank's shared expert: gate_up ``[2 S_r, H]``, down ``[H, S_r]``."""

    @property
    def shared(self) -> int:
        return self.cfg.shared_per_rank

    @property
    def gate_up_bytes(self) -> int:
        return 2 * 2 * self.shared * self.hidden

    @property
    def down_bytes(self) -> int:
        return 2 * self.hidden * self.shared

    @property
    def weight_bytes(self) -> int:
        """The bytes a call must read (the floor's numerator): both weights."""
        return self.gate_up_bytes + self.down_bytes

    def floor_us(self, nbytes: int | None = None) -> float:
        return (nbytes or self.weight_bytes) / (READ_CEILING_TBS * 1e12) * 1e6


def random_copies(shape: tuple[int, int], fan_in: int, nbytes: int, seed: int,
                  keep: jax.Array | None = None) -> list[jax.Array]:
    """Copies of a random bf16 weight (normal / sqrt(fan_in); zero where ``keep``, broadcast to
    ``shape``, is False), enough of them to exceed ``ROTATION_BYTES`` together (at least two); each a
    distinct buffer with distinct values."""
    copies = max(2, -(-ROTATION_BYTES // nbytes))

    @jax.jit
    def one(k):
        w = jax.random.normal(k, shape, jnp.float32) / np.sqrt(fan_in)
        return (w if keep is None else jnp.where(keep, w, 0)).astype(jnp.bfloat16)

    return [one(k) for k in jax.random.split(jax.random.key(seed), copies)]


def gate_up_copies(s: SharedShape, seed: int = 0) -> list[jax.Array]:
    return random_copies((2 * s.shared, s.hidden), s.hidden, s.gate_up_bytes, seed)


def down_copies(s: SharedShape, seed: int = 1) -> list[jax.Array]:
    return random_copies((s.hidden, s.shared), s.shared, s.down_bytes, seed)


def rows(batch: int, width: int, seed: int = 2) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (batch, width), jnp.float32).astype(jnp.bfloat16)


# Spans of whole calls

CHAIN = 8
"""Calls per jitted program in the span measure."""


def chain_program(fn, xs, pairs, small: bool = False):
    """A jitted, warmed program of ``len(xs)`` calls, one after another: call i on ``xs[i]`` and
    ``pairs[i]`` (no operand shared, so XLA merges no dots across calls), its ``xs[i]`` passed
    through an optimization barrier with call i - 1's output, so that XLA cannot start a call
    before the one before it has finished, nor interleave their kernels (it did, with independent
    calls at tp8 B=1 on 2026-12-06, c486ce7), as the layers of a decode step follow one another.
    ``small``: the program returns one float32 scalar, as a serving loop's step returns little, not
    every output: one element of each output of every call, each taken after a barrier, so that
    XLA can neither drop a call's work nor narrow it to that element (without the barriers it
    dropped most of it: docs/findings.md, the layer kernel)."""

    def calls(xs, ws):
        outs, held = [fn(xs[0], ws[0])], []
        for x, w in zip(xs[1:], ws[1:]):
            out, x = lax.optimization_barrier((outs[-1], x))
            held.append(out)
            outs.append(fn(x, w))
        if small:
            held.append(lax.optimization_barrier(outs[-1]))
            return sum(leaf.reshape(-1)[0].astype(jnp.float32) for leaf in jax.tree.leaves(held))
        return outs

    program = jax.jit(calls)
    jax.block_until_ready(program(xs, pairs))
    return functools.partial(program, xs, pairs)


def kernel_kind(name: str) -> str:
    """A kernel's name without what differs between programs: XLA's fusion numbers
    (``loop_convert_fusion_1``) and Mosaic GPU's suffix."""
    return re.sub(r"(_\d+)+$", "", name.removesuffix("_mosaic_gpu_kernel"))


def call_spans(timeline: list, kernels_per_call: int) -> list[float]:
    """Each call's span in a program's ``timeline`` (``(name, start, duration)`` in time order):
    from its first kernel's start to its last kernel's end, in microseconds."""
    calls = [timeline[at:at + kernels_per_call] for at in range(0, len(timeline), kernels_per_call)]
    return [max(start + duration for _, start, duration in call) - call[0][1] for call in calls]


def span(row: dict, program, programs: int = 12, calls: int = CHAIN) -> None:
    """For ``program`` (``chain_program``'s; ``row["kernels"]`` the kernels of one call), from a
    profiler trace of ``programs`` programs of ``calls`` calls run one at a time: ``spans_of``'s
    keys in ``row``. The trace keeps the kernels of only some programs (three of twelve in the PDL
    probe's runs, 2026-12-06). It holds CUPTI, as the CUPTI timing does, so it runs after all of
    that."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            for _ in range(programs):
                jax.block_until_ready(program())
        trace_file, = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz"))
        with gzip.open(trace_file) as f:
            row.update(spans_of(json.load(f)["traceEvents"], row["kernels"], calls))


PROGRAM_GAP_US = 500.0
"""``trace_programs`` pauses 2 ms between programs; the GPU idles this long only between them."""


def stream_kernels(events: list[dict]) -> list[tuple[float, float, str]]:
    """``(start, end, name)`` of the kernels on a trace's GPU streams, in time order."""
    streams = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M"
               and e.get("name") == "thread_name"
               and e.get("args", {}).get("name", "").startswith("Stream")}
    return sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                  if e.get("ph") == "X" and (e.get("pid"), e.get("tid")) in streams)


def programs_of(events: list[dict], gap_us: float = PROGRAM_GAP_US) -> list[list[tuple]]:
    """A trace's GPU kernels cut into programs wherever the GPU idled over ``gap_us`` (from the
    latest end so far to the next start): each program's kernels as ``(name, start, duration)``
    in microseconds from its first start. Needs no kernel names, so it holds for programs whose
    layers XLA fused differently."""
    programs, last_end = [], None
    for start, end, name in stream_kernels(events):
        if last_end is None or start - last_end > gap_us:
            programs.append([])
        programs[-1].append((name, start, end))
        last_end = end if last_end is None else max(last_end, end)
    return [[(name, round(s - p[0][1], 2), round(e - s, 2)) for name, s, e in p] for p in programs]


def trace_programs(program, programs: int) -> list[list[tuple]]:
    """Run ``program`` ``programs`` times, one at a time and 2 ms apart, under a profiler trace;
    ``programs_of`` the trace. The trace's kernels are CUPTI's (the profiler subscribes to it), so
    nothing else may time with CUPTI while it runs, nor after it in the same process (an H100
    dropped activity records, 2026-12-07)."""
    with tempfile.TemporaryDirectory() as log_dir:
        with jax.profiler.trace(log_dir):
            for _ in range(programs):
                jax.block_until_ready(program())
                time.sleep(0.002)
        trace_file, = glob.glob(os.path.join(log_dir, "plugins", "profile", "*", "*.trace.json.gz"))
        with gzip.open(trace_file) as f:
            return programs_of(json.load(f)["traceEvents"])


def spans_of(events: list[dict], call_kernels: list[str], calls: int = CHAIN) -> dict:
    """From a trace's ``events`` (Chrome trace format) of ``chain_program`` programs of ``calls``
    calls, each launching ``call_kernels``, in order: ``call_span_us``, the median over the traced
    calls of a call's span (its first kernel's start to its last kernel's end: the gap between its
    kernels counts, and so does the overlap PDL gives); ``timeline``, each traced program's kernels
    as ``(name, start, duration)`` in microseconds from its first start; ``programs_traced``. The
    gaps between calls may hold the host's launches (the trace's own cost included), so no span
    across calls is taken. A count of kernels on the GPU's streams that is not a whole number of
    programs, or a program whose kernels are not its calls' one after another (``kernel_kind``),
    gives ``span_error`` alone."""
    kernels = stream_kernels(events)
    per_call = len(call_kernels)
    size = per_call * calls
    if not kernels or len(kernels) % size:
        return dict(span_error=f"{len(kernels)} events on the GPU's streams, not a whole number "
                               f"of programs of {size} kernels")
    programs = [kernels[at:at + size] for at in range(0, len(kernels), size)]
    expected = [kernel_kind(name) for name in call_kernels] * calls
    if any([kernel_kind(name) for _, _, name in program] != expected for program in programs):
        return dict(span_error="a traced program's kernels are not its calls' one after another")
    timeline = [[(name, round(start - program[0][0], 2), round(end - start, 2))
                 for start, end, name in program] for program in programs]
    return dict(programs_traced=len(programs), timeline=timeline, call_span_us=float(np.median(
        [s for one in timeline for s in call_spans(one, per_call)])))


def write_result(out: str, name: str, device_kind: str, rows: list[dict], stage: str,
                 ceiling_tbs: float, label: str, **extra) -> None:
    """``$out/<name>.json`` in benchmarks/README.md's format: ``rows`` and ``stage``'s floor at
    ``ceiling_tbs`` (shown as ``label``), and any ``extra`` keys."""
    os.makedirs(out, exist_ok=True)
    result = dict(device=device_kind, rows=rows,
                  floors={stage: {"bandwidth_gbs": ceiling_tbs * 1e3, "label": label}}, **extra)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
