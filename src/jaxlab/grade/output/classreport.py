"""The class's files at once: final_grades.csv, score_distribution.png and report.html, and with
a roster the gradebooks' files."""

from . import gradebook, page, plot, similarity
from .results import write_csv


def write_class_report(out, records, autograder, waiting=(), roster=None, policy=None,
                       canvas_roster=None, canvas_column=None, similar=None):
    """final_grades.csv, score_distribution.png and report.html for ``records``; ``waiting``:
    what is not graded yet, in words, for the page. With a ``roster`` (Gradescope's export) also
    gradescope_scores.csv and canvas_grades.csv (its assignment column titled
    ``canvas_column``, default the lab's name), late ``policy`` applied; ``similar``: the
    similarity check's result for the page's section. The names of students no row of
    ``canvas_roster`` matched."""
    frame = write_csv(out, records, autograder, roster, policy)
    unmatched = []
    if roster is not None and frame is not None:
        gradebook.write_gradescope(out, frame)
        unmatched = gradebook.write_canvas(
            out, frame, canvas_column or autograder.assignment_name or "assignment",
            canvas_roster)
    if similar is not None:
        similarity.write_csv(out, similar)
    plot.plot_distribution(out, records, autograder)
    page.write(out, records, autograder, waiting=waiting, similar=similar)
    return unmatched
