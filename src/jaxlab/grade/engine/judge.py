"""Score a submission in a trusted process from the evidence its kernel left behind.

Two steps, each done once. ``verdicts`` runs the lab's ``verdict`` on each question's probe
evidence (plain data): it alone decides the points-carrying test cases. ``score`` then puts
otter's test files together: the kernel's own run of otter's tests (its *claim*, gathered only
for questions the verdict fails) decides their 0-point public cases, and any case where it
claims more than the verdict gives is reported as tampering — unless the trusted check itself
failed to run (a grader error, reported as such: the kernel's claim is then no contradiction).
"""

import copy
import dataclasses
import json
import re

from otter.test_files import TestCaseResult

from ...checks.form import load_evidence
from . import traces

MAX_EVIDENCE_BYTES = 512 * 2**20
GRADER_ERROR_MESSAGE = (
    "The grader failed while checking this answer: an error in the grader, not in your answer. "
    "No points could be given for it; your instructor sees the details and can regrade it.")


@dataclasses.dataclass(frozen=True)
class Verdict:
    passed: bool
    message: str | None  # why it failed, for the student
    outcome: str  # "pass" | "fail" | "error" | "timeout"
    suspicious: tuple = ()  # graded names whose value claims to equal any object
    # the verdict rests on timings measured in the kernel (the checks module's MEASURED): the
    # kernel's own check measures again at another moment, so disagreeing is not tampering
    measured: bool = False
    program: dict = dataclasses.field(default_factory=dict)  # traces.tokens of its evidence
    # the trusted check raised something other than its AssertionError: the grader's fault
    # (a check that cannot handle this evidence), never evidence against the student
    grader_error: str | None = None
    undefined: str | None = None  # the graded name the check found unset (form.expect_defined)


@dataclasses.dataclass
class Judgement:
    test_files: list  # otter TestFile objects with results
    outcomes: dict  # question -> "pass" | "fail" | "error" | "timeout"
    flags: list  # tampering suspicions, in words
    grader_errors: list = dataclasses.field(default_factory=list)  # checks that could not run


def verdicts(autograder, checks, layout, no_answers_reason=None):
    """question -> Verdict, for the questions the checks module covers (none without one)."""
    if checks is None:
        return {}
    measured = set(getattr(checks, "MEASURED", ()))
    return {q: dataclasses.replace(_verdict(checks, q, layout.probe(q), no_answers_reason),
                                   measured=q in measured)
            for q in autograder.tests if q in checks.QUESTIONS}


def score(autograder, decided, layout, no_answers_reason=None):
    """otter's test files with results, from the trusted ``decided`` verdicts and the claims."""
    test_files, outcomes, flags, cheated, broken = [], {}, [], [], []
    for q, template in autograder.tests.items():
        claim = _read_claim(layout.claim(q))
        v = decided.get(q)
        if v is not None:
            flags += [f"`{n}` claims to equal any object" for n in v.suspicious]
            if v.grader_error:
                broken.append(f"{q} ({v.grader_error})")
        results = []
        for i, tc in enumerate(template.test_cases):
            claimed = claim[i] if i < len(claim) else None
            if v is not None and tc.points:
                results.append(TestCaseResult(tc, None if v.passed else v.message, v.passed))
                if claimed and claimed[0] and not v.passed and not v.measured \
                        and not v.grader_error:
                    cheated.append(q)
            elif claimed is not None:
                results.append(TestCaseResult(tc, claimed[1] or None, claimed[0]))
            elif v is not None and v.passed:
                # no claim is gathered for a question the verdict passes, and every verdict
                # checks the form its public cases check
                results.append(TestCaseResult(tc, None, True))
            elif any(claim):  # the kernel's own run of the pointed case passed: left unrun
                results.append(TestCaseResult(tc, "not run: this question's own check "
                                              "decided it", False))
            else:
                results.append(TestCaseResult(tc, no_answers_reason or "the test did not run",
                                              False))
        outcomes[q] = v.outcome if v is not None else \
            "pass" if all(r.passed for r in results) else "fail" if claim else "error"
        tf = copy.copy(template)
        tf.test_case_results = results
        test_files.append(tf)
    if cheated:
        flags.insert(0, f"the kernel reported {', '.join(sorted(set(cheated)))} as passed but "
                        "the trusted check failed")
    return Judgement(test_files, outcomes, flags, broken)


def _read_claim(path):
    """[(passed, message) or None where the kernel left the case unrun] of a claim file."""
    try:
        claim = json.loads(path.read_text())
        return [None if c is None else (c[0] is True, str(c[1])) for c in claim.get("cases", [])]
    except Exception:
        return []


def _verdict(checks, q, path, no_answers_reason):
    if not path.exists():
        reason = no_answers_reason or "the grader could not read the answers"
        return Verdict(False, f"Not graded: {reason}.", "error")
    try:
        size = path.stat().st_size + path.with_suffix(".npz").stat().st_size
        if size > MAX_EVIDENCE_BYTES:
            raise ValueError("evidence too large")
        envelope = load_evidence(path)
        suspicious = tuple(str(n) for n in envelope.get("equal_to_anything", []))
        error = envelope.get("error")
        evidence = envelope.get("evidence")
    except Exception as exc:
        return Verdict(False, f"Not graded: unreadable evidence ({type(exc).__name__}).", "error")
    try:
        program = traces.tokens(evidence)
    except Exception:  # a record for the similarity check only: never a grading error
        program = {}
    if error is not None:
        return Verdict(False, f"Checking this question raised {error}",
                       "timeout" if re.match(r"KeyboardInterrupt", str(error)) else "error",
                       suspicious, program=program)
    try:
        checks.verdict(q, evidence)
    except AssertionError as exc:
        return Verdict(False, str(exc) or "wrong answer", "fail", suspicious, program=program,
                       undefined=getattr(exc, "undefined", None))
    except Exception as exc:
        return Verdict(False, GRADER_ERROR_MESSAGE, "error", suspicious, program=program,
                       grader_error=f"{type(exc).__name__}: {exc}"[:300])
    return Verdict(True, None, "pass", suspicious, program=program)
