"""Compile the routing kernel for sm_90 on a host without a GPU, to check it and count what it became.

  python benchmarks/route_sm90.py dump DIR       # the project's venv (jax): Triton IR, DIR/*.ttir
  python benchmarks/route_sm90.py compile DIR    # a venv with triton (3.6 here): PTX, cubin, counts

``dump`` lowers ``route.route`` for an H200 from the CPU (as tests/h200.py does) for each config,
selection and schedule of ``CASES`` and writes the Triton IR that Pallas hands to XLA, as text
(captured by ``tests/h200.triton_ir_for_h200`` from a private module of Pallas: a tool, not a test).
``compile`` compiles each file with Triton alone for sm_90 (``triton.compile`` on ``.ttir``), runs the
bundled ``ptxas -v`` and ``cuobjdump -sass``, and prints per kernel: registers, spill bytes, barriers
(``bar.sync`` in the PTX), shuffles, ``ttg.convert_layout`` ops and SASS instructions. Static counts
of straight-line code, not timings: every instruction runs once per warp, but latency depends on
the dependency chains, which only the GPU measures (``bench_route.py --sweep``).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile

CASES = [
    # (config name, selection, block_rows, num_warps, group, width, batch)
    ("k3", "argmax", 1, 4, 0, 0, 1),
    ("k3", "argmax", 1, 8, 0, 0, 1),
    ("k3", "groups", 1, 2, 0, 0, 1),
    ("k3", "groups", 1, 4, 0, 0, 1),
    ("k3", "groups", 1, 8, 0, 0, 1),
    ("k3", "groups", 1, 4, 8, 8, 1),
    ("k3", "groups", 1, 8, 8, 8, 1),
    ("k3", "argmax", 4, 4, 0, 0, 37),
    ("k3", "groups", 4, 4, 0, 0, 37),
    ("e1024_top32", "argmax", 1, 4, 0, 0, 1),
    ("e1024_top32", "groups", 1, 4, 0, 0, 1),
    ("e100_top6", "groups", 4, 4, 0, 0, 37),
]


def dump(out: str) -> None:
    import jax.numpy as jnp

    import moe_front_jax as mf
    from moe_front_jax.pallas import route as rt

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from h200 import triton_ir_for_h200

    configs = {
        "k3": mf.KIMI_K3,
        "e1024_top32": mf.FrontConfig(hidden=256, experts=1024, top_k=32, latent=128, shared=0),
        "e100_top6": mf.FrontConfig(hidden=256, experts=100, top_k=6, latent=128, shared=0),
    }
    os.makedirs(out, exist_ok=True)
    for name, select, rows, warps, group, width, batch in CASES:
        cfg = configs[name]
        config = rt.RouteConfig(rows, warps, select, group, width)
        [text] = triton_ir_for_h200(lambda l, b: rt.route(l, b, cfg, config=config),
                                    jnp.zeros((batch, cfg.experts), jnp.float32),
                                    jnp.zeros((cfg.experts,), jnp.float32))
        path = os.path.join(out, f"{name}_B{batch}_{config.name}.w{warps}.ttir")
        with open(path, "w") as f:
            f.write(text)
        print(path)


def compile_all(out: str) -> None:
    os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp())
    import triton
    from triton.backends.compiler import GPUTarget

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    print(f"{'kernel':<40} {'regs':>4} {'spill':>5} {'bar':>4} {'shfl':>4} {'cvt':>4} {'sass':>5}")
    for path in sorted(glob.glob(os.path.join(out, "*.ttir"))):
        warps = int(re.search(r"\.w(\d+)\.ttir$", path).group(1))
        compiled = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=warps, num_stages=1))
        base = path[: -len(".ttir")]
        ptx = compiled.asm["ptx"]
        with open(base + ".ptx", "w") as f:
            f.write(ptx)
        info = subprocess.run([os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", base + ".ptx",
                               "-o", base + ".cubin"], capture_output=True, text=True, check=True)
        sass = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", base + ".cubin"],
                              capture_output=True, text=True, check=True).stdout
        regs = re.search(r"Used (\d+) registers", info.stderr).group(1)
        spill = re.search(r"(\d+) bytes spill stores", info.stderr).group(1)
        bars = len(re.findall(r"bar\.sync|barrier\.sync", ptx))
        converts = compiled.asm["ttgir"].count("convert_layout")
        instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/", sass, re.M))
        print(f"{os.path.basename(base):<40} {regs:>4} {spill:>5} {bars:>4} "
              f"{ptx.count('shfl.sync'):>4} {converts:>4} {instructions:>5}")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("dump", "compile"):
        sys.exit(__doc__)
    (dump if sys.argv[1] == "dump" else compile_all)(sys.argv[2])
