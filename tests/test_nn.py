"""mf.nn.MoEFront: the NNX module against mf.moe_front, alone and inside a small decode model; its
Params in FrontParams' layout, read from a checkpoint, and passed straight to the front GEMM."""

import dataclasses
import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

import moe_front_jax as mf
from moe_front_jax import params as P
from moe_front_jax.checkpoint import CheckpointReader

CFG = mf.FrontConfig(hidden=128, experts=64, top_k=8, latent=128, shared=64)


def rows(batch, seed=1):
    return jax.random.normal(jax.random.key(seed), (batch, CFG.hidden)).astype(jnp.bfloat16)


def assert_outputs_equal(got: mf.FrontOutput, want: mf.FrontOutput):
    for name in ("ids", "weights", "latent", "logits", "shared", "status"):
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    if want.plan is None:
        assert got.plan is None
    else:
        for a, b in zip(got.plan, want.plan):
            np.testing.assert_array_equal(np.asarray(a.view(jnp.uint8)), np.asarray(b.view(jnp.uint8)))


@functools.partial(jax.jit, static_argnames="plan")
def reference_front(x, params, plan=False):
    return mf.moe_front(x, params, plan=plan, backend="xla")


@pytest.mark.parametrize("shared, plan", [(True, True), (False, False)])
def test_module_matches_moe_front(shared, plan):
    weights = mf.init_weights(jax.random.key(0), CFG, shared=shared)
    front = mf.nn.MoEFront(CFG, weights=weights)
    x = rows(5)
    want = reference_front(x, mf.pack_params(weights, CFG), plan=plan)
    assert_outputs_equal(nnx.jit(lambda m, x: m(x, plan=plan))(front, x), want)


def test_module_called_eagerly():
    weights = mf.init_weights(jax.random.key(0), CFG)
    x = rows(3)
    assert_outputs_equal(mf.nn.MoEFront(CFG, weights=weights)(x), reference_front(x, mf.pack_params(weights, CFG)))


def test_module_takes_permute_and_a_mailbox_as_moe_front_does():
    """``front(x, permute=True)`` returns ``moe_front``'s dispatch; with a mailbox, the pair
    ``(FrontOutput, Mailbox)``, the same bits as ``moe_front`` with its own mailbox."""
    weights = mf.init_weights(jax.random.key(0), CFG)
    front, params = mf.nn.MoEFront(CFG, weights=weights), mf.pack_params(weights, CFG)
    x = rows(5)
    direct = jax.jit(functools.partial(mf.moe_front, permute=True, backend="xla"))
    want = direct(x, params)
    got = nnx.jit(lambda m, x: m(x, permute=True), graph_updates=False)(front, x)
    assert_outputs_equal(got, want)
    for a, b in zip(got.dispatch, want.dispatch):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    boxed = nnx.jit(lambda m, x, box: m(x, plan=True, permute=True, mailbox=box),
                    graph_updates=False)
    box = mf.Mailbox.create(CFG, capacity=8)
    for _ in range(2):
        out, box = boxed(front, x, box)
        assert isinstance(box, mf.Mailbox)
        assert_outputs_equal(out, reference_front(x, params, plan=True))
        for a, b in zip(out.dispatch, want.dispatch):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def assert_weights_equal(got, want):
    """``got`` holds exactly ``want``: the same keys, shapes, dtypes and bits."""
    assert set(got) == set(want)
    for name, array in want.items():
        assert got[name].shape == array.shape and got[name].dtype == array.dtype, name
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(array), err_msg=name)


@pytest.mark.parametrize("shared", [True, False])
def test_weights_returns_the_given_weights(shared):
    weights = mf.init_weights(jax.random.key(2), CFG, shared=shared)
    assert_weights_equal(mf.nn.MoEFront(CFG, weights=weights).weights(), weights)


def test_rngs_draw_init_weights():
    front = mf.nn.MoEFront(CFG, rngs=nnx.Rngs(params=3))
    assert_weights_equal(front.weights(), mf.init_weights(nnx.Rngs(params=3).params(), CFG))
    front = mf.nn.MoEFront(CFG, rngs=nnx.Rngs(0), shared=False)
    assert front.gate_up is None and front.down is None
    assert set(front.weights()) == {P.GATE, P.BIAS, P.ROUTED_DOWN}


def expected_layout(weights, tp):
    """The Params' arrays for ``tp`` ranks, built here with numpy from the checkpoint's weights:
    per rank its router rows, zero rows up to a multiple of 16, its latent rows; its gate rows, then
    its up rows."""
    w = {k: np.asarray(v) for k, v in weights.items()}
    valid, shard, s_r = CFG.experts // tp, CFG.latent // tp, CFG.shared // tp
    split = -(-valid // 16) * 16
    packed, gate_up = [], []
    for r in range(tp):
        packed += [w[P.GATE][r * valid:(r + 1) * valid], np.zeros((split - valid, CFG.hidden), w[P.GATE].dtype),
                   w[P.ROUTED_DOWN][r * shard:(r + 1) * shard]]
        if P.GATE_UP in w:
            gate_up += [w[P.GATE_UP][r * s_r:(r + 1) * s_r],
                        w[P.GATE_UP][CFG.shared + r * s_r:CFG.shared + (r + 1) * s_r]]
    layout = {"packed": np.concatenate(packed), "bias": w[P.BIAS]}
    if gate_up:
        layout.update(gate_up=np.concatenate(gate_up), down=w[P.DOWN])
    return layout


ANNOTATIONS = {"packed": ("tp", None), "bias": (), "gate_up": ("tp", None), "down": (None, "tp")}


def assert_params_hold(front, weights, mesh):
    """The module's Params are the FrontParams arrays of ``weights`` (``expected_layout``), with their
    tp annotations, and on a mesh each device holds its rank's block."""
    state = nnx.state(front, nnx.Param)
    flat = {".".join(map(str, path)): var for path, var in nnx.to_flat_state(state)}
    specs = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.get_partition_spec(state))}
    want = expected_layout(weights, 1 if mesh is None else mesh.shape["tp"])
    assert set(flat) == set(want)
    for name, array in want.items():
        value = flat[name][...]
        assert value.dtype == array.dtype, name
        np.testing.assert_array_equal(np.asarray(value), array, err_msg=name)
        assert flat[name].get_metadata()["out_sharding"] == ANNOTATIONS[name], name
        spec = jax.sharding.PartitionSpec(*ANNOTATIONS[name])
        assert specs[name].get_value() == spec, name
        if mesh is not None:
            assert value.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), value.ndim), name


@pytest.mark.parametrize("tp, shared", [(None, True), (4, True), (8, False)])
def test_params_hold_the_front_params_layout_with_tp_annotations(tp, shared):
    weights = mf.init_weights(jax.random.key(0), CFG, shared=shared)
    mesh = None if tp is None else tp_mesh(tp)
    assert_params_hold(mf.nn.MoEFront(CFG, weights=weights, mesh=mesh), weights, mesh)


class TinyDecoder(nnx.Module):
    """A toy decode model: token embedding, RMSNorm, the MoE front, a routed expert table, a head."""

    def __init__(self, cfg, vocab, rngs, mesh=None):
        replicate = (lambda a: a) if mesh is None else (
            lambda a: jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))
        self.embed = nnx.Embed(vocab, cfg.hidden, rngs=rngs)
        self.norm = nnx.RMSNorm(cfg.hidden, rngs=rngs)
        self.front = mf.nn.MoEFront(cfg, rngs=rngs, mesh=mesh)
        self.experts = nnx.Param(jax.random.normal(rngs.params(), (cfg.experts, cfg.hidden)) * 0.1)
        self.head = nnx.Linear(cfg.hidden, vocab, rngs=rngs)
        for module in (self.embed, self.norm, self.head, self):
            for name, value in vars(module).items():
                if isinstance(value, nnx.Param):
                    value.set_value(replicate(value[...]))

    def rows(self, tokens):
        return self.norm(self.embed(tokens)).astype(jnp.bfloat16)

    def __call__(self, tokens):
        x = self.rows(tokens)
        out = self.front(x)
        routed = jnp.einsum("bk,bkh->bh", out.weights.astype(jnp.float32), self.experts[...][out.ids])
        hidden = x.astype(jnp.float32) + routed + out.shared.astype(jnp.float32)
        return out, jnp.argmax(self.head(hidden), axis=-1)


def test_front_inside_a_decode_model_under_nnx_jit():
    model = TinyDecoder(CFG, vocab=97, rngs=nnx.Rngs(0))
    step = nnx.jit(lambda m, tokens: m(tokens))
    params = mf.pack_params(model.front.weights(), CFG)
    tokens = jnp.array([3, 14, 15, 92, 65, 35], jnp.int32)
    for _ in range(3):
        out, next_tokens = step(model, tokens)
        assert_outputs_equal(out, reference_front(model.rows(tokens), params))
        assert next_tokens.shape == tokens.shape and next_tokens.dtype == jnp.int32
        tokens = next_tokens


def test_bad_arguments_raise_value_error():
    weights = mf.init_weights(jax.random.key(0), CFG)
    with pytest.raises(ValueError, match="exactly one of rngs"):
        mf.nn.MoEFront(CFG)
    with pytest.raises(ValueError, match="exactly one of rngs"):
        mf.nn.MoEFront(CFG, rngs=nnx.Rngs(0), weights=weights)
    with pytest.raises(ValueError, match="backend must be one of"):
        mf.nn.MoEFront(CFG, weights=weights, backend="cuda")
    no_shared = dataclasses.replace(CFG, shared=0)
    with pytest.raises(ValueError, match="shared=True needs"):
        mf.nn.MoEFront(no_shared, rngs=nnx.Rngs(0), shared=True)
    for shared in (True, False):
        with pytest.raises(ValueError, match=f"shared={shared} applies to rngs="):
            mf.nn.MoEFront(CFG, weights=weights, shared=shared)
    # By default the module draws a shared expert exactly when the config has one.
    assert mf.nn.MoEFront(no_shared, rngs=nnx.Rngs(0))(rows(2)).shared is None
    assert mf.nn.MoEFront(CFG, rngs=nnx.Rngs(0))(rows(2)).shared.shape == (2, CFG.hidden)
    bad = dict(weights, **{P.ROUTED_DOWN: weights[P.ROUTED_DOWN][:-1]})
    with pytest.raises(ValueError, match=re.escape(repr(P.ROUTED_DOWN))):
        mf.nn.MoEFront(CFG, weights=bad)
    front = mf.nn.MoEFront(CFG, weights=weights)
    with pytest.raises(ValueError, match="x must be bfloat16"):
        front(rows(2).astype(jnp.float32))


def tp_mesh(tp, names=("tp",), shape=None):
    devices = np.array(jax.devices("cpu")[: math.prod(shape or (tp,))]).reshape(shape or (tp,))
    return jax.sharding.Mesh(devices, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(names))


@pytest.mark.parametrize("tp", [2, 8])
def test_module_on_a_tp_mesh_matches_moe_front(tp):
    weights = mf.init_weights(jax.random.key(0), CFG)
    front = mf.nn.MoEFront(CFG, weights=weights, mesh=tp_mesh(tp))
    assert front.cfg.tp == tp
    x = rows(5)
    got = nnx.jit(lambda m, x: m(x, plan=True))(front, x)
    want = reference_front(x, mf.pack_params(weights, CFG), plan=True)
    # The shared expert's partial sums are added in another order than one device's accumulation.
    np.testing.assert_allclose(np.asarray(got.shared, np.float32), np.asarray(want.shared, np.float32),
                               rtol=2.0**-7, atol=2.0**-10)
    assert_outputs_equal(got._replace(shared=want.shared), want)
    assert_weights_equal(front.weights(), weights)


def test_decode_model_with_a_tp_front_under_nnx_jit():
    mesh = tp_mesh(4)
    model = TinyDecoder(CFG, vocab=97, rngs=nnx.Rngs(0), mesh=mesh)
    tokens = jnp.array([3, 14, 15, 92], jnp.int32)
    step = nnx.jit(lambda m, tokens: m(tokens))
    one_device = mf.pack_params(jax.device_get(model.front.weights()), CFG)
    for _ in range(2):
        out, next_tokens = step(model, tokens)
        want = reference_front(jax.device_get(model.rows(tokens)), one_device)
        np.testing.assert_array_equal(np.asarray(out.ids), np.asarray(want.ids))
        np.testing.assert_array_equal(np.asarray(out.latent), np.asarray(want.latent))
        tokens = next_tokens


def test_data_axis_beside_tp_and_psum_scatter():
    weights = mf.init_weights(jax.random.key(0), CFG)
    mesh = tp_mesh(4, names=("data", "tp"), shape=(2, 4))
    front = mf.nn.MoEFront(CFG, weights=weights, mesh=mesh, shared_reduce="psum_scatter")
    call = nnx.jit(lambda m, x: m(x))
    got = call(front, jax.device_put(rows(6), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data", None))))
    np.testing.assert_array_equal(np.asarray(call(front, rows(6)).ids), np.asarray(got.ids))  # x on one device
    want = reference_front(rows(6), mf.pack_params(weights, CFG))
    assert got.shared.sharding.spec == jax.sharding.PartitionSpec("data", "tp")
    np.testing.assert_array_equal(np.asarray(got.ids), np.asarray(want.ids))
    np.testing.assert_allclose(np.asarray(got.shared, np.float32), np.asarray(want.shared, np.float32),
                               rtol=2.0**-7, atol=2.0**-10)
    with pytest.raises(ValueError, match="B must be divisible by 2"):
        call(front, rows(3))


def test_tp_arguments_raise_value_error():
    weights = mf.init_weights(jax.random.key(0), CFG)
    with pytest.raises(ValueError, match="cfg.tp=2 needs mesh="):
        mf.nn.MoEFront(CFG.with_tp(2), weights=weights)
    with pytest.raises(ValueError, match="axis='model' is not an axis of the mesh"):
        mf.nn.MoEFront(CFG, weights=weights, mesh=tp_mesh(2), axis="model")
    with pytest.raises(ValueError, match="cfg.tp=4 disagrees with mesh axis 'tp' of size 2"):
        mf.nn.MoEFront(CFG.with_tp(4), weights=weights, mesh=tp_mesh(2))
    with pytest.raises(ValueError, match="shared_reduce must be one of"):
        mf.nn.MoEFront(CFG, weights=weights, shared_reduce="sum")


PREFIX = "model.layers.3.mlp."


@pytest.mark.parametrize("tp, shared", [(None, True), (4, True), (8, False)])
def test_from_checkpoint_round_trips(tmp_path, monkeypatch, tp, shared):
    weights = mf.init_weights(jax.random.key(6), CFG, shared=shared)
    tensors = {PREFIX + name: np.asarray(array) for name, array in weights.items()}
    tensors["model.layers.4.mlp.gate.weight"] = tensors[PREFIX + P.GATE] * 0  # a neighbouring layer
    save_file(tensors, str(tmp_path / "model.safetensors"))
    reads, read = [], CheckpointReader.read

    def spy(self, name, bounds=None):
        reads.append((name, bounds))
        return read(self, name, bounds)

    monkeypatch.setattr(CheckpointReader, "read", spy)
    mesh = None if tp is None else tp_mesh(tp)
    front = mf.nn.MoEFront.from_checkpoint(tmp_path, CFG, PREFIX, mesh=mesh, backend="xla")
    assert_params_hold(front, weights, mesh)
    assert_weights_equal(front.weights(), weights)
    if mesh is not None:
        # Each device read only its rank's rows (or down's columns) of each weight.
        block = {P.GATE: CFG.experts // tp, P.ROUTED_DOWN: CFG.latent // tp, P.GATE_UP: CFG.shared // tp}
        for name, bounds in reads:
            if name in block:
                assert bounds[0][1] - bounds[0][0] == block[name], (name, bounds)
            elif name == P.DOWN:
                assert bounds[1][1] - bounds[1][0] == CFG.shared // tp, bounds
    x = rows(3)
    got = nnx.jit(lambda m, x: m(x))(front, x)
    want = reference_front(x, mf.pack_params(weights, CFG))
    np.testing.assert_array_equal(np.asarray(got.ids), np.asarray(want.ids))
    np.testing.assert_array_equal(np.asarray(got.latent), np.asarray(want.latent))


WEIGHT_PARAMS = ("packed", "gate_up", "down")


def weight_reads(jaxpr, labels):
    """``(param, primitive, operand index)`` of every equation that reads a weight Param in
    ``jaxpr``, following the Params through the calls they enter whole (jit, shard_map)."""
    reads = []
    for eqn in jaxpr.eqns:
        inputs = [labels.get(v) if isinstance(v, jax.extend.core.Var) else None for v in eqn.invars]
        bodies = [getattr(p, "jaxpr", p) for p in eqn.params.values()
                  if isinstance(p, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr))]
        if any(inputs) and len(bodies) == 1 and len(bodies[0].invars) == len(inputs):
            reads += weight_reads(bodies[0], {v: label for v, label in zip(bodies[0].invars, inputs) if label})
        else:
            reads += [(label, eqn.primitive.name, i) for i, label in enumerate(inputs) if label]
    return reads


HLO_ARRAY = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} ([\w-]+)\(")


@pytest.mark.parametrize("tp", [None, 8])
def test_a_call_passes_the_params_straight_to_the_gemms(tp):
    """No repacking per call: under nnx.jit the packed Param (and the shared expert's) is read only by
    its GEMM, and the optimized program makes no array the size of a rank's packed weight."""
    mesh = None if tp is None else tp_mesh(tp)
    front = mf.nn.MoEFront(CFG, rngs=nnx.Rngs(0), mesh=mesh)
    x = rows(5)
    call = nnx.jit(lambda m, x: m(x))
    graphdef, state = nnx.split(front)
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    closed = jax.make_jaxpr(lambda state, x: call(nnx.merge(graphdef, state), x))(state, x)
    labels = {}
    for var, (path, _) in zip(closed.jaxpr.invars, leaves):
        name = next((key.key for key in path if getattr(key, "key", None) in WEIGHT_PARAMS), None)
        if name:
            labels[var] = name
    assert sorted(labels.values()) == sorted(WEIGHT_PARAMS)
    reads = weight_reads(closed.jaxpr, labels)
    # One GEMM reads each weight, as its right-hand operand, and nothing else touches it.
    assert sorted(reads) == sorted((name, "dot_general", 1) for name in WEIGHT_PARAMS), reads

    # Compiled: graph-mode nnx.jit also returns the module's Variables, which XLA copies into fresh
    # buffers unless they are donated; a call that takes no updates back (graph_updates=False, as in
    # examples/decode.py) makes no array the size of a rank's packed weight.
    ranks = tp or 1
    packed_rows = -(-CFG.experts // ranks // 16) * 16 + CFG.latent // ranks
    hlo = nnx.jit(lambda m, x: m(x), graph_updates=False).lower(front, x).compile().as_text()
    made = [(op, shape) for dtype, shape, op in HLO_ARRAY.findall(hlo)
            if op != "parameter" and math.prod(map(int, filter(None, shape.split(",")))) >= packed_rows * CFG.hidden]
    assert not made, made
