"""Grade a batch of submissions with a pool of trusted worker processes."""

import dataclasses
import functools
import json
import os
import pathlib
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from tqdm import tqdm

from ..engine import cgroup, process, warmup
from ..engine.autograder import open_autograder, shipped_autograder
from ..engine.kernel import cache_env
from ..engine.sandbox import Mode, SandboxUnavailable, decide, disk_cap_reason, unmount_under
from ..engine import gradescope
from ..engine.submissions import collect
from ..engine.warmup import shipped_solution
from ..model import Limits, Record, Settings
from ..output.results import results_of, write_csv, write_submission
from ..output.tally import print_table, question_table
from . import course, shard as shards

GRACE_S = 120  # a worker gets this long beyond --timeout to judge and write its record


def grade(*, paths, output_dir="grades", workers=None, timeout=Limits.timeout,
          cell_timeout=Limits.cell_timeout, memory_mb=Limits.memory_mb,
          processes=Limits.processes, cpus=Limits.cpus, disk_mb=Limits.disk_mb, assignment=None,
          autograder=None, force=False, output_cap_mb=Limits.output_cap_mb, prestart=True,
          compile_cache=True, warm_up=None, xla_threads=None, pin_cpus=None,
          sandbox=Mode.AUTO.value, resource_caps=True, shard=None, show=True, only=None,
          deadline=None, late_penalty=None, grace=None, late_cap=None, cutoff=None,
          extensions=None, canvas_roster=None, canvas_assignment=None, template=None):
    """Grade every submission under ``paths`` into ``output_dir``; True when the batch ran.

    ``shard``: ``"K/N"`` grades only the submissions of shard K of N (``shard.shard_of``) and
    writes only their records, summaries and Gradescope JSON into ``output_dir``, which other
    shards share; ``jaxlab report`` (``run.report.report``) then writes the CSV, plot and page.
    Without it the batch is one shard of one and writes everything itself.
    ``sandbox``: "auto" runs each kernel in a bubblewrap sandbox where bwrap runs here and says
    in every row where it does not; "require" refuses to grade without one; "off" never uses one.
    ``warm_up``: a trusted notebook (the lab's solution) graded once per autograder and machine
    to write the compilation cache every kernel reads (default: the shipped solution beside the
    autograder zip, if there is one; without one, kernels compile everything themselves).
    ``processes``, ``cpus``, ``disk_mb``: each kernel's cap on processes and threads, its CPU
    time in cores and what it may write (cgroups and a tmpfs; where this machine cannot apply
    them, e.g. without root, every row says so). ``resource_caps=False`` applies none of the
    three (the benchmark compares).
    A Gradescope export among ``paths`` (``engine.gradescope``) gives each row its students and
    submission time; ``deadline``, ``late_penalty``, ``grace``, ``late_cap``, ``cutoff`` and
    ``extensions`` make the late policy (``run.course.policy_of``), ``canvas_roster`` a Canvas
    gradebook export to take students' Canvas IDs and the assignment's column from,
    ``canvas_assignment`` that column's title (``run.course.canvas_column``: checked before
    anything is graded). ``only``: names of submissions, export
    folders or students (name, email or SID) to grade again, leaving every other record as it
    is. ``template``: the student notebook as released, whose code the similarity check leaves
    out (default: the shipped one beside the autograder zip).
    """
    started = time.time()
    part = shards.Shard.parse(shard) if shard is not None else shards.WHOLE
    whole = part == shards.WHOLE
    out = pathlib.Path(output_dir)
    export = gradescope.find(paths, shards.state_dir(out) / "export")
    roster = export.roster if export else None
    # graded from an earlier export, lacking from this one: kept, their students in the roster
    kept = course.graded_before(out, [s.file for s in export.submissions]) if export else {}
    if kept:
        roster = course.with_graded_before(roster, kept)
    # checked before anything is graded: a bad deadline or extension costs nothing
    policy = course.policy_of(out, roster, deadline=deadline, late_penalty=late_penalty,
                              grace=grace, late_cap=late_cap, cutoff=cutoff,
                              extensions=extensions)
    canvas = course.canvas_of(out, canvas_roster, canvas_assignment)
    if export:
        entries = {sub.entry for sub, _ in kept.values()}
        gradescope.say(export.warnings + [w for e, w in export.absent.items() if e not in entries])
        course.say_kept(kept)
    everything = export.submissions if export else collect(paths, exclude=[out])
    if not everything:
        print("jaxlab grade: no .ipynb or .zip submissions found", file=sys.stderr)
        return False
    # every shard sees the whole folder: the same `file` keys, the same autograder guess
    subs = [s for s in everything if part.holds(s.file)]
    again = {s.file for s in course.select(subs, roster, only)} if only else set()
    if not whole:
        print(f"jaxlab grade: shard {part} holds {len(subs)} of the {len(everything)} "
              "submissions", file=sys.stderr)
    try:
        isolation = decide(sandbox)
    except SandboxUnavailable as exc:
        print(f"jaxlab grade: refusing to grade: {exc}", file=sys.stderr)
        return False
    if not isolation.sandboxed:
        print(f"jaxlab grade: kernels run with your own rights, {isolation.status}",
              file=sys.stderr)
    no_cgroups, no_disk_cap = (cgroup.unavailable_reason(), disk_cap_reason()) if resource_caps \
        else ("resource_caps=False", "disk use not capped")
    uncapped = [no_disk_cap] if no_disk_cap else []
    if no_cgroups and isolation.sandboxed and os.geteuid() != 0 and resource_caps:
        uncapped.insert(0, f"CPU share not enforced ({no_cgroups})")  # RLIMIT_NPROC caps processes
    elif no_cgroups:
        uncapped.insert(0, f"processes and CPU not capped ({no_cgroups})")
    for reason in uncapped:
        print(f"jaxlab grade: {reason}", file=sys.stderr)
    row_notes = [n for n in (isolation.status, *uncapped) if n]
    zip_path = autograder or shipped_autograder(assignment, [s.path for s in everything])
    column = course.canvas_column(canvas, course.lab_name(zip_path))
    state = shards.state_dir(out)
    (state / shards.RECORDS).mkdir(parents=True, exist_ok=True)
    if roster is not None:
        course.keep_roster(out, roster)
    course.keep_policy(out, policy)
    course.keep_canvas(out, canvas)
    course.keep_template(out, template or course.shipped_template(zip_path))
    # named by this process: its cgroup and its kernels' mounts say whose they are
    scratch = pathlib.Path(tempfile.mkdtemp(prefix=f"{cgroup.BATCH_PREFIX}{os.getpid()}-"))
    process.set_subreaper()
    if not no_cgroups:
        cgroup.Parent.find().remove_orphans()  # left by batches killed with SIGKILL
    groups = None if no_cgroups else cgroup.Parent.find().child(scratch.name)
    on_term = _exit_on_sigterm()
    try:
        ag = open_autograder(zip_path, scratch / "autograder")
        digests = {s.file: s.digest() for s in subs}
        # the report step reads the autograder from here, on whichever machine it runs
        manifest = shards.started(out, part, digests, shards.keep_autograder(out, zip_path))
        records = {} if force and not only else shards.records_of(out, digests)
        records = {f: r for f, r in records.items() if f not in again}
        pending = [s for s in subs if s.file not in records]
        if not whole and show:
            print(f"jaxlab grade: shard {part}: {len(records)} graded before, grading "
                  f"{len(pending)}", file=sys.stderr)
        settings = Settings(
            autograder_root=str(ag.root), fingerprint=ag.fingerprint(), scratch=str(scratch),
            limits=Limits(timeout=timeout, cell_timeout=cell_timeout, memory_mb=memory_mb,
                          output_cap_mb=output_cap_mb, processes=processes, cpus=cpus,
                          disk_mb=disk_mb),
            sandboxed=isolation.sandboxed, prestart=prestart, xla_threads=xla_threads,
            cgroup=groups and groups.to_dict(), disk_cap=no_disk_cap is None,
            reference_dir=str(warmup.reference_folder(zip_path)) if compile_cache else None,
            log=str(state / ("workers.log" if whole else f"workers-{part.name}.log")))
        cpus = sorted(os.sched_getaffinity(0))  # what this process may use (Slurm binds it)
        n = max(1, min(workers or len(cpus), len(pending)))
        if pin_cpus is None:  # one kernel per core measured 15% faster than sharing both
            # a shard given more cores than workers shares them with others (pods on one
            # node, shards started by hand), which would pin to the same first cores
            pin_cpus = n <= len(cpus) and (whole or workers is None or workers >= len(cpus))
        # 0. the compilation cache every kernel reads, written once by a trusted notebook
        warm_up = warm_up or shipped_solution(zip_path)
        if compile_cache and warm_up and pending:
            cache = warmup.warm(zip_path=zip_path, notebook=warm_up, grade_one=functools.partial(
                _warm_up, dataclasses.replace(settings, cpu=cpus[0] if pin_cpus else None),
                scratch, ag))
            if cache is None:
                print(f"jaxlab grade: could not grade {warm_up} to warm the compilation cache; "
                      "every kernel compiles for itself", file=sys.stderr)
            else:
                settings = dataclasses.replace(settings, cache_dir=str(cache.folder))
                if show or not cache.complete:
                    print(f"jaxlab grade: {cache.describe()}", file=sys.stderr)
                if not cache.complete:
                    print(f"jaxlab grade: WARNING: {warm_up} does not score in full with this "
                          f"autograder here ({cache.status}); check this machine's environment "
                          "before trusting the grades", file=sys.stderr)
        jobs = queue.Queue()
        for s in pending:
            jobs.put({"submission": str(s.path), "file": s.file, "sha256": digests[s.file],
                      "record": str(scratch / f"{shards.record_key(s.file)}.json")})
        done = queue.Queue()
        slots = [threading.Thread(target=_slot, daemon=True, args=(
                     dataclasses.replace(settings, cpu=cpus[i % len(cpus)] if pin_cpus else None),
                     jobs, done))
                 for i in range(n if pending else 0)]
        for t in slots:
            t.start()
        csv_at, csv_took = -float("inf"), 0.0
        with _Progress(len(pending), show, "" if whole else f"shard {part}: ") as bar:
            for _ in pending:
                record = done.get()
                if row_notes:
                    record.status = "; ".join([record.status, *row_notes])
                records[record.file] = record
                record.write(state / shards.RECORDS / f"{shards.record_key(record.file)}.json")
                write_submission(out, record, ag)
                # a shard leaves the files every shard would write to the report; a whole
                # batch keeps the CSV current, spending at most ~10% of its time rewriting it
                # (2,000 rows take seconds; `jaxlab report` rebuilds it from the records)
                if whole and time.monotonic() - csv_at >= 10 * csv_took:
                    csv_at = time.monotonic()
                    write_csv(out, _ordered(records, subs, kept), ag, roster, policy)
                    csv_took = time.monotonic() - csv_at
                bar.update()
        for t in slots:
            t.join()
        manifest.finished = time.time()
        shards.write_manifest(out, manifest)
        if whole:
            course.write_class_files(out, _ordered(records, subs, kept), ag, policy=policy,
                                     canvas_roster=canvas.rows, canvas_column=column, show=show)
            if show:
                print_table(question_table(_ordered(records, subs), ag))
        elif show:
            print(f"jaxlab grade: shard {part} done; once every shard is, `jaxlab report {out}` "
                  "writes final_grades.csv and the class report", file=sys.stderr)
        return True
    finally:
        _sweep(started)
        if groups:
            groups.remove()
        unmount_under(scratch)  # kernel folders a killed worker left mounted
        shutil.rmtree(scratch, ignore_errors=True)
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)


class _Progress:
    """tqdm's bar where stderr is a terminal; elsewhere (a Slurm log, a pipe, a file), where
    each of the bar's redraws would stay behind as a carriage return, a plain line every
    ~1/LINES of the batch and at its end, in tqdm's own words without the bar.

    tqdm's ``disable=None`` is its own switch for "not a terminal"; ``mininterval`` only
    spaces the redraws, which still land on one line of the log."""

    LINES = 20  # at most this many lines per batch, plus the last
    WORDS = "{desc}graded {n_fmt} of {total_fmt} ({percentage:.0f}%) in {elapsed}, " \
            "{remaining} left"

    def __init__(self, total, show, desc=""):
        self.bar = tqdm(total=total, unit="nb", desc="grading", disable=None if show else True)
        self.lines = show and self.bar.disable
        self.total, self.n, self.desc, self.began = total, 0, desc, time.monotonic()
        self.every = max(1, -(-total // self.LINES))

    def update(self):
        self.bar.update()
        self.n += 1
        if self.lines and (self.n % self.every == 0 or self.n == self.total):
            print("jaxlab grade: " + tqdm.format_meter(
                self.n, self.total, time.monotonic() - self.began, prefix=self.desc,
                bar_format=self.WORDS), file=sys.stderr, flush=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.bar.close()


def _exit_on_sigterm():
    """Make SIGTERM (what scancel, kill and a Kubernetes pod's end send first) unwind the batch
    like Ctrl-C, so that its kernels, cgroups and mounts are cleaned up; the old handler."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def _warm_up(settings, scratch, ag, cache_dir, notebook):
    """Grade the trusted ``notebook`` with ``cache_dir`` writable: (earned, possible, status)."""
    settings = dataclasses.replace(settings, cache_dir=str(cache_dir), cache_writable=True)
    record = _grade_one(settings, {
        "submission": str(notebook), "file": pathlib.Path(notebook).name, "sha256": "",
        "record": str(scratch / "warm-up.json"), "more": False})
    if record is None or record.catastrophic:
        return None
    results = results_of(record, ag)
    return results.total, results.possible, record.status


def _grade_one(settings, job):
    """One job in a worker process of its own; its record, or None if it died or hung."""
    worker = _Process(settings)
    try:
        worker.send_line(json.dumps(job))
        ok = worker.wait_done(2 * settings.limits.timeout + GRACE_S)
    except OSError:
        ok = False
    finally:
        worker.close() if ok else worker.kill()
    return _read_record(job) if ok else None


def _ordered(records, subs, kept=None):
    """The records of ``subs`` in their order, then those ``kept`` (``course.graded_before``)."""
    return [records[s.file] for s in subs if s.file in records] + \
        [record for _, record in (kept or {}).values()]


def _worker_env(settings):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    # glibc gives each of XLA's threads its own malloc arena; two arenas kept a Lab 3 kernel
    # at ~780 MiB instead of ~970 MiB and the worker at ~320 MiB instead of ~590 MiB, same speed
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PJRT_NPROC="16", MALLOC_ARENA_MAX="2")
    # the worker's references compile from the same trusted cache (and into it while warming)
    env.update(cache_env(settings.cache_dir, settings.cache_writable))
    if settings.reference_dir:
        env["JAXLAB_REFERENCE_DIR"] = settings.reference_dir  # read by the checks module
    return env


class _Process:
    """One worker subprocess; its stdout lines arrive on a queue so reads can time out."""

    def __init__(self, settings):
        with open(settings.log, "a") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jaxlab.grade.engine.worker"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, text=True, env=_worker_env(settings),
                start_new_session=True)
        self.lines = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.send_line(settings.to_json())

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def send_line(self, text):
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def wait_done(self, seconds):
        try:
            return self.lines.get(timeout=seconds) == "done"
        except queue.Empty:
            return False

    def close(self):
        try:
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()

    def kill(self):
        process.kill_and_reap(process.tree(self.proc.pid))
        self.proc.wait()


def _slot(settings, jobs, done):
    worker = None
    try:
        while True:
            try:
                job = jobs.get_nowait()
            except queue.Empty:
                return
            job["more"] = not jobs.empty()  # else no kernel is started ahead for a next one
            worker = worker or _Process(settings)
            try:
                worker.send_line(json.dumps(job))
                # a kernel death costs a second run, each up to the timeout
                ok = worker.wait_done(2 * settings.limits.timeout + GRACE_S)
            except OSError:
                ok = False
            record = _read_record(job) if ok else None
            if record is None:
                worker.kill()
                worker = None
                record = Record(job["file"], job["sha256"], catastrophic=True,
                                status="the grading process for this submission died or hung",
                                sandboxed=settings.sandboxed)
            done.put(record)
    finally:
        if worker:
            worker.close()


def _read_record(job):
    try:
        record = Record.read(job["record"])
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if record.file != job["file"] or record.sha256 != job["sha256"]:
        return None
    return record


def _sweep(since):
    """Kill any process this batch started that is still alive (none should be)."""
    process.kill_and_reap(process.descendants(since=since))
