"""The main job: decode steps of a model built around the Kimi-K3 MoE front, as an NNX module.

    python examples/decode.py [--batch 1 8 64] [--steps 4] [--backend auto] [--small]

The installed console script ``moe-front-demo`` runs the same ``main``: ``moe_front_jax.demo``.
"""

import sys

from moe_front_jax.demo import main

if __name__ == "__main__":
    sys.exit(main())
