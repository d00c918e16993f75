"""Presets: the fronts of the open MoE families as ``FrontConfig`` values, at their published sizes.

Each preset is the MoE layer of its model as its Hugging Face ``config.json`` gives it: ``hidden_size``
-> ``hidden``, ``n_routed_experts`` (``num_experts``, ``num_local_experts``) -> ``experts``,
``num_experts_per_tok`` -> ``top_k``, ``n_group`` / ``topk_group`` -> ``groups`` / ``topk_groups``,
``n_shared_experts * moe_intermediate_size`` -> ``shared``, ``routed_scaling_factor``, and
``norm_topk_prob`` -> ``renormalize``. Only Kimi-K3 has a latent; the others route hidden-space experts
(``latent = 0``). ``ROUTED_INTERMEDIATE`` holds each model's routed experts' ``moe_intermediate_size``
(``mf.layers.MoELayer`` takes it). Load a checkpoint's layer with the preset and the layer's prefix::

    weights = mf.load_weights(path, mf.configs.DEEPSEEK_V3, prefix="model.layers.3.mlp.")
"""

from __future__ import annotations

from moe_front_jax.config import KIMI_K3, FrontConfig

__all__ = ["DEEPSEEK_V3", "GLM_4_5", "KIMI_K2", "KIMI_K3", "MIXTRAL_8X7B", "PRESETS", "QWEN3_30B_A3B",
           "ROUTED_INTERMEDIATE"]

# DeepSeek-V3 (also R1 and V3.1): transformers' DeepseekV3Config defaults, which are the model's
# config.json (src/transformers/models/deepseek_v3/configuration_deepseek_v3.py): hidden_size 7168,
# n_routed_experts 256, num_experts_per_tok 8, n_group 8, topk_group 4, n_shared_experts 1,
# moe_intermediate_size 2048, routed_scaling_factor 2.5, norm_topk_prob true, scoring_func sigmoid.
DEEPSEEK_V3 = FrontConfig(hidden=7168, experts=256, top_k=8, latent=0, shared=2048, groups=8,
                          topk_groups=4, routed_scaling_factor=2.5, activation="silu")
"""DeepSeek-V3: 256 experts in 8 groups, the 4 best groups kept, top-8 by sigmoid + bias, no latent."""

# Kimi-K2 (moonshotai/Kimi-K2-Instruct config.json, a DeepseekV3ForCausalLM): hidden_size 7168,
# n_routed_experts 384, num_experts_per_tok 8, n_group 1, topk_group 1, n_shared_experts 1,
# moe_intermediate_size 2048, routed_scaling_factor 2.827, norm_topk_prob true, scoring_func sigmoid.
KIMI_K2 = FrontConfig(hidden=7168, experts=384, top_k=8, latent=0, shared=2048,
                      routed_scaling_factor=2.827, activation="silu")
"""Kimi-K2: 384 experts, top-8 by sigmoid + bias, one group, no latent."""

# GLM-4.5 (zai-org/GLM-4.5 config.json, Glm4MoeForCausalLM, which routes with DeepseekV3TopkRouter):
# hidden_size 5120, n_routed_experts 160, num_experts_per_tok 8, n_group 1, topk_group 1,
# n_shared_experts 1, moe_intermediate_size 1536, routed_scaling_factor 2.5, norm_topk_prob true.
GLM_4_5 = FrontConfig(hidden=5120, experts=160, top_k=8, latent=0, shared=1536,
                      routed_scaling_factor=2.5, activation="silu")
"""GLM-4.5 (355B-A32B): 160 experts, top-8 by sigmoid + bias, no latent."""

# Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json, Qwen3MoeForCausalLM): hidden_size 2048, num_experts
# 128, num_experts_per_tok 8, moe_intermediate_size 768, norm_topk_prob true; softmax router, no bias,
# no shared expert.
QWEN3_30B_A3B = FrontConfig(hidden=2048, experts=128, top_k=8, latent=0, shared=0, scoring="softmax",
                            bias=False, activation="silu")
"""Qwen3-30B-A3B: 128 experts, top-8 by softmax, renormalized, no shared expert, no latent."""

# Mixtral-8x7B (mistralai/Mixtral-8x7B-v0.1 config.json; transformers' MixtralConfig defaults):
# hidden_size 4096, num_local_experts 8, num_experts_per_tok 2, intermediate_size 14336; softmax
# router renormalized over the chosen two (MixtralTopKRouter), no bias, no shared expert.
MIXTRAL_8X7B = FrontConfig(hidden=4096, experts=8, top_k=2, latent=0, shared=0, scoring="softmax",
                           bias=False, activation="silu")
"""Mixtral-8x7B: 8 experts, top-2 by softmax, renormalized, no shared expert, no latent."""

PRESETS = {"KIMI_K3": KIMI_K3, "DEEPSEEK_V3": DEEPSEEK_V3, "KIMI_K2": KIMI_K2, "GLM_4_5": GLM_4_5,
           "QWEN3_30B_A3B": QWEN3_30B_A3B, "MIXTRAL_8X7B": MIXTRAL_8X7B}
"""Every preset by name."""

ROUTED_INTERMEDIATE = {"DEEPSEEK_V3": 2048, "KIMI_K2": 2048, "GLM_4_5": 1536, "QWEN3_30B_A3B": 768,
                       "MIXTRAL_8X7B": 14336}
"""Each model's routed-expert intermediate (``moe_intermediate_size``; Mixtral's
``intermediate_size``). Kimi-K3 is left out: its routed experts are no part of SPEC.md."""
