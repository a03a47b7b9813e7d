"""run.sh itself: it uses the machine's torch, installs only what a mode lacks, and checks elastic jobs."""
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness import launch, procs
from conftest import REPO


def test_run_sh_uses_an_installed_torch_and_installs_only_what_a_mode_lacks(tmp_path):
    # A python with torch and numpy but without the test packages: this interpreter, with pytest,
    # and tabulate made unimportable, in a copy of the project that has no .venv yet.
    block = tmp_path / "block"
    block.mkdir()
    for module in ("pytest", "tabulate"):
        (block / f"{module}.py").write_text("raise ImportError('hidden by the test')\n")
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={block} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    project = tmp_path / "project"
    shutil.copytree(REPO, project, ignore=shutil.ignore_patterns(".git", ".venv*", "runs", "__pycache__"))
    env = {**os.environ, "PYTHON": str(python)}

    def run_sh(*args):
        return subprocess.run(["bash", str(project / "run.sh"), *map(str, args)], cwd=project, env=env,
                              capture_output=True, text=True, timeout=300)

    # Training needs only torch and numpy: that python runs the (here refused) job, nothing is installed.
    proc = run_sh("ddp", 2, "--run-dir", tmp_path / "run", "--stepz", 10)
    assert proc.returncode == 2 and "unrecognized arguments: --stepz" in proc.stderr
    assert "installing" not in proc.stderr and not (project / ".venv").exists()

    # The tests need pytest too: .venv is made over that python's packages, its torch is reused, not
    # downloaded (the packages this python hides are in its site-packages, so nothing is installed here).
    proc = run_sh("test", "--version")  # pytest, run from .venv: no test collected (each imports torch)
    assert proc.returncode == 0 and proc.stdout.startswith("pytest "), proc.stdout + proc.stderr
    assert "installing" not in proc.stderr, proc.stderr
    assert "include-system-site-packages = true" in (project / ".venv" / "pyvenv.cfg").read_text()
    assert not list((project / ".venv").glob("lib/python*/site-packages/torch"))
    torch_file = subprocess.run([project / ".venv/bin/python", "-c", "import torch; print(torch.__file__)"],
                                capture_output=True, text=True, check=True).stdout
    assert not torch_file.startswith(str(project))


def test_run_sh_checks_an_elastic_job_at_every_world_size_it_may_run_at(tmp_path):
    # NNODES=1:3 with 2 ranks a node: batch 6 splits over 2 and 6 ranks, not over the 4 left when a node is lost.
    proc = subprocess.run(["bash", str(REPO / "run.sh"), "fsdp", "2", "--run-dir", str(tmp_path), "--batch-size", "6"],
                          cwd=REPO, env={**os.environ, "NNODES": "1:3", "RDZV_ENDPOINT": "localhost:29400"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "does not split evenly over 4 ranks" in proc.stderr, proc.stderr


def test_relative_paths_mean_what_they_mean_where_the_user_stands(tmp_path):
    # A text file beside the user, not in the repository: run.sh finds it (and refuses its --vocab).
    (tmp_path / "fox.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    proc = subprocess.run(["bash", str(REPO / "run.sh"), "ddp", "2", "--run-dir", "run", "--data", "fox.txt",
                           "--vocab", "64"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--data fox.txt is read as bytes" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "run").exists()  # refused: no folder left behind


@pytest.mark.parametrize("env, line", [
    ({"NNODES": "two"}, "NNODES must be a number of nodes or MIN:MAX, got 'two'"),
    ({"NNODES": "3:1"}, "NNODES=3:1: MIN must not exceed MAX"),
    ({"NNODES": "2"}, "NNODES=2 needs RDZV_ENDPOINT, the host:port of the first node, the same on every node"),
    ({"MAX_RESTARTS": "abc"}, "MAX_RESTARTS must be a whole number, got 'abc'"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "node0:29500", "NODE_RANK": "x"},
     "NODE_RANK must be a number below the nodes' count (2), got 'x'"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "node0:29500", "NODE_RANK": "2"},
     "NODE_RANK must be a number below the nodes' count (2), got '2'"),
    ({"RDZV_ENDPOINT": "localhost:99999"}, "RDZV_ENDPOINT must be host:port (a port up to 65535), got 'localhost:99999'"),
    ({"RDZV_CONF": "garbage"}, "RDZV_CONF must be key=value pairs separated by commas, got 'garbage'"),
    ({"RDZV_CONF": "join_timeout=abc"}, "RDZV_CONF: join_timeout must be a number, got 'abc'"),
    ({"SHUTDOWN_TIMEOUT": "-5"}, "SHUTDOWN_TIMEOUT must be a whole number of seconds above 0, got '-5'"),
    ({"PYTHON": "/no/python"}, "PYTHON=/no/python: no such program"),
    # Checked by harness/launch.py, before torchrun (which retries an unknown host for minutes):
    ({"NNODES": "2", "RDZV_ENDPOINT": "nohost.invalid:29500"},
     "RDZV_ENDPOINT=nohost.invalid:29500: cannot resolve nohost.invalid ("),  # (the resolver's words)
])
def test_a_bad_launch_setting_is_one_line_before_anything_starts(env, line):
    # Checked before torchrun starts: it would print its usage, a traceback, or wait.
    proc = subprocess.run(["bash", str(REPO / "run.sh"), "ddp", "2"], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.startswith(f"run.sh: {line}") and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("flags, line", [
    (["--spares", "abc"], "argument --spares: invalid int value: 'abc' (see --help)"),
    (["--survivors=yes"], "argument --survivors/--no-survivors: ignored explicit argument 'yes' (see --help)"),
])
def test_a_survivors_flag_the_launcher_cannot_read_is_the_scripts_one_line(tmp_path, flags, line):
    # The launcher reads --survivors and --spares before the preflight: a value it cannot read is left to the
    # script's check, whose line names the script, not a usage block of the launcher's three flags (audit N5).
    proc = subprocess.run(["bash", str(REPO / "run.sh"), "ddp", "2", "--run-dir", str(tmp_path / "run"), *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr == f"ddp/train.py: error: {line}\n", proc.stderr
    assert not (tmp_path / "run").exists()


def test_a_preempted_job_gets_three_times_its_slowest_save_before_torchruns_sigkill(tmp_path):
    assert launch.grace_for(tmp_path) == 30  # nothing measured yet: torchrun's own 30 s
    events = [{"event": "step", "step": 1, "step_s": 0.1}, {"event": "save", "step": 50, "total_s": 4.2},
              {"event": "save", "step": 100, "total_s": 14.6}]
    (tmp_path / "metrics-rank0.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "sa')
    assert launch.grace_for(tmp_path) == 44  # the line a crash cut short is skipped
    cmd, env = launch.torchrun("ddp/train.py", 2, tmp_path, grace_s=44)
    assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in cmd
    # torch 2.14's torchrun has the flag, 2.11's does not (its agent waits 30 s, always).
    assert ("--shutdown-timeout=44" in cmd) == launch.has_shutdown_timeout()
    assert procs.exit_code(0, env) == 0  # no worker left a stop's code


@pytest.mark.parametrize("layout", ["torchrun", "survivors"])
def test_a_killed_launcher_takes_its_workers_with_it(tmp_path, layout):
    # SIGKILL to the launcher run.sh runs. torchrun mode: the kernel sends torchrun SIGTERM, which its
    # workers take as a preemption: they save their step and end. --survivors: the launcher is the
    # supervisor, whose processes (forked by its warm parent, then its children) and warm parent the
    # kernel SIGKILLs. Either way nothing is left holding the run folder. NNODES=1:1 (elastic, one node)
    # is one node: everything it listens on is on the loopback.
    from conftest import LOOPBACK, SMALL, descendants, listening, wait_for_step
    run = tmp_path / "run"
    cmd = ["bash", str(REPO / "run.sh"), "ddp", "2", "--run-dir", str(run), *SMALL, "--steps", "100000",
           "--save-every", "100000", *(["--survivors", "--spares", "1"] if layout == "survivors" else [])]
    proc, tree = procs.start(cmd, {**os.environ, "NNODES": "1:1"}, tmp_path / "job.log"), set()
    try:
        assert wait_for_step(run, 5, proc), "the job ended before step 5"
        sockets = listening(proc.pid)
        assert sockets and all(address in LOOPBACK for address, _ in sockets), sockets
        tree = descendants(proc.pid)
        names = sorted(Path(f"/proc/{pid}/comm").read_text().strip() for pid in tree)
        # torchrun and its 2 workers; or the 2 ranks, the spare and the warm parent
        assert len(tree) >= 3 if layout == "torchrun" else names.count("ft-warm-parent") == 1 and len(tree) == 4, names
        proc.kill()
        deadline = time.monotonic() + 60
        while any(os.path.exists(f"/proc/{pid}") and not zombie(pid) for pid in tree) and time.monotonic() < deadline:
            time.sleep(0.1)  # polling /proc for the processes' end, not waiting for a moment
        left = [pid for pid in tree if os.path.exists(f"/proc/{pid}") and not zombie(pid)]
    finally:  # whatever is left, killed (the launcher's process group, and torchrun's session)
        for pid in {proc.pid, *tree, *descendants(proc.pid)}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
    assert not left, left
    log = (tmp_path / "job.log").read_text()
    if layout == "torchrun":
        assert "preempted (SIGTERM or SIGUSR1): step" in log and "saved, exiting for a restart" in log, log[-3000:]


def zombie(pid):
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    return True
