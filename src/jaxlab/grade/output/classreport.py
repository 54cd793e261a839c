"""The class's files at once: final_grades.csv, score_distribution.png and report.html."""

from . import page, plot
from .results import write_csv


def write_class_report(out, records, autograder, waiting=()):
    """final_grades.csv, score_distribution.png and report.html for ``records``; ``waiting``:
    what is not graded yet, in words, for the page."""
    write_csv(out, records, autograder)
    plot.plot_distribution(out, records, autograder)
    page.write(out, records, autograder, waiting=waiting)
