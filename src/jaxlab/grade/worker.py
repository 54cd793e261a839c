"""A trusted grading process: ``python -m jaxlab.grade.worker``, driven over stdin.

The first stdin line is the batch settings (JSON); each further line is one job
``{"submission", "file", "record"}``. For each job it runs the notebook in a fresh kernel, judges
the evidence, writes the record file and prints ``done``. Kernel output never reaches stdout.
"""

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

import psutil

from .autograder import FORM_MODULE, read_autograder
from .execute import Kernel, claim_cells, execute, kernel_env, probe_cells, student_cells
from .judge import judge
from .submissions import BadSubmission, read_submission

# what otter run / otter grade / Gradescope read results from
RESULT_FILES = {"results.json", "results.pkl", "results.txt"}
NOT_TAMPER_CHECKED = "not tamper-checked: the autograder has no jaxlab checks module"


def kill_and_reap(procs):
    procs = list(procs)
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)  # reaps our own children, so no zombie is left


def release_memory():
    """Give freed heap back to the OS, so a worker's resident size stays near its live data."""
    try:
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)
    except Exception:
        pass


def set_subreaper():
    """Orphaned descendants (e.g. a kernel's double-forked child) re-parent to this process."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except Exception:
        pass


class Worker:
    def __init__(self, settings):
        self.s = settings
        self.ag = read_autograder(settings["autograder_root"])
        self.scratch = pathlib.Path(tempfile.mkdtemp(prefix="worker-", dir=settings["scratch"]))
        self.kernels = self.scratch / "kernels"
        self.kernels.mkdir()
        self.sandboxed = settings.get("sandboxed", False)
        # a sandboxed kernel gets no compilation cache another kernel wrote: its entries are
        # code the next kernel would run
        self.env = kernel_env(None if self.sandboxed else settings.get("cache_dir"),
                              settings.get("xla_threads"))
        self.checks = self._import_checks() if self.ag.checks_module else None
        self.spare = None
        if settings.get("prestart", True):
            self.spare = self._start_kernel()

    def _start_kernel(self):
        return Kernel.start(self.env, self.kernels, self.s.get("cpu"), sandboxed=self.sandboxed)

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
                   for p, h in self.s["fingerprint"].items())

    def grade(self, job):
        start = time.monotonic()
        record = {"file": job["file"], "sha256": job["sha256"], "catastrophic": False,
                  "flags": [], "questions": {}, "outcomes": {}}
        try:
            if not self._untouched():
                raise BadSubmission("the grader's own files changed during the batch; "
                                    "grade again with --force")
            nb, extra = read_submission(job["submission"])
            self._run(nb, extra, record)
        except BadSubmission as exc:
            record.update(catastrophic=True, status=str(exc))
        except Exception as exc:  # a grader bug must cost one row, not the batch
            record.update(catastrophic=True, status=f"grader error: {type(exc).__name__}: {exc}")
        record["seconds"] = round(time.monotonic() - start, 2)
        release_memory()
        tmp = pathlib.Path(job["record"] + ".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, job["record"])

    def _run(self, nb, extra, record):
        cells = student_cells(nb)
        kernel = self.spare or self._start_kernel()
        self.spare = None
        # created only once the student's cells are done, under names they never saw, in the
        # one folder of the kernel's that is empty while they run
        private = kernel.folder.reveal / f"private-{secrets.token_hex(16)}"
        evidence = kernel.folder.reveal / f"evidence-{secrets.token_hex(16)}"
        try:
            workdir = pathlib.Path(kernel.workdir)
            for name, data in extra.items():
                (workdir / name).parent.mkdir(parents=True, exist_ok=True)
                (workdir / name).write_bytes(data)
            for path in self.ag.support_files():
                dest = workdir / path.relative_to(self.ag.files)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, dest)
            tests = {q: private / f"test_{q}.py" for q in self.ag.tests}
            if self.checks:
                # the kernel's own run of otter's tests is only needed where the trusted
                # verdict fails: a claimed pass there is the sign of tampering
                extra = probe_cells(self.checks.QUESTIONS, self.ag.checks_module, private,
                                    evidence)

                def then():
                    failing = judge(self.ag, self.checks, evidence).outcomes
                    return claim_cells({q: t for q, t in tests.items()
                                        if failing.get(q) != "pass"}, private, evidence)
            else:
                extra, then = claim_cells(tests, private, evidence), None
            ex = execute(kernel, cells, extra, timeout=self.s["timeout"],
                         cell_timeout=self.s["cell_timeout"], memory_mb=self.s["memory_mb"],
                         output_cap=self.s["output_cap"], on_start=self._prestart,
                         on_grader_start=lambda: self._reveal(private, tests, evidence),
                         then=then)
            verdicts = judge(self.ag, self.checks, evidence, no_answers_reason=ex.killed)
            expected = {f"{p}{q}.{x}" for q in self.ag.tests for p in ("", "claim-")
                        for x in ("json", "npz")}
            strangers = sorted(p.name for p in evidence.glob("*") if p.name not in expected)
            forged = [name for name in ex.files if name in RESULT_FILES]
        finally:
            kernel.close()
            self._reap()
        record["questions"] = {tf.name: _test_file_record(tf) for tf in verdicts.test_files}
        record["outcomes"] = verdicts.outcomes
        if ex.killed:
            record["outcomes"] = {q: "timeout" if ex.killed.startswith("timed out") else o
                                  for q, o in verdicts.outcomes.items() if o != "pass"} | \
                {q: o for q, o in verdicts.outcomes.items() if o == "pass"}
        record["flags"] = verdicts.flags + _imitated_reports(ex.outputs, list(self.ag.tests))
        if forged:
            record["flags"].append("the notebook wrote files named like grading results "
                                   f"({', '.join(forged)}), which this grader never reads")
        if strangers:
            record["flags"].append("files the grader did not write appeared among its "
                                   f"evidence ({', '.join(strangers[:5])})")
        record["peak_mb"] = round(ex.peak_mb)
        record["status"] = _status(ex, record["flags"], tamper_checked=self.checks is not None)

    def _reveal(self, private, tests, evidence):
        """Create the hidden checks and the evidence folder once the student's cells are done."""
        private.mkdir(mode=0o700)
        for path in [*self.ag.hidden_files(), *self.ag.files.glob(f"{FORM_MODULE}.py")]:
            shutil.copyfile(path, private / path.name)
        for q, tf in self.ag.tests.items():
            shutil.copyfile(tf.path, tests[q])
        evidence.mkdir(mode=0o700)

    def _reap(self):
        """Kill every process left from this job: orphans of the kernel land here (subreaper)."""
        keep = {p.pid for p in self.spare.tree()} if self.spare else set()
        kill_and_reap(p for p in psutil.Process().children(recursive=True) if p.pid not in keep)

    def _prestart(self):
        if self.s.get("prestart", True) and self.spare is None:
            self.spare = self._start_kernel()

    def close(self):
        if self.spare:
            self.spare.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _test_file_record(tf):
    return {"path": tf.path, "all_or_nothing": tf.all_or_nothing, "cases": [
        {"name": r.test_case.name, "hidden": r.test_case.hidden, "points": r.test_case.points,
         "success_message": r.test_case.success_message,
         "failure_message": r.test_case.failure_message,
         "passed": r.passed, "message": r.message} for r in tf.test_case_results]}


def _imitated_reports(outputs, questions):
    """Student output that looks like otter's report; otter's own check cells never run here."""
    if not questions:
        return []
    pattern = re.compile(rf"\b({'|'.join(map(re.escape, questions))}) (results:|passed!)")
    cells = sorted({i for i, text in outputs if pattern.search(text)})
    return [f"cell {i} printed text imitating a grading report" for i in cells]


def _status(ex, flags, tamper_checked):
    parts = [f"Killed: {ex.killed}" if ex.killed and not ex.killed.startswith("timed out")
             else f"Timed out: {ex.killed.removeprefix('timed out: ')}" if ex.killed
             else "Completed"]
    if ex.timed_out_cells:
        cells = ", ".join(str(i) for i, _ in ex.timed_out_cells)
        parts.append(f"cell {cells} ran over the per-cell limit and was interrupted")
    student_errors = [(i, e) for i, e in ex.cell_errors if i is not None]
    if student_errors:
        i, e = student_errors[0]
        parts.append(f"{len(student_errors)} cell(s) raised errors (first: cell {i}, {e})")
    if len(student_errors) < len(ex.cell_errors):
        parts.append("a check ran over the per-cell limit")
    if ex.output_truncated:
        parts.append("output over the cap was dropped")
    if not tamper_checked:
        parts.append(NOT_TAMPER_CHECKED)
    if flags:
        parts.append("TAMPERING SUSPECTED: " + "; ".join(flags))
    return "; ".join(parts)


def main():
    set_subreaper()
    worker = Worker(json.loads(sys.stdin.readline()))
    try:
        for line in sys.stdin:
            worker.grade(json.loads(line))
            print("done", flush=True)
    finally:
        worker.close()


if __name__ == "__main__":
    main()
