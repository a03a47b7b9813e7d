"""Chaos soak: seeded faults fired at chosen training steps, each job checked against its reference.

    bash run.sh chaos                               # every fault kind once (a few minutes on 2 cores)
    bash run.sh chaos --trials 40 --seed 7          # a long one; the seed reproduces every trial
    bash run.sh chaos --strategies fsdp --trials 10
    bash run.sh chaos --plan sigstop:ddp,async-in-flight:fsdp-async --ranks 1   # these trials, smallest jobs
    bash run.sh chaos --plan node-lost:fsdp,preempt:ddp --ranks 2   # two nodes of 2 ranks, one lost; a preemption
    bash run.sh chaos --nodes --ranks 1             # root: the --nodes kinds once each, on real nodes

This file draws the plan, runs the soak and prints its tables. The fault kinds and how each fires are
in chaos_faults.py, those on real nodes in chaos_nodes.py, one trial and its verdict in chaos_judge.py.

Faults (chaos_faults.FAULTS, one FaultKind each), each at a step drawn at random, never at a moment in
time, so that it always lands in training however fast the machine is: SIGKILL, SIGTERM (a preempted
worker) or SIGSTOP (a hung one: its peers' collectives time out, torchrun stops the job and restarts it)
sent to a random worker a random fraction of a step after the job completed that step; a crash injected
from inside (the job's FT_FAULTS, tiers/faults.py) after a step on a random rank (crash-at-step), while
a save is written (crash-in-save) or halfway through a memory snapshot (crash-in-snapshot); two faults
in one job (a crash, then a SIGKILL at a step drawn from those left after the resume); the newest
checkpoint damaged between two launches (damage-newest), or unreadable only until the relaunch has
chosen where to resume (transient-read); a crash while an async save is in flight; a node lost whole
(node-lost: an elastic job, --nnodes 1:2, of two torchrun agents with --ranks workers each; one agent
and its workers SIGKILLed, the other goes on alone); a preemption (preempt: SIGTERM to the torchrun
agent, which passes it on; the workers save the step in progress and exit, and the job is launched
again); the run folder lost (disk-lost: --archive to a local S3 server, harness/s3server.py; a first
launch killed whole once a checkpoint is archived, its folder deleted: the job resumes from the
archive). The first trials take every kind once, then kinds are drawn at random. The --survivors
strategies (ddp-survivors with a spare, fsdp-survivors with a cold replacement) take the faults that
kill or freeze a process: sigkill, sigstop, crash-at-step, crash-in-save, crash-in-snapshot; and their
own: two-at-once (two ranks SIGKILLed together, of 3), spare-killed (the spare SIGKILLed, then a rank),
replacement-killed (a rank SIGKILLed, then the process that takes its place, as it joins), node-lost
(two nodes of --ranks each, node 1 lost whole: node 0's spare takes its ranks; those left to no spare
wait for a new node 1, started with an empty memory; the job keeps its size). Their trials also fail if
a survivor's process started again. With --nodes, the kinds on real nodes (harness/nodes.py,
chaos_nodes.py): a node killed whole, cut off shorter and longer than --hang-timeout-s, node 0 (rank 0
and the job's store) cut off, a lossy link, two nodes lost one after the other; for torchrun (c10d) and
--survivors; and, --survivors with the control plane in etcd on three nodes (a member each), node 0 killed
whole, node 0 cut off, and etcd's leader killed (etcd-node0-killed, etcd-node0-cut, etcd-leader-killed).

A trial passes when its fault fired, the job ended within its time bound after exactly the restarts its
fault causes, loaded no damaged checkpoint, kept the bytes of a checkpoint that was unreadable for a
while, and ended with the reference digest. After a node's loss the reference is the uninterrupted job's
checkpoint of the step the survivor resumed from, resumed at the survivor's size; a preempted job must
resume from the step it saved. rpc-async (the parameter server in async mode, whose weights depend on
arrival order) is checked by its guarantees instead of a digest (chaos_judge.async_problems); a trainer
stopped there is not waited for: the job ends without it, its server kills it, and the job exits 0
(torchrun's restart that follows trains nothing). Exit code 1 if any trial failed.

Recovery time, per trial and as medians per kind (harness.metrics.phases): from the fault to the
first step trained after it, split into the wait until the new workers are launched (detection,
stopping, rendezvous; for a preemption also the save and the relaunch), their start (imports,
process group, model), the checkpoint load, the first step, and the steps trained again. The same
split of each reference's cold start (launch to first step) gives the ratio of the two.
"""
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tabulate import tabulate

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common.config import Parser  # noqa: E402
from harness.chaos_faults import BATCH, processes, reference  # noqa: E402
from harness.chaos_judge import run_trial  # noqa: E402
from harness.chaos_nodes import FAULTS  # noqa: E402  (every kind: chaos_faults' table, the --nodes kinds appended)
from harness.launch import STRATEGIES  # noqa: E402
from harness.nodes import can_make_nodes  # noqa: E402
from harness.s3server import S3Server  # noqa: E402

MARK = ".chaos-out"  # in --out: the folder is this runner's to empty, not the user's
KINDS = [name for name, kind in FAULTS.items() if not kind.real_nodes]
NODE_KINDS = [name for name, kind in FAULTS.items() if kind.real_nodes]


def drawn_plan(kinds, strategies, rng):
    """(strategy, kind) per trial, without end: first every kind once, in a seeded order, each on the
    applicable strategy with the fewest trials so far; then drawn at random. A trial's draw never
    depends on how many trials follow it."""
    pairs = [(k, [s for s in strategies if s in FAULTS[k].strategies]) for k in kinds]
    pairs = [(k, ss) for k, ss in pairs if ss]
    used = {s: 0 for s in strategies}
    for kind, choices in rng.sample(pairs, len(pairs)):
        strategy = min(choices, key=lambda s: (used[s], rng.random()))
        used[strategy] += 1
        yield strategy, kind
    usable = [s for s in strategies if any(s in ss for _, ss in pairs)]  # (rpc has no kind on real nodes)
    while True:
        strategy = rng.choice(usable)
        yield strategy, rng.choice([k for k, ss in pairs if strategy in ss])


def median_text(values, unit=" s", digits=1):
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):.{digits}f}{unit}" if values else "n/a"


def table(results, kinds):
    rows = []
    for kind in kinds:
        rs = [r for r in results if r.kind == kind]
        if rs:
            rows.append([kind, len(rs), sum(r.fired for r in rs), sum(r.recovered for r in rs),
                         sum(r.expected_restarts in (None, r.restarts) for r in rs),
                         sum(r.digest_equal or bool(r.async_ok) for r in rs),
                         sum(r.bad_loads for r in rs), sum(r.hung for r in rs), median_text(r.recovery_s for r in rs)])
    return tabulate(rows, headers=["fault", "jobs", "fired", "recovered", "restarts (survivors: generations) as expected",
                                   "digest == reference (rpc-async: its guarantees)",
                                   "damaged loaded", "hangs", "median recovery"])


PHASES = ["detect_s", "restart_s", "load_s", "first_step_s", "replay_s"]


def recovery_table(results, kinds, references):
    """Medians per fault kind of the recovery's phases (harness.metrics.phases), then each reference's
    cold start in the same phases: what a failure costs against a launch."""
    rows = []
    for kind in kinds:
        rs = [r for r in results if r.kind == kind and r.recovery_s is not None]
        if rs:
            rows.append([kind, len(rs), median_text(r.recovery_s for r in rs),
                         *(median_text(getattr(r, key) for r in rs) for key in PHASES),
                         median_text((r.replayed_steps for r in rs), unit="", digits=0),
                         median_text((r.vs_cold_start for r in rs), unit="", digits=2)])
    for (strategy, nproc), ref in references.items():
        rows.append([f"cold start: {strategy}, {nproc} processes", 1, median_text([ref.cold.get("total_s")]),
                     *(median_text([ref.cold.get(key)]) for key in PHASES), "", ""])
    return tabulate(rows, headers=["fault", "jobs", "recovery", "to workers' launch", "process start", "load",
                                   "first step", "replay", "steps replayed", "/ cold start"])


def soak(planned, args, out, log):
    """The references the trials of `planned` need, then the trials: (references, results)."""
    needed = sorted({(s, processes(s, FAULTS[k], args.ranks)) for s, k in planned})
    log(f"references: {', '.join(f'{s} ({n} processes)' for s, n in needed)} ...")
    with ThreadPoolExecutor(args.jobs) as pool:
        references = dict(zip(needed, pool.map(lambda sn: reference(*sn, out), needed)))

        def run_logged(t):
            strategy, kind = planned[t]
            log(f"trial {t}: {strategy}, {kind} ...")
            r = run_trial(t, strategy, FAULTS[kind], random.Random(f"{args.seed}:{t}"), out,
                          references[strategy, processes(strategy, FAULTS[kind], args.ranks)], args.ranks)
            log(f"trial {t}: {strategy}, {kind}: {'ok' if r.passed else 'FAILED'} (fired {r.fired} at step "
                f"{r.fault_step}, exit {r.exit}, restarts {r.restarts}, recovery "
                f"{r.recovery_s and round(r.recovery_s, 1)} s)")
            return r

        return references, list(pool.map(run_logged, range(len(planned))))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    p = Parser(prog="bash run.sh chaos", description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=None, help="jobs with faults; the first ones take every kind once "
                                                             "(default: that many)")
    p.add_argument("--seed", type=int, default=0, help="reproduces the series of trials")
    p.add_argument("--strategies", default=",".join(STRATEGIES), help="from: " + ", ".join(STRATEGIES))
    p.add_argument("--kinds", default="", help="fault kinds, from: " + ", ".join(KINDS + NODE_KINDS))
    p.add_argument("--nodes", action="store_true", help="the kinds on real nodes (root): " + ", ".join(NODE_KINDS))
    p.add_argument("--plan", default="", help="KIND:STRATEGY,...: exactly these trials, instead of --trials drawn ones")
    p.add_argument("--ranks", type=int, default=2, help="processes of a data-parallel job (sigstop: at least 2; "
                                                        "rpc: a server and at least 2 trainers)")
    p.add_argument("--jobs", type=int, default=1, help="trials run at once (a sigstop trial mostly waits)")
    p.add_argument("--out", default="runs/chaos", help="folder for the jobs and results.json")
    args = p.parse_args(argv)
    os.environ.pop("FT_FAULTS", None)  # a trial's faults are its own (faulted()), none from the caller's shell
    strategies = args.strategies.split(",")
    kinds = args.kinds.split(",") if args.kinds else NODE_KINDS if args.nodes else KINDS
    args.trials = len(kinds) if args.trials is None else args.trials
    planned = [tuple(reversed(e.split(":", 1))) for e in args.plan.split(",")] if args.plan else []
    bad = [s for s in strategies + [s for s, _ in planned] if s not in STRATEGIES]
    bad += [k for k in kinds + [k for _, k in planned] if k not in FAULTS]
    bad += [f"{k}:{s}" for s, k in planned if s in STRATEGIES and k in FAULTS and s not in FAULTS[k].strategies]
    if not bad and not planned and not any(s in FAULTS[k].strategies for s in strategies for k in kinds):
        bad = [f"the kinds {', '.join(kinds)} on {', '.join(strategies)}"]
    if bad:
        p.error(f"unknown or inapplicable: {', '.join(bad)}")
    if args.trials < 1 or args.jobs < 1 or args.ranks < 1 or BATCH % args.ranks:
        p.error(f"--trials and --jobs must be >= 1, --ranks must divide the batch of {BATCH}")
    real = [k for _, k in planned] if planned else kinds
    if any(FAULTS[k].real_nodes for k in real) and can_make_nodes():
        p.error(f"{', '.join(k for k in real if FAULTS[k].real_nodes)}: {can_make_nodes()}")
    if not planned:
        drawn = drawn_plan(kinds, strategies, random.Random(args.seed))
        planned = [next(drawn) for _ in range(args.trials)]
    for kind in (FAULTS[k] for k in sorted({k for _, k in planned}) if FAULTS[k].nodes > 1):  # --ranks a node, each size
        if any(BATCH % (n * args.ranks) for n in range(1, kind.nodes + 1)):
            p.error(f"{kind.name} runs {kind.nodes} nodes of --ranks processes: they must divide the batch of {BATCH}")
    out, started = Path(args.out).resolve(), time.time()
    if out.is_dir() and any(out.iterdir()) and not (out / MARK).exists():
        p.error(f"--out {args.out} holds files that chaos did not write: name a new or empty folder")
    subprocess.run(["rm", "-rf", str(out)], check=True)  # the previous soak's, as its mark says
    out.mkdir(parents=True)
    (out / MARK).write_text("written by bash run.sh chaos, which empties this folder when it runs again\n")

    def log(msg):
        print(f"[{time.time() - started:5.0f} s] {msg}", file=sys.stderr, flush=True)

    store = S3Server(out / "s3") if any(k == "disk-lost" for _, k in planned) else None
    if store:  # --archive's store: a local S3 server, its variables for the jobs
        store.start()
        os.environ.update(store.env)
    try:
        references, results = soak(planned, args, out, log)
    finally:
        if store:
            store.stop()
    (out / "results.json").write_text(json.dumps({
        "seed": args.seed, "argv": argv, "trials": [dataclasses.asdict(r) for r in results],
        "references": [{"strategy": s, "processes": n, **dataclasses.asdict(ref)} for (s, n), ref in references.items()],
    }, indent=2) + "\n")
    print(f"chaos: {len(results)} trials, seed {args.seed}, {time.time() - started:.0f} s")
    print(table(results, list(FAULTS)))
    print(f"\nRecovery, median seconds from the fault (the phases: harness.metrics.phases)\n"
          f"{recovery_table(results, list(FAULTS), references)}")
    failed = [r for r in results if not r.passed]
    for r in failed:
        print(f"\nFAILED trial {r.trial} ({r.strategy}, {r.kind}): fired {r.fired}, {'; '.join(r.problems) or 'no problem'}"
              f", digest {'==' if r.digest_equal else '!='} reference, damaged loaded {r.bad_loads}, kept {r.kept}."
              f"\nReproduce: bash run.sh chaos {' '.join(argv)} (trial {r.trial}); its last command:\n{r.command}\n"
              f"{r.output_tail}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
