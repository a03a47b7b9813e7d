"""The stop that no restart repeats. torchrun retries every non-zero exit --max-restarts times, each
retraining from the last commit; the one status it does not retry is 0. So a worker that stops on
purpose (a refused setting, a full disk, a diverged loss) first leaves its exit code in its launch's
stop file, where every restart finds it and ends at once (end_if_stopped, called by each script before
it imports torch: this module imports no torch)."""
import os
import sys
import tempfile


# Where the workers under torchrun of a launch by harness/launch.py leave the exit code of a deliberate
# stop, for the launcher to exit with (under plain torchrun: stop_file()).
STOP_FILE = "FT_STOP_FILE"


def stop(code):
    """End the process with `code`, having left it in the stop file under torchrun; then exit 0 under the
    launcher, which exits with the code, and with the code under plain torchrun, which ends non-zero (a
    scheduler must not record a stop as a success) once its restarts are spent, a few seconds each.
    Either way without the interpreter's finalization (common.dist.exit_without_finalizing), which could
    turn the exit status into a crash's."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ:  # not under torchrun: the code is the exit status
        raise SystemExit(code)
    leave_stop_code(code)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if os.environ.get(STOP_FILE) else code)


def stop_file():
    """This launch's stop file: $FT_STOP_FILE where the launcher set it; under plain torchrun, one in the
    temp folder named after this user and torchrun's agent, this process's parent (its pid and its
    start time, which no other launch has both of)."""
    if os.environ.get(STOP_FILE):
        return os.environ[STOP_FILE]
    agent = os.getppid()
    try:
        started = open(f"/proc/{agent}/stat").read().rsplit(")", 1)[1].split()[19]
    except OSError:  # no /proc: the pid alone
        started = "0"
    return os.path.join(tempfile.gettempdir(), f"ft-stop-{os.geteuid()}-{agent}-{started}")


def leave_stop_code(code):
    """Write the job's exit code to this launch's stop file: a stop's, or 0 for a job that is done though
    a worker must be killed (rpc: a frozen trainer). A restart of the same launch then trains nothing
    (end_if_stopped). Each of the node's ranks may write it: each renames a file of its own into place,
    made afresh (the temp folder is everyone's: never through a link another user planted)."""
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
    """End at once a torchrun restart that follows a stop of this launch (its code in the stop file), as
    stop() ends: torchrun restarts the whole group when any worker fails, and one may fail after a stop
    (a peer of the stopped ranks, a trainer the server killed), or (plain torchrun) the stop itself."""
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
