"""Grade each lab's solution with its shipped autograder zip inside a Gradescope-like container.

Gradescope's default autograder container has 768 MB of memory (page cache included), half a
CPU and a 10-minute limit. This script rebuilds that here, without Docker:

* a Python environment built from the zip alone (the pip part of its ``environment.yml``;
  conda's ``python=3.11`` is this interpreter), cached between runs;
* a ``/autograder`` tree (``source/`` = the zip's contents, ``submission/`` = the solution
  notebook, ``results/``) in a private root built by bubblewrap, so the real ``/`` is untouched;
* otter's containerized entry point, the zip's own ``run_otter.py``
  (``otter.run.run_autograder.main("/autograder")``), run inside a cgroup v1 with a memory
  limit (memsw too: swap cannot hide the cap) and a CFS CPU quota, under a wall-clock limit.

Each lab gets the memory the README recommends for it (Gradescope's default 768 MB for every
lab today: Lab 5's kernel gives back its compiled programs before Part D starts two more JAX
processes). Per lab it prints score / possible, wall time, the CPU time the run used (on a busy
machine the wall time says little; at half a CPU an idle one takes about twice the CPU time),
peak memory (cgroup ``max_usage_in_bytes``, and
the sampled peak of anonymous memory, i.e. without page cache) and whether it fits.

    .venv/bin/python scripts/gradescope_fit.py                     # every lab, 0.5 CPU, with
                                                                   # the README's memory setting
    .venv/bin/python scripts/gradescope_fit.py lab3-parallelism --wall 420
    .venv/bin/python scripts/gradescope_fit.py --memory 0          # no memory cap (to compare)
    .venv/bin/python scripts/gradescope_fit.py --tampering --jobs 3  # Lab 3's tampering cases

``--tampering`` grades scripts/grade_demo.py's tampering notebooks (each a wrong Task 1 answer
plus the tampering), a control with the same wrong answer and the solution, each in its own
container (``--jobs`` at once: keep jobs x cpu within this machine's cores), and checks that
Task 1 scores zero and the status says TAMPERING for each tampering case, and every other
question keeps its points (except one the tampering itself breaks: ``ALSO_LOST``).

Needs root (cgroups), cgroup v1 ``memory`` and ``cpu`` controllers and ``bwrap``.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import venv
import zipfile

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
LABS = ("lab3-parallelism", "lab4-shard-map", "lab5-scaling", "lab6-memory",
        "lab7-transformer")
# the Gradescope memory setting the README recommends per lab, where it is not Gradescope's
# default 768M (Lab 5 needed 1G until its kernel gave back its compiled programs, ~250 MiB,
# before Part D's two processes of ~115 MiB each start)
RECOMMENDED_MEMORY = {}
CGROUP_V1 = pathlib.Path("/sys/fs/cgroup")
MEMORY_DEFAULT = 768 * 2**20  # Gradescope's default container
CPU_DEFAULT = 0.5
WALL_DEFAULT = 600  # Gradescope's default timeout, seconds
CACHE_DEFAULT = pathlib.Path.home() / ".cache" / "jaxlab-gradescope-fit"
SAMPLE_EVERY_S = 0.5
MIB = 2**20


@dataclasses.dataclass(frozen=True)
class Fit:
    lab: str
    name: str
    scores: dict  # test name -> (score, max score)
    status: str  # the first line of results.json's output (jaxlab's grading_status)
    score: float | None
    possible: float | None
    wall_s: float
    timed_out: bool
    peak_bytes: int
    peak_anon_bytes: int
    peak_cache_bytes: int
    failcnt: int
    wall_limit_s: float
    cpu_s: float  # CPU time the run used (cpuacct): on a busy machine, what wall time hides

    @property
    def fits(self) -> bool:
        return (not self.timed_out and self.score is not None and self.score == self.possible
                and self.wall_s < min(self.wall_limit_s, WALL_DEFAULT))


def pip_requirements(environment_yml: str) -> list[str]:
    """The zip's dependencies as pip requirements: its pip list plus its conda packages that
    are also Python packages (python itself and pip excluded)."""
    spec = yaml.safe_load(environment_yml)
    conda, pip = [], []
    for dep in spec["dependencies"]:
        if isinstance(dep, dict):
            pip.extend(dep.get("pip", []))
        elif dep.split("=")[0] not in ("python", "pip"):
            conda.append(dep)
    return conda + pip


def build_env(zip_path: pathlib.Path, cache: pathlib.Path) -> pathlib.Path:
    with zipfile.ZipFile(zip_path) as zf:
        requirements = pip_requirements(zf.read("environment.yml").decode())
    key = hashlib.sha256("\n".join([sys.version] + requirements).encode()).hexdigest()[:16]
    env = cache / f"venv-{key}"
    if (env / ".complete").exists():
        return env
    shutil.rmtree(env, ignore_errors=True)
    print(f"building {env} from {zip_path.name}: {' '.join(requirements)}", flush=True)
    venv.EnvBuilder(with_pip=True, clear=True).create(env)
    subprocess.run([env / "bin" / "python", "-m", "pip", "install", "--quiet", *requirements],
                   check=True)
    (env / ".complete").write_text("\n".join(requirements))
    return env


def evict_page_cache(tree: pathlib.Path) -> None:
    """Drop this tree's clean pages from the page cache, so the graded run reads it cold and
    the cgroup is charged for it, as in a freshly started container. (No library does a
    per-tree eviction; ``posix_fadvise(DONTNEED)`` is the kernel's interface for it.)"""
    for path in tree.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def layout(zip_path: pathlib.Path, submission: pathlib.Path, work: pathlib.Path) -> pathlib.Path:
    autograder = work / "autograder"
    for sub in ("source", "submission", "results"):
        (autograder / sub).mkdir(parents=True)
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(autograder / "source")
    shutil.copy(submission, autograder / "submission" / submission.name)
    for sub in ("home", "tmp"):
        (work / sub).mkdir()
    return autograder


class Cgroup:
    """cgroup v1 groups (memory, cpu, cpuacct) holding one graded run."""

    def __init__(self, name: str, *, memory: int, cpu: float):
        self.memory = CGROUP_V1 / "memory" / name
        self.cpu = CGROUP_V1 / "cpu" / name
        # cpu and cpuacct may be one hierarchy (cpu,cpuacct) or two
        acct = CGROUP_V1 / "cpuacct" / name
        self.cpuacct = self.cpu if (self.cpu.parent / "cpuacct.usage").exists() else acct
        for d in dict.fromkeys((self.memory, self.cpu, self.cpuacct)):
            d.mkdir()
        if memory:
            (self.memory / "memory.limit_in_bytes").write_text(str(memory))
            memsw = self.memory / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(memory))
        (self.memory / "memory.swappiness").write_text("0")
        if cpu:
            period = 100_000
            (self.cpu / "cpu.cfs_period_us").write_text(str(period))
            (self.cpu / "cpu.cfs_quota_us").write_text(str(int(cpu * period)))

    def enter(self) -> None:  # runs in the child before exec
        for d in dict.fromkeys((self.memory, self.cpu, self.cpuacct)):
            (d / "cgroup.procs").write_text(str(os.getpid()))

    def cpu_seconds(self) -> float:
        try:
            return int((self.cpuacct / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return float("nan")

    def stat(self) -> dict[str, int]:
        pairs = (line.split() for line in (self.memory / "memory.stat").read_text().splitlines())
        return {k: int(v) for k, v in pairs}

    def read(self, name: str) -> int:
        return int((self.memory / name).read_text())

    def kill_all(self) -> None:
        for _ in range(50):
            pids = [int(p) for p in (self.memory / "cgroup.procs").read_text().split()]
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def remove(self) -> None:
        self.kill_all()
        for d in dict.fromkeys((self.memory, self.cpu, self.cpuacct)):
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def bwrap_command(env: pathlib.Path, work: pathlib.Path, setenv: dict[str, str]) -> list[str]:
    """A private root: the host's system read-only, this run's /autograder, /root and /tmp."""
    cmd = ["bwrap", "--die-with-parent", "--unshare-pid", "--new-session",
           "--proc", "/proc", "--dev", "/dev"]
    for d in ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/opt", "/var", "/sys"):
        if pathlib.Path(d).exists():
            cmd += ["--ro-bind", d, d]
    cmd += ["--bind", str(work / "home"), "/root", "--bind", str(work / "tmp"), "/tmp",
            "--bind", str(work / "autograder"), "/autograder"]
    base = pathlib.Path(sys.base_prefix)
    cmd += ["--ro-bind", str(base), str(base), "--ro-bind", str(env), str(env)]
    cmd += ["--setenv", "HOME", "/root", "--setenv", "PATH", f"{env}/bin:/usr/bin:/bin",
            "--chdir", "/autograder"]
    for name, value in setenv.items():
        cmd += ["--setenv", name, value]
    return cmd + [str(env / "bin" / "python"), "/autograder/source/run_otter.py"]


def grade(lab: str, *, memory: int, cpu: float, wall: float, cache: pathlib.Path,
          log_dir: pathlib.Path, setenv: dict[str, str],
          submission: pathlib.Path | None = None, name: str | None = None) -> Fit:
    zip_path = ROOT / "autograder" / f"{lab}-autograder.zip"
    submission = submission or ROOT / "solutions" / lab / f"{lab}.ipynb"
    name = name or lab
    env = build_env(zip_path, cache)
    evict_page_cache(env)
    with tempfile.TemporaryDirectory(prefix=f"gsfit-{lab}-") as tmp:
        work = pathlib.Path(tmp)
        autograder = layout(zip_path, submission, work)
        evict_page_cache(work)
        group = Cgroup(f"gsfit-{name}-{os.getpid()}", memory=memory, cpu=cpu)
        peaks = {"anon": 0, "cache": 0}
        done = threading.Event()

        def sample():
            while not done.wait(SAMPLE_EVERY_S):
                s = group.stat()
                peaks["anon"] = max(peaks["anon"], s.get("total_rss", 0))
                peaks["cache"] = max(peaks["cache"], s.get("total_cache", 0))

        log_path = log_dir / f"{name}.log"
        sampler = threading.Thread(target=sample, daemon=True)
        try:
            with open(log_path, "w") as log:
                start = time.perf_counter()
                proc = subprocess.Popen(bwrap_command(env, work, setenv), stdout=log,
                                        stderr=subprocess.STDOUT, preexec_fn=group.enter)
                sampler.start()
                try:
                    proc.wait(timeout=wall)
                    timed_out = False
                except subprocess.TimeoutExpired:
                    timed_out = True
                    group.kill_all()
                    proc.wait()
                wall_s = time.perf_counter() - start
            done.set()
            sampler.join()
            peak, failcnt = group.read("memory.max_usage_in_bytes"), group.read("memory.failcnt")
            cpu_s = group.cpu_seconds()
        finally:
            done.set()
            group.remove()
        score = possible = None
        scores, status = {}, ""
        results = autograder / "results" / "results.json"
        if results.exists():
            data = json.loads(results.read_text())
            tests = data.get("tests", [])
            # otter's results.json has a top-level score only when it overrides the tests' sum
            score = data.get("score", sum(t.get("score") or 0 for t in tests))
            possible = sum(t.get("max_score") or 0 for t in tests)
            scores = {t["name"]: (t.get("score"), t["max_score"]) for t in tests
                      if "max_score" in t}
            status = data.get("output", "").split("\n")[0]
            shutil.copy(results, log_dir / f"{name}-results.json")
        return Fit(lab, name, scores, status, score, possible, wall_s, timed_out, peak,
                   peaks["anon"], peaks["cache"], failcnt, wall, cpu_s)


def tampering_cases(folder: pathlib.Path) -> dict[str, tuple[pathlib.Path, bool]]:
    """name -> (notebook, tampered?): grade_demo's tampering notebooks, the control (the same
    wrong Task 1 answer, nothing else) and the solution."""
    import copy

    import nbformat

    sys.path.insert(0, str(ROOT / "scripts"))
    from grade_demo import LAB, TAMPERING, with_cell

    sol = nbformat.read(ROOT / "solutions" / LAB / f"{LAB}.ipynb", as_version=4)
    wrong = copy.deepcopy(sol)
    cell = next(c for c in wrong.cells if c.source.startswith("### Your code here\nA_sharded"))
    cell.source = cell.source.replace("jax.device_put(A, sharding)",
                                      "jax.device_put(A + 1, sharding)")
    cases = {}
    for name, nb in {"solution": sol, "wrong-task-1": wrong,
                     **{n: with_cell(wrong, src, 'grader.check("q1_device_put")')
                        for n, src in TAMPERING.items()}}.items():
        path = folder / f"{name}.ipynb"
        nbformat.write(nb, path)
        cases[name] = (path, name.startswith("tamper-"))
    return cases


# Questions a tampering case breaks through the student's own cells, besides Task 1: the
# object that replaces `A_sharded` has no `.devices()`, so Task 2's answer cell raises.
ALSO_LOST = {"tamper-equal-to-anything": {"q2_inspect"}}


def tampering(args, memory: int, logs: pathlib.Path) -> bool:
    """Grade the tampering cases side by side; print one line each; whether all came out right."""
    import concurrent.futures

    lab = "lab3-parallelism"
    build_env(ROOT / "autograder" / f"{lab}-autograder.zip", args.cache)  # once, before the pool
    cases = tampering_cases(pathlib.Path(tempfile.mkdtemp(prefix="gsfit-tampering-")))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {name: pool.submit(grade, lab, memory=memory, cpu=args.cpu, wall=args.wall,
                                     cache=args.cache, log_dir=logs, setenv={},
                                     submission=path, name=name)
                   for name, (path, _) in cases.items()}
        fits = {name: f.result() for name, f in futures.items()}
    ok = True
    for name, fit in fits.items():
        tampered = cases[name][1]
        q1, q1_max = fit.scores.get("q1_device_put", (None, None))
        lost = {"q1_device_put", *ALSO_LOST.get(name, ())}
        others_full = bool(fit.scores) and all(
            score == (0 if test in lost else most)
            for test, (score, most) in fit.scores.items() if test != "q1_device_put")
        right = (others_full and fit.wall_s < min(args.wall, WALL_DEFAULT) and
                 (q1 == 0 and "TAMPERING" in fit.status if tampered else
                  q1 == (q1_max if name == "solution" else 0) and "TAMPERING" not in fit.status))
        ok &= right
        print(f"{name:26s} Task 1 {q1!s:>4}  total {fit.score!s:>5} / {fit.possible!s:5}  "
              f"wall {fit.wall_s:5.1f} s  peak {fit.peak_bytes / MIB:4.0f} MiB  "
              f"{'as expected' if right else 'NOT AS EXPECTED'}  | {fit.status[:160]}",
              flush=True)
    return ok


def parse_size(text: str) -> int:
    """Bytes of a size such as 768M or 1G; a bare number is MiB (1024 was once read as 1024
    bytes, which no grading fits in)."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(float(text) * MIB)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", default=list(LABS), metavar="LAB",
                        help=f"default: {' '.join(LABS)}")
    parser.add_argument("--memory", default=None,
                        help="memory cap, page cache included (e.g. 768M, 1G, or MiB: 1024; 0 = "
                             "none; default: what the README recommends for the lab: Gradescope's "
                             "768M" + (f", except {RECOMMENDED_MEMORY}" if RECOMMENDED_MEMORY
                                       else "") + ")")
    parser.add_argument("--cpu", type=float, default=CPU_DEFAULT,
                        help="CPU quota in CPUs (0 = none)")
    parser.add_argument("--wall", type=float, default=WALL_DEFAULT, help="seconds")
    parser.add_argument("--cache", type=pathlib.Path, default=CACHE_DEFAULT,
                        help="where the environment built from the zip is kept")
    parser.add_argument("--setenv", action="append", default=[], metavar="NAME=VALUE",
                        help="extra environment for otter and its kernel (what-if experiments; "
                             "Gradescope's run_autograder sets none)")
    parser.add_argument("--submission", type=pathlib.Path, default=None,
                        help="grade this notebook instead of the lab's solution (one lab only)")
    parser.add_argument("--logs", type=pathlib.Path, default=None,
                        help="folder for each run's output and results.json")
    parser.add_argument("--tampering", action="store_true",
                        help="grade Lab 3's tampering cases, a control and the solution")
    parser.add_argument("--jobs", type=int, default=1,
                        help="containers at once with --tampering (default: 1)")
    args = parser.parse_args()
    if os.geteuid() != 0 or not (CGROUP_V1 / "memory").is_dir() or not shutil.which("bwrap"):
        parser.error("needs root, cgroup v1 controllers under /sys/fs/cgroup and bwrap "
                     "(apt-get install -y bubblewrap)")
    unknown = sorted(set(args.labs) - set(LABS))
    if unknown:
        parser.error(f"unknown lab {', '.join(unknown)}; expected one of {', '.join(LABS)}")
    if args.submission and (len(args.labs) != 1 or not args.submission.is_file()):
        parser.error("--submission takes an existing notebook and exactly one LAB")
    if any("=" not in item for item in args.setenv):
        parser.error("--setenv takes NAME=VALUE")
    setenv = dict(item.split("=", 1) for item in args.setenv)
    for lab in args.labs:
        missing = [p for p in (ROOT / "autograder" / f"{lab}-autograder.zip",
                               args.submission or ROOT / "solutions" / lab / f"{lab}.ipynb")
                   if not p.is_file()]
        if missing:
            parser.error(f"{lab}: {', '.join(map(str, missing))} not found; run `jaxlab release`")
    def memory_of(lab):
        return parse_size(args.memory or RECOMMENDED_MEMORY.get(lab, "768M"))

    try:
        memories = {lab: memory_of(lab) for lab in [*args.labs, "lab3-parallelism"]}
    except ValueError:
        parser.error(f"--memory {args.memory!r}: expected a size such as 768M or 1G")
    logs = args.logs or pathlib.Path(tempfile.mkdtemp(prefix="gsfit-logs-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"limits: cpu {args.cpu or 'none'}, wall {args.wall:.0f} s; logs in {logs}", flush=True)
    if args.tampering:
        raise SystemExit(0 if tampering(args, memories["lab3-parallelism"], logs) else 1)
    fits = []
    for lab in args.labs:
        memory = memories[lab]
        fit = grade(lab, memory=memory, cpu=args.cpu, wall=args.wall, cache=args.cache,
                    log_dir=logs, setenv=setenv, submission=args.submission)
        fits.append(fit)
        score = "no result" if fit.score is None else f"{fit.score:g} / {fit.possible:g}"
        print(f"{lab:18s} memory {memory // MIB or 'none':>4} MiB  score {score:>10s}  "
              f"wall {fit.wall_s:6.1f} s"
              f"{' (wall limit hit)' if fit.timed_out else ''} (CPU {fit.cpu_s:.0f} s)  "
              f"peak {fit.peak_bytes / MIB:6.0f} MiB (anon {fit.peak_anon_bytes / MIB:.0f}, "
              f"page cache {fit.peak_cache_bytes / MIB:.0f}; limit hits {fit.failcnt})  "
              f"{'FITS' if fit.fits else 'DOES NOT FIT'}", flush=True)
    raise SystemExit(0 if all(f.fits for f in fits) else 1)


if __name__ == "__main__":
    main()
