"""The answer harness gives the verdicts that full grading with `otter run` gives.

Each sample puts several corpus answers (on different questions, none of which affects another
question) into one copy of the solution notebook and grades it with the shipped autograder zip
through ``jaxlab.release.otter_run``. Every question must score what the harness scored: the
answered questions what their answers got, the others full marks. One notebook keeps the
master's file name (otter then runs each question's tests at its ``grader.check`` cell); the
other is renamed, so the init cell fails and otter runs all tests at the end on the final globals.
"""

import nbformat
import pytest

import answers_harness as harness
from jaxlab import release

LAB = "lab3-parallelism"
SAMPLES = {
    f"{LAB}.ipynb": [
        ("q1_device_put", "correct", "bare-spec-under-set-mesh"),
        ("q3_partition_specs", "wrong", "counts-distinct-blocks"),
        ("q5_dp_auto", "correct", "numpy-grid-mesh-and-none-specs"),
        ("q6_dp_explicit", "wrong", "not-jitted"),
        ("q7_dp_manual", "correct", "partial-decorator-four-devices"),
        ("q9_timing", "wrong", "no-blocking"),
    ],
    "Lab3 submission (renamed).ipynb": [
        ("q2_inspect", "correct", "set-comprehension-over-shards"),
        ("q4_propagation", "wrong", "specs-swapped"),
        ("q7_dp_manual", "wrong", "no-shard-map"),
        ("q8_sharded_training", "correct", "two-d-mesh-both-axes"),
    ],
}


def _sample(entries):
    by_id = {a.id: a for a in harness.load_answers(LAB)}
    answers = [by_id[f"{LAB}/{q}/{kind}/{name}"] for q, kind, name in entries]
    assert not any(a.other_questions_lose for a in answers), "samples must not interact"
    return answers


@pytest.mark.skipif(LAB not in harness.labs(), reason="no corpus for this lab")
@pytest.mark.parametrize("filename", sorted(SAMPLES))
def test_otter_run_agrees_with_the_harness_on_a_sample_of_answers(filename, graded, tmp_path):
    answers = _sample(SAMPLES[filename])
    verdicts = {a.question: graded(a) for a in answers}
    rel = graded.harnesses[LAB].release
    submission = tmp_path / filename
    nbformat.write(rel.notebook_with(answers), submission)
    otter = release.question_scores(release.otter_run(submission, rel.autograder, tmp_path))
    expected = {q: (verdicts[q].own["score"], verdicts[q].own["possible"]) if q in verdicts
                else (p, p) for q, (_, p) in otter.items()}
    assert set(otter) == set(rel.questions)
    assert otter == expected
    for a in answers:  # the sample exercises both verdicts
        assert (otter[a.question][0] == otter[a.question][1]) == a.correct, a.id


@pytest.mark.skipif(LAB not in harness.labs(), reason="no corpus for this lab")
def test_jaxlab_grade_agrees_with_the_harness_on_the_same_samples(graded, tmp_path):
    """The Docker-free grader, trusted verdicts outside the kernel, gives the harness's scores."""
    import pandas as pd

    from jaxlab.grade import grade

    subs = tmp_path / "submissions"
    subs.mkdir()
    expected = {}
    for filename, entries in SAMPLES.items():
        answers = _sample(entries)
        verdicts = {a.question: graded(a).own for a in answers}
        rel = graded.harnesses[LAB].release
        nbformat.write(rel.notebook_with(answers), subs / filename)
        expected[filename] = {q: verdicts[q]["score"] if q in verdicts else None
                              for q in rel.questions}
    assert grade(paths=[str(subs)], output_dir=str(tmp_path / "out"),
                 autograder=str(rel.autograder), show=False)
    df = pd.read_csv(tmp_path / "out" / "final_grades.csv").set_index("file")
    possible = df.loc["points-per-question"]
    for filename, scores in expected.items():
        row = df.loc[filename]
        assert row["grading_status"] == "Completed", row["grading_status"]
        for q, score in scores.items():
            assert float(row[q]) == (possible[q] if score is None else score), (filename, q)
