"""Tensor parallelism of the MoE front with ``jax.shard_map``.

Each device of a mesh axis (default ``"tp"``, ``tp`` devices) holds its router rows (``E/tp``), its
latent down-projection rows (``L/tp``) and its slice of the shared expert (``S/tp``). A call runs the
front GEMM on the device's shard, exchanges the shards in ONE collective (each rank's float32 logits
and bfloat16 latent shard travel together in one 16-bit row, as in one Lamport mailbox row), and every
device routes over all experts. The shared expert's partial sums are reduced in a second collective,
whole (``psum``) or scattered over the hidden size (``psum_scatter``, what a MoE tail consumes).

- ``shard_params(weights, cfg, mesh)`` places every device's shard (``NamedSharding``); ``moe_front``
  on those params runs ``sharded_front``, a ``jax.shard_map`` over the mesh.
- ``moe_front(x, local_params, axis_name="tp")`` inside the caller's own ``shard_map`` runs
  ``rank_front``, the per-device body.

The mesh's other axes (a data axis beside ``"tp"``) split the batch: each group of ``tp`` devices
runs its own rows with its own copy of the weights.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec

from moe_front_jax import registry
from moe_front_jax import mailbox as mailboxes
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
    rank_slices,
)

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


def param_specs(axis: str) -> dict[str, PartitionSpec]:
    """``PartitionSpec`` of each array of sharded ``FrontParams`` (and of ``mf.nn.MoEFront``'s Params)."""
    return {
        "packed": PartitionSpec(axis, None),
        "bias": PartitionSpec(),
        "gate_up": PartitionSpec(axis, None),
        "down": PartitionSpec(None, axis),
    }


def shard_params(
    weights: Mapping[str, jax.Array],
    cfg: FrontConfig,
    mesh: Mesh,
    axis: str = "tp",
    split_align: int = DEFAULT_SPLIT_ALIGN,
) -> FrontParams:
    """Pack the weights for a ``tp``-way mesh axis and place each device's shard on it.

    ``tp = mesh.shape[axis]``. The result holds global arrays whose rank-``r`` block along the sharded
    dimension is exactly ``pack_params(weights, cfg.with_tp(tp), rank=r)``'s array, and the device at
    index ``r`` of ``axis`` holds that block (over the mesh's other axes the weights are replicated):

    - ``packed`` ``[tp * (split + L/tp), H]`` bfloat16, rank blocks stacked along rows, sharded
      ``PartitionSpec(axis, None)``;
    - ``bias`` ``[E]`` float32, replicated;
    - ``gate_up`` ``[2S, H]`` bfloat16, rank blocks ``[its S/tp gate rows; its S/tp up rows]`` stacked
      along rows, ``PartitionSpec(axis, None)``;
    - ``down`` ``[H, S]`` bfloat16 (the checkpoint's own layout), split along columns,
      ``PartitionSpec(None, axis)``.

    ``moe_front(x, params)`` then runs under ``jax.shard_map``; inside a caller's own ``shard_map``
    over the same mesh, pass ``jax.tree.map(lambda a: a.sharding.spec, params)`` as the params' in_specs and
    call ``moe_front(x, params, axis_name=axis)``.

    Args:
      weights: the unsharded weights under the keys of SPEC section 2.
      cfg: the model config, with ``tp=1`` (the mesh decides) or ``tp`` equal to the axis size.
      mesh: a ``jax.sharding.Mesh`` that has ``axis``; other axes are allowed (they split the batch).
      axis: the mesh axis to shard over.
      split_align: as for ``pack_params``.

    Returns:
      ``FrontParams`` with ``cfg.tp == tp``, ``mesh`` and ``axis`` set.

    Raises:
      ValueError: ``axis`` missing from ``mesh``, a mesh that is not a concrete ``Mesh`` (an
        ``AbstractMesh`` places nothing), ``tp`` not dividing ``E``, ``L`` or ``S``, a ``cfg.tp``
        that disagrees with the mesh, weights of the wrong keys, shapes or dtypes, or
        ``split_align`` not a positive int.
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


def exchange(
    logits: jax.Array, latent_shard: jax.Array, axis_name: str
) -> tuple[jax.Array, jax.Array]:
    """Every rank's logits and latent shard, to every rank, in ONE all-gather over ``axis_name``.

    Each rank packs its row as a mailbox row would (SPEC section 7): ``[latent shard as bf16 | logits
    as float32 words, two 16-bit columns each]``, ``[B, shard + 2 valid]`` uint16, so the exchange is a
    single collective of ``B * (L + 2E) * 2 / tp`` bytes per rank, bit-exact (NaN payloads, -0.0).

    Args:
      logits: ``[B, valid]`` float32, this rank's experts ``[r*valid, (r+1)*valid)``.
      latent_shard: ``[B, shard]`` bfloat16, this rank's latent columns ``[r*shard, (r+1)*shard)``.
      axis_name: the ``shard_map`` axis of the ``tp`` ranks.

    Returns:
      ``logits`` ``[B, tp*valid]`` float32 and ``latent`` ``[B, tp*shard]`` bfloat16, every rank's
      shard in rank order, identical (invariant) on every rank.
    """
    rows, valid = logits.shape
    shard = latent_shard.shape[1]
    words = lax.bitcast_convert_type(logits, jnp.uint16).reshape(rows, 2 * valid)
    halves = lax.bitcast_convert_type(latent_shard, jnp.uint16)
    mailbox_row = jnp.concatenate([halves, words], axis=1)
    # A leading axis of 1 gathered tiled, rather than a new axis: the gathered [tp, B, W] then keeps
    # the batch dimension in place under meshes whose other axes carry explicit shardings.
    gathered = lax.all_gather(mailbox_row[None], axis_name, axis=0, tiled=True, to="invarying")
    tp = gathered.shape[0]
    latent = lax.bitcast_convert_type(gathered[:, :, :shard], jnp.bfloat16)
    words = gathered[:, :, shard:].reshape(tp, rows, valid, 2)
    logits = lax.bitcast_convert_type(words, jnp.float32)
    return (
        logits.transpose(1, 0, 2).reshape(rows, tp * valid),
        latent.transpose(1, 0, 2).reshape(rows, tp * shard),
    )


def reduce_shared(partial: jax.Array, axis_name: str, shared_reduce: str) -> jax.Array:
    """Sum the ranks' float32 shared-expert partial sums ``[B, H]``, then round once to bfloat16.

    The partial sums travel in float32 (twice the bytes of bfloat16) so that the result is the
    unsharded shared expert up to float32 summation order: bfloat16 partials would add one rounding
    per rank, and a collective that sums in bfloat16 another per step, an error growing with tp.

    Returns:
      ``"psum"``: ``[B, H]`` bfloat16 on every rank; ``"psum_scatter"``: ``[B, H/tp]`` bfloat16, rank
      ``r`` holding hidden columns ``[r*H/tp, (r+1)*H/tp)``.
    """
    if shared_reduce == "psum":
        total = lax.psum(partial, axis_name)
    else:
        total = lax.psum_scatter(partial, axis_name, scatter_dimension=1, tiled=True)
    return total.astype(jnp.bfloat16)


def check_scatter(shared_reduce: str, cfg: FrontConfig, tp: int) -> None:
    """A reduce-scatter over the hidden size needs ``tp`` to divide it."""
    if shared_reduce == "psum_scatter" and cfg.hidden % tp:
        raise ValueError(
            f"shared_reduce='psum_scatter' scatters hidden={cfg.hidden} over tp={tp} ranks, which "
            "does not divide it; use shared_reduce='psum'"
        )


def rank_front(
    x: jax.Array,
    params: FrontParams,
    axis_name: str,
    *,
    plan: bool,
    backend: str,
    shared_reduce: str,
    permute: bool = False,
    mailbox=None,
) -> tuple:
    """One rank's front inside ``shard_map``: its GEMM, the exchange, routing of all experts.

    ``params`` are this rank's (validated by the caller: ``check_params``), ``x`` ``[B, H]`` the rank's
    rows (the same on every rank of ``axis_name``). Without ``mailbox`` the ranks exchange logits and
    latent through one all-gather; with this rank's ``Mailbox`` (laid out for ``params.cfg``), through
    it: the plain-JAX protocol over a gather, or on a GPU the peer-store publish
    (``transport="peer"``) and this rank's collect.

    Returns:
      The fields of ``FrontOutput`` in order: ``ids``, ``weights``, ``latent`` ``[B, L]``, ``logits``
      ``[B, E]``, ``shared`` (``reduce_shared``'s, or None), ``plan`` (or None), ``status``, the
      dispatch ``(order, group_sizes, inverse)`` with ``permute`` (or None; every rank routes all
      experts, so every rank's is the same); then the returned mailbox (None without one).

    Raises:
      ValueError: ``axis_name`` is not an axis of the enclosing ``shard_map``, its size is not
        ``params.cfg.tp``, or ``psum_scatter`` over a hidden size ``tp`` does not divide.
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
    check_scatter(shared_reduce, cfg, tp)
    logits, latent_shard = registry.run("front_gemm", backend, x, params.packed, params.split,
                                        cfg.experts_per_rank)
    status = jnp.zeros((), jnp.int32)
    if mailbox is None:
        logits, latent = exchange(logits, latent_shard, axis_name)
        dispatched = None
        if permute:
            ids, weights, *dispatched = registry.run("route", backend, logits, params.bias, cfg,
                                                     permute=True)
            dispatched = tuple(dispatched)
        else:
            ids, weights = registry.run("route", backend, logits, params.bias, cfg)
        planned = registry.run("plan", backend, latent, cfg.plan_block) if plan else None
    else:
        transport = "peer" if mailboxes.runs_kernels(mailbox, x.shape[0], backend) else "gather"
        ids, weights, logits, latent, planned, status, dispatched, mailbox = (
            mailboxes.exchange_route(
                mailbox, logits, latent_shard, params.bias, axis_name=axis_name, backend=backend,
                transport=transport, plan=plan, permute=permute,
            ))
    shared = None
    if params.has_shared:
        partial = registry.run("shared_expert", backend, x, params.gate_up, params.down, cfg,
                               jnp.float32)
        shared = reduce_shared(partial, axis_name, shared_reduce)
    return (ids, weights, latent, logits, shared, planned, status, dispatched), mailbox


def runs_kernels(params: FrontParams, rows: int, backend: str, plan: bool,
                 permute: bool = False) -> bool:
    """Whether ``rank_front`` over ``rows`` rows of one rank's ``params`` runs any Pallas kernel
    under ``backend`` (``registry`` asked with the rank's shapes), rather than only the reference."""
    cfg = params.cfg

    def local(*shape, dtype=jnp.bfloat16):
        return jax.ShapeDtypeStruct(shape, dtype)

    x = local(rows, cfg.hidden)
    packed = local(params.split + cfg.latent_per_rank, cfg.hidden)
    asks = [("front_gemm", (x, packed, params.split, cfg.experts_per_rank), {}),
            ("route", (local(rows, cfg.experts, dtype=jnp.float32),
                       local(cfg.experts, dtype=jnp.float32), cfg),
             dict(permute=True) if permute else {})]
    if plan:
        asks.append(("plan", (local(rows, cfg.latent), cfg.plan_block), {}))
    if params.has_shared:
        asks.append(("shared_expert", (x, local(2 * cfg.shared_per_rank, cfg.hidden),
                                       local(cfg.hidden, cfg.shared_per_rank), cfg, jnp.float32),
                     {}))
    return any(registry.choose(name, backend, *args, **kwargs).kernel
               for name, args, kwargs in asks)


def sharded_front(
    x: jax.Array, params: FrontParams, *, plan: bool, backend: str, shared_reduce: str,
    permute: bool = False,
) -> tuple:
    """``rank_front`` on every device of ``params.mesh`` under ``jax.shard_map``.

    ``params`` come from ``shard_params`` (validated by the caller: ``check_sharded_params``). The
    mesh's axes other than ``params.axis`` split the batch of ``x`` (data parallel).

    Returns:
      The fields of ``FrontOutput`` as global arrays: everything ``[B, ...]`` replicated over the
      ``tp`` axis, except ``shared`` under ``"psum_scatter"``: ``[B, H]`` whose hidden columns are
      sharded over it (each device holds its ``H/tp`` columns of the reduce-scatter). The dispatch
      (with ``permute``): ``order`` and ``inverse`` ``[B * K]``, ``group_sizes`` ``[groups * E]``,
      split over the data-parallel axes: group ``g``'s part is the dispatch of its own rows, its
      slots numbered from 0 (with no data-parallel axis, the direct path's dispatch).

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
    batch = others or None
    rows = PartitionSpec(batch, None)
    explicit = [n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit]
    if explicit:
        # shard_map takes x typed over Explicit axes only in its in_spec's sharding; over Auto axes
        # jit reshards x itself (and jax.reshard refuses them).
        split = tuple(name for name in others if name in explicit) or None
        x = jax.reshard(x, NamedSharding(mesh, PartitionSpec(split, None)))
    specs = param_specs(axis)
    shared_spec = PartitionSpec(batch, axis) if shared_reduce == "psum_scatter" else rows

    def body(x, packed, bias, gate_up, down):
        local = FrontParams(packed, bias, gate_up, down, cfg, params.split)
        fields, _ = rank_front(
            x, local, axis, plan=plan, backend=backend, shared_reduce=shared_reduce,
            permute=permute,
        )
        return fields

    front = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(rows, specs["packed"], specs["bias"], specs["gate_up"], specs["down"]),
        out_specs=(rows, rows, rows, rows, shared_spec, rows, PartitionSpec(),
                   PartitionSpec(batch)),
        # A pallas_call's out_shape carries no varying-axes type, which check_vma=True requires.
        check_vma=not runs_kernels(params, x.shape[0] // groups, backend, plan, permute),
    )
    return front(x, params.packed, params.bias, params.gate_up, params.down)
