"""The warm parent of a --survivors node: one process that has imported torch, torch._dynamo, the script
and what it imports, and forks each new process of the node when the supervisor asks (a replacement, a
spare, the first launch's ranks), so that a new process starts in milliseconds instead of paying
`import torch` and torch._dynamo again (seconds). The supervisor (harness/supervisor.py) starts it,
with the environment its processes share, and then supervises each forked child as it supervises one it
started itself: its own pid, its exit status, the fence.

    python harness/warm.py FD SCRIPT [flags]   # run by the supervisor: FD its end of a socket pair

The child runs the script as `python SCRIPT flags` would (runpy, as __main__, with the same sys.path
and its own environment). What it must not inherit, and how it does not:
  - threads, and the locks they hold: the parent starts none. It imports modules only: no process
    group, no store client, no tensor op (torch's intra-op pool starts on the first parallel one), no
    device. It refuses to fork with a Python thread or with CUDA initialised (CUDA cannot cross a fork:
    each child initialises its own device, as a fresh process does). numpy's OpenBLAS starts a pool
    where OMP_NUM_THREADS is unset (a rank alone): OpenBLAS stops it at fork (pthread_atfork).
  - the random state: Python's `random` reseeds itself in a forked child; numpy's global generator is
    reseeded from the OS, and torch's CPU generator set back to its start (what a fresh process has).
    The hash seed is the parent's for every child (a fresh process draws its own): the same order of
    a set of strings in each, which no result here depends on.
  - sockets and pipes: the child closes the parent's (the supervisor's socket, the fork's pipes).
  - signal handlers and the session: the defaults again, a session of its own, and SIGKILL when the
    supervisor dies (PR_SET_PDEATHSIG), as a process the supervisor starts itself gets.
  - the environment: os.environ is the child's own (the one the supervisor sent). /proc/<pid>/environ
    and /proc/<pid>/cmdline still show the parent's (the kernel's copy of what was exec'd), which holds
    what every process of the node shares; the parent's name (comm) is "ft-warm-parent", the child's
    that of a fresh python.
A child's parent is the supervisor, not this process: it is forked from a short-lived middle process,
which exits at once, and the supervisor is the subreaper (PR_SET_CHILD_SUBREAPER) that the kernel gives
it to. So the children live on if the warm parent dies; the supervisor starts another.
"""
import ctypes
import json
import os
import runpy
import signal
import socket
import sys
import threading
import time

PR_SET_PDEATHSIG, PR_SET_NAME, PR_GET_NAME, PR_SET_CHILD_SUBREAPER = 1, 15, 16, 36  # (linux/prctl.h)
NAME = b"ft-warm-parent"
FAULT = "FT_WARM_DIES_IN_FORK"  # the tests': N, the parent SIGKILLs itself in its N-th fork (its first life only)
# What a --survivors process imports later, in the modules of the tiers it opens (ddp/train.py, fsdp/train.py).
TIERS = ("tiers.survivors", "tiers.shm", "tiers.snapshot", "tiers.replica", "tiers.faults", "tiers.light")


def prctl(option, value):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


def comm():
    name = ctypes.create_string_buffer(16)
    ctypes.CDLL(None).prctl(PR_GET_NAME, name, 0, 0, 0)
    return name.value


def fork_problem():
    """Why this process must not fork a training process now, or None."""
    import torch
    if threading.active_count() > 1:
        return f"{threading.active_count()} threads"
    if torch.cuda.is_initialized():
        return "CUDA initialised"
    return None


def send(sock, **message):
    sock.sendall(json.dumps(message).encode() + b"\n")


def serve(sock, script, flags):
    """Load what the script imports, say so, then fork a child for each request (one line of JSON: the
    child's environment) and answer with its pid. Returns only in a child: (its environment, the
    sys.path a fresh `python script` starts with); the parent exits when the supervisor closes its end."""
    t0 = time.monotonic()
    sys.path[0] = os.path.dirname(os.path.realpath(script))  # as `python script` has it
    fresh_path = list(sys.path)
    import importlib.util
    spec = importlib.util.spec_from_file_location("__warm__", script)  # not __main__: its main() does not run
    sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[spec.name])
    import torch._dynamo  # noqa: F401  (the first optimizer construction imports it: as long as torch itself)
    for name in TIERS:
        __import__(name)
    own_name = comm()
    prctl(PR_SET_NAME, ctypes.c_char_p(NAME))
    send(sock, ready=True, pid=os.getpid(), load_s=time.monotonic() - t0, threads=len(os.listdir("/proc/self/task")))
    requests, forks = sock.makefile("rb"), 0
    for line in requests:
        env = json.loads(line)["env"]
        problem = fork_problem()
        if problem:
            send(sock, error=problem)
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        go_r, go_w = os.pipe()  # the child starts once it is the supervisor's
        pid_r, pid_w = os.pipe()
        middle = os.fork()
        if middle == 0:  # the middle process: forks the child, says its pid, exits
            try:
                child = os.fork()
            except OSError:
                os._exit(1)
            if child == 0:
                for fd in (go_w, pid_r, pid_w):
                    os.close(fd)
                requests.close()
                sock.close()
                if os.read(go_r, 1) != b"1":  # the parent died before the supervisor knew this process: never run
                    os._exit(1)
                os.close(go_r)
                prctl(PR_SET_NAME, ctypes.c_char_p(own_name))
                return env, fresh_path
            os.write(pid_w, str(child).encode())
            os._exit(0)
        os.close(pid_w)
        os.close(go_r)
        child = os.read(pid_r, 32)
        os.close(pid_r)
        os.waitpid(middle, 0)  # its exit gave the child to the supervisor (the subreaper)
        forks += 1
        if child and forks == int(os.environ.get(FAULT, "0")):
            print(f"fault injection: the warm parent dies in its fork {forks}, of pid {int(child)}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        # The supervisor knows the child's pid before the child may run: a parent that dies in between
        # leaves a child that reads no go and exits, never one that runs beside its slot's next process.
        send(sock, **({"pid": int(child)} if child else {"error": "the fork failed"}))
        os.write(go_w, b"1")
        os.close(go_w)
    os._exit(0)


def become(env, fresh_path, script, flags, supervisor):
    """This forked child becomes a fresh `python script flags` of environment `env`, then runs it."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != supervisor:  # the supervisor died before this process became its
        os._exit(1)
    os.setsid()
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import numpy
    import torch
    from tiers.survivors import FORKED
    os.environ.clear()
    os.environ.update(env, **{FORKED: "1"})
    numpy.random.seed()
    torch.default_generator.manual_seed(torch.initial_seed())
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # the parent's OpenMP read it when torch loaded
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    sys.path[:] = fresh_path
    sys.argv = [script, *flags]
    runpy.run_path(script, run_name="__main__")


# ----------------------------------------------------------------------------- the supervisor's side
READY_S = 120  # the first launch waits this long for the parent to load (it takes about what a fresh process does)
REPLY_S = 30  # a fork's answer: milliseconds; a parent silent this long (stopped, stuck) is dead to the supervisor


class WarmParent:
    """The supervisor's handle on its node's warm parent: started now, ready once it has loaded. `cmd`
    runs the script ([python, script, *flags]); `env`, what the node's processes share; `pass_fds`,
    the fds they inherit. OSError if this process cannot be the subreaper of the children."""

    def __init__(self, cmd, env, pass_fds=()):
        import subprocess
        from harness.procs import dies_with_parent
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.sock, theirs = socket.socketpair()
        self.proc = subprocess.Popen(dies_with_parent([cmd[0], __file__, str(theirs.fileno()), *cmd[1:]], signal.SIGKILL),
                                     env=env, pass_fds=(theirs.fileno(), *pass_fds), start_new_session=True)
        theirs.close()
        self.sock.settimeout(REPLY_S)
        self.replies = self.sock.makefile("rb")
        self.loaded = None  # its first message ({"ready": ...}); False: it ended before it was ready

    def ready(self, timeout_s):
        """Whether it is ready to fork, waiting up to `timeout_s` for it to finish loading."""
        import select
        if self.loaded is None and select.select([self.sock], [], [], timeout_s)[0]:
            self.loaded = self.reply() or False
            if self.loaded:
                print(f"supervisor: the warm parent (pid {self.proc.pid}) loaded in {self.loaded['load_s']:.1f} s "
                      f"({self.loaded['threads']} threads): new processes are forked from it", flush=True)
        return bool(self.loaded)

    def reply(self):
        try:
            line = self.replies.readline()
        except OSError:  # silent for REPLY_S
            line = b""
        return json.loads(line) if line else None

    def fork(self, env):
        """A new process of environment `env` (a Forked), or why there is none (a string)."""
        try:
            send(self.sock, env=env)
        except OSError as e:
            return f"it is gone ({e.strerror})"
        answer = self.reply()
        if answer is None:
            return "it did not answer"
        return Forked(answer["pid"]) if "pid" in answer else answer["error"]

    def close(self):
        """It exits once its socket closes; killed if it does not at once."""
        import subprocess
        self.sock.close()
        try:
            self.proc.wait(timeout=1)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Forked:
    """A process the warm parent forked for the supervisor, which is its parent (the subreaper): the part
    of subprocess.Popen's interface that the supervisor uses."""

    def __init__(self, pid):
        self.pid, self.returncode = pid, None

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout=None):
        import subprocess
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.005)
        return self.returncode

    def send_signal(self, number):
        if self.poll() is None:
            os.kill(self.pid, number)

    def kill(self):
        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    fd, script, *flags = sys.argv[1:]
    supervisor = os.getppid()
    # The parent dies with the supervisor (and takes no terminal's Ctrl-C: the supervisor passes signals on).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    become(*serve(socket.socket(fileno=int(fd)), script, flags), script, flags, supervisor)

