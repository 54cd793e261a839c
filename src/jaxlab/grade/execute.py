"""Run a submission's cells in a kernel under limits, then have the kernel report what it holds.

The kernel is untrusted: everything it reports lands as JSON/npz files in ``evidence_dir`` and
is judged elsewhere. Limits are enforced from outside the kernel by a watchdog thread.
"""

import ast
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_core.utils import run_sync
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

from .sandbox import KernelFolder, bwrap_argv

SANDBOX_KERNEL = "jaxlab-sandbox"

OTTER_CALLS = {"check", "check_all", "export", "to_pdf", "run_plugin", "submit"}
IGNORE_TAG = "otter_ignore"


def student_cells(nb):
    """(index, source) of the code cells otter's grading would run as the student's own."""
    graders = _grader_names(nb)
    cells = []
    for i, cell in enumerate(nb.cells):
        meta = cell.get("metadata", {})
        if cell.cell_type != "code" or IGNORE_TAG in meta.get("tags", []) \
                or meta.get("otter", {}).get("ignore", False):
            continue
        if not _is_otter_cell(cell.source, graders):
            cells.append((i, cell.source))
    return cells


def _grader_names(nb):
    names = {"grader"}
    for cell in nb.cells:
        try:
            tree = ast.parse(cell.source) if cell.cell_type == "code" else None
        except SyntaxError:
            continue
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Assign) and _is_notebook_call(node.value):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _is_notebook_call(node):
    return isinstance(node, ast.Call) and (
        isinstance(node.func, ast.Attribute) and node.func.attr == "Notebook"
        or isinstance(node.func, ast.Name) and node.func.id == "Notebook")


def _is_otter_cell(source, graders):
    """Whether every statement is otter's init, a grader.check/export call or a bare ``grader``.

    Skipping such a cell only removes calls into otter, never student code.
    """
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    if not body:
        return False
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in stmt.names] if isinstance(stmt, ast.Import) else [stmt.module]
            if all(m == "otter" for m in mods):
                continue
        elif isinstance(stmt, ast.Assign) and _is_notebook_call(stmt.value):
            continue
        elif isinstance(stmt, ast.Expr):
            v = stmt.value
            if isinstance(v, ast.Name) and v.id in graders:
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) \
                    and isinstance(v.func.value, ast.Name) and v.func.value.id in graders \
                    and v.func.attr in OTTER_CALLS:
                continue
        return False
    return True


# --------------------------------------------------------------------------- grader cells
PROBE_CELL = '''\
def _jaxlab_probe():
    import importlib, sys
    sys.path.insert(0, {private!r})
    for name in ({module!r}, "jaxlab_form"):
        sys.modules.pop(name, None)
    checks, form = importlib.import_module({module!r}), importlib.import_module("jaxlab_form")
    ns = globals()
    names = checks.QUESTIONS[{question!r}].names
    out = {{"equal_to_anything": []}}
    try:
        out["evidence"] = checks.probe({question!r}, {{n: ns.get(n) for n in names}})
    except BaseException as exc:
        out["error"] = f"{{type(exc).__name__}}: {{exc}}"
    class Stranger:
        pass
    for n in names:
        try:
            eq = ns.get(n) == Stranger()
            if eq is True or type(eq).__name__ == "bool_" and bool(eq):
                out["equal_to_anything"].append(n)
        except BaseException:
            pass
    form.dump_evidence(out, {path!r})
_jaxlab_probe()
del _jaxlab_probe
'''

CLAIM_CELL = '''\
def _jaxlab_claim():
    import json, sys
    from otter.nbmeta_config import NBMetadataConfig
    from otter.test_files import create_test_file
    sys.path.insert(0, {private!r})
    claim = {{}}
    try:
        tf = create_test_file({test!r}, NBMetadataConfig())
        tf.run(globals())
        claim["cases"] = [[bool(r.passed), str(r.message or "")[:4000]] for r in tf.test_case_results]
    except BaseException as exc:
        claim["error"] = f"{{type(exc).__name__}}: {{exc}}"
    with open({path!r}, "w") as f:
        json.dump(claim, f)
_jaxlab_claim()
del _jaxlab_claim
'''


def probe_cells(questions, module, private, evidence_dir):
    """Cells appended after the student's: one probe of the jaxlab checks per question."""
    return [PROBE_CELL.format(private=str(private), module=module, question=q,
                              path=str(evidence_dir / f"{q}.json")) for q in questions]


def claim_cells(tests, private, evidence_dir):
    """Cells running otter's own tests in the kernel, for the questions in ``tests``."""
    return [CLAIM_CELL.format(private=str(private), test=str(test),
                              path=str(evidence_dir / f"claim-{q}.json"))
            for q, test in tests.items()]


# --------------------------------------------------------------------------- kernels
def kernel_env(cache_dir=None, xla_threads=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_", "JPY_"))}
    env.pop("TMPDIR", None)
    env.update(PJRT_NPROC="16", MPLBACKEND="Agg", PYTHONHASHSEED="0", MALLOC_ARENA_MAX="2")
    if cache_dir:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache_dir),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")
    if xla_threads:
        env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
        env["OMP_NUM_THREADS"] = str(xla_threads)
    return env


@dataclasses.dataclass
class Kernel:
    km: AsyncKernelManager
    folder: KernelFolder
    sandboxed: bool

    @classmethod
    def start(cls, env, root, cpu=None, *, sandboxed=False, cache_dir=None):
        """A kernel in a fresh folder under ``root``; in its own bwrap sandbox if ``sandboxed``."""
        folder = KernelFolder.create(root)
        if sandboxed:
            # a kernelspec per kernel: bwrap's command line names this kernel's folder
            spec = folder.root / "spec" / SANDBOX_KERNEL
            spec.mkdir(parents=True)
            argv = [*bwrap_argv(folder, cache_dir=cache_dir, cpu=cpu), sys.executable, "-m",
                    "ipykernel_launcher", "-f", "{connection_file}"]
            # the kernel leads its own session inside (--new-session), so the provisioner's
            # SIGINT to the outer process group would miss it: interrupt by message instead
            (spec / "kernel.json").write_text(json.dumps(
                {"argv": argv, "display_name": "sandboxed Python", "language": "python",
                 "interrupt_mode": "message"}))
            km = AsyncKernelManager(
                kernel_name=SANDBOX_KERNEL, transport="ipc",
                connection_file=str(folder.ipc / "kernel.json"),
                kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)]))
        else:
            km = AsyncKernelManager(kernel_name="python3")
        # jupyter_client starts the kernel in a new session: its pid is its process group id.
        run_sync(km.start_kernel)(cwd=str(folder.work), env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        kernel = cls(km, folder, sandboxed)
        if cpu is not None and not sandboxed:
            # XLA's threads start later from the kernel's main thread and inherit this
            psutil.Process(kernel.pid).cpu_affinity([cpu])
        return kernel

    @property
    def workdir(self):
        return str(self.folder.work)

    @property
    def pid(self):
        return self.km.provisioner.pid

    def tree(self):
        """The kernel's processes; in a sandbox, bwrap and everything in its PID namespace."""
        try:
            root = psutil.Process(self.pid)
            return [root, *root.children(recursive=True)]
        except psutil.Error:
            return []

    def kill(self, also=()):
        for proc in [*self.tree(), *also]:
            _kill(proc)
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, TypeError):
            pass
        try:
            run_sync(self.km.shutdown_kernel)(now=True)
        except Exception:
            pass
        run_sync(self.km.cleanup_resources)()

    def close(self):
        """Kill the kernel and remove its folder (with the evidence the worker read from it)."""
        self.kill()
        shutil.rmtree(self.folder.root, ignore_errors=True)


def _kill(proc):
    try:
        proc.kill()
    except psutil.Error:
        pass


class Watchdog(threading.Thread):
    """Kills the kernel's processes over the wall-clock limit or the memory cap.

    Remembers every descendant it saw, so a child that leaves the kernel's process group
    (setsid) is still killed at the end.
    """

    def __init__(self, kernel, timeout, memory_bytes):
        super().__init__(daemon=True)
        self.kernel, self.deadline, self.cap = kernel, time.monotonic() + timeout, memory_bytes
        self.seen, self.reason, self.peak = {}, None, 0
        self._halt = threading.Event()

    def run(self):
        while not self._halt.wait(0.2):
            procs = self.kernel.tree()
            self.seen.update((p.pid, p) for p in procs)
            rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, rss)
            if rss > self.cap:
                self.reason = f"memory use {rss / 2**20:.0f} MiB went over the cap of " \
                              f"{self.cap / 2**20:.0f} MiB"
            elif time.monotonic() > self.deadline:
                self.reason = "timeout"
            if self.reason:
                self.kernel.kill(self.seen.values())
                return

    def stop(self):
        self._halt.set()


# --------------------------------------------------------------------------- running
class _Client(NotebookClient):
    """nbclient that stops keeping outputs past ``output_cap`` characters."""

    output_cap = 10 * 2**20
    timed_out = ()

    async def _async_handle_timeout(self, timeout, cell=None):
        self.timed_out = (*self.timed_out, cell)
        return await super()._async_handle_timeout(timeout, cell)

    def output(self, outs, msg, display_id, cell_index):
        self.output_chars = getattr(self, "output_chars", 0) + len(str(msg["content"]))
        if self.output_chars > self.output_cap:
            self.output_truncated = True
            return None
        return super().output(outs, msg, display_id, cell_index)


@dataclasses.dataclass
class Execution:
    killed: str | None = None  # why the kernel was killed or died, if it was
    cell_errors: list = dataclasses.field(default_factory=list)  # (cell index, "Name: text")
    timed_out_cells: list = dataclasses.field(default_factory=list)
    output_truncated: bool = False
    outputs: list = dataclasses.field(default_factory=list)  # (cell index, text) of student cells
    peak_mb: float = 0
    seconds: float = 0
    files: list = dataclasses.field(default_factory=list)  # names left in the kernel's folder


def execute(kernel, cells, extra_cells, *, timeout, cell_timeout, memory_mb, output_cap,
            on_start=None, on_grader_start=None, then=None):
    """Run ``cells`` ((index, source) pairs) then ``extra_cells`` (sources) in ``kernel``.

    ``on_grader_start`` runs once, after the student's cells and before the first extra cell.
    ``then()``, called once the extra cells are done, returns more cells to run after them.
    """
    import nbformat.v4 as v4

    nb = v4.new_notebook(cells=[v4.new_code_cell(src) for _, src in cells]
                         + [v4.new_code_cell(src) for src in extra_cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    index = [i for i, _ in cells] + [None] * len(extra_cells)
    client = _Client(nb, km=kernel.km, timeout=cell_timeout, allow_errors=True,
                     interrupt_on_timeout=True, kernel_name="python3",
                     on_notebook_start=lambda **kw: on_start and on_start())
    client.output_cap = output_cap
    result = Execution()
    current = {"cell": None}

    def on_cell_execute(cell, cell_index):
        if index[cell_index] is None and current["cell"] != "grader" and on_grader_start:
            on_grader_start()
        current.update(cell=index[cell_index] if index[cell_index] is not None else "grader")

    pending_then = [then] if then else []

    def on_cell_executed(cell, cell_index, **_):
        if pending_then and cell_index == len(index) - 1 and not dog.reason:
            more = pending_then.pop()()
            # nbclient walks nb.cells as a live list, so cells appended here run next
            nb.cells.extend(v4.new_code_cell(src) for src in more)
            index.extend([None] * len(more))

    client.on_cell_execute = on_cell_execute
    client.on_cell_executed = on_cell_executed
    dog = Watchdog(kernel, timeout, memory_mb * 2**20)
    start = time.monotonic()
    dog.start()
    try:
        client.execute()
    except DeadKernelError:
        pass
    except Exception as exc:
        result.killed = f"the kernel stopped answering ({type(exc).__name__})"
    finally:
        dog.stop()
        dog.join()
        result.seconds = time.monotonic() - start
    alive = any(p.is_running() for p in kernel.tree())
    where = {None: "", "grader": " while the grader read the answers"}.get(
        current["cell"], f" in cell {current['cell']}")
    if dog.reason == "timeout":
        result.killed = f"timed out: ran over {timeout:g} s{where} and was killed"
    elif dog.reason:
        result.killed = f"killed{where}: {dog.reason}"
    elif not alive or result.killed:
        result.killed = f"the kernel died{where}" + (f" ({result.killed})" if result.killed else "")
    timed_out = [id(c) for c in client.timed_out]
    for cell, i in zip(nb.cells, index):
        if id(cell) in timed_out:
            (result.timed_out_cells if i is not None else result.cell_errors).append(
                (i, f"ran over {cell_timeout:g} s and was interrupted"))
            continue
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                result.cell_errors.append((i, f"{out.ename}: {out.evalue}"[:300]))
            elif i is not None:
                text = out.get("text") or out.get("data", {}).get("text/plain", "")
                result.outputs.append((i, "".join(text)))
    result.output_truncated = getattr(client, "output_truncated", False)
    result.peak_mb = dog.peak / 2**20
    result.files = sorted({p.name for p in pathlib.Path(kernel.workdir).rglob("*")})
    kernel.kill(dog.seen.values())
    return result
