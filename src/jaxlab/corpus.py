"""Grade answers to a lab (the corpus in tests/answers/<lab>/<question>.yaml, or the mutation
analysis's mutants) the way otter grades a notebook.

One kernel per lab runs the solution notebook once, as otter's grading run does (same cells,
same globals, the autograder zip's support files beside it, PJRT_NPROC=16 in the kernel's
environment). Otter's own init, ``grader.check`` and export cells are skipped: the harness runs
the zip's test file for each question itself, with otter's ``Checker.check``, which is what
those cells call in grading mode.

Before every code cell the kernel keeps a shallow copy of its globals, so the notebook's state
before any cell, and after the last one, can be put back without running anything. Grading an
answer at cell k then replays what a notebook with that answer would do:

* the answer code runs in the state the notebook had before cell k;
* every later cell that reads a name the answer (or the solution's cell) assigns is run again,
  transitively (names read inside functions count, so a function defined from a changed name
  is defined again); each of these cells sees, for the names no re-run cell assigned, the
  values they had at that point of the original run, so a cell that fails half way leaves the
  same names behind as in a full run;
* names whose last writer in the notebook is a later cell that did not run again get that
  cell's value back;
* then the question's test file runs against the globals, and so does the test file of every
  other question that reads a name the replay assigned (the others read the very objects the
  solution run left, whose verdicts were taken once after that run);
* finally every name the replay touched gets its value from the end of the solution run.

``tests/test_grading_paths.py`` grades a sample of answers through the full ``otter run`` path
and checks the verdicts agree. ``jaxlab mutants`` grades its mutants here too, and asks the
kernel for a question's evidence (its probe on inputs drawn from a given seed) to compare what
a mutant does with what the solution does.
"""

import ast
import dataclasses
import json
import os
import pathlib
import queue
import shutil
import zipfile

import nbformat
import yaml

from jaxlab.checks.form import module_writes, python_of
from jaxlab.grade.output.tally import in_notebook_order

# the repository this package is installed from (`make` installs it editable): assignments/,
# the releases and tests/answers/ are there
ROOT = pathlib.Path(__file__).resolve().parents[2]
PROMPT = "### Your code here"
MARK = "@@corpus@@"
CLAIM_TAG = "claim:"  # the tag of a cell that measures what the text claims (docs/claims.md)


# --------------------------------------------------------------------------- the corpus
@dataclasses.dataclass(frozen=True)
class Answer:
    lab: str
    question: str
    name: str
    why: str
    code: str
    correct: bool
    message: str | None = None  # what the failure must say
    other_questions_lose: tuple = ()
    # written blind (tests/answers/<lab>/blind/: from the student notebook alone, by someone
    # who never saw the checks), with the sentence its label rests on and the mistake's kind
    blind: bool = False
    sentence: str | None = None
    kind: str | None = None

    @property
    def id(self):
        label = "correct" if self.correct else "wrong"
        return f"{self.lab}/{self.question}/{'blind/' if self.blind else ''}{label}/{self.name}"

    def cell_source(self):
        return f"{PROMPT}\n{self.code.rstrip()}\n"


def answers_folder(root=ROOT):
    return pathlib.Path(root) / "tests" / "answers"


def labs(root=ROOT):
    """Labs with an answer corpus and a release to grade it against."""
    found, answers = [], answers_folder(root)
    for folder in sorted(p for p in answers.iterdir() if p.is_dir()) if answers.exists() else []:
        lab = folder.name
        if (pathlib.Path(root) / "student" / lab / f"{lab}.ipynb").exists() and \
                (pathlib.Path(root) / "autograder" / f"{lab}-autograder.zip").exists():
            found.append(lab)
    return found


def load_answers(lab, root=ROOT, *, blind=True):
    """The corpus of ``lab``: its answers, then (``blind``) those of its ``blind/`` folder."""
    folder = answers_folder(root) / lab
    paths = [(p, False) for p in sorted(folder.glob("*.yaml"))]
    if blind:
        paths += [(p, True) for p in sorted((folder / "blind").glob("*.yaml"))]
    answers = []
    for path, written_blind in paths:
        data = yaml.safe_load(path.read_text()) or {}
        unknown = set(data) - {"correct", "wrong"}
        if unknown:
            raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}")
        for kind in ("correct", "wrong"):
            for entry in data.get(kind) or []:
                answers.append(Answer(
                    lab=lab, question=path.stem, name=entry["name"], why=entry["why"],
                    code=entry["code"], correct=kind == "correct",
                    message=entry.get("message"),
                    other_questions_lose=tuple(entry.get("other_questions_lose", ())),
                    blind=written_blind, sentence=entry.get("sentence"),
                    kind=entry.get("kind")))
    return answers


# --------------------------------------------------------------------------- notebook analysis
def reads_writes(source):
    """(names read anywhere in the cell, names it binds at module level)."""
    try:
        tree = ast.parse(python_of(source))
    except SyntaxError:
        return set(), set()
    reads = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    return reads, module_writes(tree.body, set())


def _is_otter_cell(source):
    return "grader.check(" in source or "grader.export(" in source or "otter.Notebook(" in source


@dataclasses.dataclass
class Cell:
    index: int
    source: str
    reads: set
    writes: set


class Release:
    """The student notebook, solution notebook and autograder zip of one lab."""

    def __init__(self, lab, root=ROOT):
        root = pathlib.Path(root)
        self.lab = lab
        self.student = root / "student" / lab / f"{lab}.ipynb"
        self.solution = root / "solutions" / lab / f"{lab}.ipynb"
        self.autograder = root / "autograder" / f"{lab}-autograder.zip"
        self.solution_nb = nbformat.read(self.solution, as_version=4)
        self.student_nb = nbformat.read(self.student, as_version=4)
        self.cells = []  # code cells the kernel runs, in order
        self.answer_cell = {}  # question -> index into self.solution_nb.cells
        for i, cell in enumerate(self.solution_nb.cells):
            if cell.cell_type != "code":
                continue
            nxt = self.solution_nb.cells[i + 1] if i + 1 < len(self.solution_nb.cells) else None
            if nxt is not None and nxt.cell_type == "code" and nxt.source.startswith("grader.check("):
                self.answer_cell[nxt.source.split('"')[1]] = i
            if not _is_otter_cell(cell.source):
                self.cells.append(Cell(i, cell.source, *reads_writes(cell.source)))
        self.graded_names = {}  # question -> names its test functions read from the notebook
        self.checks_module = None  # the lab's hidden checks as the tests import them
        with zipfile.ZipFile(self.autograder) as zf:
            for n in sorted(zf.namelist()):
                if n.startswith("tests/") and n.endswith(".py"):
                    tree = ast.parse(zf.read(n).decode())
                    self.graded_names[pathlib.Path(n).stem] = {
                        a.arg for f in tree.body if isinstance(f, ast.FunctionDef)
                        for a in f.args.args}
                    for node in ast.walk(tree):
                        if isinstance(node, ast.Import):
                            self.checks_module = next(
                                (a.name for a in node.names if a.name.startswith("jaxlab_")
                                 and a.name != "jaxlab_form"), self.checks_module)
        self.questions = sorted(self.graded_names)
        # claim id -> index of the solution cell that measures it (cell tag "claim:<id>")
        self.claim_cells = {tag[len(CLAIM_TAG):]: i for i, cell in enumerate(self.solution_nb.cells)
                            for tag in cell.get("metadata", {}).get("tags", [])
                            if tag.startswith(CLAIM_TAG)}

    def answer_source(self, question):
        """The solution's answer cell for ``question``, without its ``### Your code here`` line."""
        source = self.solution_nb.cells[self.answer_cell[question]].source
        return source[len(PROMPT):].lstrip("\n") if source.startswith(PROMPT) else source

    def blank(self, question):
        """The student notebook's answer cell for ``question`` (what a blank answer submits)."""
        return self.student_nb.cells[self.answer_cell[question]].source

    def stage(self, workdir):
        """A folder laid out like otter's grading folder: notebook, files/, tests/."""
        workdir = pathlib.Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        for extra in self.student.parent.iterdir():
            shutil.copy(extra, workdir / extra.name)
        with zipfile.ZipFile(self.autograder) as zf:
            for name in zf.namelist():
                if name.startswith("files/"):
                    (workdir / pathlib.Path(name).name).write_bytes(zf.read(name))
                elif name.startswith("tests/"):
                    (workdir / "tests").mkdir(exist_ok=True)
                    (workdir / name).write_bytes(zf.read(name))
        return workdir

    def notebook_with(self, answers):
        """The solution notebook (outputs cleared) with each answer in its question's cell."""
        nb = nbformat.read(self.solution, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                cell.outputs, cell.execution_count = [], None
        questions = [a.question for a in answers]
        if len(questions) != len(set(questions)):
            raise ValueError("one answer per question")
        for answer in answers:
            nb.cells[self.answer_cell[answer.question]].source = answer.cell_source()
        return nb


# --------------------------------------------------------------------------- the kernel
KERNEL_HELPERS = r'''
def __corpus_helpers():
    import json
    snaps = {}
    missing = object()

    def snap(key):
        snaps[key] = dict(globals())

    def put(names, key):
        g, s = globals(), snaps[key]
        for n in names:
            if n in s:
                g[n] = s[n]
            else:
                g.pop(n, None)

    def test(path):
        from otter.execute import Checker
        from otter.nbmeta_config import NBMetadataConfig
        tf = Checker.check(path, NBMetadataConfig(), global_env=globals())
        return {"name": tf.name, "score": tf.score, "possible": tf.possible,
                "cases": [{"name": r.test_case.name, "hidden": r.test_case.hidden,
                           "passed": r.passed, "message": r.message}
                          for r in tf.test_case_results]}

    def tests(paths):
        print("@@corpus@@" + json.dumps([test(p) for p in paths]))

    def evidence(module, question, names, seed, path):
        import importlib
        import jaxlab_form
        checks = importlib.import_module(module)
        values = {n: globals().get(n) for n in names}  # None where missing, as otter passes it
        with jaxlab_form.seeded(seed):
            jaxlab_form.dump_evidence(checks.probe(question, values), path)
        print("@@corpus@@" + json.dumps(path))

    return snap, put, tests, evidence

__corpus_snap, __corpus_put, __corpus_tests, __corpus_evidence = __corpus_helpers()
del __corpus_helpers
'''


class KernelError(RuntimeError):
    pass


class Kernel:
    def __init__(self, cwd, cache_dir=None):
        from jupyter_client.manager import KernelManager

        from jaxlab.grade.engine.kernel import GRADED_XLA_FLAGS, cache_env

        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
        env["PJRT_NPROC"] = "16"
        # compiled as a graded kernel compiles: the answers are graded as the grader grades
        # them, and the claims read collectives, bytes and memory, which the flag leaves as they
        # are (no claim's test reads a time). The five solutions' runs took 11.8-37.4 s instead
        # of 13.5-48.1 s (2026-11-28)
        env["XLA_FLAGS"] = GRADED_XLA_FLAGS
        # JAX's persistent compilation cache, as `jaxlab grade` warms it: answers replay the same
        # later cells and checks, and identical programs then compile once (Lab 5's q3 answers,
        # each re-running 10 cells: ~2x faster, 2026-11-26)
        env.update(cache_env(cache_dir, True))
        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(cwd=str(cwd), env=env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def run(self, code, timeout=300):
        """Run ``code``; returns (stdout, error text or None)."""
        out, error = [], []

        def hook(msg):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream" and content.get("name") == "stdout":
                out.append(content["text"])
            elif kind == "error":
                error.append(f"{content['ename']}: {content['evalue']}")

        try:
            reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook,
                                                allow_stdin=False, store_history=False)
        except (TimeoutError, queue.Empty):
            self.km.interrupt_kernel()
            raise KernelError(f"timed out after {timeout}s running:\n{code[:300]}")
        if reply["content"]["status"] != "ok" and not error:
            error.append(reply["content"].get("ename", "error"))
        return "".join(out), (error[0] if error else None)

    def shutdown(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


# --------------------------------------------------------------------------- grading
@dataclasses.dataclass
class Verdict:
    answer: Answer
    results: dict  # question -> otter results of its test file after the replay
    cell_errors: list  # (cell index, error) of the answer cell and re-run cells
    evidence: dict | None = None  # the question's probe on seeded inputs, when asked for

    @property
    def own(self):
        return self.results[self.answer.question]

    @property
    def full_marks(self):
        return self.own["score"] == self.own["possible"]

    @property
    def public_flags(self):
        """The messages of the question's public cases that failed: what ``grader.check``
        says in the student's notebook."""
        return [c["message"] for c in self.own["cases"] if not c["hidden"] and not c["passed"]]

    def failure_messages(self):
        return [c["message"] for c in self.own["cases"] if not c["passed"]]

    def scores(self):
        return {q: (r["score"], r["possible"]) for q, r in self.results.items()}


class LabHarness:
    """One kernel holding the solution run of ``lab``; grades answers by partial replay."""

    def __init__(self, lab, workdir, cache_dir=None, root=ROOT):
        self.release = Release(lab, root)
        self.workdir = self.release.stage(workdir)
        self.kernel = Kernel(self.workdir, cache_dir)
        self.kernel.run(KERNEL_HELPERS)
        self.kernel.run(f"import sys; sys.path.append({str(self.workdir)!r})")
        # what the student's setup cell does beside starting otter (the harness skips that cell):
        # the checks then name the exception of a cell that raised, as the student reads it
        if any("watch_cells()" in c.source for c in self.release.student_nb.cells):
            self.kernel.run("import jaxlab_form; jaxlab_form.watch_cells()")
        self.solution_errors = []
        self.solution_outputs = {}  # cell index -> what it printed (docs/claims.md reads them)
        for cell in self.release.cells:
            self.kernel.run(f"__corpus_snap({cell.index})")
            out, err = self.kernel.run(cell.source)
            self.solution_outputs[cell.index] = out
            if err:
                self.solution_errors.append((cell.index, err))
        self.kernel.run("__corpus_snap('final')")
        self.solution_results = self.run_tests(self.release.questions)
        self.last_writer = {}
        for cell in self.release.cells:
            for name in cell.writes:
                self.last_writer[name] = cell.index

    def test_paths(self, questions):
        return [str(self.workdir / "tests" / f"{q}.py") for q in questions]

    def _marked(self, out, err, what):
        line = [ln for ln in out.splitlines() if ln.startswith(MARK)]
        if err or not line:
            raise KernelError(f"{what} failed: {err}\n{out[-2000:]}")
        return json.loads(line[-1][len(MARK):])

    def run_tests(self, questions, timeout=300):
        out, err = self.kernel.run(f"__corpus_tests({self.test_paths(questions)!r})", timeout)
        return {r["name"]: r for r in self._marked(out, err, "running the tests")}

    def evidence(self, question, seed, timeout=300):
        """What the lab's probe records for ``question`` from the kernel's current values, on
        fresh inputs drawn from ``seed`` (the same seed draws the same inputs), transported as
        the grader receives it."""
        from jaxlab.checks import form

        rel = self.release
        path = self.workdir / f".evidence-{question}"
        out, err = self.kernel.run(
            f"__corpus_evidence({rel.checks_module!r}, {question!r}, "
            f"{sorted(rel.graded_names[question])!r}, {seed!r}, {str(path)!r})", timeout)
        self._marked(out, err, f"probing {question}")
        return form.load_evidence(path)

    def plan(self, k, source, only=None):
        """The cells to run for an answer ``source`` in cell ``k``: it, then those later cells
        that read a name it (or the solution's cell) assigns, transitively, and that the graded
        names of ``only`` (a set of questions) depend on; by default ``only`` is every question
        whose graded names those later cells assign, and the answer's own."""
        reads, writes = reads_writes(source)
        solution_cell = next(c for c in self.release.cells if c.index == k)
        written = set(writes) | solution_cell.writes
        later = []
        for cell in self.release.cells:
            if cell.index > k and cell.reads & written:
                later.append(cell)
                written |= cell.writes
        if only is None:
            # every question whose graded names a replayed cell assigns, and no cell that feeds
            # none of them: a later demo or measuring cell changes no verdict (Lab 5's Task 3
            # answers replayed the pipeline's compiled-program demos: ~13 s an answer)
            own = {q for q, i in self.release.answer_cell.items() if i == k}
            only = {q for q, names in self.release.graded_names.items()
                    if q in own or names & written}
        if only:  # a backward slice from the names those questions read
            needed = set().union(*(self.release.graded_names[q] for q in only))
            kept = []
            for cell in reversed(later):
                if cell.writes & needed:
                    kept.append(cell)
                    needed |= cell.reads
            later = kept[::-1]
        return [(k, source, reads, set(writes) | solution_cell.writes)] + [
            (c.index, c.source, c.reads, c.writes) for c in later]

    def grade(self, answer, *, only=None, evidence_seed=None, timeout=300):
        """The verdicts after replaying the notebook with ``answer`` in its cell.

        ``only``: grade just these questions (and replay just what they read); by default the
        answer's question and every question that reads a name the replay assigned.
        ``evidence_seed``: also record the answer's question's evidence on inputs drawn from
        it. ``timeout``: seconds for each cell and each test run (past it the kernel is
        interrupted and KernelError raised)."""
        rel = self.release
        k = rel.answer_cell[answer.question]
        source = answer.cell_source()
        writes = reads_writes(source)[1]
        plan = self.plan(k, source, only)
        rerun = {index for index, *_ in plan}
        touched, errors, done, evidence = set(), [], set(), None
        # what the setup cell's watch_cells() remembered of the last answer's failing cells
        self.kernel.run("get_ipython().__dict__.pop('_jaxlab_cell_faults', None)")
        try:
            for index, src, cell_reads, cell_writes in plan:
                # names no replayed cell has assigned yet hold what the original run had here
                stale = sorted((cell_reads | cell_writes | (set(writes) if index == k else set()))
                               - done)
                touched |= set(stale)
                self.kernel.run(f"__corpus_put({stale!r}, {index})")
                _, err = self.kernel.run(src, timeout)
                if err:
                    errors.append((index, err))
                done |= cell_writes | (set(writes) if index == k else set())
            # a name that a later, not replayed cell assigns last ends with that cell's value
            later = sorted(n for n in done if self.last_writer.get(n, -1) > k
                           and self.last_writer[n] not in rerun)
            self.kernel.run(f"__corpus_put({later!r}, 'final')")
            # names only read were put back to earlier values: the rest of the notebook ran too
            self.kernel.run(f"__corpus_put({sorted(touched - done)!r}, 'final')")
            touched |= done
            # a question whose graded names all still hold the solution's objects keeps the
            # verdict it had on the solution; every other question is graded again
            questions = [q for q in rel.questions
                         if q == answer.question or rel.graded_names[q] & done] \
                if only is None else sorted(only)
            results = {**self.solution_results, **self.run_tests(questions, timeout)}
            if evidence_seed is not None:
                evidence = self.evidence(answer.question, evidence_seed, timeout)
        finally:
            self.kernel.run(f"__corpus_put({sorted(touched)!r}, 'final')")
        return Verdict(answer, results, errors, evidence)

    def close(self):
        self.kernel.shutdown()


# --------------------------------------------------------------------------- reporting
def confusion_table(outcomes):
    """Lines of a table: per question, correct answers accepted/rejected, wrong rejected/accepted.
    ``outcomes``: (lab, question, answer is correct, it got full marks) per graded answer."""
    rows = {}
    for lab, question, correct, full_marks in outcomes:
        row = rows.setdefault((lab, question), [0, 0, 0, 0])
        if correct:
            row[0 if full_marks else 1] += 1
        else:
            row[3 if full_marks else 2] += 1
    width = max([len("question")] + [len(q) for _, q in rows])
    head = f"{'lab':<20} {'question':<{width}} {'correct ok':>10} {'correct REJ':>11} " \
           f"{'wrong ok':>8} {'wrong ACC':>9}"
    lines = [head, "-" * len(head)]
    order = {q: i for i, q in enumerate(in_notebook_order({q for _, q in rows}))}
    for (lab, q), r in sorted(rows.items(), key=lambda item: (item[0][0], order[item[0][1]])):
        lines.append(f"{lab:<20} {q:<{width}} {r[0]:>10} {r[1]:>11} {r[2]:>8} {r[3]:>9}")
    total = [sum(r[i] for r in rows.values()) for i in range(4)]
    lines.append(f"{'total':<{width + 21}} {total[0]:>10} {total[1]:>11} {total[2]:>8} "
                 f"{total[3]:>9}")
    return lines


def public_flag_table(outcomes):
    """Lines of a table: per lab, how many wrong answers the public checks flag, and how many
    correct answers they flag (should be none). ``outcomes``: (lab, correct, flagged)."""
    rows = {}
    for lab, correct, flagged in outcomes:
        row = rows.setdefault(lab, [0, 0, 0, 0])  # wrong flagged, wrong, correct flagged, correct
        row[0 if not correct else 2] += bool(flagged)
        row[1 if not correct else 3] += 1
    lines = [f"{'lab':<20} {'wrong flagged':>14} {'share':>6} {'correct flagged':>16}"]
    for lab, (wf, w, cf, c) in sorted(rows.items()):
        lines.append(f"{lab:<20} {f'{wf}/{w}':>14} {wf / max(w, 1):>6.0%} {f'{cf}/{c}':>16}")
    return lines
