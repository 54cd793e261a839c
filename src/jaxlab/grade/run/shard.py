"""Split a batch into shards that separate machines grade into one shared output folder.

A submission's shard is a hash of its ``file`` key modulo the number of shards: every machine
computes the same split from the same folder, each submission is in exactly one shard, and
adding submissions never moves the others. Each shard writes only files of its own: its
submissions' records, summaries and Gradescope JSON, its log and its manifest
(``.jaxlab/shards/K-of-N.json``: which submissions, with their content hashes, it was given).
``jaxlab report`` merges the records the manifests name; ``jaxlab status`` (``status`` here)
counts them per shard.
"""

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import socket
import time

from ..model import Record

SHARDS = "shards"  # under OUTDIR/.jaxlab
RECORDS = "records"
AUTOGRADERS = "autograder"  # under OUTDIR/.jaxlab: the zips records were graded with


class BadShard(ValueError):
    """A --shard that is not K/N with 0 <= K < N; the message says what was given."""


@dataclasses.dataclass(frozen=True)
class Shard:
    index: int
    count: int

    @classmethod
    def parse(cls, text):
        """``"K/N"`` (as Slurm's and Kubernetes' indexes count: from 0) into a Shard."""
        if isinstance(text, Shard):
            return text
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
        if not m or not 0 <= int(m[1]) < int(m[2]):
            raise BadShard(f"--shard takes K/N with 0 <= K < N (shards count from 0, as "
                           f"SLURM_ARRAY_TASK_ID and JOB_COMPLETION_INDEX do); got {text!r}")
        return cls(int(m[1]), int(m[2]))

    def __str__(self):
        return f"{self.index}/{self.count}"

    @property
    def name(self):
        return f"{self.index}-of-{self.count}"

    def holds(self, file):
        return shard_of(file, self.count) == self.index


WHOLE = Shard(0, 1)  # a batch graded on one machine is its own single shard


def shard_of(file, count):
    """The shard of the submission whose ``file`` key is ``file``, out of ``count``."""
    digest = hashlib.sha256(file.encode()).digest()
    return int.from_bytes(digest[:8], "big") % count


@dataclasses.dataclass
class Manifest:
    """What one shard was given, written by that shard alone (or by ``jaxlab slurm`` before it
    starts): ``files`` maps each submission's ``file`` key to its content hash."""

    shard: Shard
    files: dict
    autograder: str | None = None  # the zip's name under .jaxlab/autograder/
    host: str | None = None
    started: float | None = None  # None: planned, not started yet
    finished: float | None = None
    updated: float = 0.0

    def to_dict(self):
        return {**dataclasses.asdict(self), "shard": str(self.shard)}

    @classmethod
    def from_dict(cls, raw):
        return cls(**{**raw, "shard": Shard.parse(raw["shard"])})


def state_dir(output_dir):
    return pathlib.Path(output_dir) / ".jaxlab"


def manifest_path(output_dir, shard):
    return state_dir(output_dir) / SHARDS / f"{shard.name}.json"


def write_manifest(output_dir, manifest):
    manifest.updated = time.time()
    path = manifest_path(output_dir, manifest.shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest.to_dict(), indent=1, sort_keys=True))
    tmp.replace(path)


def keep_autograder(output_dir, zip_path):
    """A copy of ``zip_path`` under OUTDIR/.jaxlab, named by its content (shards copying the
    same zip write the same bytes under the same name, atomically); that name."""
    data = pathlib.Path(zip_path).read_bytes()
    name = f"{hashlib.sha256(data).hexdigest()[:20]}.zip"
    folder = state_dir(output_dir) / AUTOGRADERS
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / name).exists():
        tmp = folder / f"{name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        tmp.replace(folder / name)
    return name


def started(output_dir, shard, files, autograder):
    """Write ``shard``'s manifest as it starts grading ``files`` ({file: sha256})."""
    m = Manifest(shard=shard, files=dict(sorted(files.items())), autograder=autograder,
                 host=socket.gethostname(), started=time.time())
    write_manifest(output_dir, m)
    return m


def plan(output_dir, subs, count, autograder=None):
    """Manifests of every shard of ``subs`` split ``count`` ways, before any of them starts
    (``jaxlab slurm`` writes them, so ``jaxlab status`` knows what a queued shard holds)."""
    digests = {s.file: s.digest() for s in subs}
    manifests = []
    for index in range(count):
        shard = Shard(index, count)
        m = Manifest(shard=shard, autograder=autograder,
                     files={f: d for f, d in sorted(digests.items()) if shard.holds(f)})
        write_manifest(output_dir, m)
        manifests.append(m)
    return manifests


class NoManifests(FileNotFoundError):
    """OUTDIR holds no shard manifest: nothing was graded into it by this jaxlab."""


@dataclasses.dataclass(frozen=True)
class Split:
    """The manifests of the most recent split of OUTDIR (the last ``--shard K/N`` count used)."""

    count: int
    manifests: dict  # index -> Manifest
    ignored: tuple  # counts of older splits whose manifests are left out

    def files(self):
        """{file: sha256} over every shard's manifest, sorted by file."""
        out = {}
        for m in self.manifests.values():
            out.update(m.files)
        return dict(sorted(out.items()))

    def missing(self):
        """Indexes of shards without a manifest (never planned nor started)."""
        return [i for i in range(self.count) if i not in self.manifests]


def current_split(output_dir):
    """The split of OUTDIR whose manifest was written last."""
    folder = state_dir(output_dir) / SHARDS
    found = []
    for path in sorted(folder.glob("*-of-*.json")) if folder.is_dir() else []:
        try:
            found.append(Manifest.from_dict(json.loads(path.read_text())))
        except (OSError, ValueError, TypeError, KeyError):
            continue
    if not found:
        raise NoManifests(f"{output_dir} holds no grading state (.jaxlab/{SHARDS}/); grade "
                          "into it with `jaxlab grade` first")
    newest = max(found, key=lambda m: m.updated).shard.count
    chosen = {m.shard.index: m for m in found if m.shard.count == newest}
    ignored = tuple(sorted({m.shard.count for m in found} - {newest}))
    return Split(newest, chosen, ignored)


def records_of(output_dir, files):
    """{file: Record} for the submissions in ``files`` ({file: sha256}) graded at that hash."""
    folder = state_dir(output_dir) / RECORDS
    found = {}
    for path in folder.glob("*.json") if folder.is_dir() else []:
        try:
            r = Record.read(path)
        except (OSError, ValueError, TypeError, KeyError):  # unreadable or from an older jaxlab
            continue
        if files.get(r.file) == r.sha256:
            found[r.file] = r
    return found


@dataclasses.dataclass(frozen=True)
class ShardStatus:
    shard: Shard
    total: int | None  # None: no manifest yet
    done: int = 0  # graded (a row with its points)
    failed: int = 0  # nothing could be graded: the grading process died or hung, etc.
    host: str | None = None
    started: float | None = None
    finished: float | None = None
    last_record: float | None = None  # when its newest record was written
    queue: str | None = None  # what the scheduler says of its task, e.g. "pending (Resources)"

    @property
    def remaining(self):
        return None if self.total is None else self.total - self.done - self.failed

    @property
    def state(self):
        if self.total is None:
            return "no manifest"
        if self.total == 0:
            return "empty"  # no submission hashes to it
        if self.remaining == 0:
            return "complete"
        if self.started is None:
            return "queued"
        if self.finished is not None:
            return "ended incomplete"
        return "started"


def status(*, output_dir, queue=None, show=True):
    """Done, failed and remaining submissions per shard of OUTDIR's current split.

    ``queue``: {Shard: what the scheduler says of its task} (``slurm.queue``), shown beside."""
    queue = queue or {}
    split = current_split(output_dir)
    records = records_of(output_dir, split.files())
    folder = state_dir(output_dir) / RECORDS
    rows = []
    for index in range(split.count):
        m = split.manifests.get(index)
        if m is None:
            rows.append(ShardStatus(Shard(index, split.count), None))
            continue
        mine = [records[f] for f in m.files if f in records]
        times = [(folder / f"{record_key(r.file)}.json").stat().st_mtime for r in mine]
        rows.append(ShardStatus(m.shard, len(m.files),
                                done=sum(not r.catastrophic for r in mine),
                                failed=sum(r.catastrophic for r in mine), host=m.host,
                                started=m.started, finished=m.finished,
                                last_record=max(times) if times else None,
                                queue=queue.get(m.shard)))
    if show:
        print_status(rows, split)
    return rows


def record_key(file):
    """The name (without .json) of a submission's record under .jaxlab/records/."""
    return hashlib.sha256(file.encode()).hexdigest()[:24]


def print_status(rows, split):
    from rich.console import Console
    from rich.table import Table

    now = time.time()
    t = Table(title=f"{split.count} shard{'s' if split.count != 1 else ''}")
    for col in ("shard", "state", "done", "failed", "remaining", "host", "last record"):
        t.add_column(col, justify="right" if col in ("done", "failed", "remaining") else "left")
    for r in rows:
        ago = f"{now - r.last_record:.0f} s ago" if r.last_record else ""
        t.add_row(str(r.shard), r.state, str(r.done), str(r.failed),
                  "?" if r.remaining is None else str(r.remaining), r.host or "", ago)
    if len(rows) > 1:
        known = [r for r in rows if r.total is not None]
        t.add_row("all", "", str(sum(r.done for r in rows)), str(sum(r.failed for r in rows)),
                  str(sum(r.remaining for r in known)) + ("+?" if len(known) < len(rows) else ""),
                  "", "")
    Console().print(t)
    for r in rows:  # whole lines, not a column an 80-character table would cut short
        if r.queue:
            print(f"shard {r.shard} in the scheduler's queue: {r.queue}")
    if split.ignored:
        print(f"(older manifests of a {', '.join(map(str, split.ignored))}-way split are "
              "ignored)")
