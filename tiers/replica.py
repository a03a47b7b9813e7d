"""The memory tier's peer replicas (tiers/snapshot.py), for a job on several nodes: each rank's record
of a snapshot, and for FSDP its shards, are also kept by the same local rank of the next node, so that a
node replaced with an empty memory still resumes from memory. snapshot.open_tier makes a Replica only
when the job has several nodes; a job on one node never imports this module.

Files, in the keeping rank's snapshot folder, named after the rank they came from (the source):
    <run>-rank<R>-slot<S>.replica.json          its record, written after its shards
    <run>-rank<R>-slot<S>-<size>.replica.bin    its shards ("shards" mode only)
"""
import json

import torch
import torch.distributed as dist

from common.checkpoint import atomic_write
from tiers.shm import checksum, map_file, read_checked


class Replica:
    """This rank's side of the exchange, over `side` (a gloo group whose timeout is a hang's): each
    record goes to `partner`, and `source`'s is received and kept. `mode` is "records" (DDP: every node
    holds the same model and optimizer, so a new rank takes them from a peer and only its record is kept)
    or "shards" (FSDP: the record's shards are kept too). `fmt` is the tier's record format."""

    def __init__(self, folder, run, rank, partner, source, side, mode, fmt):
        self.folder, self.run, self.rank, self.fmt = folder, run, rank, fmt
        self.partner, self.source, self.side, self.mode = partner, source, side, mode
        self.maps = {}  # (slot, size) -> the source's shards kept here, mapped as uint8

    def path(self, slot):
        return self.folder / f"{self.run}-rank{self.source}-slot{slot}.replica.json"

    def bin_path(self, slot, nbytes):
        return self.folder / f"{self.run}-rank{self.source}-slot{slot}-{nbytes}.replica.bin"

    def exchange(self, payload, shards):
        """Send this rank's record (`payload`, JSON bytes; empty after a failed copy) and, with "shards",
        its shards (`shards`, the .bin as uint8) to the partner, and keep the source's: the sizes, then
        the bytes. The kept record is deleted before its shards arrive and written after them, as a
        slot's own."""
        size = torch.zeros(1, dtype=torch.int64)
        for request in (dist.isend(torch.tensor([len(payload)]), self.partner, group=self.side),
                        dist.irecv(size, self.source, group=self.side)):
            request.wait()
        out = torch.frombuffer(bytearray(payload + b"\0"), dtype=torch.uint8)[:len(payload)]
        incoming = torch.empty(int(size), dtype=torch.uint8)
        requests = [dist.isend(out, self.partner, group=self.side)] if len(payload) else []
        requests += [dist.irecv(incoming, self.source, group=self.side)] if len(incoming) else []
        for request in requests:
            request.wait()
        record = json.loads(incoming.numpy().tobytes()) if len(incoming) else None
        if self.mode == "shards":
            requests = [dist.isend(shards, self.partner, group=self.side)] if len(payload) else []
            if record is not None:
                self.path(record["slot"]).unlink(missing_ok=True)
                key = (record["slot"], record["nbytes"])
                if key not in self.maps:
                    self.maps[key] = map_file(self.bin_path(*key), record["nbytes"], write=True)
                requests.append(dist.irecv(self.maps[key], self.source, group=self.side))
            for request in requests:
                request.wait()
        if record is not None:
            data = incoming.numpy().tobytes()
            atomic_write(self.path(record["slot"]), lambda f: f.write(data), mode=0o600)

    def records(self):
        """{source rank: {step: record}} of the replicas kept here, of this run ({}: none); with shards,
        only those whose shards match the record's checksum."""
        found = {}
        for slot in (0, 1):
            try:
                record = json.loads(read_checked(self.path(slot)))
            except (OSError, ValueError):  # absent, or not a record
                continue
            if (record.get("format"), record.get("run"), record.get("rank")) != (self.fmt, self.run, self.source):
                continue
            if self.mode == "shards" and self.shards(record) is None:
                print(f"rank {self.rank}: the replica of rank {self.source}'s step {record['step']} is damaged: "
                      "not used", flush=True)
                continue
            found[record["step"]] = record
        return {self.source: found} if found else {}

    def shards(self, record):
        """The source's shards of `record`, kept here (uint8), if they match its checksum; else None."""
        if record["part"] != [0, record["nbytes"]]:
            return None
        try:
            buf = map_file(self.bin_path(record["slot"], record["nbytes"]), record["nbytes"], write=False)
        except (OSError, ValueError):  # missing, or of the wrong size
            return None
        return buf if checksum(buf, record["layout"]) == record["crc32"] else None

    def send_shards(self, record, to):
        """At a resume: the shards of `record`, kept here, to the rank `to` that lost its own."""
        dist.isend(self.shards(record), to, group=self.side).wait()

    def receive_shards(self, record, holder):
        """At a resume: this rank's shards of `record`, from the rank `holder` that kept them."""
        buf = torch.empty(record["nbytes"], dtype=torch.uint8)
        dist.irecv(buf, holder, group=self.side).wait()
        return buf
