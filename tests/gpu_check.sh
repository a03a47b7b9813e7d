#!/usr/bin/env bash
# The GPU check (opt-in, one GPU; 7 to 8 minutes on an H200 by an estimate from earlier runs' parts: this
# version has not run there): issue 11's measurements, then the CUDA + NCCL + bf16 crash-resume of both
# scripts. The sections run in this order, most wanted first, so that a run cut short loses the last.
#   1. fsdp on the largest preset, --compile and --async-save: MFU, the loop's blocked time per async save,
#      and the step time while a save is being written against the other steps (from its metrics);
#   2. tests/save_bench.py on that preset: a raw fsync'd write of the model state's bytes (one stream, 8
#      streams), against the scripts' synchronous saves (torch.save; DCP at 8 threads) and the async save;
#   3. crash-resume on the GPU, each against a run never crashed (digests must match): fsdp killed in its
#      async save's upload, fsdp --compile killed while staging, ddp killed in its async write;
#   4. ddp on the largest preset with --async-save, for docs/measurements.md;
#   5. --survivors on NCCL, where there are 2 GPUs or more: a rank SIGKILLed, one SIGSTOPped (ddp); rank 0
#      killed inside a synchronous save, the others in DCP's collectives (fsdp).
# Each job is launched as the tests launch it (python3 -m harness.launch), with a timeout.
#   bash tests/gpu_check.sh                      # the GPU figures of docs/measurements.md come from this
#   BIG=tiny BATCH=8 STEPS=20 SMALL=tiny bash tests/gpu_check.sh   # on a CPU: checks the script itself
#   (SURVIVORS_ON_CPU=1 runs section 5 there too)
# OUT (default: a new folder under /tmp, printed) receives the log, both summary.json files and save_bench.json. Exit 1 if any
# run failed, restarted when it should not have (torchrun's restarts would hide a crash behind the right
# digest) or other than its fault asked, or resumed to another digest. The targets are reported, not
# enforced: they are performance figures of one machine.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-$(mktemp -d /tmp/gpu-check-out.XXXXXX)}; mkdir -p "$OUT"; echo "gpu_check: output in $OUT"
BIG=${BIG:-1b}; BATCH=${BATCH:-8}; STEPS=${STEPS:-160}; SMALL=${SMALL:-small}
R=$(mktemp -d /tmp/gpu-check-runs.XXXXXX); trap 'rm -rf "$R"' EXIT  # the jobs' run folders
exec > >(tee "$OUT/log") 2>&1
log() { echo "=== $* (t=${SECONDS}s)"; }
failed=()
# verify RUN_DIR EXIT_CODE RESTARTS: the run exited 0 after exactly RESTARTS torchrun restarts, and
# printed no Traceback if none was expected (harness.launch.problems, as the tests check every run).
verify() {
  local why
  why=$(python3 -c "import sys; from harness.launch import problems
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

# launch SECONDS MAX_RESTARTS SCRIPT RUN_DIR FLAGS...: one process under torchrun, as the tests launch it
# (harness/launch.py), killed after SECONDS; run.sh's package check and preflight would import torch twice
# more per launch. Its output goes to RUN_DIR.log.
launch() {
  local seconds=$1 restarts=$2 script=$3 dir=$4; shift 4
  MAX_RESTARTS=$restarts timeout "$seconds" python3 -m harness.launch "$script" 1 --run-dir "$dir" "$@" > "$dir.log" 2>&1
}

# One big run: $STEPS steps, a save every $STEPS/2, the last at the end. The steps between saves should
# outlast a save's staging and write (1b on the H200 before: 5.8 s and about 17 s; on torch 2.11 each
# save pins its buffers afresh), else the next save waits for the last: the save event's commit_wait_s.
big() {  # big NAME SCRIPT FLAGS...: one run on the largest preset, its figures copied to $OUT
  local name=$1 script=$2; shift 2
  log "$name on $BIG"
  launch 300 0 $script $R/$name --preset $BIG --batch-size $BATCH --log-every 10 \
    --lr 3e-4 "$@"
  verify $R/$name $? 0
  grep -v Warning $R/$name.log | tail -8
  cp $R/$name/summary.json "$OUT/$name-$BIG-summary.json"
  python3 - $R/$name <<'PY'
import json, sys
from harness.metrics import events, step_slowdown_while_saving
ev = events(sys.argv[1]); s = json.load(open(sys.argv[1] + "/summary.json"))
saves = [e for e in ev if e["event"] == "save" and e["rank"] == 0]
steps = [e for e in ev if e["event"] == "step"]
mfu = f"{s['mfu']:.1%}" if s["mfu"] is not None else "n/a (no GPU peak known)"
print(f"median step {s['median_step_s'] * 1000:.0f} ms, {s['tokens_per_s']:,.0f} tokens/s, MFU {mfu} "
      f"(target with --compile: 50%), peak memory {(s.get('cuda_peak_bytes') or s.get('rss_peak_bytes')) / 2**30:.1f} GiB")
for e in saves:  # the last save's wait at the end is not counted: no step is left to stall
    waits = (f" (of which {e['staging_wait_s'] * 1000:.0f} ms for its copy, {e['commit_wait_s'] * 1000:.0f} ms for"
             " the previous save's commit)" if "staging_wait_s" in e else "")
    print(f"save step {e['step']}: loop blocked {e['blocking_s'] * 1000:.0f} ms{waits} (target 50 ms), staged "
          f"{(e.get('staging_s') or 0):.2f} s, committed {e['total_s']:.2f} s, {e['bytes'] / 1e9:.1f} GB")
slow = step_slowdown_while_saving(steps)
print(f"step time while a save is written / otherwise: {slow:.2f} (target 1.15)" if slow else
      "no step ran while a save was written")
PY
  [ $? = 0 ] || failed+=("$name: its figures could not be read from its metrics")
  du -sh $R/$name/ckpt/*; rm -rf $R/$name/ckpt
}

# 1. FSDP on the largest preset, compiled, with async saves.
big fsdp-big fsdp/train.py --compile --async-save --steps $STEPS --save-every $((STEPS / 2))

# 2. The write speeds, on the same preset and disk.
log "save_bench --model $BIG"
mkdir -p $R/bench
timeout 240 python3 tests/save_bench.py --model $BIG --repeats 1 --threads 8 --dir $R/bench \
  --out "$OUT/save_bench.json" || failed+=("save_bench: exit $?")

# 3. Bitwise resume on the GPU: each run killed inside an async save (rank 0, step 20) and restarted by
# torchrun, against one never killed; the save of step 20 never commits, so each resumes from step 10 (the
# memory tier off: with it, each would resume from its snapshot of step 20, not from the disk).
for name in fsdp fsdp-compiled ddp; do
  script=${name%-compiled}/train.py
  flags=(--preset $SMALL --steps 40 --save-every 10 --log-every 40 --async-save --snapshot-every 0)
  fault=crash-in-save=20  # FT_FAULTS (tiers/faults.py), given to the crashed run alone
  [ $name = fsdp-compiled ] && flags+=(--compile) && fault=crash-in-staging=20
  log "$name resume on $SMALL, $fault"
  launch 150 0 $script $R/$name-ref "${flags[@]}"
  verify $R/$name-ref $? 0
  grep -E "^done|Error" $R/$name-ref.log | tail -2
  FT_FAULTS=$fault launch 150 1 $script $R/$name-crash "${flags[@]}"
  verify $R/$name-crash $? 1
  grep -E "injected|resuming|^done|Error" $R/$name-crash.log | tail -4
  grep -q "resuming from step 10" $R/$name-crash.log || failed+=("$name: did not resume from step 10")
  same() { python3 -c "import json,sys; a,b=(json.load(open(f'$R/$name-{n}/summary.json'))['param_digest'] for n in sys.argv[1:]); print('$name', *sys.argv[1:], 'digest equal' if a==b else 'DIGEST DIFFERS')" "$@"; }
  same ref crash
  if ! grep -q "$(python3 -c "import json; print(json.load(open('$R/$name-ref/summary.json'))['param_digest'])")" $R/$name-crash/summary.json; then
    failed+=("$name: the resumed run's digest differs from the uninterrupted one")
    log "$name: a second uninterrupted run, to tell GPU nondeterminism from a resume bug"
    launch 150 0 $script $R/$name-ref2 "${flags[@]}"
    verify $R/$name-ref2 $? 0
    same ref ref2
  fi
done

# 4. DDP on the largest preset (its async save copies on the loop, into pinned memory): one save, at the end.
big ddp-big ddp/train.py --async-save --steps 40 --save-every 40

# 5. --survivors on NCCL (tiers/survivors.py): ddp, the last rank SIGKILLed after step 20, rank 1
# SIGSTOPped after step 40, rank 0 keeping its process; fsdp, rank 0 killed in step 20's save before its
# commit, the others waiting in DCP's collectives. Each survivor hears of it from the store and aborts
# its NCCL groups; each job ends with the digest of one never faulted. NCCL refuses two ranks on one
# GPU: a GPU a process.
# SURVIVORS_ON_CPU=1: the same on the CPU (gloo), which checks this section itself.
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
layouts=(); device=cuda
[ "$gpus" -ge 2 ] && layouts+=("2 0")
[ "$gpus" -ge 5 ] && layouts+=("4 1")
[ -n "${SURVIVORS_ON_CPU:-}" ] && layouts=("2 0" "4 1") && device=cpu
[ ${#layouts[@]} = 0 ] && log "survivors on NCCL: not run: $gpus GPU here, two ranks need two (NCCL refuses two ranks on one device)"
for layout in "${layouts[@]}"; do
  read -r n spares <<< "$layout"
  for case in ddp fsdp; do
  log "survivors on $device, $case: $n ranks, $spares spare"
  timeout 600 python3 - "$R/survivors-$case-$n" "$n" "$spares" "$device" "$SMALL" "$case" <<'PY' || failed+=("survivors, $case, $n ranks on $device")
import json, os, signal, sys
from harness.launch import problems, survivors_job, torchrun
from harness.procs import finish, start
from harness.metrics import Watch, events
run, n, spares, device, preset, case = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *sys.argv[4:]
script = f"{case}/train.py"
flags = ["--preset", preset, "--steps", 80, "--save-every", 40 if case == "ddp" else 20, "--batch-size", 4 * n,
         "--device", device, "--log-every", 80, "--dropout", 0.1]
proc = start(*torchrun(script, n, run + "-ref", flags), log=run + "-ref.log")
code, output, hung = finish(proc, float("inf"))
wrong = problems(run + "-ref", code, output, 0)
cmd, env = survivors_job(script, n, run, flags, spares)
# fsdp: rank 0 dies in step 20's save, before its commit, while the others wait in DCP's collectives
proc = start(cmd, {**env, "FT_FAULTS": "crash-in-save=20,rank=0"} if case == "fsdp" else env, log=run + ".log")
for step, rank, number in ((20, n - 1, signal.SIGKILL), (40, 1, signal.SIGSTOP)) if case == "ddp" else ():
    if Watch(run).first("step", proc, rank=0, min_step=step) is None:
        sys.exit(f"the job ended before step {step}")
    pid = [e["pid"] for e in events(run) if e["event"] == "start" and e["rank"] == rank][-1]
    os.kill(pid, number)
code, output, hung = finish(proc, float("inf"))
wrong += ["hung"] if hung else [f"exit {code}"] if code else ["a Traceback"] if "Traceback" in output else []
ev = events(run)
if case == "ddp":
    starts = [e for e in ev if e["event"] == "start" and e["rank"] == 0]
    wrong += [] if len(starts) == 1 else [f"rank 0 started {len(starts)} times"]
else:
    wrong += [] if "injected crash: rank 0 while saving step 20" in output else ["the fault did not fire"]
    wrong += ["step 20 committed"] if os.path.exists(f"{run}/ckpt/step-00000020/.metadata") else []
for e in (e for e in ev if e["event"] == "recovered"):
    print(f"rank {e['rank']}, generation {e['generation']}: training again {e['recover_s']:.2f} s after it saw the "
          f"loss, from step {e['step']}")
digests = [json.load(open(f"{d}/summary.json"))["param_digest"] for d in (run + "-ref", run)] if not wrong else []
wrong += ["the digest differs from the uninterrupted job's"] if digests and digests[0] != digests[1] else []
print("FAILED: " + "; ".join(wrong) if wrong else f"survivors, {case}, {n} ranks on {device}: digest equal")
sys.exit(1 if wrong else 0)
PY
  done
done
log end
if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "gpu check: every run clean or restarted exactly as its fault asked, every resume bitwise"
