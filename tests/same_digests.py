"""A refactor changes no weights: each case trains in a commit and in this working tree, in one run on
this machine (a digest is comparable only on one machine), and their summary.json digests must match.

    .venv/bin/python tests/same_digests.py 6b91d5b                   # every case, about 4 minutes on 2 cores
    .venv/bin/python tests/same_digests.py HEAD~3 ddp-crash fsdp-survivors-3

The commit is checked out in a temporary `git worktree`, removed at the end. Each case runs through
`bash run.sh`, as a user would: ddp, fsdp and rpc, plain, crashed with and without the memory tier,
crashed in an async save, and under --survivors at 3 ranks with a rank killed. Every fault must fire,
every job restart as many times as its fault asks (torchrun's restarts hide a crash behind the right
digest), and a crashed job must also end with the digest of its uncrashed case. A commit from before FT_FAULTS
(tiers/faults.py) gets its faults as the fault flags the scripts had then. Exit 1 if anything differs.
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from harness.launch import problems  # noqa: E402  (restarts as expected, no Traceback in a clean run)

SMALL = ["--steps", "16", "--save-every", "4", "--dim", "32", "--layers", "2", "--heads", "2", "--seq-len", "16",
         "--batch-size", "12", "--log-every", "100"]
DROPOUT = ["--dropout", "0.1"]  # a resume is then bitwise only if each rank's RNG is restored
NO_MEMORY = ["--snapshot-every", "0"]
SURVIVORS = ["--survivors", "--spares", "1"]
CASES = {  # name: (script, processes, flags, FT_FAULTS, the uncrashed case it must end like)
    "ddp": ("ddp", 2, SMALL + DROPOUT, "", None),
    "ddp-crash": ("ddp", 2, SMALL + DROPOUT, "crash-at-step=9", "ddp"),
    "ddp-crash-disk": ("ddp", 2, SMALL + DROPOUT + NO_MEMORY, "crash-at-step=9", "ddp"),
    "ddp-async-crash-in-save": ("ddp", 2, SMALL + DROPOUT + NO_MEMORY + ["--async-save"], "crash-in-save=12", "ddp"),
    "ddp-survivors-3": ("ddp", 3, SMALL + DROPOUT + SURVIVORS, "crash-at-step=9,rank=1", None),
    "fsdp": ("fsdp", 2, SMALL + DROPOUT, "", None),
    "fsdp-crash": ("fsdp", 2, SMALL + DROPOUT, "crash-at-step=9", "fsdp"),
    "fsdp-crash-disk": ("fsdp", 2, SMALL + DROPOUT + NO_MEMORY, "crash-at-step=9", "fsdp"),
    "fsdp-async-crash-in-save": ("fsdp", 2, SMALL + DROPOUT + NO_MEMORY + ["--async-save"], "crash-in-save=12",
                                 "fsdp"),
    "fsdp-survivors-3": ("fsdp", 3, SMALL + DROPOUT + SURVIVORS, "crash-at-step=9,rank=1", None),
    "rpc": ("rpc", 3, SMALL, "", None),
    "rpc-crash-in-save": ("rpc", 3, SMALL, "crash-in-save=8", "rpc"),
}


def as_flags(faults):
    """FT_FAULTS's `kind=N,rank=R` as the scripts' fault flags before it."""
    pairs = [item.split("=") for item in faults.split(",") if item]
    return [word for kind, n in pairs for word in ("--crash-rank" if kind == "rank" else f"--{kind}", n)]


def run(tree, case, out):
    """(digest or None, what to say of the run) of `case` trained in `tree`, its run folder under `out`."""
    script, processes, flags, faults, _ = CASES[case]
    env = {k: v for k, v in os.environ.items() if k != "FT_FAULTS"}
    if faults and "FT_FAULTS" in (tree / "tiers" / "faults.py").read_text():
        env["FT_FAULTS"] = faults
    elif faults:
        flags = flags + as_flags(faults)
    run_dir = out / case
    proc = subprocess.run(["bash", "run.sh", script, str(processes), "--run-dir", str(run_dir), *flags], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=600)
    (out / f"{case}.log").write_text(proc.stdout + proc.stderr)
    restarts = 1 if faults and "--survivors" not in flags else 0  # survivors replace a process, not the job
    wrong = problems(run_dir, proc.returncode, proc.stdout + proc.stderr, restarts)
    if wrong:
        return None, f"{'; '.join(wrong)} (see {out / case}.log)"
    if faults and "injected crash" not in proc.stderr:
        return None, f"its fault did not fire (see {out / case}.log)"
    return json.loads((run_dir / "summary.json").read_text())["param_digest"], ""


def main(rev, cases):
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        sys.exit(f"same_digests.py: no case {', '.join(unknown)}: choose from {', '.join(CASES)}")
    out = Path(tempfile.mkdtemp(prefix="same-digests-"))
    old = out / "old"
    added = subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(old), rev], cwd=REPO,
                           capture_output=True, text=True)
    if added.returncode != 0:
        sys.exit(f"same_digests.py: cannot check out {rev}: {added.stderr.strip().splitlines()[-1]}")
    if (REPO / ".venv").exists():
        (old / ".venv").symlink_to(REPO / ".venv")  # run.sh would make another
    (out / "a").mkdir()
    (out / "b").mkdir()
    different, digests = 0, {}
    try:
        for case in cases or CASES:
            (a, why_a), (b, why_b) = run(old, case, out / "a"), run(REPO, case, out / "b")
            digests[case] = b
            like = CASES[case][4]
            ok = a is not None and a == b and (like not in digests or digests[like] == b)
            different += not ok
            print(f"{case:26s} {'same' if ok else 'DIFFERENT'}  {rev}: {a or why_a}  here: {b or why_b}", flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=REPO)
    print(f"{len(cases or CASES) - different} same, {different} different; the jobs' logs in {out}")
    return different


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
        sys.exit(__doc__.split("\n\n")[1])
    sys.exit(1 if main(sys.argv[1], sys.argv[2:]) else 0)
