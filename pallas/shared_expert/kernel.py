"""The shared expert stage (SPEC section 6): its gate/up kernel, then its down kernel, each from the
implementation its config names (Triton ``triton``'s grid or vector schedule, or Mosaic GPU
``tma``), chosen per shape by the device's tuning table (``select``).

Under tp the result is this rank's float32 partial, reduced by the caller. Both GEMMs are bound by
reading their weight once: ``6 S_r H`` bytes of weights and ``6 B S_r H`` FLOPs a call, plus each
kernel's own traffic (``triton``, ``tma``). Both GEMMs in one launch was slower at every shape,
in Triton and Mosaic GPU (docs/findings.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas.device import tuning_entries
from moe_front_jax.pallas.gemm import schedule
from moe_front_jax.pallas.gemm.schedule import (
    MIN_DOT,
    GridConfig,
    Selection,
    VectorConfig,
    config_from_json,
    padded_batch,
)
from moe_front_jax.pallas.shared_expert import tma, triton
from moe_front_jax.pallas.shared_expert.tma import TmaConfig

KernelConfig = GridConfig | VectorConfig | TmaConfig
"""The schedule of one of the two kernels; its class names the implementation that runs it."""
KERNEL_CONFIGS = (GridConfig, VectorConfig, TmaConfig)


@dataclasses.dataclass(frozen=True)
class SharedExpertConfig:
    """Schedules of the two kernels.

    Attributes:
      gate_up: the gate/up GEMM's (``block_rows`` gate rows and as many up rows per program; K = H).
      down: the down GEMM's (``block_rows`` of the H output rows per program; K = S_r).
    """

    gate_up: KernelConfig
    down: KernelConfig

    def __post_init__(self):
        for name in ("gate_up", "down"):
            if not isinstance(getattr(self, name), KERNEL_CONFIGS):
                raise ValueError(f"SharedExpertConfig.{name} must be a GridConfig, VectorConfig or "
                                 f"TmaConfig, got {getattr(self, name)!r}")

    @property
    def implementation(self) -> str:
        """The two kernels' implementations, ``"gate_up=..., down=..."``."""
        return f"gate_up={self.gate_up.IMPLEMENTATION}, down={self.down.IMPLEMENTATION}"

    @classmethod
    def from_json(cls, entry: dict) -> SharedExpertConfig:
        """A tuning-table entry: ``gate_up`` and ``down`` as ``gemm.schedule.config_to_json``
        writes them."""
        return cls(*(config_from_json(entry[name], KERNEL_CONFIGS) for name in ("gate_up", "down")))


def table_key(shared_per_rank: int, hidden: int, batch: int) -> str:
    """Key of a tuning-table entry: the rank's slice and the batch rounded up to a power of two."""
    return f"shared={shared_per_rank},hidden={hidden},batch={schedule.batch_key(batch)}"


def load_table(kind: str) -> dict[str, SharedExpertConfig]:
    """The tuning table of device ``kind``: ``key -> config`` (empty where there is none)."""
    return {key: SharedExpertConfig.from_json(entry)
            for key, entry in tuning_entries(kind, "shared_expert").items()}


def heuristic_config(shared_per_rank: int, hidden: int, batch: int, cores: int) -> SharedExpertConfig:
    """Grid schedules for a device without a table (``gemm.schedule.heuristic``): gate/up
    programs take 16 gate + 16 up rows up to a batch tile of 32, twice that above (each tile re-reads
    ``x`` from L2); down programs 32 rows, 64 above a batch tile of 64."""
    bp = padded_batch(batch)
    gate_rows = 16 if bp <= 32 else 32
    down_rows = 32 if bp <= 64 else 64
    return SharedExpertConfig(
        schedule.heuristic(-(-shared_per_rank // gate_rows), hidden, gate_rows, batch, cores,
                           parts=2),
        schedule.heuristic(-(-hidden // down_rows), shared_per_rank, down_rows, batch, cores),
    )


def select(shared_per_rank: int, hidden: int, batch: int) -> Selection:
    """Which implementations and schedules run the shared expert at these shapes: the target
    device's table entry (``gemm.schedule.lookup``), else ``heuristic_config``. Returns
    ``Selection(implementation, config, reason)``, the implementation ``"gate_up=..., down=..."``."""
    config, reason = schedule.lookup(
        load_table, lambda size: table_key(shared_per_rank, hidden, size), batch,
        lambda cores: heuristic_config(shared_per_rank, hidden, batch, cores))
    return Selection(config.implementation, config, reason)


def selects(x, gate_up, down, cfg, out_dtype=jnp.bfloat16) -> Selection:
    """``select`` for the stage arguments of ``shared_expert``."""
    del gate_up, cfg, out_dtype
    return select(down.shape[1], x.shape[1], x.shape[0])


def pick_config(shared_per_rank: int, hidden: int, batch: int) -> SharedExpertConfig:
    """``select(...).config``."""
    return select(shared_per_rank, hidden, batch).config


def auto_prefers_kernel(x, gate_up, down, cfg, out_dtype=jnp.bfloat16) -> bool:
    """``backend="auto"``'s choice for ``shared_expert(x, gate_up, down, cfg, out_dtype)``: True
    where the target device's auto table measured these kernels faster than
    ``reference.shared_expert`` at these shapes (``gemm.schedule.auto_prefers``). The table's runs
    are in the dtype ``moe_front`` asks for (bfloat16 at tp1, the float32 partial under tp)."""
    del gate_up, cfg, out_dtype
    return schedule.auto_prefers("shared_expert", x, down,
                                 lambda: table_key(down.shape[1], x.shape[1], x.shape[0]))


def covers(x, gate_up, down, cfg, out_dtype=jnp.bfloat16) -> None:
    """Raise ``NotImplementedError`` where the kernels do not cover these arguments (``B > 256``, H
    or S_r not a multiple of 16, an activation other than situ), ``ValueError`` where they are
    wrong."""
    schedule.check_matrices(x=x, gate_up=gate_up, down=down)
    if not isinstance(cfg, FrontConfig):
        raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
    triton.check_situ(cfg)
    (batch, hidden), (two_s, gu_hidden) = x.shape, gate_up.shape
    if gu_hidden != hidden or two_s == 0 or two_s % 2:
        raise ValueError(
            f"gate_up must be [2 S_r, H={hidden}] with S_r >= 1, got {gate_up.shape}"
        )
    if down.shape != (hidden, two_s // 2):
        raise ValueError(
            f"down must be [H, S_r] = {(hidden, two_s // 2)} to match x and gate_up, got {down.shape}"
        )
    if jnp.dtype(out_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"out_dtype must be bfloat16 or float32, got {out_dtype}")
    if batch == 0:
        raise ValueError(f"x is an empty batch (shape {x.shape}); B must be >= 1")
    schedule.check_batch_covered("shared_expert", batch)
    if hidden % MIN_DOT or (two_s // 2) % MIN_DOT:
        raise NotImplementedError(
            f"shared_expert needs H and S_r to be multiples of {MIN_DOT}, got H={hidden}, "
            f"S_r={two_s // 2}; use backend='xla'"
        )


def shared_expert(
    x: jax.Array,
    gate_up: jax.Array,
    down: jax.Array,
    cfg: FrontConfig,
    out_dtype: jnp.dtype = jnp.bfloat16,
    *,
    interpret: bool = False,
    config: SharedExpertConfig | None = None,
) -> jax.Array:
    """The shared expert on one rank's slice (SPEC section 6); a partial sum when ``cfg.tp > 1``.

    ``x`` ``[B, H]`` bfloat16 (``1 <= B <= 256``), ``gate_up`` ``[2 S_r, H]`` bfloat16 (gate rows,
    then up rows), ``down`` ``[H, S_r]`` bfloat16, ``cfg`` the model's (situ's betas); ``config``
    None runs ``select``'s. Returns ``[B, H]`` ``out_dtype`` (bfloat16, or a float32 partial):
    ``situ(bf16(gate), bf16(up)) @ down.T`` with float32 sums, as ``reference.shared_expert``.

    Raises:
      ValueError: wrong shapes or dtypes, a config that does not divide H or S_r.
      NotImplementedError: ``B > 256``, H or S_r not a multiple of 16, an activation other than
        situ, or a TMA schedule asked for ``B > 64`` or rows it does not cut (use
        ``backend='xla'``).
    """
    covers(x, gate_up, down, cfg, out_dtype)
    s_r, hidden = down.shape[1], x.shape[1]
    config = config or pick_config(s_r, hidden, x.shape[0])
    if not isinstance(config, SharedExpertConfig):
        raise ValueError(f"config must be a SharedExpertConfig or None, got {type(config).__name__}")
    betas = (cfg.situ_beta, cfg.linear_beta)
    gate_up_tma, down_tma = (isinstance(c, TmaConfig) for c in (config.gate_up, config.down))
    if gate_up_tma and down_tma:
        return tma.shared_expert(x, gate_up, down, *betas, out_dtype, gate_up_config=config.gate_up,
                                 down_config=config.down, interpret=interpret)
    if gate_up_tma:
        if (config.gate_up.split_k > 1 and not config.gate_up.batch_m
                and isinstance(config.down, GridConfig)):
            # hidden stays in the layout of the TMA kernel's partials (the batch minor): one XLA
            # fusion between the kernels instead of two. (batch_m's partials are batch-major.)
            h_t = tma.gate_up_situ_t(x, gate_up, *betas, config=config.gate_up,
                                     interpret=interpret)
            return triton.down_proj_t(h_t, down, x.shape[0], out_dtype, interpret=interpret,
                                      config=config.down)
        h = tma.gate_up_situ(x, gate_up, *betas, config=config.gate_up, interpret=interpret)
    else:
        h = triton.gate_up_situ(x, gate_up, *betas, interpret=interpret, config=config.gate_up)
    if down_tma:
        return tma.down_proj(h, down, out_dtype, config=config.down, interpret=interpret)
    return triton.down_proj(h, down, out_dtype, interpret=interpret, config=config.down)
