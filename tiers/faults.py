"""Fault injection for the tests and the chaos soak, in one place: a tier of its own. Each script makes
a Faults only when one of its FAULTS flags is set (ddp and fsdp in open_tiers, rpc in main), and calls
its hooks where `faults` is not None; the checkpointer and the memory tier are handed the hooks that
fire inside them. To copy a script without faults, delete this module, that block, the `if faults:`
lines and the Config fields marked "fault injection".

Every fault is tied to a step, never to a time, so it lands in training however fast the machine
is. Crashes fire only in torchrun's first attempt, so the restarted job runs clean; a NaN loss fires
in every attempt, as a diverged run would.
"""
import os
import signal
import sys
import time


def first_attempt():
    """True in torchrun's first attempt (TORCHELASTIC_RESTART_COUNT is 0 or unset) and, with --survivors,
    in the first generation of the group (a spare that takes a dead rank's place is not faulted again)."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and os.environ.get("FT_GENERATION", "0") == "0"


def crash(reason):
    """Die abruptly, as a lost process would: no finally blocks, no atexit, no flushing by Python."""
    print(f"injected crash: {reason}", file=sys.stderr, flush=True)
    os._exit(17)


class Faults:
    """The faults a script's flags ask for (its Config's fields marked "fault injection"), as hooks.

    `rank` is this process's rank, `world` the world size (--crash-rank -1 is the last rank), `name`
    how a crash names this process in its one line ("rank 1", "server", "trainer 2")."""

    def __init__(self, cfg, rank, world, name=None):
        self.cfg, self.rank, self.name = cfg, rank, name or f"rank {rank}"
        self.crash_rank = getattr(cfg, "crash_rank", -1) % world

    def _flag(self, name):
        return getattr(self.cfg, name, None)  # None: not asked for, or the field deleted with the faults

    def _due(self, at, step, previous):
        """`at` falls in (previous, step] on the crash rank, in the first attempt; previous defaults to
        step - 1 (the rpc trainers' steps may skip past it in async mode)."""
        previous = step - 1 if previous is None else previous
        return at is not None and previous < at <= step and self.rank == self.crash_rank and first_attempt()

    def poison_loss(self, loss, step):
        """--nan-at-step: the loss of step N (the step after `step` completed steps) is NaN, a tensor's
        or a number's."""
        return loss * float("nan") if self._flag("nan_at_step") == step + 1 else loss

    def after_step(self, step, previous=None):
        """--crash-at-step: the crash rank dies once it has completed step N, before saving it;
        --freeze-at-step: it stops there (SIGSTOP), as a hung process would, until someone kills it;
        --pause-at-step: it sleeps there 1.5 --hang-timeout-s, its peers' collectives time out."""
        if self._due(self._flag("crash_at_step"), step, previous):
            crash(f"{self.name} after step {step}")
        if self._due(self._flag("freeze_at_step"), step, previous):
            print(f"injected freeze: {self.name} after step {step}", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        if self._due(self._flag("pause_at_step"), step, previous):  # alive: a false alarm, not a death
            print(f"injected pause: {self.name} after step {step}, {1.5 * self.cfg.hang_timeout_s:.1f} s",
                  file=sys.stderr, flush=True)
            time.sleep(1.5 * self.cfg.hang_timeout_s)

    def leaves(self, step, previous=None):
        """--drop-trainer-at-step (rpc): True where the crash rank should leave silently now."""
        return self._due(self._flag("drop_trainer_at_step"), step, previous)

    def in_save(self, step, detail=""):
        """--crash-in-save: a `before_commit` hook that kills the saving process once the bytes of step
        N's checkpoint are written but not committed, or None."""
        if self._flag("crash_in_save") == step and first_attempt():
            return lambda: crash(f"{self.name} while saving step {step}{detail}")
        return None

    def in_snapshot(self, step):
        """--crash-in-snapshot: a hook that kills the crash rank halfway through copying step N's memory
        snapshot, before its record is written, or None."""
        if self._due(self._flag("crash_in_snapshot"), step, None):
            return lambda: crash(f"{self.name} while copying the memory snapshot of step {step}")
        return None

    def stager(self, options, step):
        """--crash-in-staging (fsdp --async-save): a DCP stager that kills the crash rank in its staging
        thread as it starts copying the shards of step N (the training loop goes on meanwhile), or None."""
        if not self._due(self._flag("crash_in_staging"), step, None):
            return None
        from torch.distributed.checkpoint.staging import DefaultStager  # only fsdp needs DCP here

        name = self.name

        class DyingStager(DefaultStager):
            def _stage(self, state_dict, **kwargs):  # what DefaultStager runs in its thread
                crash(f"{name} while staging step {step}: the copy of its shards begun, not finished")

        return DyingStager(options)
