"""Grade N copies of a solution with ``jaxlab grade`` and with a loop of ``otter run``; compare.

    python benchmarks/grade_vs_otter_run.py --autograder autograder/lab3-parallelism-autograder.zip \\
        --submission solutions/lab3-parallelism/lab3-parallelism.ipynb

Prints both wall times, their ratio and whether every copy got the same scores both ways.
By default ``jaxlab grade`` runs twice, with and without the sandbox (``default`` and
``no-sandbox``), and the ratio of the two is printed. Other settings (no prestart, no
compilation cache, XLA threads) can be compared with ``--variant``. Also printed, measured in the
same run:

* the warm-up: before the variants, one batch of one copy grades the lab's solution once to
  write the compilation cache every kernel reads (``jaxlab.grade.engine.warmup``; on a real machine
  once per autograder, kept between batches). Its time is printed and not counted in the
  variants; ``JAXLAB_CACHE_DIR`` points into this run's temporary folder, so it is always cold;
* the floor: the student's own cells, nothing else (no probe, no kernel start, no grader), run
  in fresh kernels with that warm compilation cache (read-only, as the kernels get it), one
  kernel pinned to each core and all cores at once, as a batch runs them; the mean seconds
  per copy, times the copies, divided by the cores. One core per kernel is the least CPU time
  the cells can take (more threads only add switching and waiting), and the cores share caches
  and memory bandwidth (measured: Lab 3's cells take ~6% longer while the other core runs a
  copy too), so no grader that runs the cells on this machine can finish the batch faster,
  whatever its overhead. The same cells with the other cores idle are printed beside it;
* the student's cells as the batch's own kernels timed them (``Record.cell_seconds``): the
  batch's time over their sum per worker is the grader's own cost, free of the run-to-run
  noise between the batch and the floor (this shared machine's speed drifts by ±5%);
* the peak memory of each worker: its own process plus its kernels (the running one and the
  one started ahead).
"""

import argparse
import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import nbformat
import pandas as pd
import psutil
from nbclient import NotebookClient

from jaxlab.grade import grade
from jaxlab.grade.engine import warmup
from jaxlab.grade.engine.autograder import open_autograder
from jaxlab.grade.engine.cells import student_cells
from jaxlab.grade.engine.kernel import Kernel, kernel_env
from jaxlab.grade.model import Record
from jaxlab.grade.engine.session import kernel_seconds

VARIANTS = {
    "default": {},  # sandboxed where bubblewrap runs
    "no-sandbox": {"sandbox": "off"},
    # the cgroup (processes, CPU) and tmpfs (disk) caps of every kernel, none of them
    "no-caps": {"resource_caps": False},
    # what sandboxed kernels give up: a compilation cache shared between kernels
    "no-sandbox-no-cache": {"sandbox": "off", "compile_cache": False},
    "no-cache": {"compile_cache": False},
    "no-prestart": {"prestart": False},
    "unpinned": {"pin_cpus": False},
    "1-thread": {"xla_threads": 1},
    "1-worker": {"workers": 1},
}


def otter_run_loop(autograder, copies, out):
    otter = pathlib.Path(sys.executable).with_name("otter")
    scores = {}
    for path in copies:
        dest = out / path.stem
        dest.mkdir(parents=True)
        subprocess.run([str(otter), "run", "-a", str(autograder), "-o", str(dest), str(path)],
                       check=True, capture_output=True)
        tests = json.loads((dest / "results.json").read_text())["tests"]
        scores[path.name] = {t["name"]: float(t["score"]) for t in tests if "score" in t}
    return scores


def cells_seconds(submission, autograder, cpu, work, cache_dir):
    """Seconds the student's cells take in a fresh kernel pinned to ``cpu`` (sum over cells)."""
    ag = open_autograder(autograder, work / "ag")
    cells = student_cells(nbformat.read(submission, as_version=4))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(src) for _, src in cells])
    kernel = Kernel.start(kernel_env(cache_dir, cache_writable=False), work, cpu=cpu)
    try:
        for path in ag.support_files():
            shutil.copy(path, kernel.workdir)
        NotebookClient(nb, km=kernel.km, timeout=600, kernel_name="python3").execute()
    finally:
        kernel.close()
    return sum(kernel_seconds(cell) for cell in nb.cells)


def cells_on_every_core(submission, autograder, cpus, work, cache_dir):
    """``cells_seconds`` of one copy per core, all running at once: seconds of each."""
    seconds = {}

    def run(cpu):
        seconds[cpu] = cells_seconds(submission, autograder, cpu, work / f"cpu{cpu}", cache_dir)

    threads = [threading.Thread(target=run, args=(cpu,)) for cpu in cpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [seconds[cpu] for cpu in cpus]


class WorkerMemory(threading.Thread):
    """Samples the resident memory of each worker process and of its whole process tree."""

    def __init__(self):
        super().__init__(daemon=True)
        self.tree_peak, self.own_peak, self.halt = 0, 0, threading.Event()

    def run(self):
        me = psutil.Process()
        while not self.halt.wait(0.2):
            for proc in me.children(recursive=True):
                try:
                    if "jaxlab.grade.engine.worker" not in " ".join(proc.cmdline()):
                        continue
                    own = proc.memory_info().rss
                    tree = own + sum(c.memory_info().rss for c in proc.children(recursive=True))
                except psutil.Error:
                    continue
                self.own_peak, self.tree_peak = max(self.own_peak, own), max(self.tree_peak, tree)


def jaxlab_scores(out):
    df = pd.read_csv(out / "final_grades.csv").set_index("file").drop("points-per-question")
    questions = [c for c in df.columns
                 if c not in ("total_points_earned", "percent_correct", "grading_status")]
    return {f: {q: float(df.loc[f, q]) for q in questions} for f in df.index}


def phase_means(out):
    """Mean seconds per submission in each phase of grading, and of the student's cells as
    their kernels timed them, from the batch's records."""
    records = [Record.read(p) for p in (out / ".jaxlab" / "records").glob("*.json")]
    phases = {}
    for r in records:
        for phase, seconds in r.phases.items():
            phases.setdefault(phase, []).append(seconds)
    text = ", ".join(f"{k} {statistics.mean(v):.1f}" for k, v in phases.items())
    return text, statistics.mean(r.cell_seconds for r in records), \
        max(r.peak_tasks for r in records)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--autograder", required=True)
    ap.add_argument("--submission", required=True)
    ap.add_argument("--copies", type=int, default=16)
    ap.add_argument("--variant", action="append", choices=list(VARIANTS))
    ap.add_argument("--skip-otter", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the graded output folders")
    ap.add_argument("--floor-runs", type=int, default=2,
                    help="times to measure the floor (the student's cells only, one copy per "
                         "core at once; 0: skip)")
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="jaxlab-bench-"))
    subs = work / "subs"
    subs.mkdir()
    copies = [shutil.copy(args.submission, subs / f"copy{i:02d}.ipynb") for i in range(args.copies)]
    copies = [pathlib.Path(c) for c in copies]
    os.environ["JAXLAB_CACHE_DIR"] = str(work / "jaxlab-cache")
    grade(paths=[str(copies[0])], output_dir=str(work / "warm-up"), autograder=args.autograder,
          show=False, sandbox="require")
    cache = warmup.read(warmup.folder_for(args.autograder))
    if cache is not None:
        print(f"warm-up (once per autograder and machine; not counted below): "
              f"{cache.seconds:.1f} s grading {cache.notebook} ({cache.earned:g}/"
              f"{cache.possible:g})", flush=True)
    results = {}
    cpus = sorted(os.sched_getaffinity(0))
    variants = args.variant or ["default", "no-sandbox"]
    for variant in variants:
        out = work / f"grade-{variant}"
        memory = WorkerMemory()
        memory.start()
        t = time.perf_counter()
        grade(paths=[str(subs)], output_dir=str(out), autograder=args.autograder,
              show=False, **{"sandbox": "require", **VARIANTS[variant]})
        results[variant] = (time.perf_counter() - t, jaxlab_scores(out))
        memory.halt.set()
        print(f"jaxlab grade [{variant}]: {results[variant][0]:.1f} s; peak memory per worker "
              f"{memory.tree_peak / 2**20:.0f} MiB with its kernels, "
              f"{memory.own_peak / 2**20:.0f} MiB for the worker process alone", flush=True)
        phases, cells, tasks = phase_means(out)
        slots = min(VARIANTS[variant].get("workers", len(cpus)), len(cpus))
        print(f"  mean seconds per submission by phase: {phases}", flush=True)
        if tasks:
            print(f"  most processes and threads one kernel's sandbox ran at once (sampled): "
                  f"{tasks}", flush=True)
        print(f"  the student's cells as this batch's kernels timed them: {cells:.1f} s per "
              f"copy; jaxlab grade / their sum over the workers = "
              f"{results[variant][0] * slots / (cells * args.copies):.2f} (the grader's own "
              "cost, measured in the same batch)", flush=True)
    if {"default", "no-sandbox"} <= set(results):
        (on, on_scores), (off, off_scores) = results["default"], results["no-sandbox"]
        print(f"sandbox on / off = {on / off:.3f} (target <= 1.05); identical scores: "
              f"{on_scores == off_scores}", flush=True)
    if {"default", "no-caps"} <= set(results):
        (on, on_scores), (off, off_scores) = results["default"], results["no-caps"]
        print(f"resource caps on / off = {on / off:.3f} (target: no measurable slowdown); "
              f"identical scores: {on_scores == off_scores}", flush=True)
    floor = None
    if args.floor_runs:
        folder = cache and cache.folder
        side_by_side = [statistics.mean(cells_on_every_core(
            args.submission, args.autograder, cpus, work / f"floor{i}", folder))
            for i in range(args.floor_runs)]
        alone = cells_seconds(args.submission, args.autograder, cpus[0], work / "alone", folder)
        per_copy = statistics.median(side_by_side)
        floor = per_copy * args.copies / len(cpus)
        print(f"student cells only, one kernel per core on all {len(cpus)} cores at once: "
              f"{per_copy:.1f} s per copy (runs: {', '.join(f'{r:.1f}' for r in side_by_side)});"
              f" floor for {args.copies} copies: {floor:.1f} s", flush=True)
        print(f"(the same cells with the other cores idle: {alone:.1f} s per copy, "
              f"{alone * args.copies / len(cpus):.1f} s for {args.copies} copies)", flush=True)
        for variant, (seconds, _) in results.items():
            print(f"[{variant}] jaxlab grade / floor = {seconds / floor:.2f} (target <= 1.15); "
                  f"/ idle-core figure = {seconds * len(cpus) / (alone * args.copies):.2f}",
                  flush=True)
    if not args.skip_otter:
        t = time.perf_counter()
        theirs = otter_run_loop(args.autograder, copies, work / "otter")
        otter_s = time.perf_counter() - t
        print(f"otter run loop: {otter_s:.1f} s for {len(copies)} copies")
        for variant, (seconds, ours) in results.items():
            same = ours == theirs
            print(f"[{variant}] jaxlab grade / otter run = {seconds / otter_s:.2f} "
                  f"(target <= 0.33); identical scores: {same}")
            for f in sorted(set(ours) | set(theirs)):
                a, b = ours.get(f, {}), theirs.get(f, {})
                for q in sorted(set(a) | set(b)):
                    if a.get(q) != b.get(q):
                        print(f"  {f} {q}: jaxlab grade {a.get(q)}, otter run {b.get(q)}")
        if floor:
            print(f"floor / otter run = {floor / otter_s:.2f}: no grader that runs the "
                  "student's cells can go below this on this machine")
    if args.keep:
        print(f"outputs kept in {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
