"""The Lamport mailbox (SPEC.md section 7): state, layout, and the protocol in plain JAX.

The mailbox carries every tensor-parallel rank's router logits and latent shard to every rank. Each
decode row (token) has a mailbox row; a rank *publishes* its shard into the row, and the reader
*collects* the row: it polls every 16-byte chunk until none of its four 32-bit words is the sentinel,
copies the chunk out, and re-arms it with the sentinel. No flag, barrier or collective separates the
two: the sentinel in the data itself says whether a word has arrived (Lamport's trick), and the
re-armed buffer is ready for a later step.

Layout
------
A row is ``L + 2E`` 16-bit columns: the latent ``[0, L)`` as bfloat16, then the logits ``[L, L + 2E)``
as float32 words (5376 columns for Kimi-K3). It is stored as uint32 words, little-endian as the GPU
reads memory: word ``i < L/2`` holds latent columns ``2i`` (low half) and ``2i + 1`` (high half), word
``L/2 + e`` holds the float32 bits of logit ``e``. Rows are padded with zero words to a whole number
of 16-byte chunks; zero is not the sentinel, so padding is never waited for, and it is never written.
``Mailbox.buffer`` is ``[generations, capacity, words]`` uint32.

Rank ``r`` of ``tp`` publishes its latent shard at columns ``[r * L/tp, (r+1) * L/tp)`` and its logits
at experts ``[r * E/tp, (r+1) * E/tp)`` into every rank's mailbox (``exchange`` with ``axis_name``
expresses it as a gather of the shards and one local publish per rank). A row is complete when every
rank has published.

Sentinel and canonicalization
-----------------------------
The sentinel is the word ``0x80000000`` (float32 -0.0); an armed row holds it in every data word.
Writers canonicalize so that no data word is the sentinel: a float32 logit -0.0 becomes +0.0, and a
bfloat16 -0 (``0x8000``) in either half of a latent word becomes +0 (the high half is the one that could
make a sentinel; the low half is canonicalized too so that every latent column follows one rule). This
is the only way the mailbox path differs from the direct path, bit for bit: logits and latent values
that are -0 come out as +0. Routing cannot see it: ``sigmoid(-0.0) == sigmoid(+0.0) == 0.5`` exactly,
so every key, id and weight is unchanged. The MXFP8 plan of a -0 latent value becomes ``0x00``
instead of ``0x80`` (its scale is unchanged: the block's amax does not depend on the sign of zero).
Other negative values, subnormals and NaN payloads pass unchanged.

Generations, and why the immediate re-arm is safe
-------------------------------------------------
Step ``t`` (one ``exchange``) uses generation ``g = t mod G``. ``Mailbox.control`` is int32 ``[2]``:
the generation the last collect read, then the one the last publish wrote. A publish writes generation
``(control[0] + 1) mod G`` and records it in ``control[1]``; a collect reads generation ``control[1]``
and records it in ``control[0]``. Neither kernel writes a word it reads, so every program of a grid
reads the same value without atomics or a barrier. A new mailbox holds ``[G - 1, G - 1]``, and
after a step both words are that step's generation. A collect re-arms each chunk right after copying it
out. That never erases a value of a later step:

1. On one device (tp = 1, what runs today): publish(t), collect(t) and publish(t+1) are kernels on one
   stream. collect(t) completes, its re-arm stores included, before publish(t+1) starts (jax-triton's
   kernels never trigger programmatic dependent launch, so the next kernel starts only after this one
   has finished and its stores are visible), so no value of step t+1 exists while step t is re-armed.
   One generation would suffice.
2. Across ranks (the peer-store publish, ``peer_mailbox``): rank ``r`` writes into rank ``s``'s
   generation ``g`` again only at step ``t + G``. Rank ``r`` issues publish(t+G) after its
   collect(t+G-1) has seen every rank's publish(t+G-1), including ``s``'s; ``s`` issues publish(t+G-1)
   after its collect(t), re-arm included, has completed, provided ``t + G - 1 >= t + 1``, that is
   ``G >= 2``. So every write of step ``t + G`` happens after ``s`` read and re-armed step ``t``, and
   a write of step ``t + 1`` lands in another generation. With ``G = 1`` a fast rank could write step
   ``t + 1`` into a row its peer has not collected yet. The default ``G = 3`` follows TensorRT-LLM's
   Lamport buffers and leaves one step of slack for a re-arm deferred into the next call.

Tile tickets
------------
``Mailbox.tickets`` holds int32 counters for the front GEMM kernel that publishes into the mailbox
(``front_gemm.front_gemm_publish``): its split-K and stream-K schedules hand a tile's float32
partials to the tile's last program through a counter per tile, and that program zeroes the counter
again. Kept in the mailbox from call to call, the counters need no zeroing kernel before each GEMM,
which ``front_gemm``'s fresh counters do (0.64 us on the H200). They must be zero between calls:
``Mailbox.create`` makes them so and every call leaves them so; a counter found non-zero would hand a
tile to the wrong program.

Bounded polling and the status
------------------------------
Polling stops after a spin limit (``triton_mailbox.SPIN_LIMIT`` iterations on the GPU). A chunk that
still holds the sentinel then is a timeout: ``collect`` returns status ``TIMEOUT`` (else 0), still
copies out what it read (sentinel words come out as -0.0 logits and ``0x8000``/``0x0000`` bfloat16
pairs), and still re-arms the whole row, so the mailbox comes back armed. After a timeout a late
writer may still land in the re-armed row: a caller that sees the status should replace the mailbox
with a new one. In plain JAX there is nothing to wait for: a chunk holding the sentinel when it is
collected is a timeout.

On the GPU the status is one word: publish writes 0 into it, and a collect program that times out
writes ``TIMEOUT``; the other programs read it while they poll and stop at once when it is set, so
the programs of a later wave do not each spin to the limit.

Backends: ``"auto"`` runs the jax-triton kernels of ``triton_mailbox`` on a GPU (imported only then:
jax-triton 0.3.1 cannot be imported without a GPU jaxlib) and this module's plain JAX elsewhere;
``"pallas"`` asks for the kernels; ``"xla"`` and ``"interpret"`` run the plain-JAX protocol.
``exchange_route`` (the path of ``moe_front``) with ``plan=True`` collects with the routing kernel
instead (``pallas/route_collect.py``) wherever that kernel runs: on a GPU after the kernels' publish,
and in interpret mode after the plain-JAX publish. At tp = 1, wherever the direct path runs the front
GEMM kernel (``"pallas"``, ``"interpret"``, and ``"auto"`` at the shapes its table gives the kernel),
``moe_front`` publishes from that kernel's epilogue instead, with the direct path's schedule
(``gemm_exchange_route``, ``front_gemm.front_gemm_publish``): the same words, with no publish kernel
and no logits or latent written first; the collect then runs as above.

Transports (``exchange``'s ``transport``): ``"gather"`` (the default) gathers the ranks' shards with
one XLA all-gather and publishes them locally (with the GPU kernels: tp = 1 only); ``"peer"`` runs the
peer-store publish of ``peer_mailbox`` (a Mosaic GPU kernel: each rank stores its words straight into
every rank's mailbox) and then the kernels' collect. ``"peer"`` needs the GPU kernels; under plain JAX
``"gather"`` states the same words.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from moe_front_jax import backends
from moe_front_jax.config import FrontConfig
from moe_front_jax.pallas.streaming import MIN_DOT

SENTINEL = 0x80000000
"""The armed word: float32 -0.0. No published data word equals it."""
TIMEOUT = 1
"""Status of a collect that found a chunk still holding the sentinel after its spin limit."""
CHUNK_WORDS = 4
"""32-bit words per 16-byte chunk, the unit a reader polls, copies and re-arms."""
CONTROL_WORDS = 2
"""``Mailbox.control``: [generation the last collect read, generation the last publish wrote]."""


def latent_words(cfg: FrontConfig) -> int:
    """Words of a row holding the latent: ``L / 2``."""
    return cfg.latent // 2


def data_words(cfg: FrontConfig) -> int:
    """Words of a row that carry data: ``L / 2 + E``."""
    return latent_words(cfg) + cfg.experts


def row_words(cfg: FrontConfig) -> int:
    """Words of a stored row: ``data_words`` rounded up to whole 16-byte chunks."""
    return -(-data_words(cfg) // CHUNK_WORDS) * CHUNK_WORDS


def ticket_count(cfg: FrontConfig) -> int:
    """Tile counters of ``Mailbox.tickets``: one per tile of the front GEMM's narrowest tensor-core
    schedule over a rank's rows (``MIN_DOT`` rows a tile, router and latent rows tiled apart), so
    enough for any schedule of ``front_gemm.front_gemm_publish``: 280 for Kimi-K3 at tp = 1."""
    return -(-cfg.experts_per_rank // MIN_DOT) + -(-cfg.latent_per_rank // MIN_DOT)


def armed_row(cfg: FrontConfig) -> np.ndarray:
    """An armed row, ``[row_words]`` uint32: the sentinel in every data word, zero in the padding."""
    row = np.zeros(row_words(cfg), np.uint32)
    row[: data_words(cfg)] = SENTINEL
    return row


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mailbox:
    """A Lamport mailbox: state passed into ``moe_front`` and returned by it (a pytree).

    Donate it (``jax.jit(..., donate_argnames="mailbox")``) so that its buffer is updated in place;
    ``moe_front`` called outside ``jit`` donates it itself.

    Attributes:
      buffer: ``[generations, capacity, words]`` uint32 rows (layout in the module docstring).
      control: ``[2]`` int32: the generation the last collect read, and the one the last publish
        wrote (``[G - 1, G - 1]`` when new).
      tickets: ``[ticket_count(cfg)]`` int32, zero between calls: the tile counters of the split-K
        and stream-K schedules of the front GEMM publishing into the mailbox (module docstring).
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
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        rows = np.broadcast_to(armed_row(cfg), (generations, capacity, row_words(cfg)))
        control = jnp.full((CONTROL_WORDS,), generations - 1, jnp.int32)
        return cls(jnp.asarray(rows), control, jnp.zeros((ticket_count(cfg),), jnp.int32), cfg)

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
    if tuple(tickets.shape) != (ticket_count(cfg),) or tickets.dtype != jnp.int32:
        raise ValueError(
            f"mailbox.tickets is {tuple(tickets.shape)} {tickets.dtype}, expected "
            f"({ticket_count(cfg)},) int32"
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


def uses_kernels(backend: str) -> bool:
    """Whether ``backend`` runs the mailbox's GPU kernels (``"pallas"``, or ``"auto"`` on a GPU) rather
    than the plain-JAX protocol.

    Raises:
      ValueError: an unknown backend.
      NotImplementedError: ``"pallas"`` without a GPU.
    """
    backends.check_backend(backend)
    if backend == "pallas" and not backends.on_gpu():
        raise NotImplementedError(
            "backend='pallas': the jax-triton mailbox kernels need an NVIDIA GPU; use backend='xla' "
            "for the plain-JAX protocol"
        )
    return backend == "pallas" or (backend == "auto" and backends.on_gpu())


def _kernels():
    from moe_front_jax.bridge import triton_mailbox

    return triton_mailbox


TRANSPORTS = ("gather", "peer")
"""How ``exchange`` carries the shards to every rank (module docstring)."""


def logits_to_words(logits: jax.Array) -> jax.Array:
    """float32 ``[B, n]`` logits as canonical words ``[B, n]`` uint32 (-0.0 becomes +0.0)."""
    words = lax.bitcast_convert_type(logits, jnp.uint32)
    return jnp.where(words == jnp.uint32(SENTINEL), jnp.uint32(0), words)


def latent_word_pairs(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """Canonical words (uint32) from bfloat16 latent columns ``2i`` (``lo``) and ``2i + 1``
    (``hi``) of one shape: the low and high halves, a -0 (``0x8000``) becoming +0. Also what the
    front GEMM kernel's epilogue publishes (``front_gemm.front_gemm_publish``)."""
    def half(v):
        bits = lax.bitcast_convert_type(v, jnp.uint16).astype(jnp.uint32)
        return jnp.where(bits == jnp.uint32(0x8000), jnp.uint32(0), bits)

    return half(lo) | (half(hi) << 16)


def latent_to_words(latent: jax.Array) -> jax.Array:
    """bfloat16 ``[B, n]`` latent (n even) as canonical words ``[B, n/2]`` uint32.

    Column ``2i`` is the low half of word ``i``; a bfloat16 -0 (``0x8000``) becomes +0.
    """
    return latent_word_pairs(latent[:, 0::2], latent[:, 1::2])


def words_to_latent(words: jax.Array) -> jax.Array:
    """Words ``[B, n]`` uint32 back to bfloat16 columns ``[B, 2n]`` (inverse of ``latent_to_words``)."""
    halves = jnp.stack([words & jnp.uint32(0xFFFF), words >> 16], axis=-1).astype(jnp.uint16)
    return lax.bitcast_convert_type(halves.reshape(words.shape[0], -1), jnp.bfloat16)


def publish(
    mailbox: Mailbox,
    logits: jax.Array,
    latent_shard: jax.Array,
    rank: int | jax.Array = 0,
    *,
    backend: str = "auto",
) -> Mailbox:
    """Rank ``rank`` writes its logits and latent shard into the current generation's rows.

    Args:
      mailbox: the ``Mailbox`` (laid out for ``mailbox.cfg``, whose ``tp`` ranks share the rows).
      logits: ``[B, E/tp]`` float32, the rank's router logits.
      latent_shard: ``[B, L/tp]`` bfloat16, the rank's latent columns.
      rank: an int in ``[0, tp)``, or an int32 scalar array (``lax.axis_index`` under ``shard_map``).
      backend: see the module docstring; the GPU kernels publish rank 0 of tp = 1 only.

    Returns:
      The mailbox with rows ``[0, B)`` of generation ``g = (control[0] + 1) mod G`` holding the
      canonical words at the rank's columns (latent words ``[rank * L/(2 tp), ...)``, logit words
      ``L/2 + [rank * E/tp, ...)``), and ``control[1] = g``.

    Raises:
      ValueError: a wrong shape or dtype, a batch over the capacity, or an int ``rank`` out of range.
      NotImplementedError: the GPU kernels asked for a rank of tp > 1 (the cross-GPU publish arrives
        with the multi-GPU issue; use backend="xla").
    """
    cfg = mailbox_config(mailbox)
    batch = _check_shard("logits", logits, None, cfg.experts_per_rank, jnp.float32)
    _check_shard("latent_shard", latent_shard, batch, cfg.latent_per_rank, jnp.bfloat16)
    check_mailbox(mailbox, cfg, batch)
    if isinstance(rank, int) and not 0 <= rank < cfg.tp:
        raise ValueError(f"rank must be in [0, tp={cfg.tp}), got {rank}")
    if uses_kernels(backend):
        if cfg.tp != 1:
            raise NotImplementedError(
                f"the GPU mailbox kernels publish on one device (tp=1), got tp={cfg.tp}: the "
                "cross-GPU publish arrives with the multi-GPU issue; use backend='xla'"
            )
        return _kernels().publish(mailbox, logits, latent_shard)[0]
    generation = (mailbox.control[0] + 1) % mailbox.generations
    latent_at = rank * (cfg.latent_per_rank // 2)
    logits_at = latent_words(cfg) + rank * cfg.experts_per_rank
    buffer = lax.dynamic_update_slice(
        mailbox.buffer, latent_to_words(latent_shard)[None], (generation, 0, latent_at)
    )
    buffer = lax.dynamic_update_slice(buffer, logits_to_words(logits)[None], (generation, 0, logits_at))
    return dataclasses.replace(mailbox, buffer=buffer, control=mailbox.control.at[1].set(generation))


def collect(
    mailbox: Mailbox, batch: int, *, backend: str = "auto"
) -> tuple[jax.Array, jax.Array, jax.Array, Mailbox]:
    """Read rows ``[0, batch)`` of the generation last published, and re-arm them.

    Args:
      mailbox: the ``Mailbox``.
      batch: rows to collect, in ``[1, capacity]``.
      backend: see the module docstring.

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
    if uses_kernels(backend):
        return _kernels().collect(mailbox, batch, jnp.zeros((), jnp.int32))
    generation = mailbox.control[1]
    words = lax.dynamic_slice(mailbox.buffer, (generation, 0, 0), (1, batch, data_words(cfg)))[0]
    # The copy-out is complete before the re-arm: without the barrier XLA may fuse reads of the rows
    # into consumers scheduled after the re-arm, and then copies the whole buffer to keep them valid.
    words, generation, buffer, control = lax.optimization_barrier(
        (words, generation, mailbox.buffer, mailbox.control)
    )
    status = jnp.where(jnp.any(words == jnp.uint32(SENTINEL)), TIMEOUT, 0).astype(jnp.int32)
    latent = words_to_latent(words[:, : latent_words(cfg)])
    logits = lax.bitcast_convert_type(words[:, latent_words(cfg):], jnp.float32)
    armed = jnp.full((1, batch, data_words(cfg)), SENTINEL, jnp.uint32)
    buffer = lax.dynamic_update_slice(buffer, armed, (generation, 0, 0))
    control = control.at[0].set(generation)
    return logits, latent, status, dataclasses.replace(mailbox, buffer=buffer, control=control)


def _check_exchange(mailbox, logits, latent_shard, axis_name, transport) -> int:
    """``exchange``'s argument checks; returns the batch."""
    cfg = mailbox_config(mailbox)
    batch = _check_shard("logits", logits, None, cfg.experts_per_rank, jnp.float32)
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
    return batch


def _publish_all(mailbox: Mailbox, logits, latent_shard, axis_name, backend: str, transport: str):
    """Every rank's shard into this rank's mailbox (``exchange``'s first half).

    Returns ``(mailbox, status)``: the GPU kernels' zeroed status word, or None after the plain-JAX
    publish.
    """
    cfg = mailbox.cfg
    batch = logits.shape[0]
    if transport == "peer":
        _check_shard("latent_shard", latent_shard, batch, cfg.latent_per_rank, jnp.bfloat16)
        if cfg.tp > 1 and mailbox.generations < 2:
            raise ValueError(
                f"transport='peer' over tp={cfg.tp} ranks needs generations >= 2 (a fast rank's "
                f"next step must land in another generation), got {mailbox.generations}"
            )
        if not uses_kernels(backend):
            raise NotImplementedError(
                f"transport='peer' stores through GPU peer pointers and needs the GPU kernels, got "
                f"backend={backend!r} on {jax.default_backend()}; use transport='gather'"
            )
        from moe_front_jax.bridge import peer_mailbox

        return peer_mailbox.publish(mailbox, logits, latent_shard, axis_name)
    if cfg.tp == 1:
        if uses_kernels(backend):
            _check_shard("latent_shard", latent_shard, batch, cfg.latent_per_rank, jnp.bfloat16)
            return _kernels().publish(mailbox, logits, latent_shard)
        return publish(mailbox, logits, latent_shard, 0, backend=backend), None
    if uses_kernels(backend):
        raise NotImplementedError(
            "transport='gather' publishes locally with the GPU kernels (tp=1); across GPUs use "
            "transport='peer', or backend='xla'"
        )
    _check_shard("latent_shard", latent_shard, batch, cfg.latent_per_rank, jnp.bfloat16)
    every_logits = lax.all_gather(logits, axis_name)
    every_latent = lax.all_gather(latent_shard, axis_name)
    for rank in range(cfg.tp):
        mailbox = publish(mailbox, every_logits[rank], every_latent[rank], rank, backend=backend)
    return mailbox, None


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
      axis_name: with tp > 1, the mesh axis of the ranks (inside ``shard_map``). ``"gather"``
        gathers the shards over it and publishes each rank's shard at its columns, as if every rank
        stored into every rank's mailbox; ``"peer"`` does store so. None for tp = 1.
      backend: see the module docstring.
      transport: ``"gather"`` or ``"peer"`` (module docstring).

    Returns:
      ``(logits [B, E] float32, latent [B, L] bfloat16, status int32 scalar, mailbox)`` as
      ``collect`` returns them.

    Raises:
      ValueError: a wrong shape, dtype or mailbox, a batch over its capacity, tp > 1 without
        ``axis_name``, an ``axis_name`` whose size is not tp, an unknown ``transport``, or
        ``"peer"`` over tp > 1 with fewer than 2 generations.
      NotImplementedError: ``"gather"`` with ``axis_name`` and the GPU kernels (use ``"peer"``, or
        backend="xla"), or ``"peer"`` without the GPU kernels.
    """
    batch = _check_exchange(mailbox, logits, latent_shard, axis_name, transport)
    mailbox, status = _publish_all(mailbox, logits, latent_shard, axis_name, backend, transport)
    return _collect_published(mailbox, batch, status, backend)


def _collect_published(mailbox: Mailbox, batch: int, status, backend: str):
    """``collect`` after a publish: by the kernels where they run, polling with the publish's status
    word; else in plain JAX (``status`` unused)."""
    if uses_kernels(backend):
        return _kernels().collect(mailbox, batch, status)
    return collect(mailbox, batch, backend=backend)


@functools.partial(
    jax.jit, static_argnames=("axis_name", "backend", "transport", "plan"), donate_argnames="mailbox"
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
) -> tuple:
    """``exchange``, then the routing step of SPEC section 4 over the collected logits (and, with
    ``plan``, the MXFP8 plan of the collected latent, SPEC section 5).

    With ``plan``, where ``backend`` runs the routing kernel (``"pallas"``, ``"interpret"``,
    ``"auto"`` on a GPU), the routing kernel polls the mailbox itself and writes the plan from the
    words it collects (``pallas/route_collect.py``: collect, route and plan in one launch, the plan
    in the pass that writes the latent). Otherwise ``exchange`` (the collect kernel), the routing and
    the plan stages run one after the other: on the H200, with the groups selection, the separate
    collect and routing kernels measured 0.3-0.6 us faster than ``route_collect`` at B <= 64
    (benchmarks/RESULTS.md, eighth session). The outputs are the same bits either way.

    Args:
      mailbox, logits, latent_shard, axis_name, backend, transport: as for ``exchange``.
      bias: ``[E]`` float32 correction bias.
      plan: also return the plan.

    Returns:
      ``(ids [B, K] int32, weights [B, K] bfloat16, logits [B, E] float32, latent [B, L] bfloat16,
      plan, status int32 scalar, mailbox)``; ``plan`` is ``(values [B, L] float8_e4m3fn, scales
      [B, L / plan_block] float8_e8m0fnu)``, or None without ``plan``.

    Raises:
      As ``exchange``; a wrong bias is a ValueError.
    """
    batch = _check_exchange(mailbox, logits, latent_shard, axis_name, transport)
    mailbox, status = _publish_all(mailbox, logits, latent_shard, axis_name, backend, transport)
    return _route_published(mailbox, status, bias, batch, backend, plan)


@functools.partial(
    jax.jit,
    static_argnames=("split", "valid", "backend", "plan", "plan_schedule"),
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
    plan_schedule: bool = False,
) -> tuple:
    """``exchange_route`` at tp = 1 with the publish done by the front GEMM kernel's epilogue
    (``front_gemm.front_gemm_publish``): the logits and latent go from the GEMM's registers into the
    mailbox, and no publish kernel runs.

    Args:
      mailbox: the ``Mailbox`` (tp = 1, armed).
      x, packed, split, valid: ``front_gemm``'s arguments.
      bias, backend, plan: as for ``exchange_route``; ``backend`` runs the front GEMM kernel
        (``"pallas"``, ``"interpret"``, or ``"auto"`` where it does).
      plan_schedule: multiply with ``front_gemm_plan``'s schedule rather than ``front_gemm``'s: the
        one the direct path runs, so that both paths give the same bits.

    Returns:
      As ``exchange_route``.

    Raises:
      ValueError: a ``backend`` that does not run the front GEMM kernel at these shapes (use
        ``exchange_route`` after the GEMM); otherwise as ``front_gemm.front_gemm_publish`` and
        ``exchange_route``.
    """
    from moe_front_jax.pallas import front_gemm

    gemm = "front_gemm_plan" if plan_schedule else "front_gemm"
    block = (mailbox_config(mailbox).plan_block,) if plan_schedule else ()
    if not backends.runs_kernel(gemm, backend, x, packed, split, valid, *block):
        raise ValueError(
            f"backend={backend!r} does not run the {gemm} kernel at these shapes (x {x.shape}): "
            "publish with exchange_route after the GEMM instead"
        )
    mailbox, status = front_gemm.front_gemm_publish(
        x, packed, split, valid, mailbox, interpret=backend == "interpret",
        plan_block=block[0] if block else None,
    )
    return _route_published(mailbox, status, bias, x.shape[0], backend, plan)


def _route_published(mailbox: Mailbox, status, bias, batch: int, backend: str, plan: bool) -> tuple:
    """``exchange_route`` after the publish: collect, route and plan, or ``route_collect``."""
    from moe_front_jax.pallas import route_collect

    cfg = mailbox.cfg
    route = backends.stage("route", backend)
    if plan and route is not backends.REFERENCE["route"] and route_collect.fuses_plan(cfg):
        if status is None:
            status = jnp.zeros((), jnp.int32)
        return route_collect.route_collect(
            mailbox, status, bias, batch, with_plan=True, interpret=backend == "interpret"
        )
    logits, latent, status, mailbox = _collect_published(mailbox, batch, status, backend)
    ids, weights = route(logits, bias, cfg)
    planned = backends.stage("plan", backend)(latent, cfg.plan_block) if plan else None
    return ids, weights, logits, latent, planned, status, mailbox
