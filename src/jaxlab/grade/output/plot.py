"""``score_distribution.png``: per question the share of each outcome, and the total scores."""

import pathlib

from .tally import CATEGORIES, COLOURS, LEGEND, in_notebook_order, per_question

PLOT = "score_distribution.png"


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
