"""Tensor parallelism of the MoE front with ``jax.shard_map``.

Each device of a mesh axis (default ``"tp"``, ``tp`` devices) holds its router rows (``E/tp``), its
latent down-projection rows (``L/tp``) and its slice of the shared expert (``S/tp``). A call runs the
front GEMM on the device's shard, exchanges the shards in ONE collective (each rank's float32 logits
and bfloat16 latent shard travel together in one 16-bit row, as in one Lamport mailbox row), and every
device routes over all experts. The shared expert's partial sums are reduced in a second collective,
whole (``psum``) or scattered over the hidden size (``psum_scatter``, what a MoE tail consumes).

- ``shard_params(weights, cfg, mesh)`` places every device's shard (``NamedSharding``); ``moe_front``
  on those params runs the plan's rank steps under a ``jax.shard_map`` over the mesh.
- ``moe_front(x, local_params, axis_name="tp")`` inside the caller's own ``shard_map`` runs one
  rank's steps (``moe_front_jax.planner`` decides them; this module checks the arguments).

The mesh's other axes (a data axis beside ``"tp"``) split the batch: each group of ``tp`` devices
runs its own rows with its own copy of the weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from moe_front_jax.config import FrontConfig
from moe_front_jax.params import (
    DEFAULT_SPLIT_ALIGN,
    DOWN,
    GATE_UP,
    FrontParams,
    bias_of,
    check_param_arrays,
    check_split_align,
    check_weights,
    padded_split,
    param_specs,
    rank_slices,
)
from moe_front_jax.reference.exchange import exchange, reduce_shared

__all__ = ["SHARED_REDUCES", "check_groups", "check_rank", "check_scatter", "check_shared_reduce",
           "check_sharded_params", "check_vma_off", "exchange", "mesh_tp", "param_specs",
           "reduce_shared", "shard_params"]

SHARED_REDUCES = ("psum", "psum_scatter")


def check_shared_reduce(shared_reduce: str) -> str:
    """Validate ``shared_reduce``; returns it."""
    if shared_reduce not in SHARED_REDUCES:
        raise ValueError(f"shared_reduce must be one of {SHARED_REDUCES}, got {shared_reduce!r}")
    return shared_reduce


def mesh_tp(cfg: FrontConfig, mesh: Mesh | AbstractMesh, axis: str) -> int:
    """The tensor-parallel degree ``mesh.shape[axis]``, validated against ``cfg``.

    Raises:
      ValueError: ``mesh`` is not a ``Mesh`` or ``AbstractMesh``, ``axis`` is not one of its axes,
        ``cfg.tp`` is neither 1 nor the axis size, or ``experts``, ``latent`` or ``shared`` is not
        divisible by it.
    """
    if not isinstance(cfg, FrontConfig):
        raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh, whose axes are {mesh.axis_names}")
    tp = mesh.shape[axis]
    if cfg.tp not in (1, tp):
        raise ValueError(
            f"cfg.tp={cfg.tp} disagrees with mesh axis {axis!r} of size {tp}: pass cfg with tp=1 "
            f"(the mesh decides) or tp={tp}"
        )
    for name in ("experts", "latent", "shared"):
        value = getattr(cfg, name)
        if value % tp:
            raise ValueError(
                f"FrontConfig.{name}={value} must be divisible by the size {tp} of mesh axis {axis!r}"
            )
    return tp


def shard_params(
    weights: Mapping[str, jax.Array],
    cfg: FrontConfig,
    mesh: Mesh,
    axis: str = "tp",
    split_align: int = DEFAULT_SPLIT_ALIGN,
) -> FrontParams:
    """Pack the unsharded ``weights`` (SPEC section 2) for the ``tp = mesh.shape[axis]`` ranks and
    place each device's shard: rank ``r``'s block of every array is exactly ``pack_params(weights,
    cfg.with_tp(tp), rank=r)``'s, held by the device at index ``r`` of ``axis`` (replicated over the
    mesh's other axes, which split the batch). ``packed`` ``[tp * (split + L/tp), H]`` and
    ``gate_up`` ``[2S, H]`` stack the rank blocks along rows (``PartitionSpec(axis, None)``),
    ``down`` ``[H, S]`` splits its columns (``PartitionSpec(None, axis)``), ``bias`` ``[E]`` is
    replicated. ``moe_front(x, params)`` then runs under ``jax.shard_map``; inside your own, pass
    ``jax.tree.map(lambda a: a.sharding.spec, params)`` as in_specs and ``axis_name=axis``.

    ``cfg.tp`` is 1 (the mesh decides) or the axis size; ``split_align`` as for ``pack_params``.
    Returns ``FrontParams`` with ``cfg.tp == tp``, ``mesh`` and ``axis`` set. Raises ``ValueError``
    for ``axis`` not in a concrete ``Mesh``, ``tp`` not dividing ``E``, ``L`` or ``S``, a ``cfg.tp``
    that disagrees, weights of the wrong keys, shapes or dtypes, or a bad ``split_align``.
    """
    tp = mesh_tp(cfg, mesh, axis)
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"mesh must be a concrete jax.sharding.Mesh to place the weights on, got {mesh}"
        )
    cfg = cfg.with_tp(tp)
    check_weights(weights, cfg)
    split_align = check_split_align(split_align)
    split = padded_split(cfg.experts_per_rank, split_align)
    blocks = [rank_slices(weights, cfg, rank, split) for rank in range(tp)]
    arrays = {
        "packed": jnp.concatenate([packed for packed, _, _ in blocks]),
        "bias": bias_of(weights, cfg),
        "gate_up": None,
        "down": None,
    }
    if GATE_UP in weights:
        arrays["gate_up"] = jnp.concatenate([gate_up for _, gate_up, _ in blocks])
        arrays["down"] = jnp.asarray(weights[DOWN])
    specs = param_specs(axis)
    placed = {
        name: None if array is None else jax.device_put(array, NamedSharding(mesh, specs[name]))
        for name, array in arrays.items()
    }
    return FrontParams(**placed, cfg=cfg, split=split, mesh=mesh, axis=axis)


def check_sharded_params(params: FrontParams) -> None:
    """Sharded params must hold global arrays matching their config.

    ``shard_params`` gives such params. Their ``mesh`` may also be an ``AbstractMesh`` (with
    ``jax.ShapeDtypeStruct`` leaves, through ``dataclasses.replace``): to lower the sharded front for
    devices this host does not have, under ``jax.sharding.use_abstract_mesh``.
    """
    cfg, mesh, axis = params.cfg, params.mesh, params.axis
    tp = mesh_tp(cfg, mesh, axis)
    if cfg.tp != tp:
        raise ValueError(f"params.cfg.tp={cfg.tp} but mesh axis {axis!r} has {tp} devices")
    check_param_arrays(params, tp, f" (global, sharded over mesh axis {axis!r} of size {tp})")


def check_scatter(shared_reduce: str, cfg: FrontConfig, tp: int) -> None:
    """A reduce-scatter over the hidden size needs ``tp`` to divide it."""
    if shared_reduce == "psum_scatter" and cfg.hidden % tp:
        raise ValueError(
            f"shared_reduce='psum_scatter' scatters hidden={cfg.hidden} over tp={tp} ranks, which "
            "does not divide it; use shared_reduce='psum'"
        )


def check_rank(params: FrontParams, axis_name: str) -> None:
    """Inside ``shard_map``: ``axis_name`` must be an axis of it, of ``params.cfg.tp`` devices.

    Raises:
      ValueError: ``axis_name`` is not an axis of the enclosing ``jax.shard_map``, or its size is not
        ``params.cfg.tp``.
    """
    cfg = params.cfg
    try:
        tp = lax.axis_size(axis_name)
    except NameError as error:
        raise ValueError(
            f"axis_name={axis_name!r} is not an axis of the enclosing jax.shard_map ({error})"
        ) from None
    if tp != cfg.tp:
        raise ValueError(
            f"axis_name={axis_name!r} has {tp} devices but params are one rank's shard of "
            f"tp={cfg.tp}"
        )


def check_vma_off(params: FrontParams, axis_name: str, backend: str, runs_kernels: bool) -> None:
    """Kernels inside the caller's ``shard_map`` need its ``check_vma=False``: a ``pallas_call``'s
    outputs carry no varying-axes type. Raises a ``ValueError`` that says so where a kernel would
    run (``runs_kernels``, read off the call's plan) under ``check_vma=True``."""
    if runs_kernels and axis_name in jax.typeof(params.packed).manual_axis_type.varying:
        raise ValueError(
            f"backend={backend!r} runs Pallas kernels here, whose outputs carry no varying-axes "
            "type: pass check_vma=False to the enclosing jax.shard_map"
        )


def check_groups(x, params: FrontParams, shared_reduce: str) -> None:
    """Sharded params' mesh axes other than ``params.axis`` split ``x``'s rows (data parallel).

    Raises:
      ValueError: ``B`` not divisible by the product of the other mesh axes' sizes, or
        ``psum_scatter`` over a hidden size ``tp`` does not divide.
    """
    cfg, mesh, axis = params.cfg, params.mesh, params.axis
    check_scatter(shared_reduce, cfg, cfg.tp)
    others = tuple(name for name in mesh.axis_names if name != axis)
    groups = math.prod(mesh.shape[name] for name in others)
    if x.shape[0] % groups:
        raise ValueError(
            f"x has B={x.shape[0]} rows, split data-parallel over mesh axes {others} of "
            f"{groups} groups: B must be divisible by {groups}"
        )
