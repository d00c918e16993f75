"""moe-front-jax: the decode-time MoE front of Kimi-K3-class LatentMoE models in JAX.

One weight-stationary GEMM over the packed ``[router rows; latent down-projection rows]`` weight gives
float32 router logits and a bfloat16 latent; exact top-k routing by sigmoid + correction bias; the
shared expert beside it; an MXFP8 copy of the latent for the routed experts. See SPEC.md for the
contract and README.md for usage.
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
