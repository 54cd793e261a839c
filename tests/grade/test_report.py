import types

import matplotlib.image

from jaxlab.grade.model import Record
from jaxlab.grade.output.plot import PLOT, plot_distribution
from jaxlab.grade.output.tally import in_notebook_order, per_question, question_table


def test_per_question_table_lists_questions_in_notebook_order_not_alphabetical():
    otter_order = ["q10_dp_training", "q1_vmap_collective", "q2_global_sum", "q9_loss_tp"]
    assert in_notebook_order(otter_order) == [
        "q1_vmap_collective", "q2_global_sum", "q9_loss_tp", "q10_dp_training"]


AG = types.SimpleNamespace(points={"q10": 2.0, "q1": 1.0, "q2": 3.0}, assignment_name="demo")


def record(file, scores=None, outcomes=None, catastrophic=False):
    """A worker record: each question has a 0-point public case and its points cases."""
    questions = {q: {"cases": [{"points": 0.0, "passed": True}] + [
        {"points": 1.0, "passed": i < scores[q]} for i in range(int(AG.points[q]))]}
        for q in (scores or {})}
    return Record(file=file, sha256="", catastrophic=catastrophic, questions=questions,
                  outcomes=outcomes or {})


RECORDS = [
    record("full.ipynb", {"q1": 1, "q2": 3, "q10": 2}, {"q1": "pass", "q2": "pass", "q10": "pass"}),
    record("mixed.ipynb", {"q1": 0, "q2": 2, "q10": 0}, {"q1": "fail", "q2": "fail",
                                                         "q10": "timeout"}),
    record("died.ipynb", {"q1": 1, "q2": 0, "q10": 0}, {"q1": "pass", "q2": "error",
                                                        "q10": "error"}),
    record("unreadable.ipynb", catastrophic=True),
]


def test_each_question_of_each_submission_falls_in_one_category():
    long = per_question(RECORDS, AG)
    got = {(r.file, r.question): r.category for r in long.itertuples()}
    assert got == {
        ("full.ipynb", "q1"): "full marks", ("full.ipynb", "q2"): "full marks",
        ("full.ipynb", "q10"): "full marks",
        ("mixed.ipynb", "q1"): "zero", ("mixed.ipynb", "q2"): "partial",
        ("mixed.ipynb", "q10"): "timed out",
        ("died.ipynb", "q1"): "full marks", ("died.ipynb", "q2"): "error",
        ("died.ipynb", "q10"): "error",
        ("unreadable.ipynb", "q1"): "error", ("unreadable.ipynb", "q2"): "error",
        ("unreadable.ipynb", "q10"): "error"}
    assert list(long["question"].unique()) == ["q1", "q2", "q10"]


def test_question_table_counts_scores_errors_and_timeouts():
    table = question_table(RECORDS, AG).set_index("question")
    assert list(table.index) == ["q1", "q2", "q10"]
    assert table.loc["q2", "mean"] == (3 + 2 + 0 + 0) / 4
    assert table.loc["q1", "full marks"] == 0.5
    assert table.loc["q10", "errors"] == 2 and table.loc["q10", "timeouts"] == 1


def test_class_report_is_one_readable_figure_that_grows_with_the_questions(tmp_path):
    plot_distribution(tmp_path, RECORDS, AG)
    small = matplotlib.image.imread(tmp_path / PLOT).shape
    many = types.SimpleNamespace(points={f"q{i}": 1.0 for i in range(1, 21)},
                                 assignment_name="many")
    plot_distribution(tmp_path, RECORDS, many)
    tall = matplotlib.image.imread(tmp_path / PLOT).shape
    # at its natural size: one slide wide, not one panel per question side by side
    assert small[1] == tall[1] <= 1400
    assert 400 <= small[0] < tall[0] <= 1400


def test_failure_messages_of_one_shape_group_together_and_others_do_not():
    from jaxlab.grade.output.page import shape

    same = [
        "`replicas[P('x', None)]` is the number 2; with P('x', None) each distinct block is "
        "held by 4 devices",
        "`replicas[P(None, 'y')]` is the number 8; with P(None, 'y') each distinct block is "
        "held by 2 devices",
    ]
    assert shape(same[0]) == shape(same[1])
    arrays = ["`y` is Array([0., 1., 2.], dtype=float32), expected [0. 2. 4.]",
              "`y` is Array([[1., 1.],\n [1., 1.]], dtype=float32), expected [[2. 2.]\n [2. 2.]]"]
    assert shape(arrays[0]) == shape(arrays[1])
    assert shape("loss went from 0.52 to 1.3e-05 in 100 steps") == \
        shape("loss went from 2.1 to 0.25 in 10 steps")
    # a different sentence stays a different reason; names inside identifiers stay
    assert shape("`double(x)` does not return twice its input.") != \
        shape("`y_mean` is not the mean of `y`.")
    assert shape("float32 is not bfloat16") != shape("float64 is not bfloat16")
    assert "q1" in shape("q1 failed") and "#" in shape("off by 3")


def test_the_page_lists_every_question_with_its_counts_and_groups_reasons(tmp_path):
    from jaxlab.grade.output import page

    msg = "`y` has {} of {} values wrong"
    recs = [record(f"s{i}.ipynb", {"q1": 0, "q2": 3, "q10": 2},
                   {"q1": "fail", "q2": "pass", "q10": "pass"}) for i in range(4)]
    for i, r in enumerate(recs):
        r.questions["q1"]["cases"][1]["message"] = msg.format(i + 1, 8)
    recs.append(record("broken.ipynb", catastrophic=True))
    recs[-1].status = "not a notebook: the JSON has no list of cells"
    html = page.render(recs, AG)
    assert [m for m in ("q1", "q2", "q10") if f'data-question="{m}"' in html] == \
        ["q1", "q2", "q10"]
    assert html.index('id="q2"') < html.index('id="q10"')
    assert 'data-zero="4"' in html and 'data-error="1"' in html
    assert html.count('class="reason" data-count="4"') == 1  # four messages, one shape
    assert "4 variants of this message" in html
    assert "grading-summaries/broken.txt" in html and "no list of cells" in html
    assert "<script" not in html and "http" not in html
