"""A cgroup per kernel: a cap on its processes and threads, and its share of the CPU.

Everything a kernel starts (bwrap, the kernel, its threads, whatever a cell forks) is born in
the kernel's cgroup, so the caps hold for the whole sandbox and nothing started inside can
leave it: ``pids.max`` bounds processes and threads together (a fork bomb stops at the cap and
the grader's own process starts, outside the cgroup, are not counted), ``cpuset.cpus`` keeps
every thread on the kernel's core (``sched_setaffinity`` from inside cannot widen past it,
unlike ``taskset``), and a CFS quota bounds its CPU time where it is not pinned.
``pids.events`` tells when the cap was hit, and teardown kills until ``cgroup.procs`` is empty.

cgroup v1 (one hierarchy per controller, as on this project's CI machine) and v2 (one unified
hierarchy) are both handled; the kernel joins through a one-line shell prefix before bwrap
starts (no library wraps cgroup files; cgexec would add a system package for one write).
"""

import dataclasses
import os
import pathlib
import secrets
import signal
import time

ROOT = pathlib.Path("/sys/fs/cgroup")
CONTROLLERS = ("pids", "cpuset", "cpu")
PERIOD_US = 100_000
BATCH_PREFIX = "jaxlab-grade-"  # + the batch process's pid + "-" + random: its cgroup's name


class CgroupUnavailable(RuntimeError):
    """No writable cgroup with the pids, cpuset and cpu controllers here; the message says why."""


def _mounts():
    """{controller: (mount point, version)} from /proc/self/mounts."""
    found = {}
    for line in pathlib.Path("/proc/self/mounts").read_text().splitlines():
        _, point, fstype, opts, *_ = line.split()
        if fstype == "cgroup":
            for c in CONTROLLERS:
                if c in opts.split(","):
                    found.setdefault(c, (pathlib.Path(point), 1))
        elif fstype == "cgroup2":
            available = (pathlib.Path(point) / "cgroup.controllers")
            names = available.read_text().split() if available.exists() else []
            for c in CONTROLLERS:
                if c in names:
                    found.setdefault(c, (pathlib.Path(point), 2))
    return found


def _own_paths():
    """{controller or "": path} of this process's cgroups, from /proc/self/cgroup."""
    paths = {}
    for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(",") if names else [""]:
            paths[name] = path.lstrip("/")
    return paths


@dataclasses.dataclass(frozen=True)
class Parent:
    """Where kernel cgroups are made: a folder per controller (one shared folder in v2)."""

    dirs: dict  # controller -> folder
    version: int

    @classmethod
    def find(cls):
        """This process's own cgroups, if this process may make children in them."""
        mounts, own = _mounts(), _own_paths()
        missing = [c for c in CONTROLLERS if c not in mounts]
        if missing:
            raise CgroupUnavailable(f"no cgroup {', '.join(missing)} controller is mounted")
        versions = {v for _, v in mounts.values()}
        if len(versions) > 1:
            raise CgroupUnavailable("the pids, cpuset and cpu controllers are split between "
                                    "cgroup v1 and v2")
        version = versions.pop()
        dirs = {c: mounts[c][0] / own.get(c if version == 1 else "", "") for c in CONTROLLERS}
        for d in set(dirs.values()):
            if not os.access(d, os.W_OK):
                raise CgroupUnavailable(f"{d} is not writable (cgroups need root or a "
                                        "delegated cgroup)")
        if version == 2:
            _enable_v2(dirs["pids"])
        return cls(dirs, version)

    def child(self, name):
        """A cgroup for a whole batch under this one: its kernels' cgroups go inside, and
        removing it at the end takes any a killed worker left behind."""
        dirs = {c: d / name for c, d in self.dirs.items()}
        for c, d in dirs.items():
            d.mkdir(exist_ok=True)
            if self.version == 1 and c == "cpuset":  # a v1 cpuset starts empty
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (d / f).write_text((self.dirs[c] / f).read_text().strip())
        if self.version == 2:
            _enable_v2(dirs["pids"])
        return Parent(dirs, self.version)

    def to_dict(self):
        return {"dirs": {c: str(d) for c, d in self.dirs.items()}, "version": self.version}

    @classmethod
    def from_dict(cls, raw):
        return cls({c: pathlib.Path(d) for c, d in raw["dirs"].items()}, raw["version"])

    def remove_orphans(self):
        """Remove the empty batch cgroups here whose batch process is gone (a batch killed with
        SIGKILL leaves them behind); another live batch's, or one still holding a process, stays."""
        for d in sorted(self.dirs["pids"].glob(f"{BATCH_PREFIX}*")):
            pid = d.name[len(BATCH_PREFIX):].split("-")[0]
            if not pid.isdigit() or _alive(int(pid)):
                continue
            folders = {p / d.name for p in self.dirs.values()}
            kernels = [k for f in folders for k in f.glob("jaxlab-kernel-*") if k.is_dir()]
            for f in [*kernels, *folders]:  # rmdir fails on a cgroup with a process or a child
                try:
                    f.rmdir()
                except OSError:
                    pass

    def remove(self):
        """Kill and remove every kernel cgroup inside, then this one."""
        for d in sorted(self.dirs["pids"].glob("jaxlab-kernel-*")):
            KernelCgroup({c: p / d.name for c, p in self.dirs.items()}, self.version, 0).remove()
        for d in set(self.dirs.values()):
            try:
                d.rmdir()
            except OSError:
                pass


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _enable_v2(folder):
    """Turn the controllers on for the children of ``folder`` (v2 hands them down explicitly)."""
    control = folder / "cgroup.subtree_control"
    wanted = [c for c in CONTROLLERS if c not in control.read_text().split()]
    try:
        if wanted:
            control.write_text(" ".join(f"+{c}" for c in wanted))
    except OSError as exc:
        # v2 allows controllers only in cgroups without processes of their own
        raise CgroupUnavailable(f"cannot enable {', '.join(wanted)} in {folder} ({exc}); run "
                                "the grader in a delegated cgroup of its own") from None


@dataclasses.dataclass
class KernelCgroup:
    """One kernel's cgroup (a folder per controller in v1, one folder in v2)."""

    dirs: dict  # controller -> folder
    version: int
    processes: int

    @classmethod
    def create(cls, parent, *, processes, cpus=None, quota=None):
        """A new cgroup under ``parent``: at most ``processes`` tasks, on ``cpus`` (a set of
        core numbers; default: the parent's), with ``quota`` cores of CPU time (None: no quota).
        """
        name = f"jaxlab-kernel-{secrets.token_hex(6)}"
        dirs = {c: d / name for c, d in parent.dirs.items()}
        group = cls(dirs, parent.version, processes)
        try:
            for d in set(dirs.values()):
                d.mkdir()
            group._write("pids", "pids.max", str(processes))
            cpuset = dirs["cpuset"]
            if cpus is not None:
                group._write("cpuset", "cpuset.cpus", ",".join(map(str, sorted(cpus))))
            elif parent.version == 1:  # v1 starts a cpuset empty; v2 inherits the parent's
                group._write("cpuset", "cpuset.cpus",
                             (parent.dirs["cpuset"] / "cpuset.cpus").read_text().strip())
            if parent.version == 1:
                (cpuset / "cpuset.mems").write_text(
                    (parent.dirs["cpuset"] / "cpuset.mems").read_text().strip())
            if quota:
                if parent.version == 1:
                    group._write("cpu", "cpu.cfs_period_us", str(PERIOD_US))
                    group._write("cpu", "cpu.cfs_quota_us", str(int(quota * PERIOD_US)))
                else:
                    group._write("cpu", "cpu.max", f"{int(quota * PERIOD_US)} {PERIOD_US}")
        except OSError:
            group.remove()
            raise
        return group

    def _write(self, controller, name, value):
        (self.dirs[controller] / name).write_text(value)

    def _read(self, controller, name):
        return (self.dirs[controller] / name).read_text()

    def join_prefix(self):
        """A command prefix that moves itself into this cgroup, then runs the rest."""
        files = " ".join(f"'{d / 'cgroup.procs'}'" for d in sorted(set(self.dirs.values())))
        return ["/bin/sh", "-c", f'for f in {files}; do echo $$ > "$f" || exit 125; done; '
                            'exec "$@"', "jaxlab-cgroup-join"]

    def cap_hits(self):
        """How many times a fork or thread start failed at the cap (0 when the cgroup is gone)."""
        try:
            for line in self._read("pids", "pids.events").splitlines():
                key, value = line.split()
                if key == "max":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def tasks(self):
        """Processes and threads in the cgroup now."""
        try:
            return int(self._read("pids", "pids.current"))
        except (OSError, ValueError):
            return 0

    def pids(self):
        try:
            return [int(p) for p in self._read("pids", "cgroup.procs").split()]
        except (OSError, ValueError):
            return []

    def kill(self, timeout=10):
        """SIGKILL every process in the cgroup until none is left (a fork bomb included: it
        cannot grow past the cap, and every round kills all it has)."""
        kill_file = self.dirs["pids"] / "cgroup.kill"  # v2 (Linux 5.14): one atomic write
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pids = self.pids()
            if not pids:
                return True
            if kill_file.exists():
                try:
                    kill_file.write_text("1")
                except OSError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.02)
        return not self.pids()

    def remove(self):
        """Kill what is left and remove the cgroup's folders (a folder with tasks cannot go)."""
        self.kill()
        for d in set(self.dirs.values()):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # the last killed tasks are still exiting
                    time.sleep(0.05)


def unavailable_reason():
    """None when kernels can get cgroups here; else why not, in words."""
    try:
        Parent.find()
    except (CgroupUnavailable, OSError) as exc:
        return str(exc)
    return None
