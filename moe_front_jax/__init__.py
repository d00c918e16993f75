"""moe-front-jax: the decode-time MoE front of Kimi-K3-class LatentMoE models in JAX.

One weight-stationary GEMM over the packed ``[router rows; latent down-projection rows]`` weight gives
float32 router logits and a bfloat16 latent; exact top-k routing by sigmoid + correction bias; the
shared expert beside it; an MXFP8 copy of the latent for the routed experts. SPEC.md (at the
repository's root) is the contract, README.md the guide.

Start::

    import jax, jax.numpy as jnp
    import moe_front_jax as mf

    cfg = mf.KIMI_K3                                   # or FrontConfig(...) for another model
    params = mf.pack_params(mf.init_weights(jax.random.key(0), cfg), cfg)
    x = jnp.zeros((8, cfg.hidden), jnp.bfloat16)       # [B, H] decode rows
    out = jax.jit(mf.moe_front)(x, params)             # FrontOutput: ids, weights, latent, ...

Entry points: ``moe_front`` (the whole front of a decode step) and ``route`` (routing alone);
``nn.MoEFront`` (a Flax NNX module); ``shard_params`` (tensor parallelism over a mesh; or call
``moe_front`` with ``axis_name=`` inside your own ``jax.shard_map``); ``Mailbox`` (the Lamport
exchange between ranks); ``load_params`` / ``load_weights`` (safetensors checkpoints);
``reference`` (the plain-JAX reference every kernel is tested against).
"""

from moe_front_jax import nn, reference
from moe_front_jax.api import FrontOutput, moe_front, route
from moe_front_jax.bridge.mailbox import Mailbox
from moe_front_jax.checkpoint import load_params, load_weights
from moe_front_jax.config import KIMI_K3, FrontConfig
from moe_front_jax.params import FrontParams, init_weights, pack_params
from moe_front_jax.parallel import shard_params

__all__ = [
    "KIMI_K3",
    "FrontConfig",
    "FrontOutput",
    "FrontParams",
    "Mailbox",
    "init_weights",
    "load_params",
    "load_weights",
    "moe_front",
    "nn",
    "pack_params",
    "reference",
    "route",
    "shard_params",
]
