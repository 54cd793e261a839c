"""Mutation analysis of a lab's hidden checks: does every small fault in the solution lose
the points?

For each graded question, the solution's answer cell is mutated (``operators``) and each
mutant is graded exactly as a corpus answer is: in the corpus harness's kernel holding the
solution run, replaying what the mutant changes, with the shipped autograder's own test file.
Then:

* **killed** (by a check): the question does not get full marks;
* **limit** (killed by a limit): the mutant ran past its time limit, or killed the kernel, and
  did so again when run once more with ``RERUN_FACTOR`` times the limit. A mutant that then
  finishes is classed by what it scores, like any other: a kill must not depend on how busy
  the machine was;
* **gap** (survived, behaviour changed): full marks, yet the probe records something other for
  the mutant than for the solution on the same seeded fresh inputs (values beyond
  ``EVIDENCE_RTOL``/``EVIDENCE_ATOL``, shapes, dtypes, shardings, errors): the checks saw the
  difference and let it pass. Always a gap;
* **undecided** (survived, no behaviour the probe can tell apart): an equivalent program, a
  method the task forbids that the checks do not read, or a difference the probe's inputs
  never reach. Only a person decides: an ``equivalent:`` decision in
  ``tests/mutants/<lab>.yaml`` naming the mutant by key, with the task's sentence;
* **equivalent**: a survivor decided so by key.

A ``free:`` entry (evidence the text leaves to the student: what a script prints, which
dimension of an array carries the split) only takes that evidence out of the comparison of
values, so that a difference there is not a gap; it decides no mutant. Traced programs and
program text (``METHOD_KEYS``, a string holding a program) are method: a survivor whose method
differs from the solution's is undecided whatever ``free:`` says, and the report shows the
difference, and why each survivor is undecided, to help the person decide.
"""

import dataclasses
import hashlib
import math
import pathlib
import re
import tempfile
import time

import numpy as np
import yaml

from .. import corpus
from . import operators as ops

# what counts as the same value: well above float32 noise of another evaluation order,
# well below any tolerance a check uses (1e-4 and up)
EVIDENCE_RTOL = 1e-5
EVIDENCE_ATOL = 1e-6
# evidence of how a function computes, not of what it computes
METHOD_KEYS = frozenset({"program", "jaxpr", "jaxpr_error", "trace", "traces", "residuals",
                         "saved", "hlo", "source"})
# a mutant's limit per cell and per test run: this many times what the solution's checks of the
# question took, and at least MIN_TIMEOUT seconds
TIMEOUT_FACTOR = 5
MIN_TIMEOUT = 20
# a mutant stopped by its limit is run once more with this many times the limit before the
# stop counts (two Lab 4 mutants that finish in a few seconds were stopped at 20 s on a busy
# machine, issue 45)
RERUN_FACTOR = 3
STATUSES = ("killed", "limit", "equivalent", "gap", "undecided")


@dataclasses.dataclass
class Outcome:
    question: str
    mutant: ops.Mutant
    status: str  # one of STATUSES
    seconds: float
    detail: str = ""  # killed: the first failure; limit: what stopped it; gap/undecided/
    # equivalent: the differences found
    decision: dict | None = None
    limit: float | None = None  # limit: the (longer) limit it ran past the second time
    why: tuple = ()  # undecided: why no rule decides it, one reason a line
    rerun: str = ""  # stopped by its limit once, then finished with the longer one: so
    messages: tuple = ()  # killed: (hidden, otter's message) of each failing case of the question
    raised: tuple = ()  # killed: "Name: text" of each replayed cell that raised


@dataclasses.dataclass
class Analysis:
    lab: str
    outcomes: list
    seconds: float
    solution_seconds: float  # the harness's solution run
    stale_decisions: list  # decisions that name no surviving mutant (to remove or re-key)
    graded: dict = dataclasses.field(default_factory=dict)  # question -> names its tests read

    def of(self, status):
        return [o for o in self.outcomes if o.status == status]

    def score(self, outcomes=None):
        """Killed (by a check or a limit) / (all - equivalent)."""
        outcomes = self.outcomes if outcomes is None else outcomes
        counted = [o for o in outcomes if o.status != "equivalent"]
        killed = sum(o.status in ("killed", "limit") for o in counted)
        return killed / len(counted) if counted else 1.0


# --------------------------------------------------------------------------- decisions
def decisions_path(root, lab):
    return pathlib.Path(root) / "tests" / "mutants" / f"{lab}.yaml"


@dataclasses.dataclass
class Decisions:
    """What a person decided on a lab's task text (``tests/mutants/<lab>.yaml``), per question:

    * ``equivalent``: surviving mutants (by key) the text allows, each with its sentence: the
      only way a survivor is decided;
    * ``free``: evidence the text leaves to the student (a path pattern such as
      ``*/sharding/spec``, with its sentence): a difference there is not a gap. It frees
      values, not method evidence, and decides no mutant (before issue 45 it decided a survivor
      that differed only there; the format is unchanged)."""

    equivalent: dict  # (question, key) -> entry
    free: dict  # question -> [entry]

    def free_paths(self, question):
        return [tuple(e["evidence"].split("/")) for e in self.free.get(question, ())]


ENTRY_FIELDS = {"equivalent": {"key", "change", "text", "why"},
                "free": {"evidence", "text", "why"}}


def load_decisions(path):
    """The decisions file's content (absent: nothing decided yet)."""
    path = pathlib.Path(path)
    data = (yaml.safe_load(path.read_text()) or {}) if path.exists() else {}
    decisions = Decisions({}, {})
    for question, sections in data.items():
        unknown = set(sections or {}) - set(ENTRY_FIELDS)
        if unknown:
            raise ValueError(f"{path}: {question}: unknown sections {sorted(unknown)} (a "
                             f"survivor the text does not allow must be killed by a stronger "
                             f"check, not decided; sections: {sorted(ENTRY_FIELDS)})")
        for section, fields in ENTRY_FIELDS.items():
            for entry in (sections or {}).get(section) or []:
                missing = fields - set(entry)
                if missing:
                    raise ValueError(f"{path}: {question} {section} "
                                     f"{entry.get('key', entry.get('evidence'))}: missing "
                                     f"{sorted(missing)}")
                if section == "equivalent":
                    decisions.equivalent[question, entry["key"]] = entry
                else:
                    decisions.free.setdefault(question, []).append(entry)
    return decisions


def _matches(path, pattern):
    return len(path) >= len(pattern) and all(
        p == "*" or p == q for p, q in zip(pattern, path))


# --------------------------------------------------------------------------- evidence
# names that differ between two runs of the same program: object addresses, and the file name
# IPython gives each execution of a cell
VOLATILE_TEXT = re.compile(r"0x[0-9a-fA-F]{6,}|/[\w/.-]*ipykernel_\d+/\d+\.py")


def _is_program(text):
    """Whether ``text`` is the source of a program of a few statements (Lab 5's script)."""
    import ast

    if not isinstance(text, str) or text.count("\n") < 3:
        return False
    try:
        return len(ast.parse(text).body) >= 3
    except (SyntaxError, ValueError):
        return False


def canonical(ev):
    """Evidence with what is not behaviour made equal: a tuple and a list of the same items
    (both travel to the grader as lists), a spec with or without trailing ``None`` entries (the
    same sharding; also as a PartitionSpec value), a sharding's repr (made of those fields) and the Python type of a function
    (jitted or not: whether the task asks for jax.jit is read from the traced program); a
    string that holds a program (Lab 5's training script) is method, like a traced program."""
    if isinstance(ev, dict):
        ev = {k: canonical(v) for k, v in ev.items()}
        if ev.get("kind") in ("tuple", "list") and "items" in ev:
            ev["kind"] = "sequence"
        if ev.get("kind") == "callable":  # a function, jitted (PjitFunction) or not
            ev.pop("type", None)
        if ev.get("kind") == "str" and _is_program(ev.get("value")):  # source code: method
            ev = {"kind": "program text", "source": ev["value"]}
        if "spec" in ev and "repr" in ev and isinstance(ev["spec"], list):
            ev.pop("repr")
            while ev["spec"] and ev["spec"][-1] is None:
                ev["spec"] = ev["spec"][:-1]
        if ev.get("kind") == "spec" and isinstance(ev.get("entries"), list):
            while ev["entries"] and ev["entries"][-1] is None:
                ev["entries"] = ev["entries"][:-1]
        return ev
    if isinstance(ev, (list, tuple)):
        return [canonical(v) for v in ev]
    return ev


def _leaves(ev, path=(), method=False):
    """(path, is method evidence, leaf) of an evidence tree."""
    if isinstance(ev, dict):
        for key in sorted(ev):
            yield from _leaves(ev[key], path + (str(key),), method or key in METHOD_KEYS)
    elif isinstance(ev, (list, tuple)):
        yield path + ("#len",), method, len(ev)
        for i, item in enumerate(ev):
            yield from _leaves(item, path + (str(i),), method)
    else:
        yield path, method, ev


def _same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.kind in "fc":
            return bool(np.allclose(a, b, rtol=EVIDENCE_RTOL, atol=EVIDENCE_ATOL,
                                    equal_nan=True))
        return bool(np.array_equal(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or math.isclose(
            a, b, rel_tol=EVIDENCE_RTOL, abs_tol=EVIDENCE_ATOL)
    if isinstance(a, str) and isinstance(b, str):
        return VOLATILE_TEXT.sub("_", a) == VOLATILE_TEXT.sub("_", b)
    return type(a) is type(b) and a == b


def _diff(reference, other, volatile=frozenset(), free=()):
    """(path, is method evidence, value in reference, value in other) where they differ,
    leaving out the ``volatile`` paths and the values matching a ``free`` pattern (method
    evidence is never free)."""
    ref = {p: (m, v) for p, m, v in _leaves(canonical(reference))}
    new = {p: (m, v) for p, m, v in _leaves(canonical(other))}
    for path in sorted(set(ref) | set(new)):
        if any(path[:i] in volatile for i in range(1, len(path) + 1)):
            continue
        (m_a, a), (m_b, b) = ref.get(path, (None, "(absent)")), new.get(path, (None, "(absent)"))
        if path in ref and path in new and _same(a, b):
            continue
        method = m_a if path in ref else m_b
        if not method and any(_matches(path, pattern) for pattern in free):
            continue
        yield path, method, a, b


def differences(reference, other, volatile=frozenset(), free=()):
    """(behaviour, method): where ``other`` differs from ``reference``, in words, leaving out
    the ``volatile`` paths (those two runs of the solution disagree on) and the values on
    ``free`` ones (what the text leaves to the student)."""
    behaviour, method = [], []
    for path, is_method, a, b in _diff(reference, other, volatile, free):
        (method if is_method else behaviour).append(f"{'/'.join(path)}: {_short(a)} -> {_short(b)}")
    return behaviour, method


def freed(reference, other, volatile=frozenset(), free=()):
    """Where ``other``'s values differ from ``reference``'s only on ``free`` paths, in words."""
    return [f"{'/'.join(path)}: {_short(a)} -> {_short(b)}"
            for path, is_method, a, b in _diff(reference, other, volatile)
            if not is_method and any(_matches(path, pattern) for pattern in free)]


def undecided_why(method, free_differences):
    """Why a survivor with no behaviour difference waits for a person: one reason a line."""
    why = []
    if method:
        why.append("its method differs from the solution's (" + "; ".join(method[:3]) +
                   "): a free: entry frees values, never a method")
    if free_differences:
        why.append("it differs only in evidence the text leaves free (" +
                   "; ".join(free_differences[:3]) + "): free: keeps that from being a gap, "
                   "it does not decide the mutant")
    if not why:
        why.append("the same evidence as the solution on the seeded inputs: no check and no "
                   "probe tells it apart")
    return tuple(why)


def volatile_paths(first, second):
    """Paths two probes of the same program on the same inputs disagree on (timings, ids)."""
    return frozenset(path for path, *_ in _diff(first, second))


def _short(value, width=60):
    if isinstance(value, np.ndarray):
        text = f"array{list(value.shape)} {value.dtype}"
        if value.size and value.dtype.kind in "fciub":
            text += f" [{np.ravel(value)[:3].tolist()}...]"
        return text
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


# --------------------------------------------------------------------------- running
def question_seed(lab, question):
    """A fixed seed per question: the solution and its mutants see the same inputs."""
    return int.from_bytes(hashlib.sha1(f"{lab}/{question}".encode()).digest()[:4], "little")


class _Runner:
    """A corpus harness that starts again when a mutant leaves its kernel dead or stuck."""

    def __init__(self, lab, root, harness=None):
        self.lab, self.root, self.own = lab, root, harness is None
        self.folder = tempfile.TemporaryDirectory(prefix=f"jaxlab-mutants-{lab}-")
        self.restarts = 0
        self.harness = harness or self._start()

    def _start(self):
        n = self.restarts
        base = pathlib.Path(self.folder.name)
        return corpus.LabHarness(self.lab, base / f"work{n}", base / "jax-cache", self.root)

    def alive(self):
        try:
            return self.harness.kernel.km.is_alive() and \
                self.harness.kernel.run("1", timeout=30)[1] is None
        except corpus.KernelError:
            return False

    def restart(self):
        if not self.own:  # the caller's kernel (the test suite's corpus) cannot be replaced
            raise corpus.KernelError("a mutant killed the kernel the analysis was given")
        try:
            self.harness.close()
        except Exception:  # a dead kernel cannot be shut down cleanly; it is gone either way
            pass
        self.restarts += 1
        self.harness = self._start()

    def close(self):
        if self.own:
            self.harness.close()
        self.folder.cleanup()


def scope(release, question):
    """The code of the solution notebook's cells before ``question``'s answer cell (as Python):
    the meshes, shardings and functions a mutant of that cell may use instead of its own."""
    cells = release.solution_nb.cells[:release.answer_cell[question]]
    return tuple(corpus.python_of(c.source) for c in cells if c.cell_type == "code")


def plan(release, questions=None, operators=None):
    """(question, mutant) for every mutant of the solution's answer cells: what ``analyse``
    grades, and ``jaxlab mutants --list`` prints."""
    questions = list(release.questions if questions is None else questions)
    unknown = set(questions) - set(release.questions)
    if unknown:
        raise ValueError(f"{release.lab} has no graded question {sorted(unknown)}; its "
                         f"questions: {', '.join(release.questions)}")
    return [(q, m) for q in questions
            for m in ops.mutants(release.answer_source(q), operators, scope(release, q))]


def _answer(lab, question, mutant):
    return corpus.Answer(lab=lab, question=question, name=mutant.key, why=mutant.change,
                         code=mutant.code, correct=False)


def _first_failure(verdict):
    messages = verdict.failure_messages()
    text = messages[0].strip().splitlines()[-1] if messages else "no points"
    return text if len(text) <= 200 else text[:197] + "..."


def _messages(verdict):
    """(hidden, message) of each failing case of the question: what the student reads."""
    own = getattr(verdict, "own", None)
    if own is None:  # a verdict without its cases: its messages, as the hidden case's
        return tuple((True, m) for m in verdict.failure_messages())
    return tuple((c["hidden"], c["message"]) for c in own["cases"] if not c["passed"])


def _stopped(why, limit):
    """What stopped a grading, in the report's words."""
    return f"ran past its {limit:.0f} s limit" if why == "limit" else \
        f"killed the kernel (limit {limit:.0f} s)"


STOPS = ("limit", "died")


def _grade(runner, answer, **kwargs):
    """(verdict, None); or (None, why): ``"limit"`` when the mutant ran past ``timeout``,
    ``"died"`` when it killed the kernel (which is started again), ``"error: ..."`` when the
    tests could not run."""
    try:
        verdict, stop = runner.harness.grade(answer, **kwargs), None
    except corpus.KernelError as exc:
        verdict = None
        stop = "limit" if str(exc).startswith("timed out") else \
            "error: " + (str(exc).strip().splitlines() or ["?"])[0][:160]
    if not runner.alive():
        runner.restart()
        return None, "died"
    return verdict, stop


def _classify(runner, lab, question, mutant, limit, reference, volatile, decided):
    """Grade one mutant (again with a longer limit if the first stopped it) and class it."""
    answer = _answer(lab, question, mutant)
    verdict, stop = _grade(runner, answer, only={question}, timeout=limit)
    rerun = ""
    if stop in STOPS:  # not yet a kill: the same mutant with more time
        longer = RERUN_FACTOR * limit
        verdict, again = _grade(runner, answer, only={question}, timeout=longer)
        if again in STOPS:
            return Outcome(question, mutant, "limit", 0.0, f"{_stopped(stop, limit)}; run "
                           f"again, {_stopped(again, longer)}", limit=longer)
        rerun = f"first it {_stopped(stop, limit)}; with {longer:.0f} s it finished"
        stop, limit = again, longer

    def outcome(status, detail, **kwargs):
        return Outcome(question, mutant, status, 0.0, detail, rerun=rerun, **kwargs)

    if stop is not None:  # the tests could not run: no points
        return outcome("killed", f"grading failed: {stop[7:]}")
    if not verdict.full_marks:
        return outcome("killed", _first_failure(verdict), messages=_messages(verdict),
                       raised=tuple(err for _, err in getattr(verdict, "cell_errors", ())))
    probed, stop = _grade(runner, answer, only={question}, timeout=limit,
                          evidence_seed=question_seed(lab, question))
    if probed is None or not probed.full_marks:
        # full marks once, not on other fresh inputs: a boundary the draws reach only
        # sometimes; the checks must reach it every time
        return outcome("gap", "full marks on one draw of fresh inputs, not on another" + (
            f" (the second run {_stopped(stop, limit)})" if stop in STOPS else
            f" (the second run: {stop})" if stop else ""))
    free = decided.free_paths(question)
    behaviour, method = differences(reference, probed.evidence, volatile, free)
    decision = decided.equivalent.get((question, mutant.key))
    if behaviour:
        return outcome("gap", "; ".join(behaviour[:4]), decision=decision)
    detail = "; ".join(method[:3]) or "the same evidence"
    if decision:
        return outcome("equivalent", detail, decision=decision)
    return outcome("undecided", detail, why=undecided_why(
        method, freed(reference, probed.evidence, volatile, free)))


def analyse(lab, *, root=corpus.ROOT, questions=None, operators=None, decisions=None,
            harness=None, progress=None):
    """Grade every mutant of every graded question of ``lab`` (or of ``questions``) with the
    lab's shipped checks and classify it. ``decisions``: the decisions file (default
    ``tests/mutants/<lab>.yaml``). ``harness``: a ``corpus.LabHarness`` already holding the
    solution run (the test suite's), else one is started. ``progress(outcome, done, total)``
    is called after each mutant."""
    start = time.monotonic()
    decided = load_decisions(decisions or decisions_path(root, lab))
    runner = _Runner(lab, root, harness)
    solution_seconds = time.monotonic() - start
    release = runner.harness.release
    questions = list(release.questions if questions is None else questions)
    unknown = set(questions) - set(release.questions)
    if unknown:
        runner.close()
        raise ValueError(f"{lab} has no graded question {sorted(unknown)}; its questions: "
                         f"{', '.join(release.questions)}")
    mutants = plan(release, questions, operators)
    outcomes, seen = [], set()
    try:
        limits, reference, volatile = {}, {}, {}
        for question in questions:
            # the solution's own cell, run twice: what the two runs disagree on (a timing, a
            # value drawn afresh in the cell) tells nothing about a mutant
            solution = corpus.Answer(lab=lab, question=question, name="solution", why="",
                                     code=release.answer_source(question), correct=True)
            t = time.monotonic()
            runner.harness.grade(solution, only={question})
            limits[question] = max(MIN_TIMEOUT, TIMEOUT_FACTOR * (time.monotonic() - t))
            first, second = (runner.harness.grade(
                solution, only={question}, evidence_seed=question_seed(lab, question)).evidence
                for _ in range(2))
            reference[question] = first
            volatile[question] = volatile_paths(first, second)
        for question, mutant in mutants:
            t = time.monotonic()
            outcome = _classify(runner, lab, question, mutant, limits[question],
                                reference[question], volatile[question], decided)
            if outcome.status in ("gap", "undecided", "equivalent"):
                seen.add((question, mutant.key))
            outcome.seconds = time.monotonic() - t
            outcomes.append(outcome)
            if progress:
                progress(outcome, len(outcomes), len(mutants))
    finally:
        runner.close()
    stale = [d for (q, key), d in sorted(decided.equivalent.items())
             if q in questions and (q, key) not in seen]
    return Analysis(lab, outcomes, time.monotonic() - start, solution_seconds, stale,
                    {q: sorted(release.graded_names[q]) for q in questions})
