"""Write what a batch produced: otter's final_grades.csv, summaries, Gradescope JSON, table, plot."""

import json
import pathlib
import re

from otter.grade.utils import SCORES_DICT_FILE_KEY, SCORES_DICT_GRADING_STATUS_KEY, \
    merge_scores_to_df
from otter.test_files import GradingResults, TestCase, TestCaseResult

SUMMARIES = "grading-summaries"
GRADESCOPE = "gradescope-results"
PLOT = "score_distribution.png"


def results_of(record, autograder):
    """The otter ``GradingResults`` a worker's record stands for."""
    if record.catastrophic:
        results = GradingResults.without_results(Exception(record.status))
    else:
        test_files = []
        for q, data in record.questions.items():
            tf = type(autograder.tests[q])(q, data["path"], [], data["all_or_nothing"])
            for case in data["cases"]:
                tc = TestCase(case["name"], None, case["hidden"], case["points"],
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


def write_csv(out, records, autograder):
    """final_grades.csv as ``otter grade`` writes it, with our grading_status per row."""
    if not records:
        return None
    df = merge_scores_to_df([results_of(r, autograder) for r in records])
    status = {r.file: r.status for r in records}
    rows = df[SCORES_DICT_FILE_KEY].isin(status)
    df.loc[rows, SCORES_DICT_GRADING_STATUS_KEY] = df.loc[rows, SCORES_DICT_FILE_KEY].map(status)
    tmp = out / "final_grades.csv.tmp"
    df.to_csv(tmp, index=False)
    tmp.replace(out / "final_grades.csv")
    return df


def in_notebook_order(questions):
    """q2 before q10, as in the notebook; the CSV keeps otter's alphabetical column order."""
    return sorted(questions, key=lambda q: [int(t) if t.isdigit() else t
                                            for t in re.split(r"(\d+)", q)])


def question_table(records, autograder):
    """Per question, in notebook order: mean score, share with full marks, errors, timeouts."""
    import pandas as pd

    rows = []
    for q in in_notebook_order(autograder.points):
        possible = autograder.points[q]
        scores, outcomes = [], []
        for r in records:
            data = r.questions.get(q)
            scores.append(sum(c["points"] for c in data["cases"] if c["passed"]) if data else 0)
            outcomes.append("error" if r.catastrophic else r.outcomes.get(q, "error"))
        s = pd.Series(scores, dtype=float)
        rows.append({"question": q, "points": possible, "mean": s.mean(),
                     "full marks": (s >= possible - 1e-9).mean() if possible else float("nan"),
                     "errors": outcomes.count("error"), "timeouts": outcomes.count("timeout")})
    return pd.DataFrame(rows)


def print_table(table):
    from rich.console import Console
    from rich.table import Table

    t = Table(title="Per-question results")
    for col in ("question", "points", "mean score", "full marks", "errors", "timeouts"):
        t.add_column(col, justify="left" if col == "question" else "right")
    for _, r in table.iterrows():
        t.add_row(r["question"], f"{r['points']:g}", f"{r['mean']:.2f}",
                  f"{r['full marks']:.0%}", str(r["errors"]), str(r["timeouts"]))
    Console().print(t)


def plot_distribution(out, df, autograder):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    questions = in_notebook_order(autograder.points)
    graded = df[df[SCORES_DICT_FILE_KEY] != "points-per-question"]
    fig, axes = plt.subplots(1, len(questions) + 1, figsize=(3 * (len(questions) + 1), 3),
                             squeeze=False)
    for ax, col in zip(axes[0], [*questions, "percent_correct"]):
        if col in graded:
            ax.hist(graded[col].astype(float), bins=10)
        ax.set_title(col)
        ax.set_xlabel("score")
    axes[0][0].set_ylabel("submissions")
    fig.tight_layout()
    fig.savefig(pathlib.Path(out) / PLOT, dpi=100)
    plt.close(fig)
