"""The Lamport mailbox's state (``Mailbox``) and one step through it: publish, collect, route.

A mailbox row per token carries every tensor-parallel rank's logits and latent shard (SPEC section 7;
the layout and the plain-JAX protocol are ``moe_front_jax.reference.mailbox``). Each implementation is
asked of ``registry``: the jax-triton publish and collect (``bridge.triton_mailbox``), the front GEMM
publishing from its epilogue (tp = 1), the routing kernel polling the rows itself (with the plan), or
the plain-JAX protocol; ``exchange`` calls the peer-store publish across GPUs
(``bridge.peer_mailbox``) itself for ``transport="peer"``.

Why the immediate re-arm never erases a later step's value: on one device publish(t), collect(t) and
publish(t+1) are kernels on one stream, and jax-triton's kernels never trigger programmatic dependent
launch, so collect(t)'s re-arm is complete before publish(t+1) starts. Across ranks, rank ``r``
writes generation ``g`` of rank ``s`` again only at step ``t + G``, after its collect(t+G-1) saw
``s``'s publish(t+G-1), which ``s`` issued after its collect(t) re-armed step ``t``: safe for
``G >= 2``. The default ``G = 3`` (as TensorRT-LLM's Lamport buffers) leaves a step of slack.

``Mailbox.tickets`` keeps the front GEMM kernel's split-K tile counters from call to call (each call
leaves them zero), so no zeroing kernel runs before the GEMM. Polling is bounded: a chunk that still
holds the sentinel after the spin limit is a timeout, the status says ``TIMEOUT`` and the rows are
re-armed anyway; a caller that sees it should replace the mailbox, since a late writer may still land.

Cost: a publish writes ``4 B (L/2 + E) / tp`` bytes per rank; a collect reads ``4 B (L/2 + E)``,
writes as many out and as many again to re-arm, ``12 B (L/2 + E)`` moved: 2.1 MB, 0.6 us at B = 64
for Kimi-K3 at the H200's copy ceiling; at decode sizes the kernels cost their launch.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moe_front_jax import registry
from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas.front_gemm import ticket_count
from moe_front_jax.reference.mailbox import CONTROL_WORDS, TIMEOUT, armed_row, row_words

TRANSPORTS = ("gather", "peer")
"""How ``exchange`` carries the shards to every rank: ``"gather"``, one XLA all-gather and a local
publish of every rank's shard; ``"peer"``, each rank stores its words straight into every rank's
mailbox (``bridge.peer_mailbox``, GPU only)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mailbox:
    """A Lamport mailbox: state passed into ``moe_front`` and returned by it (a pytree).

    Donate it (``jax.jit(..., donate_argnames="mailbox")``) so that its buffer is updated in place;
    ``moe_front`` called outside ``jit`` donates it itself.

    Attributes:
      buffer: ``[generations, capacity, words]`` uint32 rows (layout: ``reference.mailbox``).
      control: ``[2]`` int32: the generation the last collect read, and the one the last publish
        wrote (``[G - 1, G - 1]`` when new).
      tickets: int32, zero between calls: the tile counters of the split-K and stream-K schedules
        of the front GEMM publishing into the mailbox (module docstring).
      cfg: the model config the rows are laid out for (static).
    """

    buffer: jax.Array
    control: jax.Array
    tickets: jax.Array
    cfg: FrontConfig = dataclasses.field(metadata=dict(static=True))

    TIMEOUT: ClassVar[int] = TIMEOUT
    """The status of a step that timed out (``FrontOutput.status``)."""

    @classmethod
    def create(cls, cfg: FrontConfig, capacity: int = 256, generations: int = 3) -> Mailbox:
        """An armed mailbox for up to ``capacity`` rows per call.

        Args:
          cfg: the model config; ``cfg.latent / cfg.tp`` must be even (a rank's shard fills whole
            words).
          capacity: the largest batch a call may carry.
          generations: buffers rotated from step to step (at least 2 across ranks, see the module
            docstring).

        Returns:
          A ``Mailbox`` whose every data word holds the sentinel, on the default device.

        Raises:
          ValueError: naming the argument, for a wrong type or value.
        """
        if not isinstance(cfg, FrontConfig):
            raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
        if cfg.latent_per_rank % 2:
            raise ValueError(
                f"cfg.latent / cfg.tp = {cfg.latent_per_rank} must be even: the mailbox packs "
                "bfloat16 latent columns in pairs into 32-bit words"
            )
        for name, value in (("capacity", capacity), ("generations", generations)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        rows = np.broadcast_to(armed_row(cfg), (generations, int(capacity), row_words(cfg)))
        control = jnp.full((CONTROL_WORDS,), int(generations) - 1, jnp.int32)
        tickets = jnp.zeros((ticket_count(cfg.experts_per_rank, cfg.latent_per_rank),), jnp.int32)
        return cls(jnp.asarray(rows), control, tickets, cfg)

    @property
    def generations(self) -> int:
        return self.buffer.shape[0]

    @property
    def capacity(self) -> int:
        return self.buffer.shape[1]

    @property
    def words(self) -> int:
        return self.buffer.shape[2]


def check_mailbox(mailbox, cfg: FrontConfig, batch: int) -> None:
    """``mailbox`` must be a ``Mailbox`` laid out for ``cfg`` with room for ``batch`` rows (trace time).

    Raises:
      ValueError: naming the argument, its value and what was expected.
    """
    if mailbox_config(mailbox) != cfg:
        raise ValueError(f"mailbox was created for {mailbox.cfg}, but the params are for {cfg}")
    arrays = (mailbox.buffer, mailbox.control, mailbox.tickets)
    if any(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) and a.is_deleted()
           for a in arrays):
        raise ValueError(
            "mailbox's arrays were deleted: an earlier call donated them (moe_front outside jit, "
            "or a jit with donate_argnames='mailbox'); pass the Mailbox that call returned"
        )
    shape, dtype = tuple(mailbox.buffer.shape), mailbox.buffer.dtype
    if len(shape) != 3 or shape[2] != row_words(cfg) or dtype != jnp.uint32:
        raise ValueError(
            f"mailbox.buffer is {shape} {dtype}, expected (generations, capacity, "
            f"{row_words(cfg)}) uint32"
        )
    control = mailbox.control
    if tuple(control.shape) != (CONTROL_WORDS,) or control.dtype != jnp.int32:
        raise ValueError(
            f"mailbox.control is {tuple(control.shape)} {control.dtype}, "
            f"expected ({CONTROL_WORDS},) int32"
        )
    tickets = mailbox.tickets
    count = ticket_count(cfg.experts_per_rank, cfg.latent_per_rank)
    if tuple(tickets.shape) != (count,) or tickets.dtype != jnp.int32:
        raise ValueError(
            f"mailbox.tickets is {tuple(tickets.shape)} {tickets.dtype}, expected ({count},) int32"
        )
    if batch > mailbox.capacity:
        raise ValueError(
            f"batch of {batch} rows is over the mailbox capacity {mailbox.capacity}; create the "
            f"mailbox with Mailbox.create(cfg, capacity>={batch})"
        )


def mailbox_config(mailbox) -> FrontConfig:
    """The config ``mailbox`` is laid out for; a ValueError when it is not a ``Mailbox``."""
    if not isinstance(mailbox, Mailbox):
        raise ValueError(f"mailbox must be a Mailbox (Mailbox.create), got {type(mailbox).__name__}")
    return mailbox.cfg


def _check_shard(name: str, array, batch: int | None, width: int, dtype) -> int:
    shape = getattr(array, "shape", None)
    if shape is None or len(shape) != 2 or shape[1] != width or array.dtype != dtype:
        got = shape if shape is None else f"{tuple(shape)} {array.dtype}"
        raise ValueError(f"{name} must be [B, {width}] {jnp.dtype(dtype)}, got {got}")
    if shape[0] == 0 or (batch is not None and shape[0] != batch):
        expected = "B >= 1" if batch is None else f"B = {batch} as logits"
        raise ValueError(f"{name} has {shape[0]} rows, expected {expected}")
    return shape[0]


def _arrays(mailbox: Mailbox) -> tuple[jax.Array, jax.Array]:
    return mailbox.buffer, mailbox.control


def _with(mailbox: Mailbox, buffer, control, tickets=None) -> Mailbox:
    tickets = mailbox.tickets if tickets is None else tickets
    return dataclasses.replace(mailbox, buffer=buffer, control=control, tickets=tickets)


def publish(
    mailbox: Mailbox,
    logits: jax.Array,
    latent_shard: jax.Array,
    rank: int | jax.Array = 0,
    *,
    backend: str = "auto",
) -> Mailbox:
    """Rank ``rank`` writes its logits and latent shard into the next generation's rows.

    Args:
      mailbox: the ``Mailbox`` (laid out for ``mailbox.cfg``, whose ``tp`` ranks share the rows).
      logits: ``[B, E/tp]`` float32, the rank's router logits.
      latent_shard: ``[B, L/tp]`` bfloat16, the rank's latent columns.
      rank: an int in ``[0, tp)``, or an int32 scalar array (``lax.axis_index`` under ``shard_map``).
      backend: as for ``moe_front`` (the jax-triton kernel publishes one device's rows, tp = 1).

    Returns:
      The mailbox with rows ``[0, B)`` of generation ``(control[0] + 1) mod G`` holding the canonical
      words at the rank's columns, and ``control[1]`` that generation.

    Raises:
      ValueError: a wrong shape or dtype, a batch over the capacity, or an int ``rank`` out of range.
      NotImplementedError: ``backend="pallas"`` with tp > 1 (use ``exchange``'s ``"peer"``).
    """
    cfg = mailbox_config(mailbox)
    batch = _check_shard("logits", logits, None, cfg.experts_per_rank, jnp.float32)
    _check_shard("latent_shard", latent_shard, batch, cfg.latent_per_rank, jnp.bfloat16)
    check_mailbox(mailbox, cfg, batch)
    if isinstance(rank, int) and not 0 <= rank < cfg.tp:
        raise ValueError(f"rank must be in [0, tp={cfg.tp}), got {rank}")
    args = (*_arrays(mailbox), logits, latent_shard, rank, cfg)
    buffer, control, _ = registry.run("mailbox_publish", backend, *args)
    return _with(mailbox, buffer, control)


def collect(
    mailbox: Mailbox, batch: int, *, backend: str = "auto"
) -> tuple[jax.Array, jax.Array, jax.Array, Mailbox]:
    """Read rows ``[0, batch)`` of the generation last published, and re-arm them.

    Args:
      mailbox: the ``Mailbox``.
      batch: rows to collect, in ``[1, capacity]``.
      backend: as for ``moe_front``.

    Returns:
      ``(logits [batch, E] float32, latent [batch, L] bfloat16, status int32 scalar, mailbox)``:
      status is ``TIMEOUT`` when a chunk still held the sentinel (after the spin limit on the GPU),
      else 0; the returned mailbox is armed and its ``control[0]`` is the generation read.

    Raises:
      ValueError: a wrong mailbox, or ``batch`` not in ``[1, capacity]``.
    """
    cfg = mailbox_config(mailbox)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    check_mailbox(mailbox, cfg, batch)
    return _collect(mailbox, jnp.zeros((), jnp.int32), batch, backend)


def runs_kernels(mailbox: Mailbox, batch: int, backend: str) -> bool:
    """Whether ``backend`` collects ``batch`` rows of ``mailbox`` with the GPU kernels (then a
    publish across GPUs can be the peer store, ``transport="peer"``)."""
    status = jnp.zeros((), jnp.int32)
    return registry.choose("mailbox_collect", backend, *_arrays(mailbox), status, batch,
                           mailbox.cfg).kernel


def _collect(mailbox: Mailbox, status, batch: int, backend: str):
    args = (*_arrays(mailbox), status, batch, mailbox.cfg)
    logits, latent, status, buffer, control = registry.run("mailbox_collect", backend, *args)
    return logits, latent, status, _with(mailbox, buffer, control)


def _check_exchange(mailbox, logits, latent_shard, axis_name, transport) -> int:
    """``exchange``'s argument checks; returns the batch."""
    cfg = mailbox_config(mailbox)
    batch = _check_shard("logits", logits, None, cfg.experts_per_rank, jnp.float32)
    _check_shard("latent_shard", latent_shard, batch, cfg.latent_per_rank, jnp.bfloat16)
    check_mailbox(mailbox, cfg, batch)
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    if axis_name is None and cfg.tp != 1:
        raise ValueError(
            f"the mailbox is for tp={cfg.tp} ranks: pass axis_name, the mesh axis of the ranks"
        )
    if axis_name is not None and lax.axis_size(axis_name) != cfg.tp:
        raise ValueError(
            f"axis_name={axis_name!r} has {lax.axis_size(axis_name)} ranks, but the mailbox is "
            f"for tp={cfg.tp}"
        )
    if transport == "peer" and cfg.tp > 1 and mailbox.generations < 2:
        raise ValueError(
            f"transport='peer' over tp={cfg.tp} ranks needs generations >= 2 (a fast rank's "
            f"next step must land in another generation), got {mailbox.generations}"
        )
    return batch


def _publish_all(mailbox: Mailbox, logits, latent_shard, axis_name, backend: str, transport: str):
    """Every rank's shard into this rank's mailbox (``exchange``'s first half); returns
    ``(mailbox, status)``, the zeroed status word the collect polls with."""
    cfg = mailbox.cfg
    if transport == "peer":
        if not runs_kernels(mailbox, logits.shape[0], backend):
            raise NotImplementedError(
                f"transport='peer' stores through GPU peer pointers and needs the GPU kernels, got "
                f"backend={backend!r} on {registry.target_platform()}; use transport='gather'"
            )
        from moe_front_jax.bridge import peer_mailbox

        buffer, control, status = peer_mailbox.publish(*_arrays(mailbox), logits, latent_shard, cfg,
                                                       axis_name)
        return _with(mailbox, buffer, control), status
    if cfg.tp == 1:
        every = [(logits, latent_shard)]
    else:
        every_logits = lax.all_gather(logits, axis_name)
        every_latent = lax.all_gather(latent_shard, axis_name)
        every = [(every_logits[rank], every_latent[rank]) for rank in range(cfg.tp)]
    status = jnp.zeros((), jnp.int32)
    for rank, (rank_logits, rank_latent) in enumerate(every):
        args = (*_arrays(mailbox), rank_logits, rank_latent, rank, cfg)
        buffer, control, status = registry.run("mailbox_publish", backend, *args)
        mailbox = _with(mailbox, buffer, control)
    return mailbox, status


@functools.partial(
    jax.jit, static_argnames=("axis_name", "backend", "transport"), donate_argnames="mailbox"
)
def exchange(
    mailbox: Mailbox,
    logits: jax.Array,
    latent_shard: jax.Array,
    *,
    axis_name: str | None = None,
    backend: str = "auto",
    transport: str = "gather",
) -> tuple[jax.Array, jax.Array, jax.Array, Mailbox]:
    """One step through the mailbox: every rank publishes its shard, then this rank collects.

    Jitted with the mailbox donated, so that a call outside ``jit`` updates the buffer in place; inside
    the caller's ``jit`` the caller donates it.

    Args:
      mailbox: the ``Mailbox`` (armed).
      logits: ``[B, E/tp]`` float32, this rank's router logits.
      latent_shard: ``[B, L/tp]`` bfloat16, this rank's latent columns.
      axis_name: with tp > 1, the mesh axis of the ranks (inside ``shard_map``); None for tp = 1.
      backend: as for ``moe_front``.
      transport: ``"gather"`` or ``"peer"`` (``TRANSPORTS``).

    Returns:
      ``(logits [B, E] float32, latent [B, L] bfloat16, status int32 scalar, mailbox)`` as
      ``collect`` returns them.

    Raises:
      ValueError: a wrong shape, dtype or mailbox, a batch over its capacity, tp > 1 without
        ``axis_name``, an ``axis_name`` whose size is not tp, an unknown ``transport``, or
        ``"peer"`` over tp > 1 with fewer than 2 generations.
      NotImplementedError: ``"peer"`` without the GPU kernels, or ``"gather"`` over tp > 1 with
        ``backend="pallas"`` (the jax-triton publish is one device's; use ``"peer"``).
    """
    batch = _check_exchange(mailbox, logits, latent_shard, axis_name, transport)
    mailbox, status = _publish_all(mailbox, logits, latent_shard, axis_name, backend, transport)
    return _collect(mailbox, status, batch, backend)


@functools.partial(
    jax.jit, static_argnames=("axis_name", "backend", "transport", "plan", "permute"),
    donate_argnames="mailbox",
)
def exchange_route(
    mailbox: Mailbox,
    logits: jax.Array,
    latent_shard: jax.Array,
    bias: jax.Array,
    *,
    axis_name: str | None = None,
    backend: str = "auto",
    transport: str = "gather",
    plan: bool = False,
    permute: bool = False,
) -> tuple:
    """``exchange``, then the routing of SPEC section 4 over the collected logits (and, with ``plan``,
    the MXFP8 plan of the collected latent, SPEC section 5; with ``permute``, the dispatch order of
    SPEC section 4.1).

    With ``plan``, where ``registry`` runs the routing kernel that polls the mailbox
    (``route_collect``: collect, route and plan in one launch), that kernel collects; otherwise the
    collect, routing and plan stages run one after the other (without the plan the separate kernels
    measured faster: docs/findings.md). The outputs are the same bits either way. With ``permute``
    the routing kernel writes the order in its launch; after ``route_collect`` the stage
    ``permute`` computes it from the ids (the standalone kernel where it runs).

    Args:
      mailbox, logits, latent_shard, axis_name, backend, transport: as for ``exchange``.
      bias: ``[E]`` float32 correction bias.
      plan: also return the plan.
      permute: also return the dispatch order.

    Returns:
      ``(ids [B, K] int32, weights [B, K] bfloat16, logits [B, E] float32, latent [B, L] bfloat16,
      plan, status int32 scalar, dispatch, mailbox)``; ``plan`` is ``(values [B, L] float8_e4m3fn,
      scales [B, L / plan_block] float8_e8m0fnu)``, or None without ``plan``; ``dispatch`` is
      ``(order [B * K], group_sizes [E], inverse [B * K])`` int32 (``api.Dispatch``'s fields), or
      None without ``permute``.

    Raises:
      As ``exchange``; a wrong bias is a ValueError.
    """
    batch = _check_exchange(mailbox, logits, latent_shard, axis_name, transport)
    mailbox, status = _publish_all(mailbox, logits, latent_shard, axis_name, backend, transport)
    return _route_published(mailbox, status, bias, batch, backend, plan, permute)


@functools.partial(
    jax.jit,
    static_argnames=("split", "valid", "backend", "plan", "plan_block", "permute"),
    donate_argnames="mailbox",
)
def gemm_exchange_route(
    mailbox: Mailbox,
    x: jax.Array,
    packed: jax.Array,
    bias: jax.Array,
    *,
    split: int,
    valid: int,
    backend: str = "auto",
    plan: bool = False,
    plan_block: int | None = None,
    permute: bool = False,
) -> tuple:
    """``exchange_route`` at tp = 1 with the publish done by the front GEMM's stage
    ``front_gemm_publish``: where its kernel runs, the logits and latent go from the GEMM's
    registers into the mailbox and no publish kernel runs.

    Args:
      mailbox: the ``Mailbox`` (tp = 1, armed).
      x, packed, split, valid: ``front_gemm``'s arguments.
      bias, backend, plan, permute: as for ``exchange_route``.
      plan_block: multiply with ``front_gemm_plan``'s schedule for this block rather than
        ``front_gemm``'s: the one the direct path runs, so that both paths give the same bits.

    Returns:
      As ``exchange_route``.

    Raises:
      ValueError: a wrong mailbox, or shapes that disagree with it; otherwise as ``exchange_route``.
    """
    cfg = mailbox_config(mailbox)
    check_mailbox(mailbox, cfg, x.shape[0])
    args = (x, packed, split, valid, mailbox.buffer, mailbox.control, mailbox.tickets, cfg)
    buffer, control, tickets, status = registry.run("front_gemm_publish", backend, *args,
                                                    plan_block=plan_block)
    mailbox = _with(mailbox, buffer, control, tickets)
    return _route_published(mailbox, status, bias, x.shape[0], backend, plan, permute)


def _route_published(mailbox: Mailbox, status, bias, batch: int, backend: str, plan: bool,
                     permute: bool) -> tuple:
    """``exchange_route`` after the publish: ``route_collect`` (then the stage ``permute`` over its
    ids) where its kernel runs, else collect, route (with the order) and plan."""
    cfg = mailbox.cfg
    args = (*_arrays(mailbox), status, bias, batch, cfg)
    try:  # a plan the fused kernel does not write (plan_block 1) takes the separate kernels
        fused = plan and registry.choose("route_collect", backend, *args, with_plan=True).kernel
    except NotImplementedError:
        fused = False
    if fused:
        ids, *out, status, buffer, control = registry.run("route_collect", backend, *args,
                                                          with_plan=True)
        dispatched = tuple(registry.run("permute", backend, ids, cfg)) if permute else None
        return (ids, *out, status, dispatched, _with(mailbox, buffer, control))
    logits, latent, status, mailbox = _collect(mailbox, status, batch, backend)
    if permute:
        ids, weights, *dispatched = registry.run("route", backend, logits, bias, cfg, permute=True)
        dispatched = tuple(dispatched)
    else:
        (ids, weights), dispatched = registry.run("route", backend, logits, bias, cfg), None
    planned = registry.run("plan", backend, latent, cfg.plan_block) if plan else None
    return ids, weights, logits, latent, planned, status, dispatched, mailbox
