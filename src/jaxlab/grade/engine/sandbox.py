"""Where a kernel runs: a bubblewrap (``bwrap``) sandbox per submission, or the grader's own rights.

The sandbox gets its own user, PID, network, IPC, UTS and mount namespaces (``--unshare-all``):
no network at all, no view of any process outside it, and a filesystem built from an allow-list:
the system (``/usr``, ``/etc``) and the Python environment read-only, the kernel's own folder
(working folder, home, ``/tmp``, the ``ipc`` sockets it talks to the worker through, and the
folder the hidden checks are revealed in) writable, and optionally a compilation cache
read-only (written only by a trusted warm-up run, see warmup.py). Nothing else of the machine is there: not the instructor's home, not the grade
folder, not the submissions, not the autograder zip or its extracted copy.

bubblewrap is the sandbox Flatpak uses; we only assemble its command line.
"""

import dataclasses
import enum
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import jaxlab

# read-only parts of the system a Python process needs; a link (merged /usr) stays a link
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc",
               "/sys/devices/system/cpu")
# readable by the file's owner, and inside a user namespace the owner is the sandbox's user
MASKED_FILES = ("/etc/shadow", "/etc/gshadow", "/etc/shadow-", "/etc/gshadow-")
MASKED_DIRS = ("/etc/ssh", "/etc/ssl/private")
SANDBOX_UID = 1000
SANDBOX_HOSTNAME = "sandbox"
# The sandbox's /etc/hosts: its host name resolves to its own loopback. gloo, which carries
# JAX's collectives between processes on CPU (jax.distributed), looks the host name up for the
# address it listens on; the grader's /etc/hosts does not know "sandbox" and there is no DNS
# inside, so every multi-process JAX program failed there ("enforce fail at
# gloo/transport/tcp/device.cc:99 ... -3", EAI_AGAIN).
HOSTS = f"127.0.0.1\tlocalhost {SANDBOX_HOSTNAME}\n::1\tlocalhost ip6-localhost ip6-loopback\n"


class Mode(str, enum.Enum):
    AUTO = "auto"  # sandbox where bwrap runs, say so in every row where it does not
    REQUIRE = "require"  # refuse to grade where bwrap does not run
    OFF = "off"  # kernels run with the grader's own rights


class SandboxUnavailable(RuntimeError):
    """``--sandbox=require`` where bubblewrap cannot run; the message says why."""


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What the batch decided once at its start; every worker uses the same."""

    sandboxed: bool
    reason: str | None = None  # why not, in words, when not sandboxed

    @property
    def status(self):
        return None if self.sandboxed else f"not sandboxed: {self.reason}"


def decide(mode):
    """The isolation a batch gets for ``mode``; raises SandboxUnavailable for an unmet require."""
    mode = Mode(mode)
    if mode is Mode.OFF:
        return Isolation(False, "--sandbox=off")
    reason = unavailable_reason()
    if reason is None:
        return Isolation(True)
    if mode is Mode.REQUIRE:
        raise SandboxUnavailable(f"--sandbox=require, but {reason}")
    return Isolation(False, reason)


def unavailable_reason():
    """None when a bwrap sandbox with the kernel's layout starts here; else why not, in words."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap needs Linux (this is {sys.platform})"
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    with tempfile.TemporaryDirectory(prefix="jaxlab-sandbox-check-") as root:
        folder = KernelFolder.create(root)
        try:
            run = subprocess.run([*bwrap_argv(folder), sys.executable, "-c", "pass"],
                                 capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bwrap could not start ({exc})"
    if run.returncode:
        err = (run.stderr.strip().splitlines() or ["no message"])[-1]
        return f"bwrap could not start a sandbox ({err}); user namespaces may be disabled"
    return None


SHM_BYTES = 64 * 2**20  # /dev/shm inside, as in Docker (bwrap's default is half the RAM)
REVEAL_BYTES = 256 * 2**20  # the hidden checks and the probes' evidence: Lab 3's is ~1 MB


SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"  # the grader's PATH may be anything


def disk_cap_reason():
    """None when kernel folders can be size-limited tmpfs mounts here; else why not."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0 or \
            not shutil.which("mount", path=SYSTEM_PATH):
        return "disk use not capped (a size-limited folder per kernel needs root on Linux)"
    with tempfile.TemporaryDirectory(prefix="jaxlab-disk-check-") as root:
        try:
            _mount_tmpfs(pathlib.Path(root), 2**20)
            _unmount(pathlib.Path(root))
        except OSError as exc:
            return f"disk use not capped (cannot mount a tmpfs: {exc})"
    return None


def _mount_tmpfs(path, size):
    run = subprocess.run([shutil.which("mount", path=SYSTEM_PATH), "-t", "tmpfs", "-o", f"size={size},mode=0755",
                          "jaxlab-kernel", str(path)], capture_output=True, text=True)
    if run.returncode:
        raise OSError(run.stderr.strip() or f"mount exited {run.returncode}")


def _unmount(path):
    # lazy: a process of the kernel that is still being reaped must not keep the space
    subprocess.run([shutil.which("umount", path=SYSTEM_PATH), "-l", str(path)],
                   capture_output=True)


def unmount_under(folder):
    """Unmount every kernel tmpfs below ``folder`` (deepest first)."""
    points = [line.split()[1] for line in pathlib.Path("/proc/mounts").read_text().splitlines()
              if line.startswith("jaxlab-kernel ")]
    for point in sorted(points, key=len, reverse=True):
        if pathlib.Path(point).is_relative_to(folder):
            _unmount(point)


@dataclasses.dataclass(frozen=True)
class KernelFolder:
    """One kernel's folder; inside the sandbox it is mounted at the same path, read-write.

    With ``disk_bytes`` it is a tmpfs of that size (so all a kernel can write, in its working
    folder, home and /tmp together, is bounded, and a write past it fails with ENOSPC in the
    student's cell), with ``reveal`` a second small one of the grader's: what a kernel leaves
    in the first cannot stop the hidden checks and their evidence from being written.
    """

    root: pathlib.Path
    mounted: bool = False

    @classmethod
    def create(cls, parent, disk_bytes=None):
        folder = cls(pathlib.Path(tempfile.mkdtemp(prefix="kernel-", dir=parent)),
                     mounted=bool(disk_bytes))
        if disk_bytes:
            _mount_tmpfs(folder.root, disk_bytes)
        for sub in (folder.work, folder.home, folder.tmp, folder.ipc, folder.reveal):
            sub.mkdir()
        folder.hosts.write_text(HOSTS)
        if disk_bytes:
            _mount_tmpfs(folder.reveal, REVEAL_BYTES)
        return folder

    def clear_reveal(self):
        """Remove whatever a kernel put in ``reveal`` (empty until the grader fills it)."""
        names = sorted(p.name for p in self.reveal.iterdir())
        for path in self.reveal.iterdir():
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        return names

    def remove(self):
        """Delete the folder; a tmpfs gives its space back when unmounted."""
        if self.mounted:
            _unmount(self.reveal)
            _unmount(self.root)
        shutil.rmtree(self.root, ignore_errors=True)

    work = property(lambda self: self.root / "work")  # the kernel's cwd; student files
    home = property(lambda self: self.root / "home")
    tmp = property(lambda self: self.root / "tmp")  # mounted at /tmp inside
    ipc = property(lambda self: self.root / "ipc")  # jupyter's ipc sockets, connection file
    reveal = property(lambda self: self.root / "reveal")  # empty until the student's cells ran
    hosts = property(lambda self: self.root / "hosts")  # /etc/hosts inside


def python_dirs():
    """The Python installation and environment the kernel runs from (read-only inside)."""
    dirs = {pathlib.Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    dirs.add(pathlib.Path(sys.executable).resolve().parent.parent)
    return sorted(d for d in dirs if d.exists())


def hidden_package_dirs():
    """This package's own source (it holds the labs' hidden checks): never inside a sandbox."""
    return [pathlib.Path(jaxlab.__file__).resolve().parent]


def bwrap_argv(folder, *, cache_dir=None, cache_writable=False, cpu=None, nproc=None):
    """The command prefix that runs a program in ``folder``'s sandbox.

    ``nproc``: RLIMIT_NPROC set inside, the process cap where no cgroup can be made (not root).
    Linux counts it per user namespace (ucounts, 5.14+), so it counts this sandbox's processes
    and threads only (measured: a cap of 30 let 28 forks through; the grader's own processes
    are not in it). For root it counts nothing: root's processes are exempt.
    """
    argv = ["taskset", "-c", str(cpu)] if cpu is not None and shutil.which("taskset") else []
    argv += ["bwrap", "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
             "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
             "--hostname", SANDBOX_HOSTNAME,
             "--dev", "/dev", "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm", "--proc", "/proc",
             # /tmp before everything: binds below it (the Python environment or the kernel's
             # folder may lie under /tmp, as in a CI checkout there) are made on top of it
             "--bind", str(folder.tmp), "/tmp"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.exists(d):
            argv += ["--ro-bind", d, d]
    argv += [x for f in MASKED_FILES if os.path.exists(f) for x in ("--ro-bind", "/dev/null", f)]
    argv += [x for d in MASKED_DIRS if os.path.isdir(d) for x in ("--tmpfs", d)]
    if folder.hosts.exists() and os.path.exists("/etc/hosts"):
        argv += ["--ro-bind", str(folder.hosts), "/etc/hosts"]
    for d in python_dirs():
        argv += ["--ro-bind", str(d), str(d)]
    for d in hidden_package_dirs():
        if any(d.is_relative_to(p) for p in python_dirs()):
            argv += ["--tmpfs", str(d)]
    if cache_dir is not None and pathlib.Path(cache_dir).is_dir():
        # writable only for the trusted warm-up run (warmup.py); every submission reads it
        argv += ["--bind" if cache_writable else "--ro-bind", str(cache_dir), str(cache_dir)]
    argv += ["--bind", str(folder.root), str(folder.root),
             "--setenv", "HOME", str(folder.home), "--setenv", "TMPDIR", "/tmp",
             # ipykernel exits when this pid is not its parent, and no outside pid is seen
             # from inside: --die-with-parent does that job here
             "--unsetenv", "JPY_PARENT_PID",
             "--chdir", str(folder.work), "--"]
    if nproc:
        argv += [shutil.which("prlimit", path=SYSTEM_PATH) or "prlimit", f"--nproc={nproc}", "--"]
    return argv
