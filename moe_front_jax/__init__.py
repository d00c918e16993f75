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
``configs`` (presets: Kimi-K3, DeepSeek-V3, Kimi-K2, GLM-4.5, Qwen3-30B-A3B, Mixtral-8x7B);
``layers.MoELayer`` (a whole MoE layer: the front, the routed experts, the shared expert);
``explain`` (what a call would run on this device, and why);
``nn.MoEFront`` (a Flax NNX module); ``shard_params`` (tensor parallelism over a mesh; or call
``moe_front`` with ``axis_name=`` inside your own ``jax.shard_map``); ``Mailbox`` (the Lamport
exchange between ranks); ``load_params`` / ``load_weights`` (safetensors checkpoints);
``reference`` (the plain-JAX reference every kernel is tested against). ``__version__``: the
installed distribution's version.
"""

import importlib
import importlib.metadata

# Each public name -> the module that defines it, imported when first used: importing a kernel
# (``moe_front_jax.pallas.route``) then loads only what it needs, not Flax or safetensors.
_PUBLIC = {
    "KIMI_K3": "moe_front_jax.config",
    "configs": None,
    "Dispatch": "moe_front_jax.api",
    "FrontConfig": "moe_front_jax.config",
    "FrontOutput": "moe_front_jax.api",
    "FrontParams": "moe_front_jax.params",
    "FrontPlan": "moe_front_jax.planner",
    "Mailbox": "moe_front_jax.mailbox",
    "explain": "moe_front_jax.api",
    "init_weights": "moe_front_jax.params",
    "layers": None,
    "load_params": "moe_front_jax.checkpoint",
    "load_weights": "moe_front_jax.checkpoint",
    "moe_front": "moe_front_jax.api",
    "nn": None,
    "pack_params": "moe_front_jax.params",
    "reference": None,
    "route": "moe_front_jax.api",
    "shard_params": "moe_front_jax.parallel",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name == "__version__":
        # The installed distribution's version (pyproject.toml's); "0+unknown" for a source tree
        # imported through PYTHONPATH without installing it.
        try:
            return importlib.metadata.version("moe-front-jax")
        except importlib.metadata.PackageNotFoundError:
            return "0+unknown"
    if name not in _PUBLIC:
        raise AttributeError(f"module 'moe_front_jax' has no attribute {name!r}")
    module = _PUBLIC[name]
    value = (importlib.import_module(f"moe_front_jax.{name}") if module is None
             else getattr(importlib.import_module(module), name))
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC) | {"__version__"})
