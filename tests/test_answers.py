"""The answer corpus (tests/answers/) reaches its expected verdicts under the shipped tests.

Every answer is graded by ``jaxlab.corpus`` with the autograder zip's own test files in a
kernel holding the solution run of the student notebook; ``test_grading_paths`` checks
a sample against the full ``otter run`` path.
"""

import re

import pytest

from jaxlab import corpus as harness

pytestmark = pytest.mark.slow  # kernels, sandboxes or services: not in make test-quick

ANSWERS = [a for lab in harness.labs() for a in harness.load_answers(lab)]
WRONG = [a for a in ANSWERS if not a.correct]
# A blind answer is graded on its own question only (conftest.graded): what it does to the
# other questions is the authored corpus's to declare. Since 2026-11-27 a correct authored answer
# too, and a wrong one on its own question and the later questions it declares to cost: replaying
# every later question for each answer took most of the corpus's time (Lab 7's wrong Task 1 and 2
# answers ~20-28 s each, Lab 5's MoE and pipeline answers ~20 s) and make test no longer fit its
# 65 minutes. In make test the test below therefore shows that each declared loss happens;
# JAXLAB_CORPUS_REPLAY=all replays every later question and also catches a loss an answer does
# not declare (run in a fresh clone on 2026-11-27: all five labs' declarations held but seven of
# Lab 7's, corrected then).
AUTHORED_WRONG = [a for a in ANSWERS if not a.blind and not a.correct]
MIN_CORRECT, MIN_WRONG = 3, 4


def _ids(answers):
    return [a.id for a in answers]


@pytest.mark.parametrize("lab", harness.labs())
def test_every_graded_question_has_enough_correct_and_wrong_answers(lab):
    release = harness.Release(lab)
    answers = harness.load_answers(lab, blind=False)
    short = {}
    for q in release.questions:
        n_correct = sum(a.correct for a in answers if a.question == q)
        n_wrong = sum(not a.correct for a in answers if a.question == q)
        if n_correct < MIN_CORRECT or n_wrong < MIN_WRONG:
            short[q] = (n_correct, n_wrong)
    assert short == {}, f"(correct, wrong) answers per question, want >= (3, 4): {short}"
    assert {a.question for a in answers} <= set(release.questions)
    assert all(a.message for a in answers if not a.correct), "every wrong answer names a message"
    names = [a.id for a in harness.load_answers(lab)]
    assert len(names) == len(set(names)), "answer names repeat within a question"
    blind = [a for a in harness.load_answers(lab) if a.blind]
    assert all(a.sentence for a in blind), "every blind answer quotes the sentence of its label"
    assert {a.question for a in blind} <= set(release.questions)


@pytest.mark.parametrize("lab", harness.labs())
def test_solution_run_in_the_harness_is_clean_and_scores_full_marks(lab, graded, tmp_path):
    answers = harness.load_answers(lab)
    graded(answers[0])  # starts the lab's kernel
    h = graded.harnesses[lab]
    assert h.solution_errors == []
    scores = {q: (r["score"], r["possible"]) for q, r in h.solution_results.items()}
    assert all(s == p > 0 for s, p in scores.values()), scores


@pytest.mark.parametrize("answer", ANSWERS, ids=_ids(ANSWERS))
def test_answer_gets_its_expected_verdict(answer, graded, record_property):
    v = graded(answer)
    record_property("corpus", [answer.lab, answer.question, answer.correct, v.full_marks,
                               answer.blind, bool(v.public_flags)])
    if answer.correct:
        assert v.full_marks, (f"correct answer rejected ({answer.why}): "
                              f"{v.own['score']}/{v.own['possible']}\n"
                              + "\n".join(v.failure_messages()))
        assert not v.public_flags, ("a public check flags a correct answer "
                                    f"({answer.why}):\n" + "\n".join(v.public_flags))
    else:
        assert not v.full_marks, f"wrong answer accepted ({answer.why})"
        text = "\n".join(v.failure_messages())
        if answer.message is not None:  # a blind answer's message is added once it is graded
            assert answer.message in text, f"expected {answer.message!r} in:\n{text}"


@pytest.mark.parametrize("answer", AUTHORED_WRONG, ids=_ids(AUTHORED_WRONG))
def test_answer_leaves_the_other_questions_as_declared(answer, graded):
    v = graded(answer)
    lost = sorted(q for q, (s, p) in v.scores().items()
                  if q != answer.question and s != p)
    assert lost == sorted(answer.other_questions_lose), (
        f"other questions that lost points: {lost}; declared: {answer.other_questions_lose}")


# A failure message is for the student: otter shows the line of the test file that failed and
# then `<exception type>: <text>`. The text must be an AssertionError raised on purpose, name a
# graded variable in backticks, say what was expected and what was found, and hold no code or
# traceback of the hidden checks.
EXPECTATION = re.compile(
    r"expected|should|not defined yet|is empty|has no entry|asks you|put them on the same|"
    r"each device holds|is held by|is spread over|comes out as|takes about|rules out|instead|"
    r"average them with|add them up|must be|was never set", re.I)
INTERNAL = re.compile(r"Traceback|File \"|jaxlab_lab\d|_fail\(|\bev\[|\bsev\[|line \d+ of jaxlab")


def student_text(message):
    """The exception part of an otter failure message, and its type."""
    match = re.search(r"^(\w+(?:\.\w+)*): (.*)\Z", message, re.S | re.M)
    assert match, f"no exception line in otter's message:\n{message}"
    return match.group(1), match.group(2)


@pytest.mark.parametrize("answer", WRONG, ids=_ids(WRONG))
def test_wrong_answer_gets_a_message_in_the_students_terms(answer, graded):
    v = graded(answer)
    release = graded.harnesses[answer.lab].release
    names = release.graded_names[answer.question]
    messages = v.failure_messages()
    assert messages
    for message in messages:
        kind, text = student_text(message)
        assert kind == "AssertionError", f"a raw {kind} reached the student:\n{message}"
        assert len(text.strip()) > 20, f"an empty or bare message:\n{message}"
        assert any(f"`{n}" in text for n in names), (
            f"the message names none of {sorted(names)}:\n{text}")
        assert EXPECTATION.search(text), f"says nothing about what was expected:\n{text}"
        assert not INTERNAL.search(text), f"the message shows hidden test internals:\n{text}"


@pytest.mark.parametrize("lab", harness.labs())
def test_kernel_state_is_back_to_the_solution_after_the_whole_corpus(lab, graded):
    for answer in harness.load_answers(lab):
        graded(answer)
    h = graded.harnesses[lab]
    results = h.run_tests(h.release.questions)
    scores = {q: (r["score"], r["possible"]) for q, r in results.items()}
    assert all(s == p > 0 for s, p in scores.values()), scores


# The public checks (what grader.check runs in the student's notebook) must catch most mistakes
# before submission, on the notebook's own inputs: the share of the lab's wrong answers whose
# public cases fail. Labs whose public checks were written to catch mistakes are held to it.
PUBLIC_FLAG_TARGET = 0.70
PUBLIC_FLAG_LABS = {"lab3-parallelism", "lab4-shard-map", "lab5-scaling", "lab6-memory",
                    "lab7-transformer"}


@pytest.mark.parametrize("lab", harness.labs())
def test_public_checks_flag_most_wrong_answers(lab, graded):
    wrong = [a for a in harness.load_answers(lab) if not a.correct]
    flagged = [a for a in wrong if graded(a).public_flags]
    share = len(flagged) / len(wrong)
    print(f"{lab}: public checks flag {len(flagged)} of {len(wrong)} wrong answers ({share:.0%})")
    if lab in PUBLIC_FLAG_LABS:
        missed = sorted(a.id for a in wrong if a not in flagged)
        assert share >= PUBLIC_FLAG_TARGET, (
            f"{lab}: the public checks flag {share:.0%} of the wrong answers, under "
            f"{PUBLIC_FLAG_TARGET:.0%}; not flagged:\n" + "\n".join(missed))
