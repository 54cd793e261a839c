"""Grading through `otter run` with the shipped autograder zip, as instructors do."""

import shutil

import pytest

from labs import LABS, release_paths
from jaxlab import release

QUESTION_COUNTS = {"lab3-parallelism": 9, "lab4-shard-map": 10, "lab5-scaling": 9,
                   "lab6-memory": 9}


@pytest.fixture(scope="module", params=LABS)
def lab(request):
    return request.param


@pytest.fixture(scope="module")
def renamed_solution_results(lab, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("renamed")
    submission = tmp / f"{lab} - Jane Doe (1).ipynb"
    shutil.copy(release_paths(lab)["solution"], submission)
    return release.otter_run(submission, release_paths(lab)["autograder"], tmp)


@pytest.fixture(scope="module")
def blank_results(lab, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("blank")
    submission = tmp / "blank.ipynb"
    shutil.copy(release_paths(lab)["student"], submission)
    return release.otter_run(submission, release_paths(lab)["autograder"], tmp)


def test_solution_saved_under_another_name_scores_full_marks(lab, renamed_solution_results):
    scores = release.question_scores(renamed_solution_results)
    assert len(scores) == QUESTION_COUNTS[lab]
    assert all(score == possible > 0 for score, possible in scores.values()), scores


def test_blank_notebook_scores_zero_on_every_question(lab, blank_results):
    scores = release.question_scores(blank_results)
    assert len(scores) == QUESTION_COUNTS[lab]
    assert all(score == 0 for score, _ in scores.values()), scores


def test_blank_notebook_gets_a_readable_message_per_question(blank_results):
    for test in blank_results:
        if "max_score" not in test:
            continue
        output = test["output"]
        assert "AssertionError: `" in output, output
        assert "not defined yet" in output or "is empty" in output, output
        assert "Traceback" not in output
