"""Config-to-CLI: one flat dataclass per script is the single source of flags, defaults and help,
and the valid range of every flag.

Each field's trailing `# comment` in the dataclass source is its help text, so the comment a reader
sees next to a default is exactly what `--help` prints. A bad flag is one line and exit 2.
"""
import argparse
import dataclasses
import inspect
import math
import os
import re
import sys
import tempfile
import typing


class Parser(argparse.ArgumentParser):
    def error(self, message):
        # One clear line and exit 2, never a usage dump or a traceback.
        fail(f"{message} (see --help)", prog=self.prog)


def _field_help(cls):
    """Map field name -> its trailing comment in the class source."""
    src = inspect.getsource(cls)
    return dict(re.findall(r"^\s*(\w+)\s*:[^#\n]*#\s*(.+?)\s*$", src, re.MULTILINE))


def _field_type(tp):
    """int for int and Optional[int]; likewise for float, str."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if args else tp


def make_parser(cls, prog=None):
    helps = _field_help(cls)
    hints = typing.get_type_hints(cls)
    p = Parser(prog=prog, description=(cls.__doc__ or "").strip(),
                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        tp = _field_type(hints[f.name])
        if tp is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=helps.get(f.name))
        else:
            p.add_argument(flag, type=tp, default=f.default, metavar=tp.__name__.upper(), help=helps.get(f.name))
    return p


def parse_config(cls, check=None, argv=None, prog=None, presets=None):
    """Parse argv into cls; `check(cfg)` returns a list of problems, the first is reported as the error.

    `presets` maps a name to field values: `--preset NAME` replaces those fields, whatever flags say."""
    parser = make_parser(cls, prog=prog)
    cfg = cls(**vars(parser.parse_args(argv)))
    if getattr(cfg, "preset", ""):
        if cfg.preset not in (presets or {}):
            parser.error(f"--preset {cfg.preset}: choose from {', '.join(presets or {})}")
        cfg = dataclasses.replace(cfg, **presets[cfg.preset])
    for problem in (check(cfg) if check else []):
        parser.error(problem)
    return cfg


# The rules a flag's value must follow: (rule, test). Each script lists its numeric flags' rules in a
# RANGES dict beside its Config, the model's are in common/model.py; checked before any worker starts;
# tests/test_common.py tries a value outside each range, for every field of every script's Config, so
# a new numeric flag must be listed there. None is valid where it is the default (an optional fault).
# NaN fails every rule.
POSITIVE = ("must be > 0", lambda v: v > 0)
NON_NEGATIVE = ("must be >= 0", lambda v: v >= 0)
FRACTION = ("must be in [0, 1)", lambda v: 0 <= v < 1)
ANY_INT = ("any integer", lambda v: True)
AT_LEAST_ONE = ("must be >= 1", lambda v: v >= 1)
SEED = ("must be in [0, 2^32)", lambda v: 0 <= v < 2**32)  # the data's seeds are seed * 1_000_003 + step
SECONDS = ("must be in (0, 604800] (a week)", lambda v: 0 < v <= 604800)  # a timedelta, a socket timeout
HOURS = ("must be in (0, 1e6] (a century)", lambda v: 0 < v <= 1e6)  # squared and divided: a finite interval
# The fields every script's Config has (its RANGES adds its own).
SHARED_RANGES = {
    "steps": POSITIVE, "save_every": NON_NEGATIVE, "keep": POSITIVE, "seed": SEED, "batch_size": POSITIVE,
    "lr": POSITIVE, "min_lr": NON_NEGATIVE, "warmup": NON_NEGATIVE, "weight_decay": NON_NEGATIVE,
    "grad_clip": NON_NEGATIVE, "log_every": POSITIVE, "timeout_s": SECONDS,
    "crash_at_step": POSITIVE, "crash_rank": ANY_INT, "crash_in_save": POSITIVE, "nan_at_step": POSITIVE,
    "light_every": POSITIVE, "light_keep": POSITIVE}
CHOICES = {"device": ("auto", "cpu", "cuda")}


def range_problems(cfg, ranges):
    """'--flag must be > 0, got -1' for each field of `cfg` named in `ranges` whose value breaks its rule."""
    problems = []
    for name, (rule, ok) in ranges.items():
        value = getattr(cfg, name, None)
        if value is not None and not (math.isfinite(value) and ok(value)):
            problems.append(f"--{name.replace('_', '-')} {rule}, got {value}")
    return problems


def flag_problems(cfg, data_ranks, ranges):
    """Problems with the flags every script shares, and with the values of the numeric flags that the
    script's `ranges` lists; `data_ranks` is how many ranks split the batch."""
    problems = range_problems(cfg, ranges)
    problems += [f"--{name} {getattr(cfg, name)}: choose from {', '.join(allowed)}"
                 for name, allowed in CHOICES.items() if getattr(cfg, name) not in allowed]
    if getattr(cfg, "archive", ""):  # the object-store tier: a URL, s3fs, and a bucket that answers
        from tiers.archive import archive_problems
        problems += archive_problems(cfg.archive)
    if not problems and cfg.batch_size % data_ranks:
        problems.append(f"--batch-size {cfg.batch_size} (the global batch) does not split evenly over "
                        f"{data_ranks} ranks; it is kept fixed across world sizes so that a resume sees the "
                        f"same samples: pick a multiple of {data_ranks}")
    accum = getattr(cfg, "grad_accum", 1)
    if not problems and cfg.batch_size // data_ranks % accum:
        problems.append(f"--grad-accum {accum} does not divide a rank's {cfg.batch_size // data_ranks} rows "
                        f"(--batch-size {cfg.batch_size} over {data_ranks} ranks) into equal micro-batches")
    return problems


def fail(message, prog=None, code=2):
    """The same one-line error for problems found after parsing, then stop(code): 2 for bad input or
    unusable checkpoints; 3 when a running job stops itself (a diverged loss, a save that failed).
    Every rank may meet the same problem: the line is printed by each node's first rank (None: none)."""
    if message is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"{prog or os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr, flush=True)
    stop(code)


# The scripts' fault flags (tiers/faults.py; deleted with it, they read as None).
FAULT_FLAGS = ("crash_at_step", "crash_in_save", "crash_in_staging", "crash_in_snapshot", "freeze_at_step",
               "nan_at_step")


def faults_for(cfg, rank, world):
    """The tests' faults (tiers/faults.py's Faults), made only when a fault flag is set; else None."""
    if all(getattr(cfg, name, None) is None for name in FAULT_FLAGS):
        return None
    from tiers.faults import Faults
    return Faults(cfg, rank, world)


# Where the workers under torchrun of a launch by harness/launch.py leave the exit code of a deliberate
# stop, for the launcher to exit with (under plain torchrun: stop_file()).
STOP_FILE = "FT_STOP_FILE"


def stop(code):
    """End the process with `code`, a stop that trying again would only repeat (a refused setting, a full
    disk, a diverged loss). torchrun retries every non-zero exit --max-restarts times, each retraining
    from the last commit, then prints its failure dump and exits 1; the one status it does not retry is
    0. So under torchrun a worker first leaves `code` in its launch's stop file, where every restart
    finds it and exits at once (end_if_stopped); then it exits 0 under the launcher, which exits with
    the code, and with the code under plain torchrun, which then ends non-zero (a scheduler must not
    record a stop as a success) once its restarts are spent, a few seconds each. Either way without the
    interpreter's finalization (see common.dist.exit_without_finalizing), which could turn the exit
    status into a crash's."""
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
    """End at once a torchrun restart that follows a stop of this launch (its code in the stop file):
    torchrun restarts the whole group when any worker fails, and one may fail after a stop (a peer of
    the stopped ranks, a trainer the server killed), or (plain torchrun) the stop itself. Exits 0 under
    the launcher, which reports the stop's code, and with the code under plain torchrun."""
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
