"""The public entry points: ``moe_front`` (the whole front of one decode step) and ``route``."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from moe_front_jax import registry, parallel
from moe_front_jax import mailbox as mailboxes
from moe_front_jax.config import FrontConfig
from moe_front_jax.params import FrontParams, check_param_arrays


_MAILBOX_TP = (
    "mailbox= with shard_params' sharded params is not supported: each rank needs its own mailbox. "
    "Call moe_front inside your own jax.shard_map with axis_name= and this rank's Mailbox (created "
    "for the rank's cfg), or without a mailbox (the ranks then exchange through one all-gather)."
)


class Dispatch(NamedTuple):
    """The dispatch order of SPEC section 4.1: what grouped GEMMs over the routed experts consume (a
    pytree). Slot ``s = token * K + rank`` is token ``s // K``'s rank ``s % K``.

    Attributes:
      order: ``[B * K]`` int32 slots sorted by expert, by token within an expert (the stable sort by
        expert of ``ids.ravel()``); row ``j`` of the permuted input is token ``order[j] // K``.
      group_sizes: ``[E]`` int32 slots per expert (the histogram of ``ids``), summing to ``B * K``:
        ``jax.lax.ragged_dot``'s ``group_sizes``.
      inverse: ``[B * K]`` int32 position of each slot in ``order`` (``order[inverse] == arange``):
        the combine step reads slot ``s``'s expert output at row ``inverse[s]``.

    Example::

      dispatch = out.dispatch                                     # moe_front(..., permute=True)
      rows = latent[dispatch.order // K]                          # [B * K, L], grouped by expert
      h = jax.lax.ragged_dot(rows, w, dispatch.group_sizes)       # w: [E, L, N]
      per_slot = h[dispatch.inverse].reshape(B, K, N)             # back to (token, rank)
    """

    order: jax.Array
    group_sizes: jax.Array
    inverse: jax.Array


class FrontOutput(NamedTuple):
    """What one call of ``moe_front`` returns (a pytree).

    Attributes:
      ids: ``[B, K]`` int32 chosen experts, rank 0 the largest key.
      weights: ``[B, K]`` bfloat16 routing weights.
      latent: ``[B, L]`` bfloat16, every rank's latent shard in rank order.
      logits: ``[B, E]`` float32 router logits of every expert.
      shared: ``[B, H]`` bfloat16 shared-expert output, or None when the params have no shared
        expert. With ``shared_reduce="psum_scatter"``: inside your own ``shard_map``
        (``axis_name``), this rank's ``[B, H / tp]`` columns; through ``shard_params``' params, the
        global ``[B, H]`` array with its columns split over the mesh's devices.
      plan: ``(values float8_e4m3fn [B, L], scales float8_e8m0fnu [B, L / 32])`` with ``plan=True``,
        else None.
      status: int32 scalar: 0, or a mailbox timeout code.
      dispatch: ``Dispatch`` (order, group sizes and inverse of SPEC section 4.1) with
        ``permute=True``, else None; over every row of ``x``, with ``shard_params``' params on a
        mesh with data-parallel axes too.
    """

    ids: jax.Array
    weights: jax.Array
    latent: jax.Array
    logits: jax.Array
    shared: jax.Array | None
    plan: tuple[jax.Array, jax.Array] | None
    status: jax.Array
    dispatch: Dispatch | None = None


def check_batch(name: str, array, width_name: str, width: int, dtype) -> None:
    """``array`` must be a non-empty ``[B, width]`` array of ``dtype`` (checked at trace time)."""
    shape = getattr(array, "shape", None)
    kind = jnp.dtype(dtype).name
    if shape is None:
        raise ValueError(f"{name} must be a [B, {width_name}={width}] {kind} array, got a "
                         f"{type(array).__name__}")
    if len(shape) != 2 or shape[1] != width:
        raise ValueError(f"{name} must have shape [B, {width_name}={width}], got {tuple(shape)}")
    if shape[0] == 0:
        raise ValueError(f"{name} is an empty batch (shape {tuple(shape)}); B must be >= 1")
    if array.dtype != dtype:
        raise ValueError(f"{name} must be {kind}, got {array.dtype}")


def check_rows(x, cfg: FrontConfig) -> None:
    """``x`` must be a non-empty ``[B, H]`` bfloat16 array (checked at trace time)."""
    check_batch("x", x, "hidden", cfg.hidden, jnp.bfloat16)


def check_static_bool(name: str, value, function: str) -> bool:
    """``value`` must be a Python (or numpy) bool, not traced: it chooses what is traced."""
    if isinstance(value, jax.core.Tracer):
        raise ValueError(
            f"{name} is traced: under jax.jit pass it as a static argument, "
            f"jax.jit({function}, static_argnames=('{name}',))"
        )
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return bool(value)


def as_dispatch(fields) -> Dispatch | None:
    """``Dispatch`` of the stages' ``(order, group_sizes, inverse)``, or None."""
    return None if fields is None else Dispatch(*fields)


def _front_output(fields) -> FrontOutput:
    *rest, dispatched = fields
    return FrontOutput(*rest, as_dispatch(dispatched))


def check_params(params) -> None:
    """``params`` must be ``FrontParams`` whose arrays match its config (checked at trace time)."""
    if not isinstance(params, FrontParams):
        raise ValueError(
            f"params must be FrontParams (from pack_params or shard_params), got {type(params).__name__}"
        )
    check_param_arrays(params, 1, f" for tp={params.cfg.tp}")


def moe_front(
    x: jax.Array,
    params: FrontParams,
    *,
    plan: bool = False,
    permute: bool = False,
    backend: str = "auto",
    axis_name: str | None = None,
    shared_reduce: str = "psum",
    mailbox: mailboxes.Mailbox | None = None,
) -> FrontOutput | tuple[FrontOutput, mailboxes.Mailbox]:
    """The MoE front of one decode step: front GEMM, exact top-k routing, latent, shared expert.

    ``plan``, ``permute``, ``backend``, ``axis_name`` and ``shared_reduce`` choose what is traced:
    under ``jax.jit`` they are static (``jax.jit(moe_front, static_argnames=("plan", "permute",
    "backend", "axis_name", "shared_reduce"))``, or ``functools.partial`` them in).

    Args:
      x: ``[B, H]`` bfloat16 decode rows, ``B >= 1``.
      params: ``FrontParams`` from ``pack_params``, or from ``shard_params`` (then the call runs under
        ``jax.shard_map`` over the params' mesh), or one rank's params with ``axis_name``.
      plan: also return the MXFP8 copy of the latent (``FrontOutput.plan``).
      permute: also return the dispatch order of SPEC section 4.1 (``FrontOutput.dispatch``):
        where the routing kernel runs, it writes the order in the same launch as the top-k.
      backend: ``"auto"`` (on a GPU each stage's kernel where ``registry.STAGES`` prefers it, by
        measured tables; the reference elsewhere), ``"xla"`` (the reference), ``"pallas"`` (the
        kernels) or ``"interpret"`` (the Pallas kernels in interpret mode).
      axis_name: inside the caller's own ``jax.shard_map``: the mesh axis of the ``params.cfg.tp``
        ranks, ``params`` being this rank's (with Pallas kernels that ``shard_map`` needs
        ``check_vma=False``). See ``moe_front_jax.parallel``.
      shared_reduce: how the ranks' shared-expert partial sums are reduced: ``"psum"`` (``shared``
        ``[B, H]`` on every rank) or ``"psum_scatter"`` (each rank's ``H/tp`` hidden columns).
      mailbox: a ``Mailbox``: the logits and latent shard travel through it (published, polled,
        copied out, re-armed; SPEC section 7) before routing; with ``plan=True`` the routing
        kernel, where it runs, polls the mailbox itself and writes the plan
        (``mailbox.exchange_route``); where the front GEMM kernel runs (tp = 1), it publishes from
        its epilogue (``mailbox.gemm_exchange_route``). Donate it: ``jax.jit(moe_front,
        donate_argnames="mailbox")``. Its path canonicalizes -0 logits and latent values to +0
        (routing is unaffected: ``sigmoid(-0) == sigmoid(+0)``). With ``axis_name``, this
        rank's mailbox (created for ``params.cfg``); the ranks' shards reach it through a gather in
        plain JAX, or on a GPU through the peer-store publish (``exchange``'s ``transport="peer"``;
        measured on one GPU only).

    Where the params hold a shared expert and the streaming engine's kernels run (``"pallas"`` or
    ``"interpret"``, ``B <= 64``, tp = 1), the front is merged: one launch over ``[router; latent;
    gate; up]`` (the plan in its epilogue, or with a mailbox from the collect), routing, then the
    shared expert's down (``registry.STAGES["front_gate_up"]``); with a mailbox its logits and
    latent are published after it, so the mailbox path keeps the direct path's bits.

    Returns:
      ``FrontOutput(ids, weights, latent, logits, shared, plan, status, dispatch)``; with a
      mailbox, the pair ``(FrontOutput, Mailbox)``, ``status`` being 0 or ``Mailbox.TIMEOUT``.

    Raises:
      ValueError: at trace time, for a wrong shape or dtype of ``x`` or ``params``, an empty batch,
        an unknown backend or shared_reduce, an ``axis_name`` that disagrees with the params, or a
        mailbox laid out for another config or too small for the batch.
      NotImplementedError: a mailbox with ``shard_params``' sharded params (each rank needs its own:
        call ``moe_front`` inside ``jax.shard_map`` with ``axis_name`` instead); under
        ``"pallas"`` or ``"interpret"``, a call a kernel does not cover (``B > 256`` rows; ``"auto"``
        and ``"xla"`` take any ``B``).

    Example::

      cfg = mf.KIMI_K3
      params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg), cfg)
      out = jax.jit(mf.moe_front)(x, params)      # x: [B, 7168] bfloat16
      out.ids, out.weights                         # [B, 16] int32, [B, 16] bfloat16
    """
    plan = check_static_bool("plan", plan, "moe_front")
    permute = check_static_bool("permute", permute, "moe_front")
    registry.check_backend(backend)
    parallel.check_shared_reduce(shared_reduce)
    options = dict(plan=plan, permute=permute, backend=backend, shared_reduce=shared_reduce)
    if axis_name is None and isinstance(params, FrontParams) and params.mesh is not None:
        if mailbox is not None:
            raise NotImplementedError(_MAILBOX_TP)
        parallel.check_sharded_params(params)
        check_rows(x, params.cfg)
        return _front_output(parallel.sharded_front(x, params, **options))
    check_params(params)
    cfg = params.cfg
    check_rows(x, cfg)
    if axis_name is not None:
        if mailbox is not None:
            mailboxes.check_mailbox(mailbox, cfg, x.shape[0])
        fields, mailbox = parallel.rank_front(x, params, axis_name, mailbox=mailbox, **options)
        return _front_output(fields) if mailbox is None else (_front_output(fields), mailbox)
    if mailbox is not None:
        mailboxes.check_mailbox(mailbox, cfg, x.shape[0])
    if cfg.tp != 1:
        raise ValueError(
            f"params are one rank's shard of tp={cfg.tp}; call moe_front inside jax.shard_map with "
            "axis_name=..., or pass the output of shard_params"
        )
    status = jnp.zeros((), jnp.int32)
    planned = None
    gemm_args = (x, params.packed, params.split, cfg.experts_per_rank)
    # The merged front: one launch over [router; latent; gate; up], then the down. With a mailbox
    # the plan comes from the collect, as on every mailbox path.
    merged_plan = plan and mailbox is None
    merged = merged_front(x, params, backend, merged_plan)
    if merged:
        logits, latent, planned, hidden = registry.run("front_gate_up", backend, *gemm_args,
                                                       params.gate_up, cfg, plan=merged_plan)
    # Else the front GEMM with the plan in its epilogue, where its kernel runs, or the plan stage.
    plan_gemm = (plan and not merged and
                 registry.choose("front_gemm_plan", backend, *gemm_args, cfg.plan_block).kernel)
    if mailbox is not None:
        # Where the front GEMM's kernel runs (unmerged), it publishes from its epilogue with the
        # direct path's schedule (so its bits): no publish kernel, no logits or latent written
        # first. Merged, the merged front's logits and latent are published, as the direct path's.
        box = (mailbox.buffer, mailbox.control, mailbox.tickets, cfg)
        block = cfg.plan_block if plan_gemm else None
        if not merged and registry.choose("front_gemm_publish", backend, *gemm_args, *box,
                                          plan_block=block).kernel:
            (ids, weights, logits, latent, planned, status, dispatched,
             mailbox) = mailboxes.gemm_exchange_route(
                mailbox, x, params.packed, params.bias, split=params.split,
                valid=cfg.experts_per_rank, backend=backend, plan=plan, plan_block=block,
                permute=permute,
            )
        else:
            if not merged:
                logits, latent = registry.run("front_gemm", backend, *gemm_args)
            ids, weights, logits, latent, planned, status, dispatched, mailbox = (
                mailboxes.exchange_route(mailbox, logits, latent, params.bias, backend=backend,
                                         plan=plan, permute=permute))
    else:
        if plan_gemm:
            logits, latent, planned = registry.run("front_gemm_plan", backend, *gemm_args,
                                                   cfg.plan_block)
        elif not merged:
            logits, latent = registry.run("front_gemm", backend, *gemm_args)
            if plan:
                planned = registry.run("plan", backend, latent, cfg.plan_block)
        ids, weights, dispatched = route_stage(logits, params.bias, cfg, backend, permute)
    shared = None
    if merged:
        shared = registry.run("shared_down", backend, hidden, params.down, jnp.bfloat16)
    elif params.has_shared:
        shared = registry.run("shared_expert", backend, x, params.gate_up, params.down, cfg,
                              jnp.bfloat16)
    out = FrontOutput(ids, weights, latent, logits, shared, planned, status,
                      as_dispatch(dispatched))
    return out if mailbox is None else (out, mailbox)


def merged_front(x, params: FrontParams, backend: str, plan: bool) -> bool:
    """Whether one rank's front at tp = 1 runs merged with the shared expert's gate/up (the
    ``front_gate_up`` and ``shared_down`` stages) rather than as the ``front_gemm`` and
    ``shared_expert`` stages: where the params hold a shared expert and both merged kernels run and
    cover ``x``'s rows. Under tensor parallelism the front stays unmerged: Mosaic GPU's interpret
    mode cannot run under a ``shard_map`` of several devices, so that path could not be checked off
    the GPU."""
    if not params.has_shared:
        return False
    cfg = params.cfg
    hidden = jax.ShapeDtypeStruct((x.shape[0], cfg.shared_per_rank), jnp.bfloat16)
    return (registry.runs_kernel("front_gate_up", backend, x, params.packed, params.split,
                                 cfg.experts_per_rank, params.gate_up, cfg, plan=plan)
            and registry.runs_kernel("shared_down", backend, hidden, params.down, jnp.bfloat16))


def route_stage(logits, bias, cfg: FrontConfig, backend: str, permute: bool):
    """The ``route`` stage: ``(ids, weights, (order, group_sizes, inverse) or None)``."""
    if not permute:
        return (*registry.run("route", backend, logits, bias, cfg), None)
    ids, weights, *dispatched = registry.run("route", backend, logits, bias, cfg, permute=True)
    return ids, weights, tuple(dispatched)


def route(
    logits: jax.Array,
    bias: jax.Array,
    cfg: FrontConfig,
    *,
    backend: str = "auto",
    permute: bool = False,
) -> tuple[jax.Array, jax.Array] | tuple[jax.Array, jax.Array, Dispatch]:
    """The routing step alone: exact top-k of ``sigmoid(logits) + bias`` (SPEC section 4).

    Args:
      logits: ``[B, E]`` float32 router logits, ``B >= 1``.
      bias: ``[E]`` float32 correction bias.
      cfg: supplies ``experts``, ``top_k``, ``routed_scaling_factor`` and ``renormalize``.
      backend: as for ``moe_front``.
      permute: also return the ``Dispatch`` of SPEC section 4.1 (static under ``jax.jit``); where
        the routing kernel runs, it writes it in the same launch as the top-k.

    Returns:
      ``ids`` ``[B, K]`` int32 (``cfg.top_k`` distinct experts in ``[0, E)`` for any input, ties
      to the lower id, NaN lowest) and ``weights`` ``[B, K]`` bfloat16; with ``permute``, the
      triple ``(ids, weights, Dispatch)``.

    Raises:
      ValueError: an unknown ``backend``; ``cfg`` not a ``FrontConfig``; ``logits`` not a
        ``[B, E]`` float32 array or an empty batch; ``bias`` not ``[E]`` float32; ``permute`` not
        a bool.
    """
    permute = check_static_bool("permute", permute, "route")
    registry.check_backend(backend)
    if not isinstance(cfg, FrontConfig):
        raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
    check_batch("logits", logits, "experts", cfg.experts, jnp.float32)
    bias_shape = getattr(bias, "shape", None)
    if bias_shape is None or tuple(bias_shape) != (cfg.experts,) or bias.dtype != jnp.float32:
        got = (f"a {type(bias).__name__}" if bias_shape is None
               else f"{tuple(bias_shape)} {bias.dtype}")
        raise ValueError(f"bias must be ({cfg.experts},) float32, got {got}")
    ids, weights, dispatched = route_stage(logits, bias, cfg, backend, permute)
    return (ids, weights) if dispatched is None else (ids, weights, Dispatch(*dispatched))
