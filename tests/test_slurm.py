"""The cluster launch file docs/nodes.md gives (docs/slurm.sbatch), against stand-ins for Slurm's commands
that behave as Slurm 22.05 does: it saves the step and requeues only when Slurm does not end the job. And
what `bash run.sh slurm` forgives in a real job's log."""
import os
import signal
import subprocess
import time

import pytest

from conftest import REPO


# Stand-ins for Slurm's commands, as Slurm 22.05 treated docs/slurm.sbatch (job 42). srun runs a step
# that, like run.sh's workers, saves and exits 143 on SIGTERM (or exits $STEP_EXIT at once). scancel
# signals the batch shell (--batch) or the steps (--signal); a plain one cancels the job: TERM to both.
# scontrol requeue also sends TERM to both. Then the job refuses scancel: at once after a cancel; after a
# requeue (COMPLETING for KillWait) with "try again later", retried in the foreground until the batch shell ends.
STAND_INS = {
    # (its command's node wrapper, `bash -c '...' node`, run on node 1 with printenv for run.sh: NODE_RANK)
    "srun": 'args=("$@"); while [[ ${args[0]} == --* ]]; do args=("${args[@]:1}"); done\n'
            'SLURM_NODEID=1 "${args[@]:0:4}" printenv NODE_RANK > "$STATE/node_rank"\n'
            'echo $$ > "$STATE/step.pid"\n[ -n "${STEP_EXIT:-}" ] && exit "$STEP_EXIT"\n'
            'trap \'kill $!; echo saved >> "$STATE/log"; exit 143\' TERM\ntouch "$STATE/ready"\nsleep 120 & wait $!\n',
    "scancel": '''quiet=0; [ "$1" = --quiet ] && { quiet=1; shift; }  # no error for a job already ending
if [ -e "$STATE/requeued" ]; then
  echo "scancel: error: Job can not be altered now, try again later" >&2
  while kill -0 "$(cat "$STATE/batch.pid")" 2>/dev/null; do sleep 0.05; done; exit 1
fi
[ -e "$STATE/cancelled" ] && { [ $quiet = 1 ] || echo "scancel: error: Job/step already completing or completed" >&2; exit 1; }
case "$1" in
  --batch) kill -"${2#--signal=}" "$(cat "$STATE/batch.pid")" ;;
  --signal=*) kill -"${1#--signal=}" "$(cat "$STATE/step.pid")" ;;
  *) echo cancelled >> "$STATE/log"; touch "$STATE/cancelled"
     kill -TERM $(cat "$STATE/batch.pid" "$STATE/step.pid") ;;
esac
''',
    "scontrol": '''case "$1" in
  show) echo node0 ;;
  requeue) echo requeued >> "$STATE/log"; touch "$STATE/requeued"
           kill -TERM $(cat "$STATE/batch.pid" "$STATE/step.pid") 2>/dev/null; exit 0 ;;
esac
''',
}


@pytest.mark.parametrize("slurm_sends, step_exit, code, log", [
    ("USR1", None, 143, ["saved", "requeued"]),  # the limit's warning, --signal=B:USR1@60: to the batch shell
    ("scancel --batch --signal=USR1 42", None, 143, ["saved", "requeued"]),  # the same by hand
    ("scancel --signal=TERM 42", None, 143, ["saved", "requeued"]),  # to the steps only
    ("scancel 42", None, 143, ["cancelled", "saved"]),  # the trap's scancel is refused; no requeue follows
    ("scontrol requeue 42", None, 143, ["requeued", "saved"]),  # by Slurm, once; the trap's scancel must not block
    (None, 3, 3, []),  # a stop (a full disk): not requeued
])
def test_the_readme_slurm_file_saves_the_step_and_requeues_only_when_slurm_does_not_end_the_job(
        tmp_path, slurm_sends, step_exit, code, log):
    script = tmp_path / "train.sbatch"
    script.write_text((REPO / "docs" / "slurm.sbatch").read_text())
    assert "bash run.sh fsdp" in script.read_text()
    bin_dir, state = tmp_path / "bin", tmp_path / "state"
    bin_dir.mkdir(), state.mkdir()
    for name, body in STAND_INS.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STATE": str(state), "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node0", "SLURM_NNODES": "1", **({"STEP_EXIT": str(step_exit)} if step_exit else {})}
    batch = subprocess.Popen(["bash", str(script)], cwd=tmp_path, env=env)
    (state / "batch.pid").write_text(f"{batch.pid}\n")
    if slurm_sends:
        while not (state / "ready").exists():  # the step is up, its trap set
            assert batch.poll() is None, "the batch file ended before its step started"
            time.sleep(0.01)  # polling for the file the stand-in step writes, not waiting for a moment
        if slurm_sends == "USR1":
            os.kill(batch.pid, signal.SIGUSR1)
        else:
            subprocess.run(slurm_sends.split(), env=env, check=True)
    try:
        assert batch.wait(timeout=5) == code  # promptly: a blocked scancel would hold it until KillWait's SIGKILL
    finally:
        batch.kill(), batch.wait()  # reaped, so that a retrying stand-in scancel sees it gone
    assert ((state / "log").read_text().splitlines() if (state / "log").exists() else []) == log
    assert (state / "node_rank").read_text() == "1\n"  # each node's run.sh told its node's number


# The log of CI's cancel check at a9bdf4b (job 2, its stack frames cut): torchrun's agent (22063) got a second
# TERM while it logged that it passes the first to its workers, and logging printed what that interrupted.
AGENTS_ON_TERM = """saved step 10 (1.7 MiB, blocking 57 ms, total 57 ms)
slurmstepd-node0: error: *** STEP 2.0 ON node0 CANCELLED AT 2026-12-05T10:14:00 ***
--- Logging error ---
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.api.SignalException: Process 22063 got signal: 15

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
AttributeError: 'PosixPath' object has no attribute '_str'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.api.SignalException: Process 22063 got signal: 15
Call stack:
Message: 'Sending process %s closing signal %s'
Arguments: (22088, 'SIGTERM')
saved step 21 (1.7 MiB, blocking 191 ms, total 191 ms)
preempted (SIGTERM or SIGUSR1): step 21 saved, exiting for a restart
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.api.SignalException: Process 22064 got signal: 15
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.api.SignalException: Process 22063 got signal: 15
"""


def test_the_slurm_checks_forgive_torchruns_own_tracebacks_on_term_and_nothing_else():
    from harness.slurm import unexplained_tracebacks
    assert unexplained_tracebacks(AGENTS_ON_TERM) == 0
    ours = "Traceback (most recent call last):\nRuntimeError: a rank's own failure\n"
    assert unexplained_tracebacks(AGENTS_ON_TERM + ours) == 1
    not_a_signal = AGENTS_ON_TERM.replace("torch.distributed.elastic.multiprocessing.api.SignalException: Process "
                                          "22063", "OSError: Process 22063", 1)
    assert unexplained_tracebacks(not_a_signal) == 2  # not the agent's: the OSError, and so what it interrupted
    # CI at 3227afd, usr1's job: the second TERM came in logging's cache, outside a logging error.
    in_the_handler = ("Traceback (most recent call last):\n"
                      "torch.distributed.elastic.multiprocessing.api.SignalException: Process 22826 got signal: 15\n\n"
                      "During handling of the above exception, another exception occurred:\n\n"
                      "Traceback (most recent call last):\n"
                      '  File "/usr/lib/python3.11/logging/__init__.py", line 1742, in isEnabledFor\n'
                      "    return self._cache[level]\nKeyError: 30\n\n"
                      "During handling of the above exception, another exception occurred:\n\n"
                      "Traceback (most recent call last):\n"
                      "torch.distributed.elastic.multiprocessing.api.SignalException: Process 22826 got signal: 15\n")
    assert unexplained_tracebacks(in_the_handler) == 0
    ended_by_another = in_the_handler[:in_the_handler.rindex("\n\nDuring handling")] + "\n"  # the KeyError ends it
    assert unexplained_tracebacks(ended_by_another) == 1
    # The two agents' Tracebacks interleaved line by line (cancel's job, here at 75a216f).
    signal = "torch.distributed.elastic.multiprocessing.api.SignalException: Process {} got signal: 15\n"
    interleaved = ("Traceback (most recent call last):\nTraceback (most recent call last):\n" + signal.format(757)
                   + signal.format(756) + "srun: error: node0: task 0: Exited with exit code 143\n")
    assert unexplained_tracebacks(interleaved) == 0
