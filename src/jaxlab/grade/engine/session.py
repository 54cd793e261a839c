"""Run cells in one kernel under the submission's limits, one cell at a time.

Built on nbclient's public ``setup_kernel()`` and ``execute_cell()``: the worker decides what runs
next between cells (its phases), so nothing is appended to a list nbclient walks. Limits are
enforced from outside the kernel: a watchdog thread kills its process tree over the wall-clock
limit or the memory cap; a cell over the per-cell limit is interrupted.
"""

import dataclasses
import datetime
import pathlib
import re
import threading
import time

import nbformat.v4 as v4
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

from . import process
from ..model import MiB, Stop, StopKind


class Watchdog(threading.Thread):
    """Kills the kernel's processes over the wall-clock limit or the memory cap.

    Sums the resident memory of the kernel's whole tree (RLIMIT_AS breaks JAX); in a sandbox
    that tree is bwrap and everything in its PID namespace, all visible from outside. Remembers
    every process it saw, so one that left the tree is still killed at the end.
    """

    def __init__(self, kernel, timeout, memory_bytes):
        super().__init__(daemon=True)
        self.kernel, self.deadline, self.cap = kernel, time.monotonic() + timeout, memory_bytes
        self.seen, self.kind, self.detail, self.peak, self.peak_tasks = {}, None, "", 0, 0
        self._halt = threading.Event()
        self._deciding = threading.Lock()  # one thread decides to kill, and kills

    POLL_S = 0.2  # memory and clock
    TREE_EVERY = 5  # polls between looks for new processes: psutil scans all of /proc for
    # them (~2 ms, measured 0.14 CPU-s per 15 s at every poll, on the kernel's core)

    def run(self):
        polls, procs = 0, []
        while not self._halt.wait(self.POLL_S):
            if polls % self.TREE_EVERY == 0:
                procs = self.kernel.tree()
                self.seen.update((p.pid, p) for p in procs)
            polls += 1
            rss = process.rss(procs)
            self.peak = max(self.peak, rss)
            group = self.kernel.cgroup
            if group is not None:
                self.peak_tasks = max(self.peak_tasks, group.tasks())
            with self._deciding:  # the session may stop the kernel between two polls
                if self.kind is None:
                    if self._cap_hit():
                        pass  # the kind and its words are set
                    elif rss > self.cap:
                        self.kind = StopKind.MEMORY
                        self.detail = f"memory use {rss / MiB:.0f} MiB went over the cap of " \
                                      f"{self.cap / MiB:.0f} MiB"
                    elif time.monotonic() > self.deadline:
                        self.kind = StopKind.TIMEOUT
                    if self.kind:
                        self.kernel.kill(self.seen.values())
                if self.kind:
                    return

    def _cap_hit(self):
        group = self.kernel.cgroup
        if group is None or not group.cap_hits():
            return False
        # a fork or thread start failed: what it was for is broken, so this is a fault like
        # the memory cap (the second run skips the cell)
        self.kind = StopKind.PROCESSES
        self.detail = f"it tried to run more than {group.processes} processes and threads " \
                      "at once (the cap)"
        return True

    def stopped(self):
        """Why the kernel was stopped (None: it was not), looking at the process cap now; a cap
        hit kills the kernel here as at a poll (under the lock: killing from two threads at
        once can hang jupyter_client). The session asks after each cell, so that a cell that
        hits the cap and ends within one poll (a thread flood stops at its first refused start)
        is the one blamed, not the cell running at the next poll."""
        with self._deciding:
            if self.kind is None and self._cap_hit():
                self.kernel.kill(self.seen.values())
            return self.kind

    def stop(self):
        self._halt.set()


def kernel_seconds(cell):
    """Seconds a run cell took as its kernel timed it (from the execute_input message to the
    execute_reply: nbclient keeps their timestamps); 0 when unknown. Untrusted: for reports."""
    stamps = cell.get("metadata", {}).get("execution", {})
    try:
        return max(0.0, (datetime.datetime.fromisoformat(stamps["shell.execute_reply"]) -
                         datetime.datetime.fromisoformat(stamps["iopub.execute_input"])
                         ).total_seconds())
    except (KeyError, TypeError, ValueError):
        return 0.0


class _Client(NotebookClient):
    """nbclient that stops keeping outputs past ``output_cap`` characters."""

    output_cap = 10 * MiB
    output_chars = 0
    output_truncated = False

    def output(self, outs, msg, display_id, cell_index):
        self.output_chars += len(str(msg["content"]))
        if self.output_chars > self.output_cap:
            self.output_truncated = True
            return None
        return super().output(outs, msg, display_id, cell_index)


@dataclasses.dataclass(frozen=True)
class CellFault:
    """How one of the student's cells broke: it "raised", "timed out" (interrupted at the
    per-cell limit) or was "skipped" (it killed the kernel in a first run)."""

    kind: str
    error: str = ""  # "Name: text" of what it raised
    line: int | None = None  # the line of the cell where it raised or was stopped
    seconds: float | None = None  # the per-cell limit it ran over
    detail: str = ""  # why a skipped cell was skipped


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def traceback_line(traceback):
    """The line of the running cell in IPython's traceback text: its first ``Cell In[n], line k``
    (untrusted text from the kernel: it only words the student's own message)."""
    match = re.search(r"Cell In\[\d+\], line (\d+)", ANSI.sub("", "\n".join(traceback)))
    return int(match.group(1)) if match else None


def _one_line(error):
    text = f"{error.get('ename', 'Error')}: {error.get('evalue', '')}".strip()
    # a SyntaxError names the temporary file IPython compiled the cell to
    return re.sub(r" \(\d+\.py, line \d+\)$", "", text.splitlines()[0] if text else "")[:300]


@dataclasses.dataclass
class Execution:
    stop: Stop | None = None  # why the kernel stopped before the session ended, if it did
    cell_errors: list = dataclasses.field(default_factory=list)  # (cell index, "Name: text")
    timed_out_cells: list = dataclasses.field(default_factory=list)  # student cells interrupted
    grader_timeouts: int = 0  # grader cells over the per-cell limit
    grader_errors: list = dataclasses.field(default_factory=list)  # "Name: text"
    # student cell index -> how it broke, for the student's messages (engine/blame.py)
    cell_faults: dict = dataclasses.field(default_factory=dict)
    output_truncated: bool = False
    outputs: list = dataclasses.field(default_factory=list)  # (cell index, text) of student cells
    peak_mb: float = 0
    peak_tasks: int = 0
    seconds: float = 0
    cell_seconds: float = 0  # the student's cells, as the kernel timed them (kernel_seconds)
    files: list = dataclasses.field(default_factory=list)  # names left in the kernel's folder


class Session:
    """One kernel for one run of a submission; ``with Session(...) as s: s.run(...)``.

    ``run`` executes cells until one kills the kernel; ``alive`` tells whether more may run.
    Leaving the ``with`` kills the kernel's processes; ``result`` then holds what happened.
    """

    def __init__(self, kernel, limits):
        self.kernel, self.limits = kernel, limits
        self.nb = v4.new_notebook()
        self.client = _Client(self.nb, km=kernel.km, timeout=limits.cell_timeout,
                              allow_errors=True, interrupt_on_timeout=True,
                              kernel_name=kernel.km.kernel_name)
        self.client.output_cap = limits.output_cap_mb * MiB
        self.dog = Watchdog(kernel, limits.timeout, limits.memory_mb * MiB)
        self.result = Execution()
        self._setup = None

    def __enter__(self):
        self._start = time.monotonic()
        self.dog.start()
        self._setup = self.client.setup_kernel()
        self._setup.__enter__()
        return self

    def __exit__(self, *exc):
        try:
            self._setup.__exit__(None, None, None)
            if self.client.kc is not None:
                self.client.kc.stop_channels()
        finally:
            self.dog.stop()
            self.dog.join()
            r = self.result
            r.seconds = time.monotonic() - self._start
            if r.stop is None and self.dog.kind:  # e.g. killed while the worker judged
                r.stop = Stop(self.dog.kind, None, True, self.dog.detail)
            r.output_truncated = self.client.output_truncated
            r.peak_mb = self.dog.peak / MiB
            r.peak_tasks = self.dog.peak_tasks
            work = pathlib.Path(self.kernel.workdir)
            r.files = sorted({p.name for p in work.rglob("*")}) if work.exists() else []
            self.kernel.kill(self.dog.seen.values())
        return False

    @property
    def alive(self):
        return self.result.stop is None

    def run(self, sources, indices=None):
        """Run ``sources``; ``indices`` are the student cells' notebook indices (None: grader's)."""
        for k, source in enumerate(sources):
            if not self.alive:
                return False
            index = indices[k] if indices is not None else None
            cell = v4.new_code_cell(source)
            self.nb.cells.append(cell)
            start = time.monotonic()
            try:
                self.client.execute_cell(cell, len(self.nb.cells) - 1)
            except DeadKernelError:
                self.result.stop = Stop(self.dog.kind or StopKind.DIED, index, index is None,
                                        self.dog.detail)
            except Exception as exc:  # the kernel stopped answering in some other way
                self.result.stop = Stop(self.dog.kind or StopKind.UNRESPONSIVE, index,
                                        index is None, self.dog.detail or type(exc).__name__)
            self._collect(cell, index, time.monotonic() - start)
            if index is not None:
                self.result.cell_seconds += kernel_seconds(cell)
            if self.alive and self.dog.stopped():  # between two polls, after this cell
                self.result.stop = Stop(self.dog.kind, index, index is None, self.dog.detail)
        return self.alive

    def _collect(self, cell, index, seconds):
        errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
        # nbclient interrupts a cell over the limit and waits for its reply, a KeyboardInterrupt
        timed_out = seconds >= self.limits.cell_timeout and errors and \
            errors[-1].get("ename") == "KeyboardInterrupt"
        if timed_out and index is None:
            self.result.grader_timeouts += 1
        elif timed_out:
            self.result.timed_out_cells.append(index)
        if errors and index is not None:
            self.result.cell_faults[index] = CellFault(
                "timed out" if timed_out else "raised",
                _one_line(errors[-1]), traceback_line(errors[-1].get("traceback", [])),
                self.limits.cell_timeout if timed_out else None)
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error" and timed_out:
                continue
            if out.get("output_type") == "error":
                text = f"{out.ename}: {out.evalue}"[:300]
                if index is None:
                    self.result.grader_errors.append(text)
                else:
                    self.result.cell_errors.append((index, text))
            elif index is not None:
                text = out.get("text") or out.get("data", {}).get("text/plain", "")
                self.result.outputs.append((index, "".join(text)))
