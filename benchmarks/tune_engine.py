"""Time the streaming engine's tilings beside the heuristic's pick on the GPU (CUPTI, weights rotated
past the L2).

  python3 benchmarks/tune_engine.py --out $OUT [--tps 1,8] [--batches 8,64] \
      [--launches merged,down] [--budget-s 240]

For each launch (``merged``: ``engine.front_gate_up`` with the plan; ``down``: ``engine.down`` into
bfloat16), tp and B: the heuristic's ``EngineConfig``,
then every config one field away from it that the launch takes (a region's CTA rows over the cuts
that divide its rows; ``block_k`` with each ring depth from 2 to 6). Each is
checked first (merged: the logits and latent against the float64 contract; down: within
2 bfloat16 ulps of float64 at ``max(|y|, the row's RMS)``), then timed. The engine reads no table:
this says whether ``heuristic_config``'s model picks well, and by how much the best cut beats it.
A config that fails to compile or to check is listed and the run goes on; cases past
``--budget-s`` are skipped and listed. The table prints last; every timing goes to
$OUT/tune_engine.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from moe_front_jax.pallas import engine
from moe_front_jax.pallas.engine import kernel as ek
from moe_front_jax.pallas.device import core_count
from timing import (
    FrontShape, SharedShape, contract_errors, cupti_us_per_call, down_copies, float64_product,
    gate_up_copies, packed_weights, rows, tbs,
)

LAUNCHES = ("merged", "down")


@dataclasses.dataclass(frozen=True)
class Case:
    """One launch at one (tp, B): what it streams, and the config the heuristic picks."""

    launch: str
    tp: int
    batch: int

    @property
    def front(self) -> FrontShape:
        return FrontShape(self.tp)

    @property
    def shared(self) -> SharedShape:
        return SharedShape(self.tp)

    @property
    def regions(self) -> dict[str, tuple[int, int, int]]:
        """Field -> (rows, most rows per CTA, multiple) of each region the launch streams."""
        f, s = self.front, self.shared
        plan = s.cfg.plan_block
        if self.launch == "down":
            return {"down_rows": (f.hidden, ek.MAX_ROWS, ek.ROW_STEP)}
        return {"router_rows": (f.valid, ek.MAX_ROWS, ek.ROW_STEP),
                "latent_rows": (f.shard, ek.MAX_ROWS, plan),
                "gate_up_rows": (s.shared, ek.MAX_PAIR_ROWS, ek.ROW_STEP)}

    @property
    def depth(self) -> int:
        return self.shared.shared if self.launch == "down" else self.front.hidden

    @property
    def weight_bytes(self) -> int:
        if self.launch == "down":
            return self.shared.down_bytes
        return self.front.weight_bytes + self.shared.gate_up_bytes

    def heuristic(self) -> engine.EngineConfig:
        f, s = self.front, self.shared
        if self.launch == "down":
            return engine.heuristic_config(s.shared, down=f.hidden, cores=core_count())
        return engine.heuristic_config(
            f.hidden, router=f.valid, latent=f.shard, gate_up=s.shared,
            plan_block=s.cfg.plan_block, cores=core_count())


def _widest(case: Case, config: engine.EngineConfig) -> int:
    return max(getattr(config, f) * (2 if f == "gate_up_rows" else 1) for f in case.regions)


def _fits(case: Case, config: engine.EngineConfig) -> bool:
    """Whether the launch takes ``config`` (its own checks: shared memory, registers, cuts)."""
    f, s = case.front, case.shared
    x = jax.ShapeDtypeStruct((case.batch, case.depth), jnp.bfloat16)
    try:
        if case.launch == "down":
            engine.covers_down(x, jax.ShapeDtypeStruct((f.hidden, s.shared), jnp.bfloat16),
                               config=config)
        else:
            packed = jax.ShapeDtypeStruct((f.rows, f.hidden), jnp.bfloat16)
            gate_up = jax.ShapeDtypeStruct((2 * s.shared, f.hidden), jnp.bfloat16)
            engine.covers_front_gate_up(x, packed, f.split, f.valid, gate_up, s.cfg, plan=True,
                                        config=config)
    except (ValueError, NotImplementedError):
        return False
    return True


def neighbours(case: Case, base: engine.EngineConfig) -> list[engine.EngineConfig]:
    """``base``, then every config one field away from it (module docstring) that the launch
    takes, each once; a wider CTA keeps the deepest ring that fits beside it."""
    out = [base]
    for field, (rows_, most, multiple) in case.regions.items():
        for r in ek.row_choices(rows_, most, multiple):
            config = dataclasses.replace(base, **{field: r})
            stage = 2 * base.block_k * (ek.MAX_BATCH + _widest(case, config))
            out.append(dataclasses.replace(
                config, num_stages=max(2, min(base.num_stages, ek.MAX_SMEM // stage))))
    for block_k in (64, 128, 256, 512):
        for stages in range(2, 7):
            if case.depth % block_k or stages * block_k > case.depth:
                continue
            fold = max(block_k, ek.FOLD_K // block_k * block_k)
            out.append(dataclasses.replace(base, block_k=block_k, num_stages=stages, fold_k=fold))
    return [c for c in dict.fromkeys(out) if _fits(case, c)]


def launch_fn(case: Case, config: engine.EngineConfig):
    f, s = case.front, case.shared
    if case.launch == "merged":
        def merged(x, ws):
            packed, gate_up = ws
            return engine.front_gate_up(x, packed, f.split, f.valid, gate_up, s.cfg, plan=True,
                                        config=config)
        return merged
    return lambda x, w: engine.down(x, w, config=config)


def operands(case: Case):
    """``(x, weight copies)`` of the case; merged: pairs ``(packed, gate_up)``."""
    if case.launch == "down":
        return rows(case.batch, case.shared.shared), down_copies(case.shared)
    x = rows(case.batch, case.front.hidden)
    packed = packed_weights(case.front)
    gate_up = gate_up_copies(case.shared)
    return x, list(zip(packed, gate_up))


def check(case: Case, out, x, w) -> str | None:
    """None where the launch's outputs meet the contract, else what is off."""
    if case.launch == "down":
        y = float64_product(x, w)
        mag = np.maximum(np.abs(y), np.sqrt((y**2).mean(axis=1, keepdims=True)))
        ulp = np.exp2(np.floor(np.log2(np.maximum(mag, 2.0**-126))) - 7)
        err = float((np.abs(np.asarray(out, np.float64) - y) / ulp).max())
        return None if err <= 2 else f"down {err:.2f} bf16 ulps off float64"
    logits, latent = out[0], out[1]
    err_l, err_t = contract_errors(logits, latent, float64_product(x, w[0]), case.front.split)
    return None if err_l <= 1 and err_t <= 1 else f"logits {err_l:.2f}, latent {err_t:.2f} of the bound"


def run_case(case: Case, deadline: float) -> dict:
    x, weights = operands(case)
    base = case.heuristic()
    configs = neighbours(case, base)
    failed = {}

    def compile_one(config):
        try:
            return jax.jit(launch_fn(case, config)).lower(x, weights[0]).compile()
        except Exception as e:  # listed; the other configs still run
            failed[str(config)] = f"{type(e).__name__}: {e}"[:500]
            return None

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        compiled = list(pool.map(compile_one, configs))
    timed = []
    for config, fn in zip(configs, compiled):
        if fn is None or time.time() > deadline:
            continue
        problem = check(case, jax.device_get(fn(x, weights[0])), x, weights[0])
        if problem:
            failed[str(config)] = problem
            continue
        us, _ = cupti_us_per_call(fn, x, weights)
        timed.append(dict(config=dataclasses.asdict(config), us=us,
                          tbs=tbs(case.weight_bytes, us), heuristic=config == base))
    timed.sort(key=lambda t: t["us"])
    return dict(launch=case.launch, tp=case.tp, batch=case.batch, timed=timed, failed=failed,
                heuristic=dataclasses.asdict(base))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--tps", default="1,8")
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--launches", default=",".join(LAUNCHES))
    parser.add_argument("--budget-s", type=float, default=240.0,
                        help="cases that would start past this many seconds are skipped")
    args = parser.parse_args()
    launches = args.launches.split(",")
    if unknown := set(launches) - set(LAUNCHES):
        parser.error(f"--launches: unknown {sorted(unknown)}; choose from {LAUNCHES}")
    device = jax.devices()[0]
    print("device", device.device_kind, time.strftime("%Y-%m-%d %H:%M"), flush=True)
    deadline = time.time() + args.budget_s
    cases = [Case(launch, tp, batch) for launch in launches for tp in map(int, args.tps.split(","))
             for batch in map(int, args.batches.split(","))]
    results, skipped = [], []
    for i, case in enumerate(cases, 1):
        if time.time() > deadline:
            skipped.append(dataclasses.asdict(case))
            continue
        start = time.time()
        results.append(run_case(case, deadline))
        r = results[-1]
        print(f"[{i}/{len(cases)}] {case.launch} tp{case.tp} B{case.batch}: {len(r['timed'])} timed, "
              f"{len(r['failed'])} failed, {time.time() - start:.0f} s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "tune_engine.json"), "w") as f:
        json.dump(dict(device=device.device_kind, results=results, skipped=skipped), f, indent=1)
    print(f"\n{'launch':>6} {'tp':>3} {'B':>3} {'heuristic':>9} {'TB/s':>5} "
          f"{'best':>7} {'TB/s':>5}  best config   (us)")
    for r in results:
        mine = next((t for t in r["timed"] if t["heuristic"]), None)
        best = r["timed"][0] if r["timed"] else None
        changed = {k: v for k, v in best["config"].items() if v != r["heuristic"][k]} if best else {}
        print(f"{r['launch']:>6} {r['tp']:>3} {r['batch']:>3} "
              f"{mine['us'] if mine else float('nan'):>9.2f} {mine['tbs'] if mine else float('nan'):>5.2f} "
              f"{best['us'] if best else float('nan'):>7.2f} {best['tbs'] if best else float('nan'):>5.2f}  "
              f"{changed or 'the heuristic'}")
    for case in skipped:
        print("skipped (past --budget-s):", case)


if __name__ == "__main__":
    main()
