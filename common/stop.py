"""The stop that no restart repeats. torchrun retries every exit but 0, so a worker that stops on purpose (a bad
setting, a full disk, a diverged loss) leaves its exit code in the launch's stop file, where every restart
finds it and ends at once (end_if_stopped, before torch is imported: this module imports no torch)."""
import os
import sys
import tempfile


# The variable naming the stop file of a launch by harness/launch.py, which exits with the code left there.
STOP_FILE = "FT_STOP_FILE"


def stop(code):
    """End with `code`, left in the stop file under torchrun: exit 0 under the launcher, which exits with the code,
    else `code`, not a success to a scheduler. No finalization, which could turn the status into a crash's."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:  # not under torchrun: the code is the exit status
        raise SystemExit(code)
    leave_stop_code(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if os.environ.get(STOP_FILE) else code)


def stop_file():
    """$FT_STOP_FILE, or under plain torchrun a temp file named after this user and torchrun's agent, this
    process's parent (its pid and start time, which no other launch has both of)."""
    if os.environ.get(STOP_FILE):
        return os.environ[STOP_FILE]
    agent = os.getppid()
    try:
        started = open(f"/proc/{agent}/stat").read().rsplit(")", 1)[1].split()[19]
    except OSError:  # no /proc: the pid alone
        started = "0"
    return os.path.join(tempfile.gettempdir(), f"ft-stop-{os.geteuid()}-{agent}-{started}")


def leave_stop_code(code):
    """Write the exit code to the stop file (0: a job done though a worker must be killed). Each rank renames a
    fresh file of its own into place, never through a link another user planted in the shared temp folder."""
    path = stop_file()
    try:
        os.unlink(f"{path}.{os.getpid()}")  # a crashed process's, whose pid this one reuses
    except FileNotFoundError:
        pass
    try:
        fd = os.open(f"{path}.{os.getpid()}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(str(code))
        os.replace(f"{path}.{os.getpid()}", path)
    except OSError as e:  # a restart then runs, and stops again
        print(f"the stop's code could not be left in {path} ({e.strerror})", file=sys.stderr, flush=True)


def end_if_stopped():
    """End at once, as stop() ends, a torchrun restart after a stop of this launch: torchrun restarts the whole
    group when any worker fails, as a peer of a stopped rank may (or, under plain torchrun, the stop itself)."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        return
    path = stop_file()
    try:
        if os.lstat(path).st_uid != os.geteuid():  # not this user's: not this launch's
            return
        code = int(open(path).read())
    except (OSError, ValueError):
        return
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"restart {os.environ['TORCHELASTIC_RESTART_COUNT']}: the job has stopped (exit code {code}): "
              "not starting again", flush=True)
    os._exit(0 if os.environ.get(STOP_FILE) else code)
