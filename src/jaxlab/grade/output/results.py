"""One submission's results as otter writes them: its summary, its Gradescope JSON and its row of
``final_grades.csv`` (otter's own ``GradingResults``, rebuilt from the worker's record)."""

import json

from otter.grade.utils import SCORES_DICT_FILE_KEY, SCORES_DICT_GRADING_STATUS_KEY, \
    merge_scores_to_df
from otter.test_files import GradingResults, TestCase, TestCaseResult

SUMMARIES = "grading-summaries"
GRADESCOPE = "gradescope-results"
CSV = "final_grades.csv"


def results_of(record, autograder):
    """The otter ``GradingResults`` a worker's record stands for.

    Under otter's ``show_all_public`` (the release's default, ``release.RESULTS_SHOWN``) a
    hidden case whose result the jaxlab checks decided counts as public: its code stays hidden,
    and its message, written for the student, is shown on Gradescope at submission."""
    shown = bool(getattr(autograder.config, "show_all_public", False))
    if record.catastrophic:
        results = GradingResults.without_results(Exception(record.status))
    else:
        test_files = []
        for q, data in record.questions.items():
            tf = type(autograder.tests[q])(q, data["path"], [], data["all_or_nothing"])
            for case in data["cases"]:
                hidden = case["hidden"] and not (shown and case.get("by_checks", False))
                tc = TestCase(case["name"], None, hidden, case["points"],
                              case["success_message"], case["failure_message"])
                tf.test_cases.append(tc)
                tf.test_case_results.append(TestCaseResult(tc, case["message"], case["passed"]))
            test_files.append(tf)
        results = GradingResults(test_files)
    results.file = record.file
    return results


def stem(file):
    return file.rsplit(".", 1)[0].replace("/", "__")


def write_submission(out, record, autograder):
    results = results_of(record, autograder)
    for folder in (SUMMARIES, GRADESCOPE):
        (out / folder).mkdir(exist_ok=True)
    (out / SUMMARIES / f"{stem(record.file)}.txt").write_text(results.summary())
    (out / GRADESCOPE / f"{stem(record.file)}.json").write_text(
        json.dumps(results.to_gradescope_dict(autograder.config), indent=2))


def write_csv(out, records, autograder, roster=None, policy=None):
    """final_grades.csv as ``otter grade`` writes it, with our grading_status per row; with a
    ``roster`` one row per student and their columns, with a late ``policy`` its columns
    (``gradebook.per_student``)."""
    if not records:
        return None
    df = merge_scores_to_df([results_of(r, autograder) for r in records])
    status = {r.file: r.status for r in records}
    rows = df[SCORES_DICT_FILE_KEY].isin(status)
    df.loc[rows, SCORES_DICT_GRADING_STATUS_KEY] = df.loc[rows, SCORES_DICT_FILE_KEY].map(status)
    if roster is not None or policy is not None:
        from .gradebook import per_student

        df = per_student(df, roster, policy)
    tmp = out / f"{CSV}.tmp"
    df.to_csv(tmp, index=False)
    tmp.replace(out / CSV)
    return df


