"""The Hugging Face comparison cases: small MoE blocks of each family with seeded bfloat16 weights, and
their outputs from transformers' own modules on the CPU (float32).

Needs numpy and ml_dtypes; ``hf_outputs`` also torch and transformers, imported when called, so the
cases load anywhere. ``python tests/huggingface_cases.py OUT.npz`` records every case with the
outputs of the installed transformers into OUT.npz (tests/data/huggingface.npz is such a record), so
that tests/test_huggingface.py checks the recorded outputs where torch is not installed and the live
ones where it is. Weights are stored as bfloat16 bit patterns (uint16): the record does not depend on
numpy's random streams.
"""

import sys

import ml_dtypes
import numpy as np

BF16 = ml_dtypes.bfloat16

# Each family: the Hugging Face module, its config's fields, and the routing it implies. Sizes are
# small; the routers' cases also run the presets' expert counts (``ROUTER_EXPERTS``).
FAMILIES = {
    "deepseek_v3": dict(model="deepseek_v3", hidden=32, experts=16, top_k=4, groups=4, topk_groups=2,
                        intermediate=16, shared=16, scale=2.5, scoring="sigmoid", renormalize=True),
    "kimi_k2": dict(model="deepseek_v3", hidden=32, experts=24, top_k=4, groups=1, topk_groups=1,
                    intermediate=16, shared=16, scale=2.827, scoring="sigmoid", renormalize=True),
    "glm_4_5": dict(model="glm4_moe", hidden=32, experts=20, top_k=4, groups=1, topk_groups=1,
                    intermediate=16, shared=16, scale=2.5, scoring="sigmoid", renormalize=True),
    "qwen3_30b_a3b": dict(model="qwen3_moe", hidden=32, experts=16, top_k=4, groups=1, topk_groups=1,
                          intermediate=16, shared=0, scale=1.0, scoring="softmax", renormalize=True),
    "qwen3_unnormalized": dict(model="qwen3_moe", hidden=32, experts=16, top_k=4, groups=1,
                               topk_groups=1, intermediate=16, shared=0, scale=1.0,
                               scoring="softmax", renormalize=False),
    "mixtral_8x7b": dict(model="mixtral", hidden=32, experts=8, top_k=2, groups=1, topk_groups=1,
                         intermediate=16, shared=0, scale=1.0, scoring="softmax", renormalize=True),
}
ROUTER_EXPERTS = {"deepseek_v3": (256, 8, 8, 4), "kimi_k2": (384, 8, 1, 1), "glm_4_5": (160, 8, 1, 1),
                  "qwen3_30b_a3b": (128, 8, 1, 1), "qwen3_unnormalized": (128, 8, 1, 1),
                  "mixtral_8x7b": (8, 2, 1, 1)}
"""The presets' (experts, top_k, groups, topk_groups), for the routers' cases."""
LAYER_ROWS, ROUTER_ROWS = 8, 64


def bf16_normal(rng, shape, fan_in):
    return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32).astype(BF16)


def make_case(family: str, seed: int = 0) -> dict[str, np.ndarray]:
    """The family's weights and inputs: ``x`` ``[LAYER_ROWS, H]``, ``gate`` ``[E, H]``, ``bias``
    ``[E]`` float32 (sigmoid families), ``experts_gate_up`` ``[E, 2I, H]`` and ``experts_down``
    ``[E, H, I]`` (Hugging Face's layout), ``shared_gate``/``shared_up`` ``[S, H]`` and
    ``shared_down`` ``[H, S]``; and the router's case, ``router_x`` ``[ROUTER_ROWS, H]``,
    ``router_gate`` ``[E_preset, H]``, ``router_bias``. bfloat16 except the biases."""
    f = FAMILIES[family]
    rng = np.random.default_rng(seed)
    h, e, i, s = f["hidden"], f["experts"], f["intermediate"], f["shared"]
    case = {
        "x": bf16_normal(rng, (LAYER_ROWS, h), 1.0),
        "gate": bf16_normal(rng, (e, h), h),
        "experts_gate_up": bf16_normal(rng, (e, 2 * i, h), h),
        "experts_down": bf16_normal(rng, (e, h, i), i),
    }
    if f["scoring"] == "sigmoid":
        case["bias"] = rng.uniform(-0.05, 0.05, e).astype(np.float32)
    if s:
        case.update(shared_gate=bf16_normal(rng, (s, h), h), shared_up=bf16_normal(rng, (s, h), h),
                    shared_down=bf16_normal(rng, (h, s), s))
    router_e = ROUTER_EXPERTS[family][0]
    case["router_x"] = bf16_normal(rng, (ROUTER_ROWS, h), 1.0)
    case["router_gate"] = bf16_normal(rng, (router_e, h), h)
    if f["scoring"] == "sigmoid":
        case["router_bias"] = rng.uniform(-0.05, 0.05, router_e).astype(np.float32)
    return case


def hf_config(family: str, experts: int | None = None, top_k: int | None = None,
              groups: int | None = None, topk_groups: int | None = None):
    """The transformers config of ``family`` (optionally at other routing sizes), eager experts."""
    import transformers

    f = FAMILIES[family]
    e, k = experts or f["experts"], top_k or f["top_k"]
    common = dict(hidden_size=f["hidden"], num_experts_per_tok=k, hidden_act="silu")
    if f["model"] in ("deepseek_v3", "glm4_moe"):
        kind = (transformers.DeepseekV3Config if f["model"] == "deepseek_v3"
                else transformers.Glm4MoeConfig)
        config = kind(**common, n_routed_experts=e, n_group=groups or f["groups"],
                      topk_group=topk_groups or f["topk_groups"],
                      moe_intermediate_size=f["intermediate"], n_shared_experts=1,
                      routed_scaling_factor=f["scale"], norm_topk_prob=f["renormalize"])
    elif f["model"] == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=e,
                                             moe_intermediate_size=f["intermediate"],
                                             norm_topk_prob=f["renormalize"])
    else:
        config = transformers.MixtralConfig(**common, num_local_experts=e,
                                            intermediate_size=f["intermediate"])
    config._experts_implementation = "eager"
    return config


def _modules(family: str):
    from transformers.models.deepseek_v3 import modeling_deepseek_v3
    from transformers.models.glm4_moe import modeling_glm4_moe
    from transformers.models.mixtral import modeling_mixtral
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    return {
        "deepseek_v3": (modeling_deepseek_v3.DeepseekV3MoE, modeling_deepseek_v3.DeepseekV3TopkRouter),
        "glm4_moe": (modeling_glm4_moe.Glm4MoeMoE, modeling_glm4_moe.Glm4MoeTopkRouter),
        "qwen3_moe": (modeling_qwen3_moe.Qwen3MoeSparseMoeBlock, modeling_qwen3_moe.Qwen3MoeTopKRouter),
        "mixtral": (modeling_mixtral.MixtralSparseMoeBlock, modeling_mixtral.MixtralTopKRouter),
    }[FAMILIES[family]["model"]]


def hf_outputs(family: str, case: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' float32 outputs on ``case``: the block's ``out`` ``[LAYER_ROWS, H]``, and the
    router's ``router_logits`` ``[ROUTER_ROWS, E]``, ``router_ids`` and ``router_weights``
    ``[ROUTER_ROWS, K]`` (ids as torch orders them)."""
    import torch

    block_class, router_class = _modules(family)
    f32 = lambda a: torch.from_numpy(np.asarray(a, np.float32))  # noqa: E731
    with torch.no_grad():
        block = block_class(hf_config(family)).eval()
        block.gate.weight.copy_(f32(case["gate"]))
        if "bias" in case:
            block.gate.e_score_correction_bias.copy_(f32(case["bias"]))
        block.experts.gate_up_proj.copy_(f32(case["experts_gate_up"]))
        block.experts.down_proj.copy_(f32(case["experts_down"]))
        if "shared_gate" in case:
            block.shared_experts.gate_proj.weight.copy_(f32(case["shared_gate"]))
            block.shared_experts.up_proj.weight.copy_(f32(case["shared_up"]))
            block.shared_experts.down_proj.weight.copy_(f32(case["shared_down"]))
        out = block(f32(case["x"])[None])[0]
        router = router_class(hf_config(family, *ROUTER_EXPERTS[family])).eval()
        router.weight.copy_(f32(case["router_gate"]))
        if "router_bias" in case:
            router.e_score_correction_bias.copy_(f32(case["router_bias"]))
        logits, weights, ids = router(f32(case["router_x"]))
    return {"out": out.numpy(), "router_logits": logits.float().numpy(),
            "router_ids": ids.numpy().astype(np.int32), "router_weights": weights.float().numpy()}


def to_record(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """bfloat16 arrays as their uint16 bits (npz keeps no bfloat16)."""
    return {k: v.view(np.uint16) if v.dtype == BF16 else v for k, v in arrays.items()}


def from_record(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``make_case``'s arrays back from a record: every input but the biases is bfloat16."""
    return {k: v.view(BF16) if v.dtype == np.uint16 else v for k, v in arrays.items()}


def record(path: str) -> None:
    import torch
    import transformers

    arrays = {"versions": np.array([f"torch {torch.__version__}",
                                    f"transformers {transformers.__version__}"])}
    for family in FAMILIES:
        case = make_case(family)
        for name, value in {**to_record(case), **hf_outputs(family, case)}.items():
            arrays[f"{family}/{name}"] = value
    np.savez_compressed(path, **arrays)


if __name__ == "__main__":
    record(sys.argv[1])
