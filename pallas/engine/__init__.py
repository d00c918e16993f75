"""The streaming engine: one Mosaic GPU launch streams a stack of weight row regions
against ``x``, each with its own epilogue: the merged front (router, latent and the shared expert's
gate/up) and the shared expert's down."""

from moe_front_jax.pallas.engine.kernel import (
    EngineConfig,
    covers_down,
    covers_front_gate_up,
    down,
    front_gate_up,
    heuristic_config,
)

__all__ = [
    "EngineConfig",
    "covers_down",
    "covers_front_gate_up",
    "down",
    "front_gate_up",
    "heuristic_config",
]
