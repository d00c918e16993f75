"""A whole MoE layer around the front: ``MoELayer``, for any preset (``moe_front_jax.configs``).

The front (``moe_front`` with ``permute=True``) routes each token and gives the dispatch order (SPEC
section 4.1); the routed experts run as two ``jax.lax.ragged_dot`` grouped GEMMs over the tokens
sorted by expert; each slot's output goes back to its token, weighted by the routing weights; with a
latent the routed sum is projected back to the model width; the shared expert's output is added.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from safetensors import safe_open

from moe_front_jax.api import FrontOutput, moe_front
from moe_front_jax.checkpoint import SAFETENSORS_DTYPES, PathLike, checkpoint_files, load_weights
from moe_front_jax.config import FrontConfig
from moe_front_jax.params import FrontParams, init_weights, normal, pack_params

GATE_UP, DOWN, ROUTED_UP = "experts.gate_up", "experts.down", "routed_up_weight"
"""The routed experts' weight keys, ``D`` their input width (``L``, or ``H`` without a latent):
``[E, D, 2I]`` (gate columns ``[0, I)``, up ``[I, 2I)``), ``[E, I, D]``, and with a latent ``[H, L]``,
all bfloat16. Hugging Face's fused ``experts.gate_up_proj`` ``[E, 2I, H]`` and ``experts.down_proj``
``[E, H, I]`` are their transposes over the last two axes."""


def expert_shapes(cfg: FrontConfig, intermediate: int) -> dict[str, tuple[int, ...]]:
    """Shapes of the routed experts' weights (``GATE_UP``, ``DOWN``, ``ROUTED_UP`` with a latent)."""
    width = cfg.latent or cfg.hidden
    shapes = {GATE_UP: (cfg.experts, width, 2 * intermediate), DOWN: (cfg.experts, intermediate, width)}
    if cfg.latent:
        shapes[ROUTED_UP] = (cfg.hidden, cfg.latent)
    return shapes


def init_experts(key: jax.Array, cfg: FrontConfig, intermediate: int) -> dict[str, jax.Array]:
    """Seeded routed-expert weights for ``cfg``: normals scaled by ``1 / sqrt(fan_in)``, bfloat16."""
    shapes = expert_shapes(cfg, intermediate)
    keys = jax.random.split(key, len(shapes))
    # Each GEMM contracts a routed weight's middle axis, and the up-projection's last.
    return {name: normal(k, shape, shape[-1] if name == ROUTED_UP else shape[-2])
            for k, (name, shape) in zip(keys, shapes.items())}


EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
"""A routed expert's (gate, up, down) keys behind ``experts.{e}.`` in Hugging Face checkpoints:
DeepSeek-V3, Kimi-K2, GLM-4.5 and Qwen3-MoE's, then Mixtral's."""


def load_experts(paths_or_dir: PathLike | Iterable[PathLike], cfg: FrontConfig,
                 prefix: str = "") -> dict[str, jax.Array]:
    """The routed experts of a checkpoint without a latent, stacked into ``GATE_UP`` ``[E, H, 2I]``
    and ``DOWN`` ``[E, I, H]`` bfloat16, from each expert's ``prefix + "experts.{e}."`` keys
    (``EXPERT_NAMES``: ``gate_proj``/``up_proj``/``down_proj``, or Mixtral's ``w1``/``w3``/``w2``;
    gate and up ``[I, H]``, down ``[H, I]``). ``paths_or_dir`` as for ``load_weights``.

    Raises:
      ValueError: a config with a latent; a missing key, or one of another shape or dtype than
        expert 0's gate gives (naming it).
    """
    if cfg.latent:
        raise ValueError(f"load_experts reads hidden-space experts; the config has latent={cfg.latent}")
    files = checkpoint_files(paths_or_dir)
    names = next((n for n in EXPERT_NAMES if f"{prefix}experts.0.{n[0]}.weight" in files), None)
    if names is None:
        raise ValueError(f"checkpoint has no key {prefix + 'experts.0.gate_proj.weight'!r} (nor "
                         f"Mixtral's {prefix + 'experts.0.w1.weight'!r})")

    def read(e: int, name: str, shape: tuple[int, int] | None) -> np.ndarray:
        key = f"{prefix}experts.{e}.{name}.weight"
        if key not in files:
            raise ValueError(f"checkpoint has no key {key!r}")
        with safe_open(files[key], framework="numpy") as f:  # the header checked before the data
            header = f.get_slice(key)
            got, dtype = tuple(header.get_shape()), header.get_dtype()
            dtype = jnp.dtype(SAFETENSORS_DTYPES[dtype]) if dtype in SAFETENSORS_DTYPES else dtype
            if dtype != jnp.bfloat16 or (shape is not None and got != shape):
                want = "" if shape is None else f"{shape} "
                raise ValueError(f"checkpoint key {key!r} is {got} {dtype}, expected {want}bfloat16")
            return f.get_tensor(key)

    first = read(0, names[0], None)
    if first.ndim != 2 or first.shape[1] != cfg.hidden:
        raise ValueError(f"checkpoint key {prefix}experts.0.{names[0]}.weight is {first.shape}, "
                         f"expected [intermediate, hidden={cfg.hidden}]")
    rows = first.shape
    gate_up, down = [], []
    for e in range(cfg.experts):
        gate, up = read(e, names[0], rows), read(e, names[1], rows)
        gate_up.append(np.concatenate([gate.T, up.T], axis=1))
        down.append(read(e, names[2], rows[::-1]).T)
    return {GATE_UP: jnp.asarray(np.stack(gate_up)), DOWN: jnp.asarray(np.stack(down))}


def dequantize_plan(values: jax.Array, scales: jax.Array) -> jax.Array:
    """The MXFP8 plan ``(values [B, L] float8_e4m3fn, scales [B, L / block] float8_e8m0fnu)`` as
    bfloat16 ``values * 2**(scale byte - 127)``, each scale over its block of columns."""
    rows, width = values.shape
    block = width // scales.shape[1]
    v = values.astype(jnp.float32).reshape(rows, -1, block)
    return (v * scales.astype(jnp.float32)[..., None]).reshape(rows, width).astype(jnp.bfloat16)


def routed_experts(rows: jax.Array, group_sizes: jax.Array, gate_up: jax.Array,
                   down: jax.Array) -> jax.Array:
    """Each expert's SiLU-gated MLP over its contiguous rows: ``rows`` ``[B K, D]`` bfloat16 grouped
    by expert (``group_sizes`` ``[E]``) to float32 ``[B K, D]``. Float32 accumulation; the hidden
    activation is rounded to bfloat16 as the second GEMM's input."""
    h = lax.ragged_dot(rows, gate_up, group_sizes, preferred_element_type=jnp.float32)
    gate, up = jnp.split(h, 2, axis=-1)
    hidden = (jax.nn.silu(gate) * up).astype(jnp.bfloat16)
    return lax.ragged_dot(hidden, down, group_sizes, preferred_element_type=jnp.float32)


def combine(per_slot: jax.Array, inverse: jax.Array, weights: jax.Array) -> jax.Array:
    """Rows of ``per_slot`` ``[B K, N]`` (in dispatch order) back to their tokens: slot ``s``'s row
    is ``inverse[s]``; float32 ``[B, N]``, each token's K outputs weighted by ``weights`` ``[B, K]``."""
    batch, k = weights.shape
    by_slot = per_slot[inverse].reshape(batch, k, -1)
    return jnp.einsum("bk,bkn->bn", weights.astype(jnp.float32), by_slot)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MoELayer:
    """One MoE layer, ``[B, H]`` bfloat16 rows to ``[B, H]`` bfloat16 (a pytree: pass it to ``jit``).

    Attributes:
      front: the front's ``FrontParams`` (``pack_params``, or ``shard_params`` for a mesh).
      gate_up: ``[E, D, 2I]`` bfloat16, ``D = L`` with a latent, else ``H``: gate columns, then up.
      down: ``[E, I, D]`` bfloat16.
      routed_up: ``[H, L]`` bfloat16 with a latent (the routed sum back to the model width), else None.

    ``layer(x, plan=False, backend="auto")`` returns ``(out, front)``: ``out = bf16(sum_k w_k
    expert_k(u) [@ routed_up.T] + shared)`` with ``u`` the latent (its dequantized MXFP8 plan with
    ``plan=True``) or ``x`` at ``latent = 0``, and the front's ``FrontOutput`` (``dispatch`` set).
    Raises ``ValueError`` for weights that do not fit ``front.cfg``, or ``plan=True`` without a latent.
    """

    front: FrontParams
    gate_up: jax.Array
    down: jax.Array
    routed_up: jax.Array | None = None

    @classmethod
    def create(cls, front_weights: Mapping[str, jax.Array], experts: Mapping[str, jax.Array],
               cfg: FrontConfig) -> MoELayer:
        """The layer of ``front_weights`` (SPEC section 2 keys, packed by ``pack_params``) and
        ``experts`` (``GATE_UP``, ``DOWN``, and ``ROUTED_UP`` with a latent)."""
        layer = cls(pack_params(front_weights, cfg), experts[GATE_UP], experts[DOWN],
                    experts.get(ROUTED_UP))
        layer.check()
        return layer

    @classmethod
    def init(cls, key: jax.Array, cfg: FrontConfig, intermediate: int) -> MoELayer:
        """Seeded random weights (``init_weights`` and ``init_experts``)."""
        front_key, experts_key = jax.random.split(key)
        return cls.create(init_weights(front_key, cfg), init_experts(experts_key, cfg, intermediate),
                          cfg)

    @classmethod
    def from_checkpoint(cls, paths_or_dir: PathLike | Iterable[PathLike], cfg: FrontConfig,
                        prefix: str = "") -> MoELayer:
        """A Hugging Face layer without a latent: ``load_weights`` and ``load_experts`` behind
        ``prefix`` (e.g. ``"model.layers.3.mlp."``, Mixtral's ``"model.layers.3.block_sparse_moe."``)."""
        return cls.create(load_weights(paths_or_dir, cfg, prefix),
                          load_experts(paths_or_dir, cfg, prefix), cfg)

    @property
    def cfg(self) -> FrontConfig:
        return self.front.cfg

    def check(self) -> None:
        """Raise ``ValueError`` naming the weight whose shape or dtype does not fit ``front.cfg``."""
        intermediate = self.down.shape[1] if getattr(self.down, "ndim", 0) == 3 else 0
        given = {GATE_UP: self.gate_up, DOWN: self.down, ROUTED_UP: self.routed_up}
        expected = expert_shapes(self.cfg, intermediate)
        for name, array in given.items():
            shape = expected.get(name)
            if shape is None and array is not None:
                raise ValueError(f"{name} is given but the config has no latent (latent=0): "
                                 "expected None")
            if shape is not None and (array is None or tuple(array.shape) != shape
                                      or array.dtype != jnp.bfloat16):
                got = "None" if array is None else f"{tuple(array.shape)} {array.dtype}"
                raise ValueError(f"{name} is {got}, expected {shape} bfloat16")

    def __call__(self, x: jax.Array, *, plan: bool = False,
                 backend: str = "auto") -> tuple[jax.Array, FrontOutput]:
        self.check()
        cfg = self.cfg
        front = moe_front(x, self.front, plan=plan, permute=True, backend=backend)
        if not cfg.latent:
            inputs = x
        else:
            inputs = dequantize_plan(*front.plan) if plan else front.latent
        dispatch = front.dispatch
        rows = inputs[dispatch.order // cfg.top_k]  # [B K, D]: expert 0's rows first, tokens in order
        per_slot = routed_experts(rows, dispatch.group_sizes, self.gate_up, self.down)
        out = combine(per_slot, dispatch.inverse, front.weights)
        if cfg.latent:
            out = jnp.dot(out.astype(jnp.bfloat16), self.routed_up.T,
                          preferred_element_type=jnp.float32)
        if front.shared is not None:
            out = out + front.shared.astype(jnp.float32)
        return out.astype(jnp.bfloat16), front
