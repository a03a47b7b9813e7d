"""The object-store tier (--archive s3://bucket/prefix): every checkpoint that commits in the run folder is
copied to S3 by a background process, and a job whose run folder holds no checkpoint resumes from the
newest archived one. Imported only when --archive is set; it imports no torch (the uploader, `python -m
tiers.archive URL`, runs it alone) and needs s3fs (requirements.txt).

Layout: s3://bucket/prefix/step-NNNNNNNN/ holds a checkpoint's files (a DCP folder's, `.metadata` last
of them; or the one step-NNNNNNNN.pt), then ARCHIVED.json, the commit: each file's bytes and sha256, the
step and the saving job's config. An S3 object appears whole or not at all, so a step without that
marker was cut short and is never loaded; a step with it is never written again. A fetch trusts no
marker: one that names a file by a path, or another step, or whose objects are missing or differ from
it, is skipped for the previous step; once an older one is fetched, the skipped ones are moved aside to
prefix/unreadable/step-NNNNNNNN-<time>/ (copied there, then their marker and objects deleted). If none
passes, the job stops (exit 2) with nothing moved, as a run folder whose checkpoints do not load does.

The endpoint and credentials are boto's own: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID and
AWS_SECRET_ACCESS_KEY, AWS_PROFILE, ~/.aws. No flag takes them and no line prints a key.

The uploader copies the checkpoints one at a time, in the order they commit. Each failed attempt (a file
past its deadline, as when the store stops answering, is one) is one line, then a retry after 1, 2, 4 ...
30 s, for as long as the job runs; at its end the job waits up to --timeout-s for the last one.
Meanwhile keep-K deletes no checkpoint that is not archived yet (Archive.held): a store that stays
unreachable keeps them all in the run folder, until a save finds the disk full and stops the job (exit
3, every checkpoint kept).
"""
import hashlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

MARKER = "ARCHIVED.json"
ASIDE = "unreadable"  # where damaged archived steps are moved: prefix/unreadable/step-NNNNNNNN-<time>/
# Short timeouts and one try per call: the uploader retries itself, with a line each time; s3fs's own five
# retries of a dead endpoint would hide it for half a minute.
CLIENT_CONFIG = {"connect_timeout": 5, "read_timeout": 30, "retries": {"max_attempts": 1}}
# aiohttp starts a request's read timeout only once its body is sent, and bounds neither the sending nor the
# wait for the "100 Continue" that botocore asks for first: a store that stops answering during an upload
# would hold it, in silence, for as long as it stays so. So each file's upload has a deadline: STALL_S, plus
# its bytes at SLOWEST_BPS times the attempt's number (a slower link gets through on a later attempt).
STALL_S, SLOWEST_BPS = 30, 8 * 2**20
FAULT = "FT_ARCHIVE_CRASH_AT_STEP"  # tests: the uploader SIGKILLs itself before step N's marker, once
REPO = Path(__file__).resolve().parents[1]


def split(url):
    """('bucket', 'prefix') of an s3://bucket/prefix URL (the prefix may be empty)."""
    bucket, _, prefix = url[len("s3://"):].partition("/")
    return bucket, prefix.strip("/")


def base(url):
    """The archive's root as s3fs names it: 'bucket/prefix'."""
    bucket, prefix = split(url)
    return f"{bucket}/{prefix}" if prefix else bucket


def filesystem():
    import s3fs
    fs = s3fs.S3FileSystem(skip_instance_cache=True, config_kwargs=CLIENT_CONFIG)
    fs.retries = 1
    return fs


def url_problems(url):
    """['--archive ...'] if `url` is not s3://bucket[/prefix], else []."""
    if not re.fullmatch(r"s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^\s]*)?", url):
        return [f"--archive must be an s3://bucket/prefix URL (a bucket name of 3-63 lower-case letters, digits, "
                f"dots or hyphens), got '{url}'"]
    return []


def archive_problems(url):
    """Why the job cannot archive to `url`, in one line each: not an s3:// URL, s3fs missing, an endpoint
    that does not answer, refused credentials, a bucket that does not exist. Asks the store only once a
    job (the launcher's preflight, or the first attempt's rank 0), not at every restart of every rank."""
    problems = url_problems(url)
    if problems or os.environ.get("RANK", "0") != "0" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return problems
    try:
        fs = filesystem()
    except ImportError:
        return ["--archive needs s3fs: run.sh installs it, or pip install s3fs==2026.9.0 (requirements.txt)"]
    return [f"--archive {url}: {why}"] if (why := reach(fs, split(url)[0])) else []


def tier_problems(cfg, fmt, shape_fields, sample_fields):
    """The script's check of --archive: archive_problems, then, for a run folder without a checkpoint,
    whether the archive's newest (which the resume would fetch) fits this run (common/checkpoint.py's
    resume_problem)."""
    from common.checkpoint import checkpoints, resume_problem
    problems = archive_problems(cfg.archive)
    if problems or checkpoints(Path(cfg.run_dir) / "ckpt"):
        return problems
    where, config = newest_archived(cfg.archive)
    problem = where and resume_problem({"format": fmt, "config": config}, cfg, fmt, shape_fields, sample_fields,
                                       cfg.allow_changes)[0]
    return [f"{where}: {problem}"] if problem else []


def reach(fs, bucket):
    """None if `bucket` answers, else why not (one line, no key in it)."""
    from botocore.exceptions import BotoCoreError, NoCredentialsError
    endpoint = os.environ.get("AWS_ENDPOINT_URL") or "AWS's endpoint"
    try:
        fs.call_s3("head_bucket", Bucket=bucket)
    except FileNotFoundError:
        return f"bucket {bucket} does not exist at {endpoint}: make it first"
    except PermissionError as e:
        return (f"{endpoint} refused the credentials for bucket {bucket} ({e}): check AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)")
    except NoCredentialsError:
        return "no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE)"
    except (BotoCoreError, OSError) as e:
        return f"{endpoint} did not answer ({type(e).__name__}: {str(e)[:100]}); set AWS_ENDPOINT_URL to the store's"
    return None


def marked_steps(fs, url):
    """The archived steps (those whose marker exists), newest first."""
    try:
        names = [Path(p).name for p in fs.ls(base(url), detail=False, refresh=True)]
    except FileNotFoundError:
        return []
    steps = sorted((int(m.group(1)) for n in names if (m := re.fullmatch(r"step-(\d{8})", n))), reverse=True)
    return [s for s in steps if fs.exists(f"{base(url)}/step-{s:08d}/{MARKER}")]


def newest_archived(url):
    """(its URL, the config it was saved with) of the archive's newest step, for the check before a resume
    would fetch it; (None, None) if there is none, and when the check is not the job's first (see
    archive_problems) or the store does not answer (the resume says so)."""
    if os.environ.get("RANK", "0") != "0" or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return None, None
    try:
        fs = filesystem()
        steps = marked_steps(fs, url)
        if steps:
            where = f"s3://{base(url)}/step-{steps[0]:08d}"
            return where, read_marker(fs, where[5:], steps[0])["config"]
    except Exception:
        pass
    return None, None


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


# ----------------------------------------------------------------------------- the uploader process
def upload(fs, url, job, tries=1):
    """Copy the committed checkpoint job['path'] of step job['step'] to its prefix, the marker last; its
    `tries`-th attempt. Returns the bytes copied, 0 if the step was archived already (never written again)."""
    step, path = job["step"], Path(job["path"])
    dest = f"{base(url)}/step-{step:08d}"
    if fs.exists(f"{dest}/{MARKER}"):
        return 0
    if tries > 1:  # a file cut off by its deadline may have left a multipart upload
        abort_dangling(fs, url)
    files = sorted(path.iterdir(), key=lambda p: (p.name == ".metadata", p.name)) if path.is_dir() else [path]
    manifest = {"step": step, "name": path.name, "files": {}, "config": job["config"]}
    for f in files:  # DCP's .metadata last of the data, so that DCP's own reader never sees a part
        manifest["files"][f.name] = {"bytes": f.stat().st_size, "sha256": sha256(f)}
        within_deadline(f.name, f.stat().st_size, tries, fs.put_file, str(f), f"{dest}/{f.name}")
    if os.environ.get(FAULT) == str(step):
        print(f"fault injection: the archive's uploader dies before step {step}'s marker", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    marker = json.dumps(manifest, indent=1).encode()
    within_deadline(MARKER, len(marker), tries, fs.pipe_file, f"{dest}/{MARKER}", marker)
    return sum(f["bytes"] for f in manifest["files"].values())


def within_deadline(name, nbytes, tries, call, *args):
    """call(*args), the s3fs upload of the file `name` (`nbytes`) in the `tries`-th attempt, cancelled once
    it runs past its deadline (see STALL_S): then a TimeoutError that says so."""
    from fsspec.exceptions import FSTimeoutError
    deadline_s = STALL_S + tries * nbytes / SLOWEST_BPS
    try:
        return call(*args, timeout=deadline_s)  # fsspec's own: the upload is cancelled, its connection closed
    except FSTimeoutError:
        raise TimeoutError(f"{name} not stored in {deadline_s:.0f} s: the store stopped answering, or is slower "
                           f"than {tries * SLOWEST_BPS / 2**20:.0f} MiB/s") from None


def abort_dangling(fs, url):
    """Abort the unfinished multipart uploads under the archive's prefix (an uploader that died mid-file
    leaves one, which the store keeps, and bills, until it is aborted)."""
    bucket, prefix = split(url)
    for up in fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", []):
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        print(f"archive: aborted an unfinished upload of {up['Key']}", file=sys.stderr, flush=True)


def serve(url):
    """The uploader: jobs in, one JSON line each on stdin, done in order; results out, one JSON line each
    on stdout; its messages on stderr. Ends when stdin closes and its last job is done."""
    out = sys.stdout
    sys.stdout = sys.stderr
    fs = filesystem()
    try:
        abort_dangling(fs, url)
    except Exception as e:
        print(f"archive: could not list unfinished uploads ({type(e).__name__}: {str(e)[:100]})", file=sys.stderr)
    for line in sys.stdin:
        out.write(json.dumps(attempt(fs, url, json.loads(line), out)) + "\n")
        out.flush()


def attempt(fs, url, job, out):
    """Upload `job` until it succeeds: each failure one line (and a result line on `out`), then a retry
    after 1, 2, 4 ... 30 s."""
    t0, tries = time.perf_counter(), 0
    while True:
        tries += 1
        try:
            nbytes = upload(fs, url, job, tries)
            return {"step": job["step"], "bytes": nbytes, "seconds": time.perf_counter() - t0, "attempts": tries,
                    "already": nbytes == 0}
        except FileNotFoundError as e:
            if not Path(job["path"]).exists():  # gone from the run folder (a person removed it): nothing to copy
                print(f"archive: step {job['step']} is gone from {Path(job['path']).parent}: not archived",
                      file=sys.stderr, flush=True)
                return {"step": job["step"], "skipped": True}
            error = e
        except Exception as e:
            error = e
        wait_s = min(30, 2 ** (tries - 1))
        why = f"{type(error).__name__}: {str(error)[:120]}"
        print(f"archive: step {job['step']}: attempt {tries} failed ({why}); again in {wait_s} s", file=sys.stderr,
              flush=True)
        out.write(json.dumps({"step": job["step"], "failed": why, "attempts": tries}) + "\n")
        out.flush()
        time.sleep(wait_s)


# ----------------------------------------------------------------------------- in the training job (rank 0)
class Archive:
    """Rank 0's end of the uploader: submit(step, path) after each commit; `held` are the steps keep-K must
    not delete (sent, not yet archived); record(monitor) logs each archive's event (step,
    bytes, seconds, attempts); close(wait_s) at the end. An uploader that dies is started again (one
    line), and the steps it held are sent again."""

    def __init__(self, url, config):
        self.url, self.config, self.held, self.done, self.archived = url, config, {}, [], []
        self.results, self.proc, self.blocked_s = queue.SimpleQueue(), None, 0.0
        self.start()

    def start(self):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        if self.proc is not None:
            env.pop(FAULT, None)  # a fault fires once
        self.proc = subprocess.Popen([sys.executable, "-m", "tiers.archive", self.url, str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        proc = self.proc
        self.reader = threading.Thread(target=lambda: [self.results.put(json.loads(line)) for line in proc.stdout],
                                       daemon=True)
        self.reader.start()
        for step, path in sorted(self.held.items()):
            self.send(step, path)

    def send(self, step, path):
        try:
            self.proc.stdin.write(json.dumps({"step": step, "path": str(path), "config": self.config}) + "\n")
            self.proc.stdin.flush()
        except OSError:  # the uploader is gone: check() starts another, which gets every held step
            pass

    def submit(self, step, path):
        """Archive the committed checkpoint `path` of `step`; it is held in the run folder until then."""
        self.held[step] = path
        self.send(step, path)

    def committed(self, step, path, monitor):
        """After a commit, in the training loop: submit it, log what is done; the loop's time in it counted."""
        t0 = time.perf_counter()
        self.submit(step, path)
        self.record(monitor)
        self.blocked_s += time.perf_counter() - t0

    def take(self, wait_s=0.0):
        """The uploader's results so far, in its order (waiting up to `wait_s` for the first): a step
        archived (or gone from the run folder) is no longer held; a failed attempt is only an event, the
        uploader tries again."""
        while True:
            try:
                result = self.results.get(timeout=wait_s) if wait_s > 0 else self.results.get_nowait()
            except queue.Empty:
                return
            wait_s = 0.0
            if "failed" not in result:
                self.held.pop(result["step"], None)
            if not result.get("skipped"):
                self.done.append(result)

    def check(self, idle=True):
        """Take the results; start the uploader again if it died (with `idle`, even if it held nothing)."""
        self.take()
        if self.proc.poll() is not None:
            self.reader.join(timeout=5)  # what it wrote before it ended
            self.take()
        if self.proc.poll() is not None and (idle or self.held):
            print(f"archive: the uploader died (exit {self.proc.returncode}); starting another"
                  + (f" for step {', '.join(map(str, sorted(self.held)))}" if self.held else ""), flush=True)
            self.start()

    def record(self, monitor):
        """Take the results (see check), and log them: an event each, and a line for each new archive."""
        self.check()
        self.log(monitor)

    def log(self, monitor):
        for result in self.done:
            monitor.event("archive_failed" if "failed" in result else "archive", **result)
            if not result.get("already", True):
                print(f"archived step {result['step']} ({result['bytes'] / 2**20:.1f} MiB in {result['seconds']:.2f} s,"
                      f" {result['attempts']} attempt{'s' * (result['attempts'] > 1)})", flush=True)
        self.archived += [{k: r[k] for k in ("step", "bytes", "seconds", "attempts")} for r in self.done
                          if "failed" not in r]  # for the summary
        self.done = []

    def close(self, wait_s, monitor):
        """Wait up to `wait_s` for the held steps' archives, then end the uploader; one line naming what
        is not archived if it gives up. Returns the steps not archived."""
        deadline = time.monotonic() + wait_s
        self.check()
        self.proc.stdin.close()  # the uploader ends once its last job is done
        while self.held and time.monotonic() < deadline:
            self.take(wait_s=min(1.0, deadline - time.monotonic()))
            if self.held and self.proc.poll() is not None:  # died at the end: another one for what it held
                self.check(idle=False)
                self.proc.stdin.close()
            self.log(monitor)  # as they come: a store down at the end shows in the metrics before it returns
        self.take()
        self.log(monitor)
        monitor.event("archive_end", archived=[r["step"] for r in self.archived], not_archived=sorted(self.held),
                      blocked_s=self.blocked_s)
        if self.held:
            print(f"archive: gave up after {wait_s:.0f} s: step {', '.join(map(str, sorted(self.held)))} is "
                  f"committed in the run folder but not archived in {self.url}", flush=True)
            self.proc.kill()
        self.proc.wait()
        return sorted(self.held)


OPEN = {}  # url -> this process's Archive: a Checkpointer made again (fsdp --survivors) keeps its uploader


def open_archive(url, config):
    if url not in OPEN:
        OPEN[url] = Archive(url, config)
    return OPEN[url]


class ArchiveTier:
    """--archive as a tier of the checkpointer (common/checkpointer.py calls its hooks; rpc/ps.py calls
    them itself): rank 0's uploader (Archive, started at the first call) gets each commit, keep-K
    deletes no step it holds, a run folder without a checkpoint gets the archive's newest before the
    resume, and the end waits up to --timeout-s for the last upload. The other ranks do nothing here."""

    def __init__(self, cfg, rank, monitor):
        self.cfg, self.rank, self.monitor = cfg, rank, monitor
        self.ckpt_dir, self.archived = Path(cfg.run_dir) / "ckpt", None

    def uploader(self):
        import dataclasses
        return open_archive(self.cfg.archive, dataclasses.asdict(self.cfg))

    def pinned(self):
        return set(self.uploader().held)

    def committed(self, step, path):
        self.uploader().committed(step, path, self.monitor)

    def before_load(self, restored):
        """Before a resume, on rank 0: a run folder that holds no committed checkpoint gets the archive's
        newest whole step (unless a step was restored already, from memory), where the script's load finds
        it; the newest local commit goes to the uploader (an earlier attempt may have ended before it was
        archived). A store that does not answer is a crash (torchrun tries again), never a fresh start
        over the archive."""
        from common.checkpoint import checkpoints
        if self.rank != 0:
            return
        archive = self.uploader()
        if restored is None and not checkpoints(self.ckpt_dir):
            try:
                step, nbytes, seconds = fetch_newest(self.cfg.archive, self.ckpt_dir)
            except NoneWhole as e:
                from common.config import fail
                fail(f"{e}; never a fresh start over the archive: move the damaged steps away or use another "
                     "--archive")
            except Exception as e:
                print(f"could not read the archive {self.cfg.archive} ({type(e).__name__}: {str(e)[:120]}): not "
                      "starting fresh over it", flush=True)
                raise SystemExit(1)
            if step is not None:
                self.monitor.event("fetch", step=step, bytes=nbytes, fetch_s=seconds, source=self.cfg.archive)
        committed = checkpoints(self.ckpt_dir)
        if committed:
            archive.submit(*committed[0])

    def finish(self, done=False):
        """At the end of a job (or a stop), on rank 0: wait up to --timeout-s for the uploader (a finished
        run is whole in the store), then apply keep-K to what it held back."""
        from common.checkpoint import checkpoints, prune
        if self.rank != 0:
            return
        archive = self.uploader()
        archive.close(self.cfg.timeout_s, self.monitor)
        committed = checkpoints(self.ckpt_dir)
        if committed:
            prune(self.ckpt_dir, self.cfg.keep, committed[0][0], held=archive.held)
        self.archived = archive.archived

    def summary(self):
        """What this attempt archived (step, bytes, seconds, attempts each)."""
        return {"archived": self.archived}


def end_with_trainer(trainer):
    """Make this process, the uploader, end with the training process `trainer` that started it: the
    kernel SIGKILLs it when `trainer` dies (PR_SET_PDEATHSIG, set by the uploader itself once it runs:
    between fork and exec is unsafe in a process with threads). A restarted job starts its own."""
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
    if os.getppid() != trainer:  # it died before the call
        sys.exit(1)


# ----------------------------------------------------------------------------- the resume (rank 0)
class Damaged(Exception):
    pass


class NoneWhole(Exception):
    pass


def fetch_newest(url, ckpt_dir):
    """Copy the newest archived step that is whole into `ckpt_dir` (committed there by a rename: the
    script's own load then reads it, with all its checks) and return (step, bytes, seconds); or
    (None, 0, 0) if the archive has none. A marked step whose marker or objects fail their check is
    skipped; once an older one has been fetched, the skipped ones are moved aside in the archive. If
    none passes, nothing is moved and NoneWhole is raised: as with a run folder whose checkpoints do not
    load, the job stops (never a fresh start over the archive)."""
    fs, t0 = filesystem(), time.perf_counter()
    for stale in Path(ckpt_dir).glob(".fetch-*"):  # a download killed before its rename (the lookup ignores it)
        shutil.rmtree(stale, ignore_errors=True)
    damaged = []
    for step in marked_steps(fs, url):
        src = f"{base(url)}/step-{step:08d}"
        try:
            nbytes, name = download(fs, src, step, Path(ckpt_dir))
        except Damaged as why:
            print(f"archive: step {step} fails its check ({why}): trying the previous one", flush=True)
            damaged.append((step, str(why)))
            continue
        for newer, why in damaged:
            move_aside(fs, url, newer, why)
        print(f"fetched step {step} from {url} ({nbytes / 2**20:.1f} MiB in {time.perf_counter() - t0:.2f} s)",
              flush=True)
        return step, nbytes, time.perf_counter() - t0
    if damaged:
        raise NoneWhole(f"no archived step of {url} passes its check (see above; steps "
                        f"{', '.join(str(s) for s, _ in damaged)}): nothing loaded, nothing moved")
    return None, 0, 0.0


PLAIN = re.compile(r"[A-Za-z0-9._-]{1,255}")  # a file name a marker may give: no separator
MARKER_MAX = 1 << 20  # bytes: a marker lists a step's few files (a DCP folder's: one a rank, and 2)


def read_marker(fs, src, step):
    """The marker of the archived step `src` (of `step`), checked before anything is written from it: its
    own size bounded, `name` the step's own (its file, or its DCP folder), each file a plain name (no
    separator, not . or ..) with a size and a sha256. Raises Damaged naming what is wrong: a marker is
    the bucket's word, and whoever can write the bucket can write it."""
    text = fs.cat_file(f"{src}/{MARKER}", start=0, end=MARKER_MAX + 1)  # read once: no other size to trust
    if len(text) > MARKER_MAX:
        raise Damaged(f"its marker is more than a marker's {MARKER_MAX} bytes")
    try:
        manifest = json.loads(text)
        name, files = manifest["name"], manifest["files"]
        assert isinstance(files, dict) and files
    except (ValueError, KeyError, TypeError, AssertionError):
        raise Damaged("its marker is not a marker (JSON with a name and files)") from None
    if name not in (f"step-{step:08d}", f"step-{step:08d}.pt"):
        raise Damaged(f"its marker names {str(name)[:80]!r}, not step {step}'s own checkpoint")
    for fname, want in files.items():
        if not PLAIN.fullmatch(fname) or fname in (".", ".."):
            raise Damaged(f"its marker names the file {fname[:80]!r}, not a plain file name")
        if not (isinstance(want, dict) and type(want.get("bytes")) is int and want["bytes"] >= 0
                and re.fullmatch(r"[0-9a-f]{64}", str(want.get("sha256")))):
            raise Damaged(f"its marker gives {fname!r} no size and sha256")
    if name.endswith(".pt") and list(files) != [name]:
        raise Damaged(f"its marker lists other files than {name}")
    if not name.endswith(".pt") and ".metadata" not in files:  # a DCP folder's commit (common/checkpoint.py)
        raise Damaged(f"its marker lists no .metadata for the folder {name}")
    return manifest


def download(fs, src, step, ckpt_dir):
    """Download the archived step `src` (of `step`) into a temp folder of this process's, checking its
    marker (read_marker) and each object against it (its size before the download, its sha256 after),
    and commit it as ckpt_dir/<name> by one rename. Returns (bytes, name); raises Damaged. Nothing is
    written outside the temp folder but the commit: each file is made new there (O_EXCL | O_NOFOLLOW)."""
    from common.checkpoint import fsync_dir as fsync  # (the training process's: torch is imported there)
    manifest = read_marker(fs, src, step)
    name, files = manifest["name"], manifest["files"]
    tmp = ckpt_dir / f".fetch-{name}-{os.getpid()}"
    tmp.mkdir(mode=0o700)
    try:
        for fname, want in files.items():
            try:
                size = fs.info(f"{src}/{fname}")["size"]
            except FileNotFoundError:
                raise Damaged(f"{fname} is missing") from None
            if size != want["bytes"]:
                raise Damaged(f"{fname} is {size} bytes, its marker says {want['bytes']}")
            os.close(os.open(tmp / fname, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
            fs.get_file(f"{src}/{fname}", str(tmp / fname))
            if (tmp / fname).stat().st_size != want["bytes"] or sha256(tmp / fname) != want["sha256"]:
                raise Damaged(f"{fname} differs from its marker")
            fsync(tmp / fname)
        fsync(tmp)
        os.replace(tmp / name if name.endswith(".pt") else tmp, ckpt_dir / name)  # the commit
        fsync(ckpt_dir)
    finally:
        if tmp.exists():
            for f in tmp.iterdir():
                f.unlink()
            tmp.rmdir()
    return sum(f["bytes"] for f in files.values()), name


def move_aside(fs, url, step, why):
    """Move an archived step that is not whole to prefix/unreadable/: copy its objects, then delete its
    marker (it is no longer an archived step), then the rest."""
    src = f"{base(url)}/step-{step:08d}"
    aside = f"{base(url)}/{ASIDE}/step-{step:08d}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    objects = fs.find(src)
    for obj in objects:
        fs.copy(obj, f"{aside}/{obj[len(src) + 1:]}")
    fs.rm_file(f"{src}/{MARKER}")
    for obj in objects:
        if not obj.endswith(f"/{MARKER}"):
            fs.rm_file(obj)
    print(f"archive: moved step {step} aside to s3://{aside} ({why}); it is kept for inspection, never loaded",
          flush=True)


if __name__ == "__main__":
    end_with_trainer(int(sys.argv[2]))
    serve(sys.argv[1])
