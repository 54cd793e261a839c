"""The comparisons Lab 6's notebook shows a student tell the common wrong answer from the right
one (issue 42): each demo cell after a task, run on a wrong answer of the corpus, prints the
difference. The master's code cells run once in this process (the solution); each case then puts
one wrong answer in place, runs the demo cell and reads what it printed."""

import contextlib
import io
import os
import re

import pytest
import yaml

from labs import ROOT

pytestmark = pytest.mark.slow  # runs the whole lab's code (about a minute)

LAB = "lab6-memory"
MASTER = ROOT / "assignments" / LAB / f"{LAB}.py"


def _answer(question, name):
    data = yaml.safe_load((ROOT / "tests" / "answers" / LAB / f"{question}.yaml").read_text())
    return next(a["code"] for kind in ("correct", "wrong") for a in data.get(kind) or []
                if a["name"] == name)


@pytest.fixture(scope="module")
def notebook():
    import jupytext

    os.environ.setdefault("MPLBACKEND", "Agg")
    cells = [c.source for c in jupytext.read(MASTER).cells if c.cell_type == "code"]
    namespace = {"__name__": "__main__"}
    with contextlib.redirect_stdout(io.StringIO()):
        for source in cells:
            exec(compile(source, "<lab6 cell>", "exec"), namespace)
    return cells, namespace


def _demo(notebook, marker, *answers):
    """What the demo cell holding ``marker`` prints with ``answers`` ((question, name) of the
    corpus) in place of the solution's."""
    cells, solution = notebook
    namespace = dict(solution)
    with contextlib.redirect_stdout(io.StringIO()):
        for question, name in answers:
            exec(_answer(question, name), namespace)
    cell = next(c for c in cells if marker in c)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        exec(compile(cell, "<lab6 demo>", "exec"), namespace)
    return text.getvalue()


def test_task2_demo_tries_the_policy_and_tells_dots_saveable_from_the_names(notebook):
    right = _demo(notebook, "print_costs(policy_loss")
    wrong = _demo(notebook, "print_costs(policy_loss", ("q2_remat_policy",
                                                        "dots_saveable_without_names"))
    row = re.compile(r"^your policy_loss\s+(.*?)\s+[\d.]+\s+[\d.]+$", re.M)
    assert row.search(right).group(1) == row.search(wrong).group(1)  # the table's row: the same
    assert "named 'hidden'" in right and "output of dot_general" not in right
    assert wrong.count("output of dot_general") == 3 and "named 'hidden'" not in wrong


def test_task4_demo_compares_m_and_v_and_shows_the_sum_taken_for_the_mean(notebook):
    marker = "zero_state = zero_init(reg_W)"
    assert re.findall(r"the same as on one device.*?: (\w+)", _demo(notebook, marker)) == \
        ["True"] * 3
    wrong = _demo(notebook, marker, ("q4_zero_sharded_adam", "sum_not_mean"))
    found = dict(re.findall(r"^(\w) the same as on one device.*?: (\w+)", wrong, re.M))
    assert found == {"W": "True", "m": "False", "v": "False"}, wrong
    assert "against the one-device m's: 8.000" in wrong


def test_zero_memory_cell_shows_the_moments_gathered_in_scratch_memory_and_collectives(notebook):
    marker = "zero_compiled = jax.jit(zero_step)"

    def zero_row(text):
        temp, collectives = re.search(r"^ZeRO:.*temporary\s+([\d.]+) MiB, collectives (\[.*\]),",
                                      text, re.M).groups()
        return float(temp), re.findall(r"'([a-z-]+)'\)", collectives)

    right, wrong = _demo(notebook, marker), _demo(notebook, marker, (
        "q4_zero_sharded_adam", "gathers_the_moments_too"))
    assert zero_row(right)[1] == ["all-gather", "reduce-scatter"]
    assert zero_row(wrong)[0] > 2 * zero_row(right)[0]
    assert zero_row(wrong)[1].count("all-gather") >= 3


@pytest.mark.parametrize("question, marker, answers", [
    ("q5", "att_out = attention(att_q", [("q5_attention_reference", "unscaled_scores")]),
    # the audit's case: both functions unscaled, so "equals attention" alone says True
    ("q6", "blocked = blocked_attention(att_q", [("q5_attention_reference", "unscaled_scores"),
                                                ("q6_online_softmax", "unscaled_scores")]),
])
def test_attention_demos_check_a_row_worked_out_by_hand(notebook, question, marker, answers):
    right = _demo(notebook, marker)
    wrong = _demo(notebook, marker, *answers)
    by_hand = re.compile(r"second row equals row_one(?: \(by hand\))?: (\w+)")
    assert set(by_hand.findall(right)) == {"True"}
    assert set(by_hand.findall(wrong)) == {"False"}, wrong
    if question == "q6":
        assert "equals attention: True" in wrong  # what the demo said before, for this answer


def test_task6_demo_shows_the_largest_array_and_large_scores(notebook):
    marker = "blocked = blocked_attention(att_q"
    largest = re.compile(r"^block size +(\d+):.*finite for 100 q, 100 k: (\w+) +largest array: "
                         r"(\d+) × (\d+) +score blocks computed: (\d+) \(one pass: (\d+)\)$",
                         re.M)

    def rows(text, passes=False):
        found = largest.findall(text)
        if passes:
            return {int(b): (int(n), int(one)) for b, _, _, _, n, one in found}
        return {int(b): (finite, int(r) * int(c)) for b, finite, r, c, _, _ in found}

    right = rows(_demo(notebook, marker))
    assert right == {1: ("True", 64 * 16), 8: ("True", 64 * 16), 64: ("True", 64 * 64)}, right
    # the whole score matrix prints what the right answer prints but this line (issue 42)
    whole = rows(_demo(notebook, marker, ("q6_online_softmax", "whole_score_matrix")))
    assert {b: size for b, (_, size) in whole.items()} == {1: 64 * 64, 8: 64 * 64, 64: 64 * 64}
    unstable = rows(_demo(notebook, marker, ("q6_online_softmax", "no_running_maximum")))
    assert {finite for finite, _ in unstable.values()} == {"False"}, unstable
    assert rows(_demo(notebook, marker), passes=True) == {1: (64, 64), 8: (8, 8), 64: (1, 1)}
    twice = rows(_demo(notebook, marker, ("q6_online_softmax", "two_passes")), passes=True)
    assert twice == {1: (128, 64), 8: (16, 8), 64: (2, 1)}, twice


def test_task7_demo_counts_the_moves_the_loops_make(notebook):
    marker = "moved_by_ppermute(ring_attention"
    count = re.compile(r"sends with ppermute: (\d+) = ([\d.]+) blocks")
    assert count.search(_demo(notebook, marker)).groups() == ("1792", "14.0")
    wrong = _demo(notebook, marker, ("q7_ring_attention", "moves_after_every_block"))
    assert count.search(wrong).groups() == ("2048", "16.0"), wrong
