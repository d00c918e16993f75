"""Weights of the MoE front: seeded initialisation, validation, and packing into ``FrontParams``.

The weights are a flat mapping under the model's module names (SPEC.md section 2). ``pack_params``
turns one rank's share of them into the layout the kernels read: the packed
``[router rows; zero rows; latent rows]`` front weight (SPEC section 3), the full correction bias, and
the rank's slice of the shared expert. ``unpack_params`` turns every rank's share back into the weights.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jax.sharding import PartitionSpec

from moe_front_jax.config import FrontConfig

GATE = "gate.weight"
BIAS = "gate.e_score_correction_bias"
ROUTED_DOWN = "routed_down_weight"
GATE_UP = "shared_experts.gate_up_proj.weight"
DOWN = "shared_experts.down_proj.weight"
SHARED_KEYS = (GATE_UP, DOWN)
GATE_PROJ = "shared_experts.gate_proj.weight"
UP_PROJ = "shared_experts.up_proj.weight"
SPLIT_GATE_UP = (GATE_PROJ, UP_PROJ)
"""DeepSeek-V3, Kimi-K2 and GLM-4.5 checkpoints hold the shared expert's gate and up as these two
``[S, H]`` keys; ``GATE_UP`` stacks them, gate rows first."""

DEFAULT_SPLIT_ALIGN = 16
"""Router rows are padded with zero rows up to a multiple of this before the latent rows start."""


def weight_shapes(cfg: FrontConfig) -> dict[str, tuple[tuple[int, ...], jnp.dtype]]:
    """Expected ``(shape, dtype)`` of every weight key for ``cfg`` (unsharded, SPEC section 2): no
    ``BIAS`` without ``cfg.bias``, no ``ROUTED_DOWN`` at ``latent = 0``, no shared keys at ``shared = 0``."""
    h, e, lat, s = cfg.hidden, cfg.experts, cfg.latent, cfg.shared
    shapes = {GATE: ((e, h), jnp.bfloat16)}
    if cfg.bias:
        shapes[BIAS] = ((e,), jnp.float32)
    if lat:
        shapes[ROUTED_DOWN] = ((lat, h), jnp.bfloat16)
    if s:
        shapes[GATE_UP] = ((2 * s, h), jnp.bfloat16)
        shapes[DOWN] = ((h, s), jnp.bfloat16)
    return shapes


def absent_keys(names, cfg: FrontConfig) -> str | None:
    """Why a weight in ``names`` (SPEC keys) contradicts ``cfg``, or None: a correction bias for a
    config without one (routing would ignore it: the wrong preset, or ``bias=False`` by mistake), a
    latent down-projection at ``latent = 0`` (a front without a latent would drop it)."""
    if BIAS in names and not cfg.bias:
        return (f"{BIAS!r} is given but FrontConfig.bias is False (scoring={cfg.scoring!r}): routing "
                "would ignore it; use a config with bias=True, or leave the key out")
    if ROUTED_DOWN in names and not cfg.latent:
        return (f"{ROUTED_DOWN!r} is given but FrontConfig.latent is 0: the front would drop it; "
                "use a config with its latent width, or leave the key out")
    return None


def normal(key: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
    """Seeded normals ``[*shape]`` scaled by ``1 / sqrt(fan_in)``, bfloat16 (``init_weights``')."""
    return (jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)).astype(jnp.bfloat16)


def init_weights(key: jax.Array, cfg: FrontConfig, shared: bool | None = None
                 ) -> dict[str, jax.Array]:
    """Seeded random weights at realistic scales, under the keys of SPEC section 2.

    Projections are normal with standard deviation ``1 / sqrt(fan_in)``, so unit-variance rows give
    unit-variance logits, latent and gate/up; the correction bias is uniform in ``[-0.05, 0.05)``.
    ``key`` is a ``jax.random`` key; ``shared`` includes the shared expert's weights (the default,
    None: exactly when ``cfg.shared > 0``).

    Returns ``{name: array}``: ``gate.weight`` ``[E, H]`` bf16, ``gate.e_score_correction_bias``
    ``[E]`` f32 (with ``cfg.bias``), ``routed_down_weight`` ``[L, H]`` bf16 (with ``cfg.latent``),
    and with ``shared`` ``shared_experts.gate_up_proj.weight`` ``[2S, H]`` and
    ``shared_experts.down_proj.weight`` ``[H, S]`` bf16. Raises ``ValueError`` for a ``key`` that is
    not a ``jax.random`` key, or ``shared=True`` for a config without a shared expert.
    """
    check_key(key)
    if shared is None:
        shared = cfg.shared > 0
    elif shared and not cfg.shared:
        raise ValueError("init_weights: shared=True needs FrontConfig.shared > 0, got 0")
    keys = jax.random.split(key, 5)
    h = cfg.hidden
    weights = {GATE: normal(keys[0], (cfg.experts, h), h)}
    if cfg.bias:
        weights[BIAS] = jax.random.uniform(keys[1], (cfg.experts,), jnp.float32, -0.05, 0.05)
    if cfg.latent:
        weights[ROUTED_DOWN] = normal(keys[2], (cfg.latent, h), h)
    if shared:
        weights[GATE_UP] = normal(keys[3], (2 * cfg.shared, h), h)
        weights[DOWN] = normal(keys[4], (h, cfg.shared), cfg.shared)
    return weights


def check_key(key) -> None:
    """``key`` must be a ``jax.random`` key: a typed key (``jax.random.key``) or a legacy ``uint32``
    ``[2]`` array (``jax.random.PRNGKey``), concrete or traced."""
    dtype, shape = getattr(key, "dtype", None), getattr(key, "shape", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key) and shape == ()
    legacy = dtype == jnp.uint32 and tuple(shape or ()) == (2,)
    if not (typed or legacy):
        got = f"{type(key).__name__} {key!r}" if dtype is None else f"{tuple(shape)} {dtype}"
        raise ValueError(
            f"key must be a jax.random key (jax.random.key(seed), or a uint32 [2] "
            f"jax.random.PRNGKey), got {got}"
        )


def check_weights(weights: Mapping[str, jax.Array], cfg: FrontConfig) -> bool:
    """Validate ``weights`` against ``cfg``; returns whether the shared expert is present.

    Raises:
      ValueError: naming the key whose array is missing or has the wrong shape or dtype, when only
        one of the two shared-expert keys is given, or a key ``cfg`` has no place for
        (``absent_keys``).
    """
    if not isinstance(weights, Mapping):
        raise ValueError(f"weights must be a mapping of name -> array, got {type(weights).__name__}")
    if why := absent_keys(weights, cfg):
        raise ValueError(f"weights: {why}")
    expected = weight_shapes(cfg)
    present = [k for k in SHARED_KEYS if k in weights]
    if len(present) == 1:
        missing = next(k for k in SHARED_KEYS if k not in weights)
        raise ValueError(f"weights has {present[0]!r} but not {missing!r}: give both or neither")
    if present and not cfg.shared:
        raise ValueError("weights has shared-expert keys but FrontConfig.shared is 0")
    for name, (shape, dtype) in expected.items():
        if name in SHARED_KEYS and not present:
            continue
        if name not in weights:
            raise ValueError(f"weights is missing key {name!r} (expected {shape} {jnp.dtype(dtype)})")
        array = weights[name]
        if tuple(array.shape) != shape or array.dtype != dtype:
            raise ValueError(
                f"weights[{name!r}] is {tuple(array.shape)} {array.dtype}, "
                f"expected {shape} {jnp.dtype(dtype)}"
            )
    return bool(present)


def check_split_align(split_align) -> int:
    """``split_align`` as an ``int`` (a NumPy integer is taken as its int); raises ``ValueError``
    unless it is a positive integer."""
    if (not isinstance(split_align, numbers.Integral) or isinstance(split_align, bool)
            or split_align <= 0):
        raise ValueError(f"split_align must be a positive int, got {split_align!r}")
    return int(split_align)


def padded_split(valid: int, align: int = DEFAULT_SPLIT_ALIGN) -> int:
    """First latent row of the packed weight: ``valid`` router rows rounded up to ``align``."""
    return -(-valid // align) * align


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FrontParams:
    """One rank's weights in the layout the front reads (a pytree; the config and split are static).

    Attributes:
      packed: ``[split + L/tp, H]`` bfloat16: the rank's ``E/tp`` router rows, zero rows up to
        ``split``, then its ``L/tp`` latent down-projection rows.
      bias: ``[E]`` float32 correction bias of every expert (routing ranks all of them on every rank);
        zeros for a config without one (``cfg.bias`` False).
      gate_up: ``[2 S/tp, H]`` bfloat16, the rank's gate rows then its up rows; None without a shared
        expert.
      down: ``[H, S/tp]`` bfloat16, the rank's down-projection columns; None without a shared expert.
      cfg: the model config, ``cfg.tp`` the number of ranks.
      split: first latent row of ``packed``.
      mesh, axis: set by ``shard_params``: the arrays are then global, each device of mesh axis
        ``axis`` holding its rank's block (``moe_front_jax.parallel``); None for one rank's params.
    """

    packed: jax.Array
    bias: jax.Array
    gate_up: jax.Array | None
    down: jax.Array | None
    cfg: FrontConfig = dataclasses.field(metadata=dict(static=True))
    split: int = dataclasses.field(metadata=dict(static=True))
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = dataclasses.field(
        default=None, metadata=dict(static=True)
    )
    axis: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    @property
    def has_shared(self) -> bool:
        return self.gate_up is not None


def param_specs(axis: str) -> dict[str, PartitionSpec]:
    """``PartitionSpec`` of each array of sharded ``FrontParams`` (and of ``mf.nn.MoEFront``'s Params)."""
    return {
        "packed": PartitionSpec(axis, None),
        "bias": PartitionSpec(),
        "gate_up": PartitionSpec(axis, None),
        "down": PartitionSpec(None, axis),
    }


def check_param_arrays(params: FrontParams, ranks: int, where: str) -> None:
    """``params``' arrays must have the shapes and dtypes of ``ranks`` ranks' blocks (1: one rank's
    params; ``tp``: ``shard_params``' global arrays), and the shared expert's two come together.

    Raises:
      ValueError: naming the array, what it is and what was expected (``where`` ends the message).
    """
    if (params.gate_up is None) != (params.down is None):
        given, missing = ("gate_up", "down") if params.down is None else ("down", "gate_up")
        raise ValueError(
            f"params.{given} is given but params.{missing} is None: the shared expert needs both "
            "(or neither, for a model without one)"
        )
    cfg = params.cfg
    expected = {
        "packed": ((ranks * (params.split + cfg.latent_per_rank), cfg.hidden), jnp.bfloat16),
        "bias": ((cfg.experts,), jnp.float32),
    }
    if params.gate_up is not None:
        expected["gate_up"] = ((ranks * 2 * cfg.shared_per_rank, cfg.hidden), jnp.bfloat16)
        expected["down"] = ((cfg.hidden, ranks * cfg.shared_per_rank), jnp.bfloat16)
    for name, (shape, dtype) in expected.items():
        array = getattr(params, name)
        if array is None or tuple(array.shape) != shape or array.dtype != dtype:
            got = "None" if array is None else f"{tuple(array.shape)} {array.dtype}"
            raise ValueError(f"params.{name} is {got}, expected {shape} {jnp.dtype(dtype)}{where}")


def rank_rows(cfg: FrontConfig, rank: int, split: int) -> dict[str, tuple[tuple[str | None, int, int], ...]]:
    """The packed layout, written once: for rank ``rank``'s ``packed`` and ``gate_up`` blocks, the
    ``(weight key, first row, end row)`` pieces they stack, in order (key None: zero rows).

    ``packed``: the rank's ``E/tp`` router rows, zero rows up to ``split``, its ``L/tp`` latent rows
    (a piece of no rows is left out: no zero rows when ``E/tp == split``, no latent at ``L = 0``).
    ``gate_up``: the rank's ``S/tp`` gate rows, then its ``S/tp`` up rows. (``down`` is split by
    columns, ``[:, rank * S/tp:(rank + 1) * S/tp]``.)
    """
    valid, shard, s_r = cfg.experts_per_rank, cfg.latent_per_rank, cfg.shared_per_rank
    packed = ((GATE, rank * valid, (rank + 1) * valid), (None, 0, split - valid),
              (ROUTED_DOWN, rank * shard, (rank + 1) * shard))
    return {
        "packed": tuple(piece for piece in packed if piece[2] > piece[1]),
        "gate_up": ((GATE_UP, rank * s_r, (rank + 1) * s_r),
                    (GATE_UP, cfg.shared + rank * s_r, cfg.shared + (rank + 1) * s_r)),
    }


def stack_rows(pieces, read: Callable, zeros: Callable) -> list:
    """The blocks of ``rank_rows`` pieces, to concatenate: ``read(key, first, end)`` for a weight's
    rows, ``zeros(count)`` for zero rows."""
    return [zeros(end - first) if key is None else read(key, first, end) for key, first, end in pieces]


def rank_slices(weights: Mapping[str, jax.Array], cfg: FrontConfig, rank: int, split: int):
    """``(packed, gate_up, down)`` of ``rank``, sliced from the unsharded weights."""
    rows = rank_rows(cfg, rank, split)

    def stack(name):
        return jnp.concatenate(stack_rows(rows[name], lambda key, lo, hi: jnp.asarray(weights[key][lo:hi]),
                                          lambda n: jnp.zeros((n, cfg.hidden), jnp.bfloat16)))

    if GATE_UP not in weights:
        return stack("packed"), None, None
    s_r = cfg.shared_per_rank
    return stack("packed"), stack("gate_up"), weights[DOWN][:, rank * s_r:(rank + 1) * s_r]


def pack_params(
    weights: Mapping[str, jax.Array],
    cfg: FrontConfig,
    rank: int = 0,
    split_align: int = DEFAULT_SPLIT_ALIGN,
) -> FrontParams:
    """Pack one rank's share of ``weights`` into ``FrontParams`` (SPEC section 3).

    ``weights`` are the unsharded weights under the keys of SPEC section 2 (``init_weights``' or a
    checkpoint's), shared by ``cfg.tp`` ranks; ``rank`` in ``[0, cfg.tp)`` picks the share; router
    rows are padded with zero rows up to a multiple of ``split_align``.

    Returns ``FrontParams`` with ``packed`` ``[split + L/tp, H]``, where ``split`` is ``E/tp``
    rounded up to ``split_align``.

    Raises:
      ValueError: ``cfg`` not a ``FrontConfig``, a missing key, a wrong shape or dtype (naming the
        key), ``rank`` out of range, or ``split_align`` not a positive int.
    """
    if not isinstance(cfg, FrontConfig):
        raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
    check_weights(weights, cfg)
    if not isinstance(rank, numbers.Integral) or isinstance(rank, bool) or not 0 <= rank < cfg.tp:
        raise ValueError(f"rank must be an int in [0, tp={cfg.tp}), got {rank!r}")
    split_align = check_split_align(split_align)
    rank = int(rank)  # a NumPy integer is taken as its int
    split = padded_split(cfg.experts_per_rank, split_align)
    packed, gate_up, down = rank_slices(weights, cfg, rank, split)
    return FrontParams(packed, bias_of(weights, cfg), gate_up, down, cfg, split)


def bias_of(weights: Mapping[str, jax.Array], cfg: FrontConfig) -> jax.Array:
    """The ``[E]`` float32 correction bias of ``weights``, or zeros for a config without one
    (``cfg.bias`` False: ``sigmoid(l) + 0`` is ``sigmoid(l)`` bit for bit, and softmax scoring never
    reads it)."""
    if cfg.bias:
        return jnp.asarray(weights[BIAS])
    return jnp.zeros((cfg.experts,), jnp.float32)


def unpack_params(params: FrontParams) -> dict[str, jax.Array]:
    """The weights of SPEC section 2 that ``params`` hold: the inverse of ``pack_params`` at ``tp=1``
    and of ``shard_params`` (or ``load_params``) on a mesh.

    Not for a decode step (it copies every weight). On a mesh the arrays stay sharded over its axis;
    the fused ``gate_up`` moves between devices, a rank's block of the packed layout being its gate
    rows and its up rows rather than one block of ``[2S, H]``.

    Raises:
      ValueError: ``params`` are one rank's share of ``tp > 1`` (no mesh): they lack the other ranks'.
    """
    cfg, h = params.cfg, params.cfg.hidden
    if params.mesh is None and cfg.tp != 1:
        raise ValueError(
            f"params are one rank's share of tp={cfg.tp}; unpack needs every rank's (shard_params')"
        )
    ranks = params.packed.reshape(cfg.tp, params.split + cfg.latent_per_rank, h)
    weights = {GATE: ranks[:, :cfg.experts_per_rank].reshape(cfg.experts, h)}
    if cfg.bias:
        weights[BIAS] = params.bias
    if cfg.latent:
        weights[ROUTED_DOWN] = ranks[:, params.split:].reshape(cfg.latent, h)
    if params.has_shared:
        halves = params.gate_up.reshape(cfg.tp, 2, cfg.shared_per_rank, h)
        weights[GATE_UP] = jnp.concatenate([halves[:, half].reshape(cfg.shared, h) for half in (0, 1)])
        weights[DOWN] = params.down
    return weights
