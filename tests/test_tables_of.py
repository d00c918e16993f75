"""Which schedule table a device kind takes: its own, another kind's where its own lacks the key
(``device.TABLES_OF``: the H100 SXM borrows the H200's), or none (the heuristic's schedules).
The auto tables (where ``backend="auto"`` runs a GEMM kernel) stay per kind."""

import jax
from jax.sharding import AbstractDevice, AbstractMesh

import moe_front_jax as mf
from moe_front_jax.pallas.front_gemm import kernel as fg
from moe_front_jax.pallas.route import kernel as rt
from moe_front_jax.pallas.shared_expert import kernel as se
from moe_front_jax.pallas.gemm.schedule import VectorConfig
from moe_front_jax.pallas.shared_expert.tma import TmaConfig
from moe_front_jax.pallas import device

K3 = mf.KIMI_K3
H100 = "NVIDIA H100 80GB HBM3"
BATCHES = (1, 2, 8, 16, 32, 64, 256)


def over_shapes(front_gemm, route, shared_expert) -> dict:
    """``front_gemm(c, b, plan)``, ``route(c, b)`` and ``shared_expert(c, b)`` for ``c`` the K3
    config at tp 1 and 8 and ``b`` in ``BATCHES`` (the shared expert's up to 64), by key."""
    out = {}
    for tp in (1, 8):
        c = K3.with_tp(tp)
        for b in BATCHES:
            for plan in (False, True):
                out["front_gemm", tp, b, plan] = front_gemm(c, b, plan)
            out["route", tp, b] = route(c, b)
            if b <= 64:
                out["shared_expert", tp, b] = shared_expert(c, b)
    return out


def schedules(kind: str) -> dict:
    """Each kernel's schedule (``over_shapes``), lowered for a 132-SM ``kind``; and whether the
    kind's auto table has the front GEMM's kernel faster than XLA at tp1 B=64."""
    target = AbstractDevice(device_kind=kind, num_cores=132, platform="cuda")
    with jax.sharding.use_abstract_mesh(AbstractMesh((1,), ("x",), abstract_device=target)):
        out = over_shapes(
            lambda c, b, plan: fg.pick_config(c.experts_per_rank, c.latent_per_rank, c.hidden, b,
                                              plan=plan),
            lambda c, b: rt.pick_config(b, c.experts, c.top_k),
            lambda c, b: se.pick_config(c.shared_per_rank, c.hidden, b))
        out["auto runs the kernel"] = device.measured_faster(
            "front_gemm", fg.table_key(K3.experts, K3.latent, K3.hidden, 64))
    return out


def heuristics() -> dict:
    """The heuristic's schedules at ``schedules``' shapes (what a kind with no table gets)."""
    return over_shapes(
        lambda c, b, plan: fg.heuristic_config(c.experts_per_rank, c.latent_per_rank, c.hidden, b,
                                               cores=132),
        lambda c, b: rt.heuristic_config(b, c.experts, c.top_k),
        lambda c, b: se.heuristic_config(c.shared_per_rank, c.hidden, b, 132))


def test_the_h100_takes_its_own_entries_then_the_h200_schedules_but_not_its_auto_table():
    assert device.TABLES_OF[H100] == "NVIDIA H200"
    h100, h200 = schedules(H100), schedules("NVIDIA H200")
    # Each kind's own measurement: at tp1 B=64 the front GEMM's kernel beat XLA on the H100 by more
    # than the margin (30.0 us against 34.0 and 38.0), not on the H200.
    assert h100.pop("auto runs the kernel") and not h200.pop("auto runs the kernel")
    # The H100's own shared-expert table (tp1 and tp8 at B = 1, 8, 16, 64, tp8 at B=32) wins where
    # it has the key; every other schedule (B = 2, 4; tp1 B=32, where the H200's measured faster
    # on the H100) is the H200's.
    own = se.load_table(H100)
    own_keys = {(K3.with_tp(tp).shared_per_rank, b) for tp in (1, 8) for b in (1, 8, 16, 32, 64)}
    own_keys.remove((K3.with_tp(1).shared_per_rank, 32))
    assert set(own) == {se.table_key(s, K3.hidden, b) for s, b in own_keys}
    for key, config in h100.items():
        c = K3.with_tp(key[1])
        if key[0] == "shared_expert" and (c.shared_per_rank, key[2]) in own_keys:
            assert config == own[se.table_key(c.shared_per_rank, c.hidden, key[2])], key
        else:
            assert config == h200[key], key
    # The keys where the tables differ by more than a tie: tp1 B=1's down is the vector schedule on
    # the H100, wgmma's on the H200; at tp1 B=64 the H100 takes the batch as wgmma's M, the H200
    # not.
    assert isinstance(h100["shared_expert", 1, 1].down, VectorConfig)
    assert isinstance(h200["shared_expert", 1, 1].down, TmaConfig)
    assert h100["shared_expert", 1, 64].gate_up.batch_m
    assert not h200["shared_expert", 1, 64].gate_up.batch_m
    assert h100 != heuristics()  # the tables do choose other schedules


def test_a_kind_without_a_table_gets_the_heuristic():
    other = schedules("NVIDIA B200")
    assert not other.pop("auto runs the kernel")
    assert other == heuristics()
