"""How each question of each submission ended, counted for the class: the categories the plot
and the page draw, and the per-question table printed after a batch."""

import re


def in_notebook_order(questions):
    """q2 before q10, as in the notebook; the CSV keeps otter's alphabetical column order."""
    return sorted(questions, key=lambda q: [int(t) if t.isdigit() else t
                                            for t in re.split(r"(\d+)", q)])


# How one question of one submission ended, for the class report; in drawing order.
CATEGORIES = ("full marks", "partial", "zero", "error", "timed out")
# Okabe-Ito colours: distinguishable with the common colour-vision deficiencies.
COLOURS = ("#009E73", "#56B4E9", "#E69F00", "#CC79A7", "#555555")
LEGEND = ("full marks", "partial credit", "zero (wrong answer)", "error (not checked)",
          "timed out")


def per_question(records, autograder):
    """One row per (submission, question): file, question, points, possible, category.

    ``category`` is one of CATEGORIES: a check that could not run (dead kernel, missing
    evidence, a submission that could not be read) is an ``error``, not a ``zero``.
    """
    import pandas as pd

    rows = []
    for r in records:
        for q in in_notebook_order(autograder.points):
            possible = autograder.points[q]
            data = r.questions.get(q)
            score = sum(c["points"] for c in data["cases"] if c["passed"]) if data else 0.0
            outcome = "error" if r.catastrophic else r.outcomes.get(q, "error")
            if outcome == "timeout":
                category = "timed out"
            elif outcome == "error" and score == 0:
                category = "error"
            elif score >= possible - 1e-9:
                category = "full marks"
            elif score > 0:
                category = "partial"
            else:
                category = "zero"
            rows.append({"file": r.file, "question": q, "points": score,
                         "possible": possible, "category": category})
    return pd.DataFrame(rows, columns=["file", "question", "points", "possible", "category"])


def question_table(records, autograder):
    """Per question, in notebook order: mean score, share with full marks, errors, timeouts."""
    import pandas as pd

    long = per_question(records, autograder)
    rows = []
    for q in in_notebook_order(autograder.points):
        one = long[long["question"] == q]
        possible = autograder.points[q]
        rows.append({"question": q, "points": possible, "mean": one["points"].mean(),
                     "full marks": (one["points"] >= possible - 1e-9).mean() if possible
                     else float("nan"),
                     "errors": int((one["category"] == "error").sum()),
                     "timeouts": int((one["category"] == "timed out").sum())})
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


