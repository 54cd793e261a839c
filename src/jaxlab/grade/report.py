"""Write what a batch produced: otter's final_grades.csv, summaries, Gradescope JSON, table, plot
and report.html; and ``jaxlab report``, which writes them from the records every shard left."""

import hashlib
import json
import os
import pathlib
import re
import shutil
import sys
import tempfile

from otter.grade.utils import SCORES_DICT_FILE_KEY, SCORES_DICT_GRADING_STATUS_KEY, \
    merge_scores_to_df
from otter.test_files import GradingResults, TestCase, TestCaseResult

from . import shard as shards

SUMMARIES = "grading-summaries"
GRADESCOPE = "gradescope-results"
PLOT = "score_distribution.png"
CSV = "final_grades.csv"
AUTOGRADERS = "autograder"  # under OUTDIR/.jaxlab: the zips records were graded with


def report(*, output_dir="grades", show=True):
    """Write final_grades.csv, the summaries, the Gradescope JSON, score_distribution.png and
    report.html in ``output_dir`` from the records its shards wrote, as one batch grading every
    submission there would have. True when every submission of the current split has a record;
    otherwise what is graded is written, and the shards still to run are printed."""
    out = pathlib.Path(output_dir)
    split = shards.current_split(out)
    files = split.files()
    records = shards.records_of(out, files)
    ordered = [records[f] for f in files if f in records]
    names = {m.autograder for m in split.manifests.values() if m.autograder}
    if len(names) != 1:
        raise ValueError(f"the shards of {out} were graded with {len(names)} different "
                         "autograders" if names else f"{out} names no autograder zip")
    waiting = [f"shard {m.shard}: {k} not graded yet" for m in split.manifests.values()
               if (k := sum(f not in records for f in m.files))]
    if split.missing():
        many = len(split.missing()) > 1
        waiting.append(f"shard{'s' if many else ''} {_ranges(split.missing())} of "
                       f"{split.count}: never started")
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="jaxlab-report-"))
    try:
        from .autograder import open_autograder

        ag = open_autograder(shards.state_dir(out) / AUTOGRADERS / names.pop(), scratch)
        for r in ordered:  # a shard wrote these as it graded; only a missing or older one again
            if _older_than_record(out, r):
                write_submission(out, r, ag)
        write_class_report(out, ordered, ag, waiting=waiting)
        if show:
            print_table(question_table(ordered, ag))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if waiting:
        print(f"jaxlab report: {len(ordered)} of {len(files)} submissions graded so far "
              f"({'; '.join(waiting)}); run those shards again, then `jaxlab report` again",
              file=sys.stderr)
    elif show:
        print(f"jaxlab report: {len(ordered)} submissions from {split.count} shard"
              f"{'s' if split.count != 1 else ''} in {out / CSV}", file=sys.stderr)
    return not waiting


def _older_than_record(out, record):
    record_time = (shards.state_dir(out) / shards.RECORDS /
                   f"{shards.record_key(record.file)}.json").stat().st_mtime
    for path in (out / SUMMARIES / f"{stem(record.file)}.txt",
                 out / GRADESCOPE / f"{stem(record.file)}.json"):
        try:
            if path.stat().st_mtime < record_time:
                return True
        except FileNotFoundError:
            return True
    return False


def _ranges(indexes):
    """[0, 2, 3, 4, 7] -> "0, 2-4, 7"."""
    runs = []
    for i in sorted(indexes):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def keep_autograder(output_dir, zip_path):
    """A copy of ``zip_path`` under OUTDIR/.jaxlab, named by its content (shards copying the
    same zip write the same bytes under the same name, atomically); that name."""
    data = pathlib.Path(zip_path).read_bytes()
    name = f"{hashlib.sha256(data).hexdigest()[:20]}.zip"
    folder = shards.state_dir(output_dir) / AUTOGRADERS
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / name).exists():
        tmp = folder / f"{name}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        tmp.replace(folder / name)
    return name


def write_class_report(out, records, autograder, waiting=()):
    """final_grades.csv, score_distribution.png and report.html for ``records``; ``waiting``:
    what is not graded yet, in words, for the page."""
    from . import page

    write_csv(out, records, autograder)
    plot_distribution(out, records, autograder)
    page.write(out, records, autograder, waiting=waiting)


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
    tmp = out / f"{CSV}.tmp"
    df.to_csv(tmp, index=False)
    tmp.replace(out / CSV)
    return df


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


def plot_distribution(out, records, autograder, title=None):
    """``score_distribution.png``: which questions the class struggled with, and why.

    Left, per question in notebook order, the share of submissions with full marks, partial
    credit, zero, an error and a timeout (stacked bars); right, the distribution of total
    scores. Sized to be read as it is: 1100 pixels wide, 190 + 42 per question high (at
    least 400).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    long = per_question(records, autograder)
    questions = in_notebook_order(autograder.points)
    n = len(records)
    shares = (long.groupby(["question", "category"]).size().unstack(fill_value=0)
              .reindex(index=questions, columns=list(CATEGORIES), fill_value=0) / max(n, 1))
    possible = sum(autograder.points.values())
    totals = long.groupby("file")["points"].sum().reindex([r.file for r in records],
                                                           fill_value=0.0)
    percent = 100 * totals / possible if possible else totals * 0

    fig, (bars, hist) = plt.subplots(
        1, 2, figsize=(11, max(4.0, 1.9 + 0.42 * len(questions))), dpi=100,
        gridspec_kw={"width_ratios": [2.2, 1]})
    y = np.arange(len(questions))
    left = np.zeros(len(questions))
    for category, colour, label in zip(CATEGORIES, COLOURS, LEGEND):
        width = shares[category].to_numpy() * 100
        bars.barh(y, width, left=left, color=colour, edgecolor="white", linewidth=0.6,
                  label=label, height=0.72)
        for yi, (l, w) in enumerate(zip(left, width)):
            if w >= 9:
                text_colour = "white" if category == "timed out" else "black"
                bars.text(l + w / 2, yi, f"{w:.0f}%", ha="center", va="center", fontsize=8,
                          color=text_colour)
        left += width
    bars.set_yticks(y, [f"{q}  ({autograder.points[q]:g} pt)" for q in questions], fontsize=9)
    bars.invert_yaxis()  # q1 at the top, as in the notebook
    bars.set_xlim(0, 100)
    bars.set_xlabel("share of submissions (%)")
    bars.set_title("How each question went", fontsize=11, loc="left")
    bars.legend(ncols=len(CATEGORIES), loc="upper center", bbox_to_anchor=(0.45, -0.13),
                frameon=False, fontsize=8, handlelength=1.2, columnspacing=1.0)
    bars.spines[["top", "right"]].set_visible(False)

    hist.hist(percent, bins=np.linspace(0, 100, 11), color="#0072B2", edgecolor="white")
    if n:
        median = float(np.median(percent))
        hist.axvline(median, color="black", linestyle="--", linewidth=1)
        hist.text(median, 1.0, f" median {median:.0f}%", transform=hist.get_xaxis_transform(),
                  ha="right" if median > 60 else "left", va="top", fontsize=8)
    hist.set_xlim(0, 100)
    hist.set_xlabel("total score (%)")
    hist.set_ylabel("submissions")
    hist.yaxis.get_major_locator().set_params(integer=True)
    hist.set_title("Total scores", fontsize=11, loc="left")
    hist.spines[["top", "right"]].set_visible(False)
    fig.suptitle(title or f"{autograder.assignment_name or 'assignment'}: {n} submission"
                 f"{'s' if n != 1 else ''}, {possible:g} points", fontsize=12, x=0.01,
                 ha="left")
    fig.tight_layout()
    fig.savefig(pathlib.Path(out) / PLOT)
    plt.close(fig)
