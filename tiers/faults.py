"""Fault injection for the tests and the chaos soak, in one place: a tier of its own, asked for by one
environment variable, so that no script's --help or Config carries a test-only flag.

    FT_FAULTS=crash-at-step=25 bash run.sh ddp 2 --steps 40 --save-every 10   # the last rank dies after step 25
    FT_FAULTS=crash-in-snapshot=12,rank=0 bash run.sh fsdp 2 --steps 40   # rank 0 dies copying step 12's snapshot

FT_FAULTS is comma-separated `kind=N` pairs, N the step (> 0) at which that fault fires, each kind at
most once, and `rank=R`, the rank they hit (-1, the default: the last rank). The kinds, and which
script has a hook for each (KINDS), are the hooks of Faults below. Like any environment variable it
passes through torchrun, run.sh and the survivors' supervisor to every worker; a harness gives it to
the faulted job alone, never to the reference run it compares with.

Each script's check() refuses a bad FT_FAULTS in one line before any worker starts (fault_problems);
its workers make a Faults only when FT_FAULTS is set (ddp and fsdp in open_tiers, rpc in main), and
call its hooks where `faults` is not None; the checkpointer and the memory tier are handed the hooks
that fire inside them. To copy a script without faults, delete this module and the script's two
`if os.environ.get("FT_FAULTS")` blocks: `faults` is then always None.

Every fault is tied to a step, never to a time, so it lands in training however fast the machine
is. Crashes fire only in torchrun's first attempt, so the restarted job runs clean; a NaN loss fires
in every attempt, as a diverged run would.
"""
import os
import signal
import sys
import time

# The fault kinds each script has hooks for.
KINDS = {
    "ddp": ("crash-at-step", "crash-in-save", "crash-in-snapshot", "crash-in-backward", "freeze-at-step",
            "pause-at-step", "nan-at-step"),
    "fsdp": ("crash-at-step", "crash-in-save", "crash-in-write", "crash-in-staging", "crash-in-snapshot",
             "crash-in-clip", "freeze-at-step", "nan-at-step"),
    "rpc": ("crash-at-step", "crash-in-save", "drop-trainer-at-step", "nan-at-step"),
}


def parse(spec, script=None):
    """{kind: N, and "rank": R if given} of the FT_FAULTS value `spec`; a ValueError of one line if it is
    not right, or (with `script`) asks for a kind that script has no hook for."""
    known = list(dict.fromkeys(kind for kinds in KINDS.values() for kind in kinds))
    faults = {}
    for part in spec.split(","):
        kind, is_pair, value = (word.strip() for word in part.partition("="))
        if not is_pair:
            raise ValueError(f"{part.strip()!r} is not kind=N")
        if kind != "rank" and kind not in known:
            raise ValueError(f"no fault {kind!r}: choose from {', '.join(known)} (and rank=R)")
        if kind != "rank" and script and kind not in KINDS[script]:
            raise ValueError(f"{kind} is not a fault of {script}'s: choose from {', '.join(KINDS[script])}")
        if kind in faults:
            raise ValueError(f"{kind} is given twice")
        try:
            faults[kind] = int(value)
        except ValueError:
            raise ValueError(f"{kind} must be an integer, got {value!r}") from None
        if kind != "rank" and faults[kind] <= 0:
            raise ValueError(f"{kind} must be > 0 (a step), got {faults[kind]}")
    if set(faults) == {"rank"}:
        raise ValueError("no fault asked for, only its rank")
    return faults


def fault_problems(script):
    """The problem with FT_FAULTS for `script` ("ddp", "fsdp" or "rpc"), in one line, or none."""
    spec = os.environ["FT_FAULTS"]
    try:
        faults = parse(spec, script)
    except ValueError as e:
        return [f"FT_FAULTS={spec}: {e}"]
    world = int(os.environ.get("WORLD_SIZE", 1))
    if "drop-trainer-at-step" in faults and faults.get("rank", -1) % world == 0:
        return [f"FT_FAULTS={spec}: drop-trainer-at-step drops a trainer, and rank 0 is the server: "
                f"pick a rank in 1..{world - 1}"]
    return []


def first_attempt():
    """True in torchrun's first attempt (TORCHELASTIC_RESTART_COUNT is 0 or unset)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"


def crash(reason):
    """Die abruptly, as a lost process would: no finally blocks, no atexit, no flushing by Python."""
    print(f"injected crash: {reason}", file=sys.stderr, flush=True)
    os._exit(17)


class Faults:
    """The faults FT_FAULTS asks for, as hooks.

    `cfg` is the script's (pause-at-step reads its --hang-timeout-s), `rank` this process's rank, `world`
    the world size (rank=-1 is the last rank), `name` how a crash names this process in its one line
    ("rank 1", "server", "trainer 2")."""

    def __init__(self, cfg, rank, world, name=None):
        self.cfg, self.rank, self.name = cfg, rank, name or f"rank {rank}"
        self.at = parse(os.environ["FT_FAULTS"])  # kind -> step (check() refused a bad value)
        self.crash_rank = self.at.pop("rank", -1) % world

    def _due(self, kind, step, previous):
        """The step of `kind` falls in (previous, step] on the crash rank, the first time; previous
        defaults to step - 1 (the rpc trainers' steps may skip past it in async mode)."""
        at = self.at.get(kind)
        previous = step - 1 if previous is None else previous
        return at is not None and previous < at <= step and self.rank == self.crash_rank and self._first(kind)

    def _first(self, kind):
        """Whether `kind` fires now: in torchrun's first attempt; with --survivors (FT_GENERATION set), the
        first time in the run, marked as it fires in <run-dir>/faults-fired/<kind>, so that a process
        that takes the dead one's rank, training its steps again, is not faulted again, while the job's
        other faults still fire in later generations."""
        if not first_attempt():
            return False
        if "FT_GENERATION" not in os.environ:
            return True
        mark = os.path.join(self.cfg.run_dir, "faults-fired", kind)
        os.makedirs(os.path.dirname(mark), exist_ok=True)
        try:
            os.close(os.open(mark, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False

    def poison_loss(self, loss, step):
        """nan-at-step: the loss of step N (the step after `step` completed steps) is NaN, a tensor's or a
        number's, on every rank (rpc async: trainer step N)."""
        return loss * float("nan") if self.at.get("nan-at-step") == step + 1 else loss

    def after_step(self, step, previous=None):
        """crash-at-step: the crash rank dies once it has completed step N, before saving it;
        freeze-at-step: it stops there (SIGSTOP), as a hung process would, until someone kills it;
        pause-at-step: it sleeps there 1.5 --hang-timeout-s, its peers' collectives time out."""
        if self._due("crash-at-step", step, previous):
            crash(f"{self.name} after step {step}")
        if self._due("freeze-at-step", step, previous):
            print(f"injected freeze: {self.name} after step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if self._due("pause-at-step", step, previous):  # alive: a false alarm, not a death
            print(f"injected pause: {self.name} after step {step}, {1.5 * self.cfg.hang_timeout_s:.1f} s",
                  file=sys.stderr, flush=True)
            time.sleep(1.5 * self.cfg.hang_timeout_s)

    def leaves(self, step, previous=None):
        """drop-trainer-at-step (rpc): True where the crash rank, a trainer, should leave silently now."""
        return self._due("drop-trainer-at-step", step, previous)

    def in_save(self, step, detail=""):
        """crash-in-save: a `before_commit` hook that kills the saving process (rank 0, rpc's server) once
        the bytes of step N's checkpoint are written but not committed, or None."""
        if self.at.get("crash-in-save") == step and self.rank == 0 and self._first("crash-in-save"):
            return lambda: crash(f"{self.name} while saving step {step}{detail}")
        return None

    def in_write(self, step):
        """crash-in-write (fsdp): a hook that kills the crash rank as it starts writing its shards of step
        N (synchronous: in the save; --async-save: in the background, while training goes on), before
        the others' commit; or None."""
        if self._due("crash-in-write", step, None):
            return lambda: crash(f"{self.name} while writing its shards of step {step}")
        return None

    def in_backward(self, model, step):
        """crash-in-backward (ddp): the crash rank dies in the backward of step N (the step after `step`
        completed ones), once its last layers' gradients are computed and while DDP's reducer all-reduces
        them with its peers: a hook on the gradient of the model's first parameter, the embedding's."""
        if self._due("crash-in-backward", step + 1, None):
            next(model.parameters()).register_hook(lambda grad: crash(f"{self.name} in the backward of step {step + 1}"))

    def before_clip(self, step):
        """crash-in-clip (fsdp): the crash rank dies in step N (the step after `step` completed ones), its
        gradients reduce-scattered, as its peers all-reduce the gradient norm to clip it."""
        if self._due("crash-in-clip", step + 1, None):
            crash(f"{self.name} in the gradient clipping of step {step + 1}")

    def in_snapshot(self, step):
        """crash-in-snapshot: a hook that kills the crash rank halfway through copying step N's memory
        snapshot, before its record is written, or None."""
        if self._due("crash-in-snapshot", step, None):
            return lambda: crash(f"{self.name} while copying the memory snapshot of step {step}")
        return None

    def stager(self, options, step):
        """crash-in-staging (fsdp --async-save): a DCP stager that kills the crash rank in its staging
        thread as it starts copying the shards of step N (the training loop goes on meanwhile), or None."""
        if not self._due("crash-in-staging", step, None):
            return None
        from torch.distributed.checkpoint.staging import DefaultStager  # only fsdp needs DCP here

        name = self.name

        class DyingStager(DefaultStager):
            def _stage(self, state_dict, **kwargs):  # what DefaultStager runs in its thread
                crash(f"{name} while staging step {step}: the copy of its shards begun, not finished")

        return DyingStager(options)
