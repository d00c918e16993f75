# Every GPU check and benchmark of the project in one run on a GPU, from the repository root:
#
#   OUT=/tmp/out bash benchmarks/run_all.sh     # BENCHES="route plan" to run some benchmarks only
#
# Installs the checkout (gpu_env.sh), runs the GPU-marked tests, the main job with the Pallas
# kernels, then each stage's benchmark beside XLA, and draws front.png from their results. Each step's
# log goes to $OUT/<step>.log; the tables print last. A failing step is reported and the rest still run;
# the exit status is the number of steps that failed.
set -u
OUT=${OUT:?set OUT to the folder for results}
mkdir -p "$OUT"
source benchmarks/gpu_env.sh || exit 1
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader || true
failed=0

step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, say how long it took
  local name=$1; shift
  local start=$SECONDS
  echo "== $name: $*"
  if "$@" > "$OUT/$name.log" 2>&1; then
    echo "   ok in $((SECONDS - start)) s"
  else
    echo "   FAILED (status $?) in $((SECONDS - start)) s; last lines:"; tail -n 15 "$OUT/$name.log"
    failed=$((failed + 1))
  fi
}

# pytest runs from tests/ so that `import moe_front_jax` is the copy gpu_env.sh installed.
# (test_notebook.py holds no GPU test and needs nbformat, which the GPU image lacks.)
step gpu_tests bash -c 'cd tests && python3 -m pytest -q -m gpu -rs -p no:cacheprovider --ignore=test_notebook.py .'
step decode python3 examples/decode.py --batch 1 64 --steps 3 --backend pallas
BENCHES=${BENCHES:-front route front_gemm shared_expert plan mailbox}
for bench in $BENCHES; do
  step "bench_$bench" python3 "benchmarks/bench_$bench.py" --out "$OUT"
done
# The stages timed against XLA (the mailbox has no XLA counterpart on one GPU: its table says what it adds).
# Where "auto" would run the GEMM kernels by this run alone (the shipped table needs every run it names).
step auto_table python3 benchmarks/auto_table.py --front "$OUT/bench_front_gemm.json" \
  --shared "$OUT/bench_shared_expert.json" --out "$OUT/auto.json"
plotted=$(for b in route front_gemm shared_expert plan; do [ -f "$OUT/bench_$b.json" ] && echo "$OUT/bench_$b.json"; done)
step plot python3 benchmarks/plot.py $plotted -o "$OUT/front.png" --table

for log in gpu_tests decode; do echo; echo "== $log (tail)"; tail -n 12 "$OUT/$log.log"; done
for bench in $BENCHES; do
  echo; echo "== bench_$bench (table)"; sed -n '/^$/,$p' "$OUT/bench_$bench.log" | tail -n 45
done
echo; echo "== plot"; cat "$OUT/plot.log"
exit $failed
