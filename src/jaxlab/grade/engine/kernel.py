"""Start and stop one IPython kernel for one submission, sandboxed by bubblewrap or not."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys

import psutil
from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_core.utils import run_sync

from . import process
from .cgroup import KernelCgroup
from ..model import MiB
from .sandbox import SYSTEM_PATH, KernelFolder, bwrap_argv

SANDBOX_KERNEL = "jaxlab-sandbox"


# a read-only cache: JAX writes an entry only for a compile that took longer than this
NEVER_WRITE_S = str(10**9)


def cache_env(cache_dir, writable):
    """JAX's settings to read the compilation cache in ``cache_dir``, and write it if allowed."""
    if not cache_dir:
        return {}
    return {"JAX_COMPILATION_CACHE_DIR": str(cache_dir),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0" if writable else NEVER_WRITE_S,
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
            # by default JAX also points XLA's GPU autotune cache into the folder, which puts
            # the folder's path into every cache key: the warm-up writes under another name
            # than kernels read (measured: 0 of 103 Lab 3 entries hit), and a read-only folder
            # could not take those writes anyway
            "JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES": "none"}


# A graded kernel mostly compiles (each fresh case is a new program) and runs little, so
# LLVM's optimisations cost more than they save: without them Lab 7's solution took 36.5
# instead of 57.7 CPU-s for its cells and 31.7 instead of 54 for its probes (JAX 0.10.2,
# 2026-11-27), what lets it grade at half a CPU on Gradescope. They change how fast the
# generated code runs, not the program XLA builds: the five solutions print the same
# collectives, bytes and memory with and without them, only timings (and the last digit of a
# few float32 results) differ (2026-11-28).
GRADED_XLA_FLAGS = "--xla_backend_optimization_level=0"


def kernel_env(cache_dir=None, xla_threads=None, *, cache_writable=False):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("JAX_", "XLA_", "JPY_", "JAXLAB_")) and k != "TMPDIR"}
    env.update(PJRT_NPROC="16", MPLBACKEND="Agg", PYTHONHASHSEED="0", MALLOC_ARENA_MAX="2")
    env.update(cache_env(cache_dir, cache_writable))
    flags = [GRADED_XLA_FLAGS]
    if xla_threads:
        flags.append("--xla_cpu_multi_thread_eigen=false")
        env["OMP_NUM_THREADS"] = str(xla_threads)
    env["XLA_FLAGS"] = " ".join(flags)
    return env


@dataclasses.dataclass(frozen=True)
class Caps:
    """The resource caps one kernel starts under; None where this machine cannot apply it."""

    cgroup_parent: object = None  # cgroup.Parent: processes and CPU capped in a child of it
    processes: int = 0
    cpus: float | None = None  # CPU quota in cores
    disk_mb: int | None = None  # a tmpfs of this size as the kernel's folder


def as_user_argv(folder, uid, connection, nproc=None):
    """The command prefix that runs a kernel as ``uid`` (run by root): its folder becomes that
    user's, and the connection file jupyter_client writes (0600, root's) readable to it just
    before the drop; the OOM killer's first choice. setpriv (util-linux) changes the user; prlimit caps its processes where
    no cgroup does (RLIMIT_NPROC counts the user's processes, and this user runs nothing else).
    """
    for sub in (folder.work, folder.home, folder.tmp, folder.ipc, folder.reveal):
        os.chown(sub, uid, uid)
    folder.root.chmod(0o711)  # the user may pass through to its subfolders, not list them
    tool = lambda name: shutil.which(name, path=SYSTEM_PATH) or name  # noqa: E731
    # oom_score_adj 1000: where only the container's memory limit holds (no cgroup of its own),
    # the kernel, not the grader, is what the OOM killer takes
    argv = [tool("sh"), "-c", 'echo 1000 > /proc/self/oom_score_adj; '
            'chown "$0" "$1" && shift && exec "$@"', f"{uid}:{uid}", str(connection)]
    if nproc:
        argv += [tool("prlimit"), f"--nproc={nproc}", "--"]
    return argv + [tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                   "--inh-caps=-all", "--bounding-set=-all", "--"]


def user_can_run_python(uid):
    """None when ``uid`` can start this Python and import ipykernel; else why not, in words."""
    run = subprocess.run([shutil.which("setpriv", path=SYSTEM_PATH) or "setpriv",
                          f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--",
                          sys.executable, "-c", "import ipykernel"],
                         capture_output=True, text=True, cwd="/", env={"HOME": "/"})
    if run.returncode:
        return (run.stderr.strip().splitlines() or [f"exit {run.returncode}"])[-1]
    return None


@dataclasses.dataclass
class Kernel:
    km: AsyncKernelManager
    folder: KernelFolder
    sandboxed: bool
    cgroup: KernelCgroup | None = None
    uid: int | None = None  # the user it runs as, when not the grader's own

    @classmethod
    def start(cls, env, root, cpu=None, *, sandboxed=False, cache_dir=None, cache_writable=False,
              caps=Caps(), uid=None):
        """A kernel in a fresh folder under ``root``; in its own bwrap sandbox if ``sandboxed``,
        with the compilation cache ``cache_dir`` bound read-only (writable if ``cache_writable``),
        under ``caps``; as user ``uid`` (not sandboxed, the grader root) if given.
        """
        folder = KernelFolder.create(root, caps.disk_mb and caps.disk_mb * MiB)
        group = None
        try:
            if caps.cgroup_parent is not None:
                group = KernelCgroup.create(caps.cgroup_parent, processes=caps.processes,
                                            cpus=None if cpu is None else {cpu}, quota=caps.cpus)
            return cls._start(env, folder, group, cpu, sandboxed, cache_dir, cache_writable,
                              caps.processes, uid)
        except BaseException:
            if group:
                group.remove()
            folder.remove()
            raise

    @classmethod
    def _start(cls, env, folder, group, cpu, sandboxed, cache_dir, cache_writable, processes,
               uid):
        prefix = group.join_prefix() if group else []
        connection = folder.ipc / "kernel.json"
        if uid is not None and not sandboxed:
            prefix += as_user_argv(folder, uid, connection,
                                   nproc=processes if group is None else None)
            env = {**env, "HOME": str(folder.home), "TMPDIR": str(folder.tmp)}
        elif sandboxed:
            # without a cgroup (not root), RLIMIT_NPROC inside the sandbox caps its processes
            nproc = processes if group is None and os.geteuid() != 0 else None
            prefix += bwrap_argv(folder, cpu=cpu, cache_dir=cache_dir,
                                 cache_writable=cache_writable, nproc=nproc)
        if prefix:
            # a kernelspec per kernel: the command line names this kernel's folder and cgroup
            spec = folder.root / "spec" / SANDBOX_KERNEL
            spec.mkdir(parents=True)
            argv = [*prefix, sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
            # the kernel leads its own session inside (--new-session), so the provisioner's
            # SIGINT to the outer process group would miss it: interrupt by message instead
            (spec / "kernel.json").write_text(json.dumps(
                {"argv": argv, "display_name": "sandboxed Python", "language": "python",
                 "interrupt_mode": "message" if sandboxed else "signal"}))
            km = AsyncKernelManager(
                kernel_name=SANDBOX_KERNEL, transport="ipc" if sandboxed else "tcp",
                connection_file=str(connection),
                kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)]))
        else:
            km = AsyncKernelManager(kernel_name="python3")
        # jupyter_client starts the kernel in a new session: its pid is its process group id
        run_sync(km.start_kernel)(cwd=str(folder.work), env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        kernel = cls(km, folder, sandboxed, group, uid if not sandboxed else None)
        if cpu is not None and not sandboxed:  # (sandboxed: taskset in bwrap's command line)
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
        return process.tree(self.pid)

    def kill(self, also=()):
        """Kill every process of the kernel (and ``also``); its folder stays for the worker."""
        if self.cgroup:  # first: nothing in it can start another process meanwhile
            self.cgroup.kill()
        process.kill_and_reap([*self.tree(), *also], wait=0)
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
        if self.cgroup:
            self.cgroup.remove()
        self.folder.remove()
