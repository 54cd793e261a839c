"""Warm the compilation cache that every kernel reads: grade a trusted notebook once.

A kernel may not write a cache that another submission's kernel loads code from (the entry
would be the next submission's code). So one trusted run writes it: the lab's own solution,
graded like a submission (in the sandbox when the batch has one) with the cache folder
writable. Every kernel after it gets the folder read-only, and JAX is told never to write
(``kernel.NEVER_WRITE_S``). The folder is kept per user, per autograder zip and per JAX
version, so one warm-up serves every later batch of that lab on this machine, as otter's
Docker image is built once per autograder.

The warm-up is also a check of the grading machine: a solution that does not score in full
here says the environment differs from the one the autograder was built for.

Batches that start together on one machine (the shards of a Slurm array on one node) warm it
once: the first takes a lock (a file under ``locks/``) and warms, the others wait for the lock
and read what it wrote. The kernel drops the lock of a grader that dies, so a killed warm-up is
retried by the next batch.
"""

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import sys
import tempfile
import time

MARKER = "warm-up.json"  # written last: a folder without it was not warmed


@dataclasses.dataclass(frozen=True)
class WarmCache:
    """A warmed compilation cache and how the trusted notebook scored while warming it."""

    folder: pathlib.Path
    notebook: str
    earned: float
    possible: float
    status: str
    seconds: float
    warmed_now: bool  # False: a previous batch warmed it

    @property
    def complete(self):
        return self.possible > 0 and self.earned >= self.possible

    def describe(self):
        when = f"warmed now in {self.seconds:.0f} s" if self.warmed_now else "warmed before"
        return (f"compilation cache {when} by grading {self.notebook} "
                f"({self.earned:g}/{self.possible:g})")


def cache_root():
    """Where jaxlab keeps what it may reuse between batches ($JAXLAB_CACHE_DIR to move it)."""
    if os.environ.get("JAXLAB_CACHE_DIR"):
        return pathlib.Path(os.environ["JAXLAB_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "jaxlab"


def folder_for(zip_path):
    """The cache folder of one autograder zip under the JAX and Python this grader runs."""
    h = hashlib.sha256(pathlib.Path(zip_path).read_bytes())
    for dist in ("jax", "jaxlib"):
        try:
            h.update(f"{dist}=={importlib.metadata.version(dist)}".encode())
        except importlib.metadata.PackageNotFoundError:
            h.update(f"{dist} missing".encode())
    h.update(f"{platform.python_version()} {platform.machine()}".encode())
    return cache_root() / "compile-cache" / h.hexdigest()[:20]


def reference_folder(zip_path):
    """Where trusted workers keep the references a checks module computed (e.g. Lab 3's trained
    parameters), for later workers and batches; never bound into a kernel."""
    return cache_root() / "references" / folder_for(zip_path).name


def shipped_solution(zip_path):
    """``solutions/<lab>/<lab>.ipynb`` beside ``autograder/<lab>-autograder.zip``, if there."""
    zip_path = pathlib.Path(zip_path).resolve()
    name = zip_path.name.removesuffix("-autograder.zip")
    path = zip_path.parent.parent / "solutions" / name / f"{name}.ipynb"
    return path if name != zip_path.name and path.is_file() else None


def read(folder):
    """The WarmCache in ``folder``, or None when it was never warmed."""
    try:
        raw = json.loads((folder / MARKER).read_text())
        return WarmCache(folder=folder, warmed_now=False, **raw)
    except (OSError, ValueError, TypeError):
        return None


def warm(*, zip_path, notebook, grade_one):
    """The warmed cache for ``zip_path``, grading ``notebook`` now if no batch warmed it yet.

    ``grade_one(cache_dir, notebook)`` grades the notebook with ``cache_dir`` writable and
    returns ``(earned, possible, status)``, or None when it could not be graded at all (then
    nothing is kept and the batch runs without a cache).
    """
    final = folder_for(zip_path)
    done = read(final)
    if done is not None:
        return done
    final.parent.mkdir(parents=True, exist_ok=True)
    locks = cache_root() / "locks"  # kept (unlinking a lock file races with its next user)
    locks.mkdir(parents=True, exist_ok=True)
    with _locked(locks / f"{final.name}.lock"):
        done = read(final)  # warmed by the batch that held the lock before us
        return done if done is not None else _warm(final, notebook, grade_one)


@contextlib.contextmanager
def _locked(path):
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"jaxlab grade: another batch on this machine is warming the compilation "
                  f"cache; waiting for it ({path})", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _warm(final, notebook, grade_one):
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"{final.name}-warming-", dir=final.parent))
    tmp.chmod(0o755)  # the sandbox's user reads it
    start = time.monotonic()
    try:
        result = grade_one(tmp, notebook)
        if result is None:
            return None
        earned, possible, status = result
        info = {"notebook": str(notebook), "earned": earned, "possible": possible,
                "status": status, "seconds": round(time.monotonic() - start, 1)}
        (tmp / MARKER).write_text(json.dumps(info))
        try:
            tmp.rename(final)  # atomic: a batch that warmed the same folder meanwhile wins
        except OSError:
            return read(final)
        return WarmCache(folder=final, warmed_now=True, **info)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
