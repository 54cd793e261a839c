"""A trusted grading process: ``python -m jaxlab.grade.engine.worker``, driven over stdin.

The first stdin line is the batch's Settings (JSON); each further line is one job
``{"submission", "file", "sha256", "record", "more"}`` (``more``: whether another job may
follow, so that a kernel is started ahead for it). For each job it grades the notebook in a fresh
kernel (sandboxed when the batch is), writes the Record file and prints ``done``. Kernel output
never reaches stdout.
"""

import dataclasses
import hashlib
import importlib.util
import json
import os
import pathlib
import re
import secrets
import shutil
import sys
import tempfile
import time

from otter.nbmeta_config import NBMetadataConfig

from . import process
from ...checks.form import probe_order
from .autograder import FORM_MODULE, read_autograder
from .blame import explain
from .cells import answer_regions, cell_labels, claim_cells, probe_cells, student_cells
from .judge import score, verdicts
from .cgroup import Parent
from .kernel import Caps, Kernel, kernel_env
from ..model import EvidenceLayout, Record, Settings, StopKind
from .session import CellFault, Session
from .submissions import BadSubmission, read_submission

# what otter run / otter grade / Gradescope read results from
RESULT_FILES = {"results.json", "results.pkl", "results.txt"}
NOT_TAMPER_CHECKED = "not tamper-checked: the autograder has no jaxlab checks module"


@dataclasses.dataclass
class Run:
    """One run of a submission in one kernel: what happened and how it scored."""

    ex: object  # session.Execution
    judgement: object  # judge.Judgement
    strangers: list  # files in the evidence folder that the grader did not write
    phases: dict  # phase -> seconds it took
    programs: dict  # question -> the traced programs of its evidence (traces.tokens)
    judged: set  # questions whose points the jaxlab checks' verdicts decided


class _Clock:
    """Seconds spent in each phase of a run, for the record (the benchmark reads them)."""

    def __init__(self):
        self.phases, self._last = {}, time.monotonic()

    def lap(self, phase):
        now = time.monotonic()
        self.phases[phase] = round(self.phases.get(phase, 0) + now - self._last, 3)
        self._last = now


class Worker:
    def __init__(self, settings):
        self.s = settings
        self.ag = read_autograder(settings.autograder_root)
        self.scratch = pathlib.Path(tempfile.mkdtemp(prefix="worker-", dir=settings.scratch))
        self.kernels = self.scratch / "kernels"
        self.kernels.mkdir()
        if settings.kernel_uid is not None:  # kernels of another user pass through to theirs
            self.scratch.chmod(0o711)
        # kernels read the trusted warm-up's compilation cache and write none: an entry one
        # submission wrote would be code the next one runs
        self.env = kernel_env(settings.cache_dir, settings.xla_threads,
                              cache_writable=settings.cache_writable)
        self.checks = self._import_checks() if self.ag.checks_module else None
        limits = settings.limits
        self.caps = Caps(cgroup_parent=Parent.from_dict(settings.cgroup) if settings.cgroup
                         else None,
                         processes=limits.processes, cpus=limits.cpus,
                         disk_mb=limits.disk_mb if settings.disk_cap else None)
        self.spare = None
        self.more = True  # whether another job may follow this one (the batch says)
        self._prestart()

    def _start_kernel(self):
        return Kernel.start(self.env, self.kernels, self.s.cpu, sandboxed=self.s.sandboxed,
                            cache_dir=self.s.cache_dir, cache_writable=self.s.cache_writable,
                            caps=self.caps, uid=self.s.kernel_uid)

    def _prestart(self):
        """Start the next submission's kernel while this one runs."""
        if self.s.prestart and self.more and self.spare is None:
            self.spare = self._start_kernel()

    def _import_checks(self):
        sys.path.insert(0, str(self.ag.files))
        path = self.ag.files / f"{self.ag.checks_module}.py"
        spec = importlib.util.spec_from_file_location(self.ag.checks_module, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[self.ag.checks_module] = module
        spec.loader.exec_module(module)
        return module

    def _untouched(self):
        return all(hashlib.sha256(pathlib.Path(p).read_bytes()).hexdigest() == h
                   for p, h in self.s.fingerprint.items())

    def grade(self, job):
        start = time.monotonic()
        record = Record(file=job["file"], sha256=job["sha256"], sandboxed=self.s.sandboxed)
        self.more = job.get("more", True)
        try:
            if not self._untouched():
                raise BadSubmission("the grader's own files changed during the batch; "
                                    "grade again with --force")
            nb, files = read_submission(job["submission"])
            self._check_assignment(nb)
            record.answers = answer_regions(nb)
            self._grade(student_cells(nb), files, record, cell_labels(nb))
        except BadSubmission as exc:
            record.catastrophic, record.status = True, str(exc)
        except Exception as exc:  # a grader bug must cost one row, not the batch
            record.catastrophic = True
            record.status = f"grader error: {type(exc).__name__}: {exc}"
        record.seconds = round(time.monotonic() - start, 2)
        process.release_memory()
        record.write(job["record"])

    def _check_assignment(self, nb):
        """otter's rule: a zip that names its assignment grades only notebooks of that name."""
        want = self.ag.assignment_name
        got = NBMetadataConfig.from_notebook(nb).assignment_name
        if want and got != want:
            raise BadSubmission(
                f"this notebook is for assignment {got!r}, but the autograder grades {want!r}; "
                "grade it with that assignment's autograder" if got else
                f"this notebook names no assignment, but the autograder grades {want!r} "
                "(otter refuses it too)")

    def _grade(self, cells, files, record, labels):
        """Grade; if a cell killed the kernel, grade again once without it."""
        run = self._run(cells, files, labels)
        record.phases, record.cell_seconds = run.phases, run.ex.cell_seconds
        first = run.ex.stop
        if first is not None and first.is_fault:
            skipped = CellFault("skipped", detail="in a first run it stopped the kernel ("
                                + first.describe(self.s.limits.timeout) + ")")
            run = self._run(cells, files, labels, {first.cell: skipped})
            record.skipped = {"cell": first.cell, "reason": first}
            record.phases = {k: record.phases.get(k, 0) + v for k, v in run.phases.items()}
            record.cell_seconds += run.ex.cell_seconds
        ex = run.ex
        record.stop = ex.stop
        record.programs = run.programs
        record.questions = {tf.name: _test_file_record(tf, tf.name in run.judged)
                            for tf in run.judgement.test_files}
        timed_out = ex.stop is not None and ex.stop.kind is StopKind.TIMEOUT
        record.outcomes = {q: "timeout" if timed_out and o != "pass" else o
                           for q, o in run.judgement.outcomes.items()}
        record.flags = run.judgement.flags + _imitated_reports(ex.outputs, list(self.ag.tests))
        record.grader_errors = run.judgement.grader_errors
        forged = [name for name in ex.files if name in RESULT_FILES]
        if forged:
            record.flags.append("the notebook wrote files named like grading results "
                                f"({', '.join(forged)}), which this grader never reads")
        if run.strangers:
            record.flags.append("files the grader did not write appeared among its "
                                f"evidence ({', '.join(run.strangers[:5])})")
        record.peak_mb = round(ex.peak_mb)
        record.peak_tasks = ex.peak_tasks
        record.cell_seconds = round(record.cell_seconds, 3)
        record.status = _status(ex, record, self.s.limits.timeout,
                                tamper_checked=self.checks is not None)

    def _run(self, cells, files, labels, skipped=None):
        """One run in a fresh kernel, in its phases; ``skipped``: cell index -> CellFault of the
        cells of ``cells`` left out of this run."""
        skipped = skipped or {}
        running = [(i, src) for i, src in cells if i not in skipped]
        clock = _Clock()
        kernel = self.spare or self._start_kernel()
        self.spare = None
        # created only once the student's cells are done, under names they never saw, in the
        # one folder of the kernel's that is empty while they run
        private = kernel.folder.reveal / f"private-{secrets.token_hex(16)}"
        layout = EvidenceLayout(kernel.folder.reveal / f"evidence-{secrets.token_hex(16)}")
        tests = {q: private / f"test_{q}.py" for q in self.ag.tests}
        limits = self.s.limits
        try:
            self._place_files(kernel, files)
            with Session(kernel, limits) as session:
                clock.lap("kernel")
                # 1. the student's cells
                session.run([src for _, src in running], [i for i, _ in running])
                clock.lap("student")
                # the next kernel starts now, not during the student's cells: on this core it
                # would take ~0.35 CPU-s from them, while the phases below leave it idle at times
                # (the worker judging, a probe that sleeps) and take longer than its ~0.6 s start
                self._prestart()
                clock.lap("prestart")
                # 2. the hidden checks and otter's tests appear, and an empty evidence folder
                planted = kernel.folder.clear_reveal() if session.alive else []
                if session.alive:
                    try:
                        self._reveal(private, tests, layout, kernel.uid)
                    except OSError as exc:  # e.g. a process of the kernel filled it meanwhile
                        raise BadSubmission("the notebook's processes kept the grader from "
                                            f"placing its checks ({exc})") from None
                # 3. each question's graded names, probed into plain data
                if session.alive and self.checks:
                    session.run(probe_cells(probe_order(self.checks.QUESTIONS),
                                            self.ag.checks_module, private, layout))
                clock.lap("probe")
                if self.s.claims_first:  # 5. now, for every question (Settings.claims_first)
                    if session.alive:
                        session.run(claim_cells(tests, private, layout,
                                                set(self.checks.QUESTIONS) if self.checks
                                                else ()))
                    clock.lap("claims")
                else:
                    # 4. the trusted verdicts, once
                    decided = self._judge(session.result, layout)
                    clock.lap("judge")
                    # 5. otter's own tests in the kernel where the verdict fails (all of them
                    #    for a zip without checks): a claimed pass there is the sign of tampering
                    failing = {q: t for q, t in tests.items()
                               if q not in decided or not decided[q].passed}
                    if session.alive:
                        session.run(claim_cells(failing, private, layout, set(decided)))
                    clock.lap("claims")
            if self.s.claims_first:  # 4. with the kernel gone
                kernel.kill()
                decided = self._judge(session.result, layout)
                clock.lap("judge")
            ex = session.result
            # the student's own exception, where a cell of theirs left a question's names unset
            names = {q: self.checks.QUESTIONS[q].names for q in decided} if self.checks else {}
            decided = explain(decided, {**ex.cell_faults, **skipped}, cells, names, labels)
            # 6. the score, from the verdicts and the claims
            reason = ex.stop.describe(limits.timeout) if ex.stop else None
            judgement = score(self.ag, decided, layout, reason)
            # names the kernel put where only the grader writes (removed before the reveal)
            strangers = [*planted, *(layout.strangers(self.ag.tests)
                                     if layout.folder.exists() else [])]
        finally:
            kernel.close()
            self._reap()
            clock.lap("close")
        programs = {q: v.program for q, v in decided.items() if v.program}
        return Run(ex, judgement, strangers, clock.phases, programs, set(decided))

    def _judge(self, result, layout):
        """The trusted verdicts, from the evidence the probes left in ``layout``."""
        reason = result.stop.describe(self.s.limits.timeout) if result.stop else None
        return verdicts(self.ag, self.checks, layout, reason)

    def _place_files(self, kernel, files):
        """The submission's other files and the autograder's support files, in its folder."""
        work = pathlib.Path(kernel.workdir)
        for name, data in files.items():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            (work / name).write_bytes(data)
        for path in self.ag.support_files():
            dest = work / path.relative_to(self.ag.files)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest)
        if kernel.uid is not None:  # the student's files are theirs to change, as anywhere
            for path in [*work.rglob("*"), work]:
                os.chown(path, kernel.uid, kernel.uid, follow_symlinks=False)

    def _reveal(self, private, tests, layout, uid=None):
        """Create the hidden checks and the evidence folder once the student's cells are done."""
        private.mkdir(mode=0o700)
        for path in [*self.ag.hidden_files(), *self.ag.files.glob(f"{FORM_MODULE}.py")]:
            shutil.copyfile(path, private / path.name)
        for q, tf in self.ag.tests.items():
            shutil.copyfile(tf.path, tests[q])
        layout.folder.mkdir(mode=0o700)
        if uid is not None:  # read and written by the kernel's user (judged here all the same)
            for path in (private, layout.folder):
                os.chown(path, uid, uid)

    def _reap(self):
        """Kill every process left from this job: orphans of the kernel land here (subreaper)."""
        spare = {self.spare.pid} if self.spare else set()
        process.kill_and_reap(process.descendants(spare=spare))

    def close(self):
        if self.spare:
            self.spare.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _test_file_record(tf, judged):
    """otter's test file as the record keeps it; ``judged``: its points were decided by the
    jaxlab checks, whose messages are written for students (``by_checks`` on those cases)."""
    return {"path": tf.path, "all_or_nothing": tf.all_or_nothing, "cases": [
        {"name": r.test_case.name, "hidden": r.test_case.hidden, "points": r.test_case.points,
         "success_message": r.test_case.success_message,
         "failure_message": r.test_case.failure_message,
         "passed": r.passed, "message": r.message,
         "by_checks": bool(judged and r.test_case.points)} for r in tf.test_case_results]}


def _imitated_reports(outputs, questions):
    """Student output that looks like otter's report; otter's own check cells never run here."""
    if not questions:
        return []
    pattern = re.compile(rf"\b({'|'.join(map(re.escape, questions))}) (results:|passed!)")
    cells = sorted({i for i, text in outputs if pattern.search(text)})
    return [f"cell {i} printed text imitating a grading report" for i in cells]


def _status(ex, record, timeout, tamper_checked):
    stop = ex.stop
    parts = ["Completed" if stop is None
             else f"Timed out: {stop.describe(timeout)}" if stop.kind is StopKind.TIMEOUT
             else f"Killed: {stop.describe(timeout)}"]
    if record.skipped:
        first = record.skipped["reason"]
        parts.append(f"cell {record.skipped['cell']} skipped in a second run (first run: "
                     f"{first.describe(timeout)}); questions that need it get no credit")
    if ex.timed_out_cells:
        cells = ", ".join(str(i) for i in ex.timed_out_cells)
        parts.append(f"cell {cells} ran over the per-cell limit and was interrupted")
    if ex.cell_errors:
        i, e = ex.cell_errors[0]
        parts.append(f"{len(ex.cell_errors)} cell(s) raised errors (first: cell {i}, {e})")
    if ex.grader_timeouts:
        parts.append("a check ran over the per-cell limit")
    if ex.output_truncated:
        parts.append("output over the cap was dropped")
    if not tamper_checked:
        parts.append(NOT_TAMPER_CHECKED)
    if record.grader_errors:
        parts.append("GRADER ERROR (not the student's): the check of "
                     + "; ".join(record.grader_errors) + " could not run; regrade after fixing it")
    if record.flags:
        parts.append("TAMPERING SUSPECTED: " + "; ".join(record.flags))
    return "; ".join(parts)


def main():
    process.set_subreaper()
    settings = Settings.from_json(sys.stdin.readline())
    if settings.cpu is not None:
        # on its kernel's core: the judge (Lab 3's reference training, multi-threaded) then
        # takes the time of its own idle kernel, not that of the next slot's kernel
        os.sched_setaffinity(0, {settings.cpu})
    worker = Worker(settings)
    try:
        for line in sys.stdin:
            worker.grade(json.loads(line))
            print("done", flush=True)
    finally:
        worker.close()


if __name__ == "__main__":
    main()
