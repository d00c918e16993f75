"""mf.load_weights / mf.load_params: small safetensors checkpoints written here and loaded back."""

import dataclasses
import json
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

import moe_front_jax as mf
from moe_front_jax import params as P
from moe_front_jax.checkpoint import CheckpointReader

CFG = mf.FrontConfig(hidden=64, experts=32, top_k=4, latent=64, shared=32)
PREFIX = "model.layers.3.mlp."


def layer(seed=0, shared=True):
    """Random weights as numpy arrays (bf16 through ml_dtypes), written to files independently of
    the loader."""
    rng = np.random.default_rng(seed)
    h, e, lat, s = CFG.hidden, CFG.experts, CFG.latent, CFG.shared

    def bf16(*shape):
        return rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)

    weights = {
        P.GATE: bf16(e, h),
        P.BIAS: rng.uniform(-0.05, 0.05, e).astype(np.float32),
        P.ROUTED_DOWN: bf16(lat, h),
    }
    if shared:
        weights[P.GATE_UP] = bf16(2 * s, h)
        weights[P.DOWN] = bf16(h, s)
    return weights


def checkpoint(weights, prefix=PREFIX):
    """The layer under ``prefix`` plus neighbours a real checkpoint has: other layers' fronts, attention."""
    tensors = {prefix + k: v for k, v in weights.items()}
    tensors["model.layers.4.mlp.gate.weight"] = np.zeros((CFG.experts, CFG.hidden), ml_dtypes.bfloat16)
    tensors["model.layers.3.self_attn.q_proj.weight"] = np.ones((8, CFG.hidden), np.float32)
    return tensors


def assert_loaded(got, want):
    assert set(got) == set(want)
    for name, array in want.items():
        assert isinstance(got[name], jax.Array), name
        assert got[name].shape == array.shape and got[name].dtype == array.dtype, name
        bits = np.uint16 if array.dtype.itemsize == 2 else np.uint32
        np.testing.assert_array_equal(np.asarray(got[name]).view(bits), array.view(bits), err_msg=name)


@pytest.mark.parametrize("shared", [True, False])
def test_one_file_round_trip(tmp_path, shared):
    weights = layer(shared=shared)
    path = tmp_path / "model.safetensors"
    save_file(checkpoint(weights), str(path))
    for source in (path, str(path), [path], tmp_path):
        assert_loaded(mf.load_weights(source, CFG, prefix=PREFIX), weights)


def test_files_with_and_without_index(tmp_path):
    weights = layer(1)
    tensors = checkpoint(weights)
    names = sorted(tensors)
    first = {k: tensors[k] for k in names[::2]}
    second = {k: tensors[k] for k in names[1::2]}
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert_loaded(mf.load_weights(tmp_path, CFG, prefix=PREFIX), weights)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert_loaded(mf.load_weights(files, CFG, prefix=PREFIX), weights)
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert_loaded(mf.load_weights(tmp_path, CFG, prefix=PREFIX), weights)
    weight_map[PREFIX + P.GATE] = "model-00003-of-00002.safetensors"
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=re.escape(repr(PREFIX + P.GATE)) + " is not in .*00003"):
        mf.load_weights(tmp_path, CFG, prefix=PREFIX)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is not a readable safetensors file"):
        mf.load_weights(sorted(tmp_path.glob("*.safetensors")), CFG, prefix=PREFIX)


def test_loaded_layer_runs_like_the_weights(tmp_path):
    weights = layer(2)
    save_file(checkpoint(weights), str(tmp_path / "m.safetensors"))
    x = jax.random.normal(jax.random.key(0), (3, CFG.hidden)).astype(jnp.bfloat16)
    device_weights = {k: jnp.asarray(v) for k, v in weights.items()}
    want = jax.jit(mf.moe_front)(x, mf.pack_params(device_weights, CFG))
    params = mf.load_params(tmp_path, CFG, prefix=PREFIX)
    got = jax.jit(mf.moe_front)(x, params)
    np.testing.assert_array_equal(np.asarray(got.ids), np.asarray(want.ids))
    np.testing.assert_array_equal(np.asarray(got.latent), np.asarray(want.latent))
    np.testing.assert_array_equal(np.asarray(got.shared), np.asarray(want.shared))


@pytest.mark.parametrize(
    "name, value, message",
    [
        (P.ROUTED_DOWN, None, "checkpoint has no key {key!r}"),
        (P.BIAS, None, "checkpoint has no key {key!r}"),
        (P.GATE, np.zeros((CFG.experts, CFG.hidden + 1), ml_dtypes.bfloat16),
         "checkpoint key {key!r} in .* is (32, 65) BF16, expected (32, 64) bfloat16"),
        (P.GATE, np.zeros((CFG.experts, CFG.hidden), np.float32),
         "checkpoint key {key!r} in .* is (32, 64) F32, expected (32, 64) bfloat16"),
        (P.BIAS, np.zeros((CFG.experts,), ml_dtypes.bfloat16),
         "checkpoint key {key!r} in .* is (32,) BF16, expected (32,) float32"),
        (P.DOWN, np.zeros((CFG.shared, CFG.hidden), ml_dtypes.bfloat16),
         "checkpoint key {key!r} in .* is (32, 64) BF16, expected (64, 32) bfloat16"),
        (P.DOWN, None, "checkpoint has no key {key!r}"),
    ],
)
def test_bad_key_raises_value_error_naming_it(tmp_path, name, value, message):
    weights = layer(3)
    if value is None:
        del weights[name]
    else:
        weights[name] = value
    save_file(checkpoint(weights), str(tmp_path / "m.safetensors"))
    key = PREFIX + name
    pattern = re.escape(message.format(key=key)).replace(re.escape(".*"), ".*")
    with pytest.raises(ValueError, match=pattern):
        mf.load_weights(tmp_path, CFG, prefix=PREFIX)


def test_a_key_the_config_has_no_place_for_raises_naming_it(tmp_path):
    """A biased checkpoint read with a config without a bias would route without it: refused."""
    save_file(checkpoint(layer(5)), str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match=re.escape(
            f"checkpoint at prefix {PREFIX!r}: 'gate.e_score_correction_bias' is given but "
            "FrontConfig.bias is False")):
        mf.load_weights(tmp_path, dataclasses.replace(CFG, bias=False), prefix=PREFIX)


def test_wrong_prefix_and_bad_sources(tmp_path):
    save_file(checkpoint(layer(4)), str(tmp_path / "m.safetensors"))
    with pytest.raises(ValueError, match=re.escape("'model.layers.5.mlp.gate.weight'") + ".*"
                       + re.escape("keys ending in 'gate.weight'")):
        mf.load_weights(tmp_path, CFG, prefix="model.layers.5.mlp.")
    with pytest.raises(ValueError, match="not a file"):
        mf.load_weights(tmp_path / "absent.safetensors", CFG, prefix=PREFIX)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no"):
        mf.load_weights(tmp_path / "empty", CFG)
    with pytest.raises(ValueError, match="empty list"):
        mf.load_weights([], CFG)
    with pytest.raises(ValueError, match="prefix must be a str"):
        mf.load_weights(tmp_path, CFG, prefix=3)
    save_file({PREFIX + P.GATE: np.zeros((1,), np.float32)}, str(tmp_path / "n.safetensors"))
    with pytest.raises(ValueError, match=re.escape(repr(PREFIX + P.GATE)) + " is in both"):
        mf.load_weights(tmp_path, CFG, prefix=PREFIX)


def whole(message):
    """A ``pytest.raises`` pattern that matches exactly ``message``."""
    return "^" + re.escape(message) + "$"


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"weight_map": {', "is not a readable JSON index: Expecting property name enclosed in double "
         "quotes: line 1 column 17 (char 16)"),
        ("", "is not a readable JSON index: Expecting value: line 1 column 1 (char 0)"),
        ('{"metadata": {}}', 'has no "weight_map"; expected {"weight_map": {tensor name: file name}}'),
        ("[1, 2]", 'has no "weight_map"; expected {"weight_map": {tensor name: file name}}'),
        ('{"weight_map": null}', 'has no "weight_map"; expected {"weight_map": {tensor name: file name}}'),
        ('{"weight_map": ["m.safetensors"]}',
         ": \"weight_map\" must map tensor names to file names (str to str), got ['m.safetensors']"),
        ('{"weight_map": {"a.weight": "m.safetensors", "b.weight": 2}}',
         ": \"weight_map\" must map tensor names to file names (str to str), got ('b.weight', 2)"),
    ],
)
def test_bad_index_raises_value_error_naming_the_file(tmp_path, content, message):
    save_file(checkpoint(layer(6)), str(tmp_path / "m.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(content)
    separator = "" if message.startswith(":") else " "
    with pytest.raises(ValueError, match=whole(f"{str(index)!r}{separator}{message}")):
        mf.load_weights(tmp_path, CFG, prefix=PREFIX)


def test_source_of_another_type_raises_value_error_naming_it():
    expected = ("paths_or_dir must be a .safetensors file (str or os.PathLike), a list of them, or a "
                "directory")
    with pytest.raises(ValueError, match=whole(f"{expected}, got 5 of type int")):
        mf.load_weights(5, CFG)
    with pytest.raises(ValueError, match=whole(f"{expected}, got None of type NoneType")):
        mf.load_params(None, CFG)
    with pytest.raises(ValueError, match=whole(f"{expected}, got b'm.safetensors' of type bytes")):
        mf.load_weights(b"m.safetensors", CFG)
    with pytest.raises(ValueError, match=whole(f"{expected}, got an iterable holding 5 of type int")):
        mf.load_weights(["m.safetensors", 5], CFG)


def tp_mesh(tp):
    return jax.sharding.Mesh(np.array(jax.devices("cpu")[:tp]), ("tp",),
                             axis_types=(jax.sharding.AxisType.Explicit,))


def record_reads(monkeypatch):
    """Every (name, bounds) the loader reads from the files."""
    reads = []
    read = CheckpointReader.read

    def spy(self, name, bounds=None):
        reads.append((name, None if bounds is None else tuple(map(tuple, bounds))))
        return read(self, name, bounds)

    monkeypatch.setattr(CheckpointReader, "read", spy)
    return reads


@pytest.mark.parametrize("tp", [2, 8])
def test_load_params_straight_into_tp_shards(tmp_path, monkeypatch, tp):
    weights = layer(5)
    save_file(checkpoint(weights), str(tmp_path / "m.safetensors"))
    mesh = tp_mesh(tp)
    reads = record_reads(monkeypatch)
    params = mf.load_params(tmp_path, CFG, prefix=PREFIX, mesh=mesh)
    want = mf.shard_params({k: jnp.asarray(v) for k, v in weights.items()}, CFG, mesh)
    assert (params.cfg, params.split, params.mesh, params.axis) == (want.cfg, want.split, mesh, "tp")
    for name in ("packed", "bias", "gate_up", "down"):
        got, expected = getattr(params, name), getattr(want, name)
        assert got.sharding == expected.sharding, name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(expected), err_msg=name)
    # Each device read its own rows: no read of a router, latent or shared weight covers two ranks.
    valid, shard, s_r = CFG.experts // tp, CFG.latent // tp, CFG.shared // tp
    rows_read = {P.GATE: valid, P.ROUTED_DOWN: shard, P.GATE_UP: s_r}
    for name, bounds in reads:
        if name in rows_read:
            assert bounds[0][1] - bounds[0][0] == rows_read[name], (name, bounds)
        elif name == P.DOWN:
            assert bounds[1][1] - bounds[1][0] == s_r, bounds
    x = jax.random.normal(jax.random.key(0), (4, CFG.hidden)).astype(jnp.bfloat16)
    front = jax.jit(mf.moe_front)
    got, expected = front(x, params), front(x, want)
    np.testing.assert_array_equal(np.asarray(got.ids), np.asarray(expected.ids))
    np.testing.assert_array_equal(np.asarray(got.shared), np.asarray(expected.shared))

