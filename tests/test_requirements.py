"""Every requirement a task states is exercised by the hidden checks (docs/requirements.md).

Each row of a lab's table says what exercises it: a constant of fresh cases in the lab's checks
module and the values the cases take (a boundary the text states, every size it lets vary), a
graded variable the check reads, or a fact of the traced program; and the corpus answers that
violate it. This test resolves every one of those names against the checks module and the
answer corpus (``requirements_table.problems``), so a row cannot claim what the checks do not
do. The corpus itself is graded by test_answers.py: each wrong answer named here is rejected
there with its message.
"""

import re

import pytest

import requirements_table as table

ROWS = table.rows()
LABS = sorted({p.stem for p in (table.ROOT / "src" / "jaxlab" / "checks").glob("lab*.py")})


def _id(row):
    return f"{row.lab}-{row.task}-line{row.line}"


def test_every_lab_with_checks_has_a_section_and_every_question_rows():
    by_lab = {}
    for row in ROWS:
        by_lab.setdefault(row.lab, set()).add(row.task)
    assert sorted(by_lab) == LABS, "a lab's checks module without a section, or the reverse"
    for lab in LABS:
        questions = {q.split("_")[0] for q in table.checks_module(lab).QUESTIONS}
        assert by_lab[lab] == questions, (lab, sorted(by_lab[lab] ^ questions))


@pytest.mark.parametrize("row", ROWS, ids=[_id(r) for r in ROWS])
def test_row_names_what_exercises_it_and_each_name_resolves(row):
    assert table.problems(row) == [], row.where()


IDENTIFIER = re.compile(r"^(?:form\.|lab\d+\.)?_?[A-Za-z]\w*$")


@pytest.mark.parametrize("row", ROWS, ids=[_id(r) for r in ROWS])
def test_checked_by_names_functions_and_constants_that_exist(row):
    from jaxlab.checks import form

    module = table.checks_module(row.lab)
    for name in table.NAME.findall(row.checked_by):
        if not IDENTIFIER.match(name) or not (name.startswith(("_", "form.", "lab"))
                                               or name.isupper()):
            continue  # code, a spec or a test's name, not a name of the checks
        owner = form if name.startswith("form.") else module
        assert hasattr(owner, name.split(".")[-1]), f"{row.where()}: {name} does not exist"


def _row_after(edit, task="q7", lab="lab5"):
    """The row of ``lab`` ``task`` whose text ``edit`` changes, parsed from the edited table."""
    text = table.REQUIREMENTS.read_text()
    lines = text.splitlines()
    for row in ROWS:
        if (row.lab, row.task) == (lab, task):
            changed = edit(lines[row.line - 1])
            if changed != lines[row.line - 1]:
                lines[row.line - 1] = changed
                return next(r for r in table.rows("\n".join(lines)) if r.line == row.line)
    raise AssertionError(f"no {lab} {task} row that the edit changes")


@pytest.mark.parametrize("edit, says", [
    (lambda line: line.replace("E = ", "E = 64, ", 1), "has E 64"),
    (lambda line: line.replace("`ROUTE_CASES`", "`ROUTE_CASE`"), "has no ROUTE_CASE"),
    (lambda line: re.sub(r"= ([0-9.]+)(, [0-9.]+)+", r"= \1", line), "lets a size vary"),
    (lambda line: line.replace("`lowest_score`", "`highest_score`"), "highest_score is not"),
    (lambda line: "|".join(c if i != 4 else " " for i, c in enumerate(line.split("|"))),
     "nothing exercises"),
])
def test_a_row_that_claims_what_the_checks_do_not_do_is_reported(edit, says):
    found = table.problems(_row_after(edit))
    assert any(says in p for p in found), found


def test_an_item_of_no_known_form_is_refused():
    with pytest.raises(table.FormatError):
        table.parse_claims("the fresh cases")
