"""The MoE front as a Flax NNX module: ``mf.nn.MoEFront``.

The module holds its weights as ``nnx.Param`` in the layout ``mf.moe_front`` reads (the arrays of
``FrontParams``, packed once when built or loaded), so a call packs, pads or copies nothing. With
``tp`` ranks along the mesh axis (1 without a mesh) and ``split`` the ``E/tp`` router rows rounded up
to 16, the Params and their ``out_sharding`` annotations (``parallel.param_specs``) are:

- ``packed`` ``[tp * (split + L/tp), H]`` bf16, ``(axis, None)``: ``gate.weight`` and
  ``routed_down_weight``, rank-major in ``params.rank_rows``' layout (SPEC.md section 3);
- ``bias`` ``[E]`` float32, ``()``: ``gate.e_score_correction_bias``, whole on every rank;
- ``gate_up`` ``[2S, H]`` bf16, ``(axis, None)``: each rank's ``S/tp`` gate rows then its up rows;
- ``down`` ``[H, S]`` bf16, ``(None, axis)``: ``shared_experts.down_proj.weight`` as is.

``gate_up`` and ``down`` are None without a shared expert; ``front.weights()`` gives the checkpoint's
weights back, unpacked. Under ``nnx.jit`` pass ``graph_updates=False`` (a call updates no Variable)
or donate the module: otherwise XLA copies every Param into a fresh buffer at every call.

Example::

  front = mf.nn.MoEFront(mf.KIMI_K3, rngs=nnx.Rngs(0))
  out = nnx.jit(lambda m, x: m(x), graph_updates=False)(front, x)   # x: [B, 7168] bf16
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from moe_front_jax import checkpoint, parallel
from moe_front_jax import params as packing
from moe_front_jax.api import FrontOutput, moe_front
from moe_front_jax.registry import check_backend
from moe_front_jax.config import FrontConfig
from moe_front_jax.mailbox import Mailbox
from moe_front_jax.params import FrontParams

TP = "tp"
"""Default name of the tensor-parallel mesh axis in the Params' sharding annotations."""

ARRAYS = ("packed", "bias", "gate_up", "down")
"""The module's Params: the array fields of ``FrontParams``, under their names."""


class MoEFront(nnx.Module):
    """The decode-time MoE front of one layer as an NNX module.

    ``front(x, plan=..., permute=..., mailbox=...)`` is ``mf.moe_front(x, front.front_params(),
    ...)``: equal on one device to ``mf.moe_front(x, mf.pack_params(weights, cfg))``. With a
    ``mesh`` every Param is a global array whose rank blocks sit on the devices of ``axis`` (as
    ``mf.shard_params`` places them) and a call runs under ``jax.shard_map``.

    Give ``rngs`` (fresh weights from ``mf.init_weights``; ``shared`` as there) or ``weights``
    (SPEC section 2's keys, validated against ``cfg`` and packed once); ``from_checkpoint`` reads a
    checkpoint straight into the module. ``backend`` and ``shared_reduce`` are ``moe_front``'s.
    The Params ``packed``, ``bias``, ``gate_up`` and ``down`` (None without a shared expert) are
    the module docstring's; ``cfg`` has ``tp`` the number of ranks.

    Raises ``ValueError`` for a bad config, backend, mesh, axis or shared_reduce, a bad weight
    (naming the key), not exactly one of ``rngs`` and ``weights``, or ``shared`` with ``weights``.
    """

    def __init__(
        self,
        cfg: FrontConfig,
        *,
        rngs: nnx.Rngs | None = None,
        weights: Mapping[str, jax.Array] | None = None,
        shared: bool | None = None,
        backend: str = "auto",
        mesh: Mesh | None = None,
        axis: str = TP,
        shared_reduce: str = "psum",
    ):
        if not isinstance(cfg, FrontConfig):
            raise ValueError(f"cfg must be a FrontConfig, got {type(cfg).__name__}")
        check_backend(backend)
        parallel.check_shared_reduce(shared_reduce)
        if mesh is None:
            if cfg.tp != 1:
                raise ValueError(
                    f"cfg.tp={cfg.tp} needs mesh=: a jax.sharding.Mesh with a {axis!r} axis of {cfg.tp} "
                    "devices (without a mesh the module holds every weight on one device)"
                )
        else:
            parallel.check_scatter(shared_reduce, cfg, parallel.mesh_tp(cfg, mesh, axis))
        if (rngs is None) == (weights is None):
            raise ValueError("give exactly one of rngs= (fresh weights) and weights= (given weights)")
        if weights is None:
            weights = packing.init_weights(rngs.params(), cfg, shared=shared)
        elif shared is not None:
            raise ValueError(
                f"shared={shared} applies to rngs=; with weights=, the shared expert is there "
                "exactly when its keys are"
            )
        if mesh is None:
            params = packing.pack_params(weights, cfg)
        else:
            params = parallel.shard_params(weights, cfg, mesh, axis)
        self.cfg = params.cfg
        self.split = params.split
        self.backend = backend
        self.mesh = mesh
        self.axis = axis
        self.shared_reduce = shared_reduce
        specs = parallel.param_specs(axis)
        for name in ARRAYS:
            array = getattr(params, name)
            setattr(self, name, None if array is None else nnx.Param(
                jnp.asarray(array), out_sharding=tuple(specs[name]), eager_sharding=False
            ))

    @classmethod
    def from_checkpoint(
        cls,
        paths_or_dir,
        cfg: FrontConfig,
        prefix: str = "",
        *,
        backend: str = "auto",
        mesh: Mesh | None = None,
        axis: str = TP,
        shared_reduce: str = "psum",
    ) -> MoEFront:
        """A module whose Params are read from a safetensors checkpoint (``mf.load_weights``' sources).

        The Params are ``mf.load_params``': with a ``mesh`` each device reads only its own rows of each
        weight from the files and packs them; no device ever holds a whole weight. Every key is checked
        (shape, dtype, presence) from the file headers, and the arguments, before any data is read; the
        shared expert is there exactly when the checkpoint has its keys.

        Raises:
          ValueError: as ``MoEFront`` and ``mf.load_weights``, naming the checkpoint key at fault.
        """
        reader = checkpoint.CheckpointReader(paths_or_dir, cfg, prefix)
        abstract = nnx.eval_shape(lambda: cls(
            cfg, rngs=nnx.Rngs(0), shared=reader.has_shared, backend=backend, mesh=mesh, axis=axis,
            shared_reduce=shared_reduce,
        ))
        graphdef, state = nnx.split(abstract)
        params = reader.params(mesh=mesh, axis=axis)
        for (name,), variable in nnx.to_flat_state(state):
            variable.set_value(getattr(params, name))
        return nnx.merge(graphdef, state)

    def front_params(self) -> FrontParams:
        """The Params as ``FrontParams`` (the arrays themselves: nothing is copied).

        One device's params, or ``mf.shard_params``' on the mesh: ``mf.moe_front`` takes either.
        """
        held = {name: getattr(self, name) for name in ARRAYS}
        arrays = {name: None if param is None else param[...] for name, param in held.items()}
        sharded = {} if self.mesh is None else dict(mesh=self.mesh, axis=self.axis)
        return FrontParams(**arrays, cfg=self.cfg, split=self.split, **sharded)

    def weights(self) -> dict[str, jax.Array]:
        """The module's weights under the keys and shapes of SPEC section 2 (``params.unpack_params``).

        Unpacking copies every weight: for checkpoints and checks, not for a decode step. With a mesh
        the arrays stay sharded over ``axis``.
        """
        return packing.unpack_params(self.front_params())

    def __call__(
        self, x: jax.Array, *, plan: bool = False, permute: bool = False,
        mailbox: Mailbox | None = None,
    ) -> FrontOutput | tuple[FrontOutput, Mailbox]:
        """The front of one decode step: ``mf.moe_front(x, self.front_params(), ...)``.

        Args:
          x: ``[B, H]`` bfloat16 decode rows, ``B >= 1``. With a mesh whose other axes split the batch
            (data parallel), ``B`` must divide by the product of their sizes.
          plan: also return the MXFP8 copy of the latent (``FrontOutput.plan``).
          permute: also return the dispatch order of SPEC section 4.1 (``FrontOutput.dispatch``).
          mailbox: a ``Mailbox`` for ``self.cfg`` (one device only), as ``moe_front``'s.

        Returns:
          ``moe_front``'s ``FrontOutput``; with a mailbox, the pair ``(FrontOutput, Mailbox)``.

        Raises:
          ValueError, NotImplementedError: as ``moe_front``.
        """
        return moe_front(
            x, self.front_params(), plan=plan, permute=permute, backend=self.backend,
            shared_reduce=self.shared_reduce, mailbox=mailbox,
        )
