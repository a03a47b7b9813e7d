"""Config-to-CLI: one flat dataclass per script is the single source of flags, defaults and help.

Each field's trailing `# comment` in the dataclass source is its help text, so the
comment a reader sees next to a default is exactly what `--help` prints.

Also a preflight, used by run.sh before torchrun starts any worker, so that a typo
is reported once, in one line, instead of being retried --max-restarts times:

    python -m common.config ddp/train.py 4 --steps 40 ...
"""
import argparse
import dataclasses
import importlib.util
import inspect
import os
import re
import sys
import tempfile
import typing


class Parser(argparse.ArgumentParser):
    def error(self, message):
        # One clear line and exit 2, never a usage dump or a traceback.
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


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


def parse_config(cls, check=None, argv=None, prog=None):
    """Parse argv into cls; `check(cfg)` returns a list of problems, the first is reported as the error."""
    parser = make_parser(cls, prog=prog)
    cfg = cls(**vars(parser.parse_args(argv)))
    if getattr(cfg, "preset", ""):  # a named model shape replaces the shape flags
        from common.model import PRESETS
        if cfg.preset not in PRESETS:
            parser.error(f"--preset {cfg.preset}: choose from {', '.join(PRESETS)}")
        cfg = dataclasses.replace(cfg, **PRESETS[cfg.preset])
    for problem in (check(cfg) if check else []):
        parser.error(problem)
    return cfg


def common_problems(cfg, data_ranks):
    """Problems with the flags every script shares; `data_ranks` is how many ranks split the batch."""
    problems = []
    for flag, value in (("steps", cfg.steps), ("save-every", cfg.save_every), ("keep", cfg.keep),
                        ("batch-size", cfg.batch_size), ("dim", cfg.dim), ("heads", cfg.heads)):
        if value <= 0:
            problems.append(f"--{flag} must be > 0, got {value}")
    if not problems and cfg.dim % cfg.heads:
        problems.append(f"--heads {cfg.heads} does not divide --dim {cfg.dim}")
    if not problems and cfg.batch_size % data_ranks:
        problems.append(f"--batch-size {cfg.batch_size} (the global batch) does not split evenly over "
                        f"{data_ranks} ranks; it is kept fixed across world sizes so that a resume sees the "
                        f"same samples: pick a multiple of {data_ranks}")
    if cfg.data and not os.path.isfile(cfg.data):
        problems.append(f"--data {cfg.data}: no such file")
    elif cfg.data and cfg.vocab != 256:
        problems.append(f"--data trains on bytes: it needs --vocab 256, got {cfg.vocab}")
    peak = os.environ.get("PEAK_TFLOPS", "")
    try:
        if peak and not float(peak) > 0:
            raise ValueError
    except ValueError:
        problems.append(f"PEAK_TFLOPS (the device's bf16 peak, for MFU) must be a positive number, got {peak!r}")
    try:
        os.makedirs(cfg.run_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=cfg.run_dir):
            pass
    except OSError as e:
        problems.append(f"--run-dir {cfg.run_dir} is not writable ({e.strerror})")
    return problems


def fail(message, prog=None):
    """The same one-line, exit-2 error for problems found after parsing (for example in a checkpoint)."""
    prog = prog or os.path.basename(sys.argv[0])
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def load_script(path):
    """Import a script file as a module (its `main` does not run)."""
    spec = importlib.util.spec_from_file_location("script_under_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # inspect finds the Config source through it
    spec.loader.exec_module(module)
    return module


if __name__ == "__main__":
    # Preflight: python -m common.config SCRIPT WORLD_SIZE [flags]; exit 0 if the flags are valid.
    script, world = sys.argv[1], sys.argv[2]
    os.environ["WORLD_SIZE"] = world  # the checks that depend on it (global batch) see the planned size
    module = load_script(script)
    parse_config(module.Config, module.check, sys.argv[3:], prog=script)
