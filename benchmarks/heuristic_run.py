"""Run one of the benchmark scripts as if the device took no other kind's schedule tables.

  python benchmarks/heuristic_run.py bench_front_gemm.py --tps 1,8 --out $OUT/heuristic

Empties ``streaming.TABLES_OF`` (the device kinds that borrow another kind's tables: the H100
takes the H200's), so that each kernel runs the device's own table or, where it has none, the
heuristic's schedules; then runs the script with the remaining arguments. Beside a plain run of the
same script on the same machine, it says what the borrowed tables are worth there.
"""

import os
import runpy
import sys

from moe_front_jax.pallas import streaming

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    streaming.TABLES_OF.clear()
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), sys.argv[1])
    sys.argv = [script, *sys.argv[2:]]
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")
