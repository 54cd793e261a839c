"""Score a submission in a trusted process from the evidence its kernel left behind.

Points-carrying test cases are decided here by the lab's ``verdict`` on plain data; the kernel's
own run of otter's tests (its *claim*, gathered only for questions the verdict fails) decides
their 0-point public cases, and any case where it claims more than the verdict gives is
reported as tampering.
"""

import copy
import dataclasses
import json
import pathlib
import re

from otter.test_files import TestCaseResult

from ..checks.form import load_evidence

MAX_EVIDENCE_BYTES = 512 * 2**20


@dataclasses.dataclass
class Judgement:
    test_files: list  # otter TestFile objects with results
    outcomes: dict  # question -> "pass" | "fail" | "error"
    flags: list  # tampering suspicions, in words


def judge(autograder, checks, evidence_dir, no_answers_reason=None):
    evidence_dir = pathlib.Path(evidence_dir)
    test_files, outcomes, flags, cheated = [], {}, [], []
    for q, template in autograder.tests.items():
        claim = _read_claim(evidence_dir / f"claim-{q}.json")
        trusted = checks is not None and q in checks.QUESTIONS
        if trusted:
            passed, message, outcome, suspicious = _verdict(checks, q, evidence_dir,
                                                            no_answers_reason)
            flags += [f"`{n}` claims to equal any object" for n in suspicious]
        results = []
        for i, tc in enumerate(template.test_cases):
            claimed = claim[i] if i < len(claim) else None
            if trusted and tc.points:
                results.append(TestCaseResult(tc, None if passed else message, passed))
                if claimed and claimed[0] and not passed:
                    cheated.append(q)
            elif claimed is not None:
                results.append(TestCaseResult(tc, claimed[1] or None, claimed[0]))
            elif trusted and passed:
                # no claim is gathered for a question the verdict passes, and every verdict
                # checks the form its public cases check
                results.append(TestCaseResult(tc, None, True))
            else:
                results.append(TestCaseResult(tc, no_answers_reason or "the test did not run",
                                              False))
        if not trusted:
            outcome = "pass" if all(r.passed for r in results) else \
                "fail" if claim else "error"
        tf = copy.copy(template)
        tf.test_case_results = results
        test_files.append(tf)
        outcomes[q] = outcome
    if cheated:
        flags.insert(0, f"the kernel reported {', '.join(sorted(set(cheated)))} as passed but "
                        "the trusted check failed")
    return Judgement(test_files, outcomes, flags)


def _read_claim(path):
    try:
        claim = json.loads(path.read_text())
        return [(c[0] is True, str(c[1])) for c in claim.get("cases", [])]
    except Exception:
        return []


def _verdict(checks, q, evidence_dir, no_answers_reason):
    """(passed, message, outcome, names claiming equality with anything)."""
    path = evidence_dir / f"{q}.json"
    if not path.exists():
        reason = no_answers_reason or "the grader could not read the answers"
        return False, f"Not graded: {reason}.", "error", []
    try:
        size = path.stat().st_size + path.with_suffix(".npz").stat().st_size
        if size > MAX_EVIDENCE_BYTES:
            raise ValueError("evidence too large")
        envelope = load_evidence(path)
        suspicious = [str(n) for n in envelope.get("equal_to_anything", [])]
        error = envelope.get("error")
        evidence = envelope.get("evidence")
    except Exception as exc:
        return False, f"Not graded: unreadable evidence ({type(exc).__name__}).", "error", []
    if error is not None:
        return False, f"Checking this question raised {error}", \
            "timeout" if re.match(r"KeyboardInterrupt", str(error)) else "error", suspicious
    try:
        checks.verdict(q, evidence)
    except AssertionError as exc:
        return False, str(exc) or "wrong answer", "fail", suspicious
    except Exception as exc:
        return False, f"Your answer could not be checked ({type(exc).__name__}: {exc}).", \
            "fail", suspicious
    return True, None, "pass", suspicious
