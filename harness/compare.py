"""Measured comparison of DDP and FSDP, each with and without async save, and the parameter server.

    bash run.sh compare 4                  # 28 jobs; about 7.5 minutes on a 2-core CPU machine
    bash run.sh compare 4 --quick          # the main table only, on the tiny model, fewer steps
    bash run.sh compare 4 --format json    # also: markdown, csv; the JSON always lands in results.json
    bash run.sh compare 4 --plot figures   # also loss.png, memory.png and saves.png (needs matplotlib)

Each strategy runs through the real torchrun with the same model, seed, data, steps and world size,
once uninterrupted and once with a crash that torchrun recovers; ddp and fsdp also with the same crash
under --survivors, the dead rank replaced by a new process (forked from the node's warm parent), then
by a spare, the other ranks kept. Every figure is read from what the
scripts wrote (metrics-rank<r>.jsonl, summary.json, the checkpoint folder); none is estimated. The
theoretical model-state figure is printed next to the measured one, labelled as such.
Tables of their own (not with --quick): the memory tier (memory_tier(): ddp and fsdp on the medium
model with a snapshot every step and without, each uninterrupted and crashed, eight jobs), and the
parameter server in sync and async mode, each with and without one trainer 3x slower (straggler(),
four clean jobs).
"""
import csv
import importlib.util
import io
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.checkpoint import checkpoints  # noqa: E402
from common.config import Parser  # noqa: E402
from harness.launch import STRATEGIES, column, problems, survivors_job, torchrun  # noqa: E402
from harness.procs import finish, start  # noqa: E402
from harness.metrics import (events, median_or_none, phases, startup_peaks, step_slowdown_while_saving,  # noqa: E402
                             training_peaks)
from common.model import PRESETS  # noqa: E402

# The columns of the main table, by their command (harness.launch.STRATEGIES): rpc-async has a table of
# its own (straggler()), its weights depending on arrival order.
COLUMNS = {column(s): STRATEGIES[s] for s in ("ddp", "ddp-async", "fsdp", "fsdp-async", "rpc")}


def run_job(name, script, nproc, run_dir, flags, log, restarts=0, timeout_s=900, spares=None, faults=""):
    """Launch one job; returns what it wrote, plus the launch time. A job that does not exit 0 after
    exactly `restarts` torchrun restarts (a clean run printing a Traceback included) is an error:
    its figures would measure another run than the one named. `spares` (a number): a --survivors job
    with that many, which must end after `restarts` generations, no torchrun restart and no Traceback.
    `faults`: its FT_FAULTS (tiers/faults.py; "": none, whatever this process's environment says)."""
    start_time = time.time()
    cmd, env = torchrun(script, nproc, run_dir, flags) if spares is None else survivors_job(script, nproc, run_dir,
                                                                                             flags, spares)
    proc = start(cmd, {**env, "FT_FAULTS": faults}, log=f"{run_dir}.log")
    code, output, hung = finish(proc, start_time + timeout_s)
    log(f"  {name}: {'hung, killed' if hung else f'exit {code}'} in {time.time() - start_time:.0f} s")
    wrong = [f"no end after {timeout_s} s"] if hung else problems(run_dir, code, output, 0 if spares is not None
                                                                  else restarts)
    if not wrong and spares is not None and "Traceback" in output:
        wrong.append("a Traceback")
    if not wrong and spares is not None and json.loads((Path(run_dir) / "summary.json").read_text()).get(
            "generation") != restarts:
        wrong.append(f"not {restarts} generations: a survivor restarted")
    if wrong:
        raise SystemExit(f"compare: {name} failed ({'; '.join(wrong)}):\n{output[-3000:]}")
    return {"launched": start_time, "summary": json.loads((Path(run_dir) / "summary.json").read_text()),
            "events": events(run_dir), "run_dir": Path(run_dir)}


def disk_reference(folder, nbytes, repeats=3):
    """A plain fsync'd sequential write of exactly nbytes in folder, in 1 MiB blocks: what the disk does,
    in bytes/s (the median of `repeats` writes; a small write is mostly the fsync's latency)."""
    path, block = Path(folder) / "disk-reference.bin", bytes(1 << 20)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with open(path, "wb") as f:
            for offset in range(0, nbytes, len(block)):
                f.write(block[:nbytes - offset])
            f.flush()
            os.fsync(f.fileno())
        times.append(time.perf_counter() - start)
        path.unlink()
    return nbytes / statistics.median(times)


def checkpoint_facts(job):
    """Size and file count of the newest committed checkpoint, and save/load timings."""
    _, newest = checkpoints(job["run_dir"] / "ckpt")[0]
    files = [newest] if newest.is_file() else [p for p in newest.rglob("*") if p.is_file()]
    saves = [e for e in job["events"] if e["event"] == "save" and e["rank"] == 0]
    size = sum(p.stat().st_size for p in files)
    total = median_or_none(e["total_s"] for e in saves)
    return {"ckpt_bytes": size, "ckpt_files": len(files), "save_blocking_s": median_or_none(e["blocking_s"] for e in saves),
            "save_staging_s": median_or_none(e.get("staging_s") for e in saves),
            "save_total_s": total, "write_bytes_per_s": size / total if total else None}


def ratios_to_ddp(rows):
    """For each column, its model state per rank and its training peak above baseline (the ranks other
    than 0) over ddp's, when the ddp column was run too: what sharding saves of each."""
    ddp = rows.get("ddp")
    for row in rows.values():
        for key, ratio in (("state_bytes_per_rank", "state_vs_ddp"), ("train_peak_bytes_others", "train_peak_vs_ddp")):
            if ddp and row.get(key) is not None and ddp.get(key):
                row[ratio] = row[key] / ddp[key]


def blocking_vs_sync(rows):
    """For each async column, its median blocking time over the median total time of the same
    strategy's synchronous saves in the same run (when that column was run too)."""
    for strategy, row in rows.items():
        sync = rows.get(strategy.replace(" --async-save", ""))
        if strategy.endswith(" --async-save") and sync and row["save_blocking_s"] is not None and sync["save_total_s"]:
            row["blocking_vs_sync"] = row["save_blocking_s"] / sync["save_total_s"]


def growth(job):
    """The measures of the growth table, from one job that was crashed and resumed."""
    last = {e["rank"]: e for e in job["events"] if e["event"] == "step"}
    loads = [e["load_s"] for e in job["events"] if e["event"] == "load" and e["rank"] == 0]
    return {"params": job["summary"]["params"], "state_bytes_per_rank": max(e.get("state_bytes") or 0 for e in last.values()),
            "load_s": loads[-1] if loads else None, **checkpoint_facts(job)}


def measure(clean, crashed, crash_step, world, strategy):
    steps = [e for e in clean["events"] if e["event"] == "step"]
    params = clean["summary"]["params"]
    last = {}
    for e in steps:
        last[e["rank"]] = e
    sharded = strategy.startswith("fsdp")
    row = {
        "world_size": world,
        "roles": f"1 server + {world - 1} trainers" if strategy == "rpc" else f"{world} data-parallel ranks",
        "params": params,
        "state_bytes_per_rank": max(e.get("state_bytes") or 0 for e in last.values()),
        "state_bytes_theory": 16 * params // (world if sharded else 1),
        "peak_mem_bytes": max(e.get("cuda_peak_bytes") or e.get("rss_peak_bytes") for e in last.values()),
        "median_step_s": median_or_none(e["step_s"] for e in steps if e["rank"] == 0),
        "tokens_per_s": median_or_none(e["tokens_per_s"] for e in steps if e["rank"] == 0),
        "comm_s_per_step": median_or_none(e.get("comm_s") for e in steps if e["rank"] == 0),
        **checkpoint_facts(clean),
        "step_slowdown_while_saving": step_slowdown_while_saving(steps),
        "final_loss": clean["summary"]["final_loss"],
    }
    row["startup_peak_bytes_rank0"], row["startup_peak_bytes_others"] = startup_peaks(clean["events"])
    row["train_peak_bytes_rank0"], row["train_peak_bytes_others"] = training_peaks(clean["events"])
    # Recovery: from the crashed rank's last completed step to the first step after the restart.
    ev = crashed["events"]
    restarted = min(e["time"] for e in ev if e["event"] == "start" and e["restarts"] > 0)
    crash_time = max(e["time"] for e in ev if e["event"] == "step" and e["step"] == crash_step and e["time"] < restarted)
    first_after = min(e["time"] for e in ev if e["event"] == "step" and e["time"] > restarted)
    cold = min(e["time"] for e in steps) - clean["launched"]
    loads = [e["load_s"] for e in ev if e["event"] == "load" and e["rank"] == 0]
    resumed = crashed["summary"]["resumed_from_step"]
    split = phases(ev, crash_time)  # the same recovery, in its phases
    row.update({
        "load_s": loads[-1] if loads else None,
        "recovery_s": first_after - crash_time,
        "recovery_detect_s": split.get("detect_s"),
        "recovery_restart_s": split.get("restart_s"),
        "replay_s": split.get("replay_s"),
        "cold_start_s": cold,
        "recovery_vs_cold_start": (first_after - crash_time) / cold,
        "steps_replayed": crash_step - resumed if resumed is not None else None,
        "resumed_digest_equal": crashed["summary"]["param_digest"] == clean["summary"]["param_digest"],
    })
    return row


def survivors_recovery(clean, crashed, crash_step, cold_start_s):
    """The same crash with --survivors (the dead rank's place taken by a new process forked from the
    warm parent, or by a spare; the others keep theirs): crash (rank 0's crashed step, the first time) to
    rank 0's first step after it."""
    ev = crashed["events"]
    crash_time = min(e["time"] for e in ev if e["event"] == "step" and e["rank"] == 0 and e["step"] == crash_step)
    total = phases(ev, crash_time).get("total_s")
    return {"recovery_s": total, "recovery_vs_cold_start": total / cold_start_s if total else None,
            "digest_equal": crashed["summary"]["param_digest"] == clean["summary"]["param_digest"]}


def main(argv=None):
    p = Parser(prog="bash run.sh compare", description=__doc__.split("\n")[0])
    p.add_argument("nproc", type=int, help="processes (ranks) per job")
    p.add_argument("--quick", action="store_true", help="main table only, tiny model, fewer steps")
    p.add_argument("--sizes", default="tiny,small,medium", help="model sizes of the growth table")
    p.add_argument("--strategies", default=",".join(COLUMNS), help="columns, from: " + ", ".join(COLUMNS))
    p.add_argument("--steps", type=int, default=None, help="steps per job (default 30, quick 12)")
    p.add_argument("--format", choices=["table", "markdown", "json", "csv"], default="table")
    p.add_argument("--out", default="runs/compare", help="folder for the jobs and results.json")
    p.add_argument("--plot", default=None, help="write PNG figures into this folder (needs matplotlib)")
    args = p.parse_args(argv)
    strategies = args.strategies.split(",")
    unknown = [s for s in strategies + args.sizes.split(",") if s not in COLUMNS and s not in PRESETS]
    if args.nproc < 2 or unknown:
        p.error(f"unknown strategy or size: {', '.join(unknown)}" if unknown else "needs at least 2 processes")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install matplotlib (bash run.sh compare installs it into .venv)")
    steps = args.steps or (12 if args.quick else 30)
    save_every, crash_step = steps // 3, steps // 3 + steps // 6 + 1  # the crash replays a few steps
    main_size = "tiny"
    split = math.lcm(args.nproc, args.nproc - 1)  # the global batch splits over all ranks and over rpc's trainers
    batch = split * max(1, round(24 / split))
    sizes = [] if args.quick else [s for s in args.sizes.split(",") if s != main_size]
    out = Path(args.out).resolve()
    started = time.time()

    def log(msg):
        print(f"[{time.time() - started:5.0f} s] {msg}", file=sys.stderr, flush=True)

    def job(strategy, size, crash, spares=None):
        script, extra = COLUMNS[strategy]
        layout = "" if spares is None else f" --survivors --spares {spares}"
        name = f"{strategy}{layout} {size}{' crash' if crash else ''}"
        run_dir = out / f"{run_name(strategy, size, crash)}{layout.replace(' --', '-').replace(' ', '-')}"
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
        flags = ["--steps", steps, "--save-every", save_every, "--batch-size", batch,
                 "--log-every", 1000, "--preset", size, *extra]
        log(f"running {name} ...")
        return run_job(name, script, args.nproc, run_dir, flags, log, restarts=1 if crash else 0, spares=spares,
                       faults=f"crash-at-step={crash_step}" if crash else "")

    results = {"main": {}, "growth": {}}
    for strategy in strategies:
        clean, crashed = job(strategy, main_size, False), job(strategy, main_size, True)
        results["main"][strategy] = measure(clean, crashed, crash_step, args.nproc, strategy)
        results["growth"].setdefault(main_size, {})[strategy] = results["main"][strategy]
        if strategy in ("ddp", "fsdp"):  # the same crash, the survivors kept: a new process, then a spare
            for spares, key in ((0, "survivors_new"), (1, "survivors_spare")):
                crashed = job(strategy, main_size, True, spares)
                row = survivors_recovery(clean, crashed, crash_step, results["main"][strategy]["cold_start_s"])
                results["main"][strategy].update({f"{key}_{k}": v for k, v in row.items()})
            results["main"][strategy]["survivors_digests"] = ", ".join(
                "yes" if results["main"][strategy][f"{key}_digest_equal"] else "NO"
                for key in ("survivors_new", "survivors_spare"))
    for size in sizes:  # one job each, with a crash: its saves and its load on resume are what grow
        for strategy in strategies:
            crashed = job(strategy, size, True)
            results["growth"].setdefault(size, {})[strategy] = growth(crashed)
    if not args.quick:
        results["memory_tier"] = memory_tier(args.nproc, steps, save_every, crash_step, batch, out, log)
    if "rpc" in strategies and not args.quick and args.nproc >= 3:  # a straggler needs another trainer beside it
        results["straggler"] = straggler(args.nproc, 2 * steps, batch, out, log)
    biggest = max(r["ckpt_bytes"] for r in results["main"].values())
    results["disk_reference_bytes_per_s"] = disk_reference(out, biggest)
    for row in results["main"].values():  # against a plain write of the same number of bytes
        row["disk_reference_bytes_per_s"] = disk_reference(out, row["ckpt_bytes"])
        row["write_vs_disk"] = row["write_bytes_per_s"] / row["disk_reference_bytes_per_s"]
    blocking_vs_sync(results["main"])
    ratios_to_ddp(results["main"])
    import torch
    results["meta"] = {
        "command": "bash run.sh compare " + " ".join(argv if argv is not None else sys.argv[1:]),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "world_size": args.nproc, "steps": steps, "save_every": save_every, "crash_at_step": crash_step,
        "main_size": main_size, "sizes": {s: PRESETS[s] for s in results["growth"]}, "elapsed_s": time.time() - started,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    log(f"wrote {out / 'results.json'}")
    print(render(results, args.format))
    if "memory_tier" in results and args.format != "json":
        print("\n" + render_side_table(results["memory_tier"], TIER_ROWS, "memory tier", f"The memory tier (a snapshot "
                                        f"every step, tiers/snapshot.py), model {TIER_SIZE}", args.format))
    if "straggler" in results and args.format != "json":
        print("\n" + render_side_table(results["straggler"], STRAGGLER_ROWS, "straggler", f"The parameter server "
                                        f"with one trainer {STRAGGLER_FACTOR}x slower (--slow-trainer, the last rank), "
                                        f"model {STRAGGLER_SIZE}", args.format))
    if args.plot:
        plot(results, out, Path(args.plot), log)
    if not all(r["resumed_digest_equal"] and "NO" not in r.get("survivors_digests", "") for r in results["main"].values()):
        log("a crashed-and-resumed run did NOT end with the uninterrupted run's digest")
        return 1
    return 0


MAIN_ROWS = [  # (label, key, format)
    ("world size", "world_size", "{}"), ("roles", "roles", "{}"), ("parameters", "params", "{:,}"),
    ("model state / rank (measured)", "state_bytes_per_rank", "mib"),
    ("model state / rank (theory: 16 B/param, / ranks if sharded)", "state_bytes_theory", "mib"),
    ("model state / rank, / ddp's", "state_vs_ddp", "{:.2f}"),
    ("peak memory / rank (RSS or CUDA)", "peak_mem_bytes", "mib"),
    ("median step time", "median_step_s", "ms"), ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("all-reduce time / step", "comm_s_per_step", "ms"),
    ("checkpoint size on disk", "ckpt_bytes", "mib"), ("checkpoint files", "ckpt_files", "{}"),
    ("save: blocking (loop waits)", "save_blocking_s", "ms"), ("save: staging (copy to CPU)", "save_staging_s", "ms"),
    ("save: total", "save_total_s", "ms"),
    ("save: blocking / total of the same strategy's sync save", "blocking_vs_sync", "{:.2f}"),
    ("save: write throughput", "write_bytes_per_s", "mibs"),
    ("save: throughput / plain fsync'd write of the same bytes", "write_vs_disk", "{:.2f}"),
    ("step time while a save is in flight / otherwise", "step_slowdown_while_saving", "{:.2f}"),
    ("start-up peak memory above baseline: rank 0", "startup_peak_bytes_rank0", "mib"),
    ("start-up peak memory above baseline: other ranks (max)", "startup_peak_bytes_others", "mib"),
    ("training peak memory above baseline: rank 0", "train_peak_bytes_rank0", "mib"),
    ("training peak memory above baseline: other ranks (max)", "train_peak_bytes_others", "mib"),
    ("training peak above baseline, other ranks, / ddp's", "train_peak_vs_ddp", "{:.2f}"),
    ("load on resume", "load_s", "ms"), ("recovery: crash to first step after restart", "recovery_s", "s"),
    ("recovery: crash to the new workers' launch", "recovery_detect_s", "s"),
    ("recovery: process start (imports, group, model)", "recovery_restart_s", "s"),
    ("recovery: replaying the lost steps", "replay_s", "s"), ("cold start: launch to first step", "cold_start_s", "s"),
    ("recovery / cold start", "recovery_vs_cold_start", "{:.2f}"), ("steps replayed", "steps_replayed", "{}"),
    ("recovery, --survivors: a new process (forked)", "survivors_new_recovery_s", "s"),
    ("recovery, --survivors: a new process, / cold start", "survivors_new_recovery_vs_cold_start", "{:.2f}"),
    ("recovery, --survivors --spares 1", "survivors_spare_recovery_s", "s"),
    ("recovery, --survivors --spares 1, / cold start", "survivors_spare_recovery_vs_cold_start", "{:.2f}"),
    ("--survivors: digests == uninterrupted (new process, spare)", "survivors_digests", "{}"),
    ("resumed digest == uninterrupted", "resumed_digest_equal", "yesno"), ("final loss", "final_loss", "{:.4f}"),
]
GROWTH_ROWS = ["params", "ckpt_bytes", "save_blocking_s", "save_total_s", "load_s", "state_bytes_per_rank"]


def fmt(value, how):
    if value is None:
        return "n/a"
    units = {"mib": lambda v: f"{v / 2**20:.2f} MiB", "ms": lambda v: f"{v * 1000:.1f} ms",
             "s": lambda v: f"{v:.1f} s", "mibs": lambda v: f"{v / 2**20:.0f} MiB/s",
             "yesno": lambda v: "yes" if v else "NO"}
    return units[how](value) if how in units else how.format(value)


def render(results, form):
    if form == "json":
        return json.dumps(results, indent=2)
    cols = list(results["main"])
    main = [[label] + [fmt(results["main"][c].get(key), how) for c in cols] for label, key, how in MAIN_ROWS]
    hows = {key: how for _, key, how in MAIN_ROWS}
    growth = [[size, key] + [fmt(results["growth"][size][c].get(key), hows[key]) for c in cols]
              for size in results["growth"] for key in GROWTH_ROWS]
    if form == "csv":
        buf = io.StringIO()
        w = csv.writer(buf)
        w.writerow(["table", "measure"] + cols)
        w.writerows([["main"] + r for r in main] + [["growth", f"{r[0]} {r[1]}"] + r[2:] for r in growth])
        return buf.getvalue()
    style = "github" if form == "markdown" else "simple"
    meta = results["meta"]
    head = (f"{meta['world_size']} ranks, {meta['device']}, torch {meta['torch']}, {meta['steps']} steps, "
            f"save every {meta['save_every']}, crash after step {meta['crash_at_step']}, model {meta['main_size']}; "
            f"plain fsync'd write: {results['disk_reference_bytes_per_s'] / 2**20:.0f} MiB/s")
    text = head + "\n\n" + tabulate(main, headers=["measure"] + cols, tablefmt=style)
    if len(results["growth"]) > 1:
        text += "\n\n" + tabulate(growth, headers=["size", "measure"] + cols, tablefmt=style)
    return text


TIER_SIZE = "medium"  # a model whose copy is more than noise next to a step
TIER_ROWS = [  # (label, key, format)
    ("median step time", "median_step_s", "ms"), ("step time / the same without the tier", "vs_no_tier", "{:.2f}"),
    ("loop blocked per snapshot (median)", "snapshot_blocked_s", "ms"),
    ("snapshot: one slot of the copy (ddp: the node's, fsdp: a rank's shards)", "snapshot_bytes", "mib"),
    ("load on resume", "load_s", "ms"), ("loaded from", "load_source", "{}"),
    ("recovery: crash to first step after restart", "recovery_s", "s"), ("steps replayed", "steps_replayed", "{}"),
    ("resumed digest == uninterrupted", "resumed_digest_equal", "yesno"),
]


def memory_tier(nproc, steps, save_every, crash_step, batch, out, log):
    """ddp and fsdp on TIER_SIZE with a snapshot every step (the default) and with --snapshot-every 0, each
    uninterrupted and with a crash (crash-at-step): what the memory tier costs a step, and what it saves a crash."""
    rows = {}
    for strategy in ("ddp", "fsdp"):
        script, _ = COLUMNS[strategy]
        for every in (1, 0):
            name = f"{strategy}{'' if every else ', tier off'}"
            jobs = {}
            for crash in (False, True):
                run_dir = out / f"tier-{strategy}-{every}{'-crash' if crash else ''}"
                subprocess.run(["rm", "-rf", str(run_dir)], check=True)
                flags = ["--steps", steps, "--save-every", save_every, "--batch-size", batch, "--log-every", 1000,
                         "--preset", TIER_SIZE, "--snapshot-every", every]
                log(f"running {name}{' crash' if crash else ''} ...")
                jobs[crash] = run_job(name, script, nproc, run_dir, flags, log, restarts=1 if crash else 0,
                                      faults=f"crash-at-step={crash_step}" if crash else "")
            steps_0 = [e for e in jobs[False]["events"] if e["event"] == "step" and e["rank"] == 0]
            loads = [e for e in jobs[True]["events"] if e["event"] == "load" and e["rank"] == 0]
            ev = jobs[True]["events"]
            restarted = min(e["time"] for e in ev if e["event"] == "start" and e["restarts"] > 0)
            crashed_at = max(e["time"] for e in ev if e["event"] == "step" and e["step"] == crash_step
                             and e["time"] < restarted)
            resumed = jobs[True]["summary"]["resumed_from_step"]
            rows[name] = {
                "median_step_s": median_or_none(e["step_s"] for e in steps_0),
                "snapshot_blocked_s": median_or_none(e.get("snapshot_s") for e in steps_0) if every else None,
                "snapshot_bytes": jobs[False]["summary"].get("snapshot_bytes"),
                "load_s": loads[-1]["load_s"] if loads else None,
                "load_source": loads[-1].get("source") if loads else None,
                "recovery_s": phases(ev, crashed_at).get("total_s"),
                "steps_replayed": crash_step - resumed if resumed is not None else None,
                "resumed_digest_equal": jobs[True]["summary"]["param_digest"] == jobs[False]["summary"]["param_digest"],
            }
        rows[strategy]["vs_no_tier"] = rows[strategy]["median_step_s"] / rows[f"{strategy}, tier off"]["median_step_s"]
    return rows


def render_side_table(rows, specs, name, head, form):
    """One of the tables beside the main one (memory tier, straggler): `specs` its (label, key, format) rows."""
    cols = list(rows)
    table = [[label] + [fmt(rows[c].get(key), how) for c in cols] for label, key, how in specs]
    if form == "csv":
        buf = io.StringIO()
        csv.writer(buf).writerows([["table", "measure"] + cols] + [[name] + r for r in table])
        return buf.getvalue()
    return head + "\n\n" + tabulate(table, headers=["measure"] + cols,
                                      tablefmt="github" if form == "markdown" else "simple", disable_numparse=True)


STRAGGLER_SIZE, STRAGGLER_FACTOR = "small", 3  # a model whose compute, not RPC, takes most of a trainer's step
STRAGGLER_ROWS = [  # (label, key, format)
    ("updates/s", "updates_per_s", "{:.2f}"), ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ("updates/s with the straggler / without", "vs_no_straggler", "{:.2f}"),
    ("steps done: straggler / fastest other trainer", "straggler_steps_ratio", "{:.2f}"),
    ("mean staleness of the applied gradients (updates)", "mean_staleness", "{:.2f}"),
    ("stale gradients dropped", "stale_dropped", "{}"),
    ("loss, mean of the last 5 updates (same tokens in every run)", "final_loss", "{:.4f}"),
]


def straggler(nproc, steps, batch, out, log):
    """The parameter server in sync and async mode, each without and with one trainer (the last rank)
    STRAGGLER_FACTOR times slower: four clean jobs of the same updates, model and batch. Rates are rank
    0's, over the updates after the first fifth (start-up); staleness is the server version at apply
    less the version a gradient was computed on."""
    rows = {}
    for mode in ("sync", "async"):
        for slow in (False, True):
            name = f"rpc {mode}{' + straggler' if slow else ''}"
            run_dir = out / f"rpc-{mode}{'-straggler' if slow else ''}"
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            flags = ["--steps", steps, "--save-every", steps, "--batch-size", batch, "--log-every", 1000,
                     "--preset", STRAGGLER_SIZE, "--mode", mode]
            flags += ["--slow-trainer", nproc - 1, "--slow-factor", STRAGGLER_FACTOR] if slow else []
            log(f"running {name} ...")
            ev = run_job(name, "rpc/ps.py", nproc, run_dir, flags, log)["events"]
            updates = [e for e in ev if e["event"] == "step" and e["rank"] == 0]
            timed = updates[len(updates) // 5:]
            seconds = timed[-1]["time"] - timed[0]["time"]
            done = {r: sum(e["event"] == "step" and e["rank"] == r for e in ev) for r in range(1, nproc)}
            rows[name] = {
                "updates_per_s": (len(timed) - 1) / seconds,
                "tokens_per_s": sum(e["tokens_per_s"] * e["step_s"] for e in timed[1:]) / seconds,
                "straggler_steps_ratio": done[nproc - 1] / max(v for r, v in done.items() if r != nproc - 1),
                "mean_staleness": statistics.mean(e["step"] - 1 - v for e in updates for _, _, v in e["applied"]),
                "stale_dropped": sum(e["event"] == "stale_dropped" for e in ev),
                "final_loss": statistics.mean(e["loss"] for e in updates[-5:]),
            }
            if slow:
                rows[name]["vs_no_straggler"] = rows[name]["updates_per_s"] / rows[f"rpc {mode}"]["updates_per_s"]
    return rows


def run_name(strategy, size, crash):
    """The folder of one job under --out, e.g. fsdp-async-save-tiny-crash."""
    return f"{strategy.replace(' --', '-')}-{size}{'-crash' if crash else ''}"


def plot(results, out, folder, log):
    """Three figures from the jobs' own metrics: loss.png (per strategy, the uninterrupted and the crashed
    run's loss, the crash and the step resumed from marked), memory.png (per strategy, each rank's peak
    memory and its model state over the steps of the uninterrupted run), saves.png (save blocking and
    total time against model size)."""
    import matplotlib
    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt
    folder.mkdir(parents=True, exist_ok=True)
    meta, strategies = results["meta"], list(results["main"])

    def per_strategy(title):
        fig, axes = plt.subplots(1, len(strategies), figsize=(4 * len(strategies), 3.2), squeeze=False, sharey=True)
        fig.suptitle(title, fontsize=10)
        return fig, axes[0]

    fig, axes = per_strategy(f"loss, {meta['world_size']} ranks, model {meta['main_size']}")
    for ax, strategy in zip(axes, strategies):
        for crash, style, label in ((False, "-", "uninterrupted"), (True, ".", "crashed and resumed")):
            steps = [e for e in events(out / run_name(strategy, meta["main_size"], crash))
                     if e["event"] == "step" and e["rank"] == 0]
            ax.plot([e["step"] for e in steps], [e["loss"] for e in steps], style, label=label)
        ax.axvline(meta["crash_at_step"], color="red", lw=0.8, label="crash")
        replayed = results["main"][strategy]["steps_replayed"] or 0
        ax.axvline(meta["crash_at_step"] - replayed, color="green", lw=0.8, label="resumed from")
        ax.set(title=strategy, xlabel="step")
    axes[0].set(ylabel="loss")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "loss.png")

    fig, axes = plt.subplots(2, len(strategies), figsize=(4 * len(strategies), 5.5), squeeze=False, sharey="row")
    fig.suptitle("memory per rank over the uninterrupted run", fontsize=10)
    for col, strategy in enumerate(strategies):
        steps = [e for e in events(out / run_name(strategy, meta["main_size"], False)) if e["event"] == "step"]
        for rank in sorted({e["rank"] for e in steps}):
            mine = [e for e in steps if e["rank"] == rank]
            x = [e["step"] for e in mine]
            axes[0][col].plot(x, [(e.get("cuda_peak_bytes") or e.get("rss_peak_bytes") or 0) / 2**20 for e in mine],
                                 label=f"rank {rank}")
            axes[1][col].plot(x, [(e.get("state_bytes") or 0) / 2**20 for e in mine], label=f"rank {rank}")
        axes[0][col].set(title=strategy)
        axes[1][col].set(xlabel="step")
    for ax in axes.flat:
        ax.set_ylim(0, 1.1 * ax.get_ylim()[1])  # after every line is drawn: the rows share their scale
    axes[0][0].set(ylabel="peak MiB (CUDA or RSS)")
    axes[1][0].set(ylabel="model state MiB")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "memory.png")

    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    sizes = list(results["growth"])
    for strategy in strategies:
        params = [results["growth"][s][strategy]["params"] for s in sizes]
        line, = ax.plot(params, [results["growth"][s][strategy]["save_blocking_s"] * 1000 for s in sizes], "o-",
                        label=f"{strategy}: loop blocked")
        ax.plot(params, [results["growth"][s][strategy]["save_total_s"] * 1000 for s in sizes], "x--",
                color=line.get_color(), label=f"{strategy}: save total")
    ax.set(xscale="log", xlabel="parameters", ylabel="ms per save", title=f"saves, {meta['world_size']} ranks")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "saves.png")
    log(f"wrote {folder / 'loss.png'}, {folder / 'memory.png'} and {folder / 'saves.png'}")


if __name__ == "__main__":
    raise SystemExit(main())
