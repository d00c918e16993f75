"""The routing reference and ``mf.layers.MoELayer`` against Hugging Face transformers' own modules:
``DeepseekV3TopkRouter`` / ``DeepseekV3MoE`` (DeepSeek-V3 with groups, Kimi-K2 without),
``Glm4MoeTopkRouter`` / ``Glm4MoeMoE``, ``Qwen3MoeTopKRouter`` / ``Qwen3MoeSparseMoeBlock`` (with and
without ``norm_topk_prob``), ``MixtralTopKRouter`` / ``MixtralSparseMoeBlock``.

Two sources of Hugging Face's outputs, the same checks: "live" runs transformers on the CPU where
torch and transformers are installed (``pip install -e '.[huggingface]'``; skipped otherwise, saying
so); "recorded" reads tests/data/huggingface.npz, the same cases run by ``python
tests/huggingface_cases.py`` under torch 2.13.0+cpu and transformers 5.25.0 (the versions the file
names), so that the comparison runs without torch too.

Routers: on Hugging Face's own float32 logits (64 random rows at the presets' expert counts), the
reference's ids equal Hugging Face's as a set per row (torch orders DeepSeek's ``sorted=False`` ids as
it likes), and each id's bfloat16 weight is within 1 bfloat16 ulp of Hugging Face's float32 weight
rounded to bfloat16 (SPEC sections 4, 4.2, 4.3: the division orders differ in float32 only).

Blocks: Hugging Face runs in float32 on the bfloat16 weights and inputs, so its output is the float32
value of the layer's math; ``MoELayer`` rounds where SPEC.md does: the routing weights (half an ulp,
``2**-9`` relative), each expert's hidden activation, the shared expert's gate, up and hidden, and the
output. As in tests/test_moe_layer_example.py, a few bfloat16 roundings carried through random-sign
dot products give an RMS error of at most about ``sqrt(4) * 0.23% = 0.46%`` of the output's norm; the
test allows ``2**-7`` (0.78%) in norm, and elementwise ``2**-5`` of the output's RMS beyond the
output's own final rounding (``2**-8 |y|``).
"""

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_front_jax as mf
from moe_front_jax import layers
from moe_front_jax import params as packing
import huggingface_cases as cases
import oracle

RECORD = Path(__file__).resolve().parent / "data" / "huggingface.npz"
OUTPUTS = ("out", "router_logits", "router_ids", "router_weights")


def front_config(family: str, router: bool = False) -> mf.FrontConfig:
    """The ``FrontConfig`` of a case: the small block's, or the router's at the preset's counts."""
    f = cases.FAMILIES[family]
    e, k, g, kg = (cases.ROUTER_EXPERTS[family] if router
                   else (f["experts"], f["top_k"], f["groups"], f["topk_groups"]))
    return mf.FrontConfig(hidden=f["hidden"], experts=e, top_k=k, latent=0, shared=f["shared"],
                          groups=g, topk_groups=kg, routed_scaling_factor=f["scale"],
                          renormalize=f["renormalize"], scoring=f["scoring"],
                          bias=f["scoring"] == "sigmoid", activation="silu")


@functools.cache
def recorded() -> dict[str, np.ndarray]:
    with np.load(RECORD) as data:
        return {name: data[name] for name in data.files}


def case_and_outputs(source: str, family: str):
    if source == "live":
        pytest.importorskip("torch", reason="live Hugging Face comparison needs torch "
                            "(pip install -e '.[huggingface]'); the recorded one runs without it")
        pytest.importorskip("transformers", reason="live Hugging Face comparison needs transformers")
        case = cases.make_case(family)
        return case, cases.hf_outputs(family, case)
    prefix = f"{family}/"
    arrays = {name[len(prefix):]: value for name, value in recorded().items()
              if name.startswith(prefix)}
    inputs = {name: value for name, value in arrays.items() if name not in OUTPUTS}
    return cases.from_record(inputs), {name: arrays[name] for name in OUTPUTS}


def test_the_record_names_its_versions():
    assert list(recorded()["versions"]) == ["torch 2.13.0+cpu", "transformers 5.25.0"]


@functools.partial(jax.jit, static_argnums=2)
def route(logits, bias, cfg):
    return mf.route(logits, bias, cfg, backend="xla")


@pytest.mark.parametrize("family", list(cases.FAMILIES))
@pytest.mark.parametrize("source", ["recorded", "live"])
def test_router_matches_hugging_face(source, family):
    case, hf = case_and_outputs(source, family)
    cfg = front_config(family, router=True)
    bias = case.get("router_bias", np.zeros(cfg.experts, np.float32))
    ids, weights = route(jnp.asarray(hf["router_logits"]), jnp.asarray(bias), cfg)
    ids, weights = np.asarray(ids), np.asarray(weights)
    oracle.assert_valid_ids(ids, cfg.experts)
    ours, theirs = np.argsort(ids, axis=-1), np.argsort(hf["router_ids"], axis=-1)
    np.testing.assert_array_equal(np.take_along_axis(ids, ours, -1),
                                  np.take_along_axis(hf["router_ids"], theirs, -1))
    hf_weights = np.take_along_axis(hf["router_weights"], theirs, -1).astype(oracle.BF16)
    distance = oracle.bf16_ulp_distance(np.take_along_axis(weights, ours, -1), hf_weights)
    assert distance.max() <= 1, distance.max()
    if cfg.groups > 1:  # the case exercises the groups: rows keep fewer than all of them
        spans = {len(set(row)) for row in ids // cfg.experts_per_group}
        assert max(spans) <= cfg.topk_groups


def moe_layer(family: str, case: dict[str, np.ndarray]) -> layers.MoELayer:
    """``MoELayer`` with the case's weights, from Hugging Face's layouts."""
    cfg = front_config(family)
    front = {packing.GATE: case["gate"]}
    if cfg.bias:
        front[packing.BIAS] = case["bias"]
    if cfg.shared:
        front[packing.GATE_UP] = np.concatenate([case["shared_gate"], case["shared_up"]])
        front[packing.DOWN] = case["shared_down"]
    experts = {layers.GATE_UP: case["experts_gate_up"].transpose(0, 2, 1),
               layers.DOWN: case["experts_down"].transpose(0, 2, 1)}
    as_jax = lambda d: {k: jnp.asarray(v) for k, v in d.items()}  # noqa: E731
    return layers.MoELayer.create(as_jax(front), as_jax(experts), cfg)


@jax.jit
def run_layer(layer, x):
    return layer(x, backend="xla")[0]


@pytest.mark.parametrize("family", list(cases.FAMILIES))
@pytest.mark.parametrize("source", ["recorded", "live"])
def test_moe_layer_matches_hugging_face_block(source, family):
    case, hf = case_and_outputs(source, family)
    assert_close(run_layer(moe_layer(family, case), jnp.asarray(case["x"])), hf["out"])


def hugging_face_checkpoint(family: str, case: dict[str, np.ndarray]) -> tuple[dict, str]:
    """The case's block under the names its model's checkpoints use, and the layer's prefix."""
    mixtral = cases.FAMILIES[family]["model"] == "mixtral"
    prefix = "model.layers.3.block_sparse_moe." if mixtral else "model.layers.3.mlp."
    gate, up, down = layers.EXPERT_NAMES[1 if mixtral else 0]
    i = case["experts_down"].shape[2]
    tensors = {"gate.weight": case["gate"]}
    if "bias" in case:
        tensors["gate.e_score_correction_bias"] = case["bias"]
    if "shared_gate" in case:
        tensors.update({"shared_experts.gate_proj.weight": case["shared_gate"],
                        "shared_experts.up_proj.weight": case["shared_up"],
                        "shared_experts.down_proj.weight": case["shared_down"]})
    for e, (gate_up, down_proj) in enumerate(zip(case["experts_gate_up"], case["experts_down"])):
        tensors.update({f"experts.{e}.{gate}.weight": gate_up[:i], f"experts.{e}.{up}.weight": gate_up[i:],
                        f"experts.{e}.{down}.weight": down_proj})
    return {prefix + k: np.ascontiguousarray(v) for k, v in tensors.items()}, prefix


@pytest.mark.parametrize("family", ["deepseek_v3", "glm_4_5", "qwen3_30b_a3b", "mixtral_8x7b"])
def test_layer_from_a_hugging_face_checkpoint_matches_the_block(tmp_path, family):
    from safetensors.numpy import save_file

    case, hf = case_and_outputs("recorded", family)
    tensors, prefix = hugging_face_checkpoint(family, case)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    layer = layers.MoELayer.from_checkpoint(tmp_path, front_config(family), prefix)
    assert_close(run_layer(layer, jnp.asarray(case["x"])), hf["out"])


def assert_close(got, want):
    """The module docstring's tolerance."""
    got, want = np.asarray(got).astype(np.float64), np.asarray(want).astype(np.float64)
    error = got - want
    relative = np.linalg.norm(error) / np.linalg.norm(want)
    assert relative <= 2.0 ** -7, relative
    beyond = np.abs(error) - 2.0 ** -8 * np.abs(want)
    rms = np.sqrt(np.mean(want ** 2))
    assert beyond.max() <= 2.0 ** -5 * rms, beyond.max() / rms
