#!/usr/bin/env bash
# The GPU check (opt-in, one GPU, about 7 minutes on an H200 before the compiled runs were added): the
# CUDA + NCCL + bf16 path of both scripts on the largest preset with async saves (tokens/s, MFU, peak
# memory, save times), then on the GPU a run crashed after step 25 and restarted by torchrun against one
# never crashed (digests must match), for ddp, fsdp and fsdp with --compile.
#   bash tests/gpu_check.sh                      # figures in the README's GPU table came from this
#   BIG=tiny BATCH=8 STEPS=10 SMALL=tiny bash tests/gpu_check.sh   # on a CPU: checks the script itself
# OUT (default /tmp/devout) receives the log and both summary.json files. Exit 1 if any run failed,
# restarted when it should not have (torchrun's restarts would hide a crash behind the right digest),
# or resumed to another digest.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 MAX_RESTARTS=${MAX_RESTARTS:-3}
OUT=${OUT:-/tmp/devout}; mkdir -p "$OUT"
BIG=${BIG:-1b}; BATCH=${BATCH:-8}; STEPS=${STEPS:-30}; SMALL=${SMALL:-small}
R=/tmp/devruns; rm -rf $R; mkdir -p $R
exec > >(tee "$OUT/log") 2>&1
log() { echo "=== $* (t=${SECONDS}s)"; }
failed=()
# verify RUN_DIR EXIT_CODE RESTARTS: the run exited 0 after exactly RESTARTS torchrun restarts, and
# printed no Traceback if none was expected (common.launch.problems, as the tests check every run).
verify() {
  local why
  why=$(python3 -c "import sys; from common.launch import problems
print('; '.join(problems(sys.argv[1], int(sys.argv[2]), open(sys.argv[1] + '.log').read(), int(sys.argv[3]))))" "$@")
  if [ -n "$why" ]; then echo "FAILED $1: $why"; failed+=("$1: $why"); fi
}

log machine
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2>/dev/null
python3 - <<'PY'
import time, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), "nccl", torch.cuda.nccl.version())
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
    for _ in range(3): a @ b
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): a @ b
    torch.cuda.synchronize(); dt = (time.perf_counter() - t) / 20
    print(f"bf16 matmul 8192^3: {2 * 8192**3 / dt / 1e12:.0f} TFLOP/s")
PY

# 1. The largest preset, bf16, one GPU: throughput, MFU, memory, a save in the middle and at the end.
for s in fsdp ddp; do
  extra=(--async-save)  # pinned staging buffers; fsdp's copy runs in a thread, ddp's on the main thread
  log "$s 1 --preset $BIG"
  MAX_RESTARTS=0 timeout 240 bash run.sh $s 1 --preset $BIG --batch-size $BATCH --steps $STEPS \
    --save-every $((STEPS / 2)) --log-every 5 --run-dir $R/$s-big "${extra[@]}" > $R/$s-big.log 2>&1
  verify $R/$s-big $? 0
  grep -v Warning $R/$s-big.log | tail -14
  cp $R/$s-big/summary.json "$OUT/$s-$BIG-summary.json"
  grep '"save"' $R/$s-big/metrics-rank0.jsonl
  du -sh $R/$s-big/ckpt/*; rm -rf $R/$s-big/ckpt
done

# 2. Bitwise resume on the GPU: a run killed after step 25 and restarted by torchrun against one never
# killed; fsdp-compiled: each block torch.compile'd (the restarted job compiles again).
for name in fsdp ddp fsdp-compiled; do
  s=${name%-compiled}
  flags=(--preset $SMALL --steps 40 --save-every 10 --log-every 40 --async-save)
  [ $name = fsdp-compiled ] && flags+=(--compile)
  log "$name resume on $SMALL"
  bash run.sh $s 1 "${flags[@]}" --run-dir $R/$name-ref > $R/$name-ref.log 2>&1
  verify $R/$name-ref $? 0
  grep -E "^done|Error" $R/$name-ref.log | tail -2
  bash run.sh $s 1 "${flags[@]}" --run-dir $R/$name-crash --crash-at-step 25 > $R/$name-crash.log 2>&1
  verify $R/$name-crash $? 1
  grep -E "injected|resuming|^done|Error" $R/$name-crash.log | tail -4
  same() { python3 -c "import json,sys; a,b=(json.load(open(f'$R/$name-{n}/summary.json'))['param_digest'] for n in sys.argv[1:]); print('$name', *sys.argv[1:], 'digest equal' if a==b else 'DIGEST DIFFERS')" "$@"; }
  same ref crash
  if ! grep -q "$(python3 -c "import json; print(json.load(open('$R/$name-ref/summary.json'))['param_digest'])")" $R/$name-crash/summary.json; then
    failed+=("$name: the resumed run's digest differs from the uninterrupted one")
    log "$name: a second uninterrupted run, to tell GPU nondeterminism from a resume bug"
    bash run.sh $s 1 "${flags[@]}" --run-dir $R/$name-ref2 > $R/$name-ref2.log 2>&1
    verify $R/$name-ref2 $? 0
    same ref ref2
  fi
done
log end
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "gpu check: every run clean or restarted exactly as its fault asked, every resume bitwise"
