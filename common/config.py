"""Config-to-CLI: one flat dataclass per script is the single source of flags, defaults, help and ranges.

Each field's trailing `# comment` is its --help text. A bad flag is one line and exit 2.
"""
import argparse
import contextlib
import dataclasses
import inspect
import math
import os
import re
import sys
import typing

from common.stop import stop


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
    p = Parser(prog=prog, description=(cls.__doc__ or "").strip(), allow_abbrev=False,  # as harness/launch.py's
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
    """Parse argv into cls; `--preset NAME` sets the fields `presets[NAME]` holds, whatever the flags say.
    The first problem `check(cfg)` returns (a missing module it imports is one) is the error."""
    parser = make_parser(cls, prog=prog)
    cfg = cls(**vars(parser.parse_args(argv)))
    if getattr(cfg, "preset", ""):
        if cfg.preset not in (presets or {}):
            parser.error(f"--preset {cfg.preset}: choose from {', '.join(presets or {})}")
        cfg = dataclasses.replace(cfg, **presets[cfg.preset])
    try:
        problems = check(cfg) if check else []
    except ModuleNotFoundError as e:  # an optional module a flag asks for, not copied with the script
        problems = [getattr(e, "needed_by", None) or f"{e.name} is not here, and a flag (yours or its default) "
                    "needs it: copy it with the script, or turn that flag off"]
    for problem in problems:
        parser.error(problem)
    return cfg


@contextlib.contextmanager
def needs(flag, off=None):
    """Around an optional module's import in check(): if it is missing, parse_config's one line names `flag`,
    which asks for it, and how to run without it (`off`: the value that turns it off; None: leave it out)."""
    try:
        yield
    except ModuleNotFoundError as e:
        missing = e.name.replace(".", "/") + (".py" if "." in e.name else "/")  # a file of a folder, or the folder
        e.needed_by = (f"{flag} needs {missing}, which is not here: copy it with the script, or run "
                       + (f"with {flag} {off}" if off is not None else f"without {flag}"))
        raise


# A flag's rules: (rule, test). Each script's RANGES lists its numeric flags', and tests/test_common.py tries a
# value outside each, so a new numeric flag must be listed. None is valid as a default; NaN fails every rule.
POSITIVE = ("must be > 0", lambda v: v > 0)
NON_NEGATIVE = ("must be >= 0", lambda v: v >= 0)
FRACTION = ("must be in [0, 1)", lambda v: 0 <= v < 1)
AT_LEAST_ONE = ("must be >= 1", lambda v: v >= 1)
SEED = ("must be in [0, 2^32)", lambda v: 0 <= v < 2**32)  # the data's seeds are seed * 1_000_003 + step
SECONDS = ("must be in (0, 604800] (a week)", lambda v: 0 < v <= 604800)  # a timedelta, a socket timeout
HOURS = ("must be in (0, 1e6] (a century)", lambda v: 0 < v <= 1e6)  # squared and divided: a finite interval
HANG = ("must be in [1, 604800] (a second to a week)", lambda v: 1 <= v <= 604800)  # below, a slow step is a hang
# Flags that do nothing without another: (the flag, the one it needs, its value when not given).
NEEDS = [("light_keep", "light_every", 2)]
# The fields every script's Config has (its RANGES adds its own).
SHARED_RANGES = {
    "steps": POSITIVE, "save_every": NON_NEGATIVE, "keep": POSITIVE, "seed": SEED, "batch_size": POSITIVE,
    "lr": POSITIVE, "min_lr": NON_NEGATIVE, "warmup": NON_NEGATIVE, "weight_decay": NON_NEGATIVE,
    "grad_clip": NON_NEGATIVE, "log_every": POSITIVE, "timeout_s": SECONDS}
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
    """Problems with the flags every script shares and those `ranges` lists; `data_ranks` ranks split the batch."""
    problems = range_problems(cfg, ranges)
    problems += [f"--{name} {getattr(cfg, name)}: choose from {', '.join(allowed)}"
                 for name, allowed in CHOICES.items() if getattr(cfg, name) not in allowed]
    problems += [f"--{flag.replace('_', '-')} does nothing without --{needed.replace('_', '-')}" for flag, needed, alone
                 in NEEDS if getattr(cfg, flag, alone) != alone and not getattr(cfg, needed, None)]
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
    """One error line, then stop(code): 2 for bad input or unusable checkpoints, 3 when a running job stops
    itself. Every rank may meet the problem, so each node's first rank alone prints it (None: none)."""
    if message is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"{prog or os.path.basename(sys.argv[0])}: error: {message}", file=sys.stderr, flush=True)
    stop(code)
