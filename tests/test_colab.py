"""Each lab's student notebook, run exactly as a Colab student runs it: the notebook alone in an
empty folder, a kernel whose shell reports Colab, an environment without otter-grader (the setup
cell installs it). Then a notebook downloaded from Colab grades in full."""

import importlib
import subprocess
import sys

import nbformat
import pandas as pd
import pytest
import yaml

import colab
from labs import LABS, ROOT, release_paths
from jaxlab import release
from jaxlab.release.standalone import COLAB_SUBMIT

SOLUTION_ANSWERS, BLANK = "solution answers", "blank"


def _questions(lab):
    return list(importlib.import_module(f"jaxlab.checks.{lab.split('-')[0]}").QUESTIONS)


@pytest.fixture(scope="module")
def python():
    return colab.venv_python()


@pytest.fixture(scope="module", params=[(lab, kind) for lab in LABS
                                        for kind in (SOLUTION_ANSWERS, BLANK)],
                ids=lambda p: f"{p[0]}-{p[1].replace(' ', '-')}")
def ran(request, python, tmp_path_factory):
    lab, kind = request.param
    assert colab.remove_otter(python), "otter-grader is still importable in the Colab-like venv"
    nb = (colab.with_solution_answers(lab) if kind == SOLUTION_ANSWERS
          else colab.read(release_paths(lab)["student"]))
    where = tmp_path_factory.mktemp("colab")
    folder = where / "content"
    folder.mkdir()
    # one more cell: what the kernel says it is, as otter sees it
    nb.cells.append(nbformat.v4.new_code_cell(
        "from otter.check.utils import IPythonInterpreter\n"
        "print('runs on', grader.interpreter, IPythonInterpreter.COLAB.value.running())"))
    done = colab.run_notebook(nb, folder, colab.colab_kernel(python, where))
    return lab, kind, done, folder


def test_the_kernel_reports_colab_and_the_setup_cell_installed_otter(ran, python):
    lab, kind, nb, folder = ran
    assert "runs on IPythonInterpreter.COLAB True" in colab.output_text(nb.cells[-1])
    assert subprocess.run([str(python), "-c", "import otter; assert otter.__version__ == "
                           "'7.0.0'"]).returncode == 0
    assert (folder / "jaxlab_form.py").is_file()
    assert sorted(p.stem for p in (folder / "tests").glob("*.py")) == sorted(_questions(lab))


def test_no_cell_raises(ran):
    """Blank or answered, no cell raises: Colab's *Run all* stops at the first error, so a raising
    demo cell after an open task would keep a student from every later check. (The lab's demo
    cells wait for the answers they use with ``answered(...)``.)"""
    lab, kind, nb, folder = ran
    assert colab.errors(nb) == []


def test_every_public_check_passes_with_the_solution_answers_and_fails_blank(ran):
    lab, kind, nb, folder = ran
    checks = colab.check_outputs(nb)
    assert sorted(checks) == sorted(_questions(lab))
    passed = {q for q, text in checks.items() if "All test cases passed!" in text}
    if kind == SOLUTION_ANSWERS:
        assert passed == set(checks), {q: checks[q] for q in set(checks) - passed}
    else:
        assert passed == set()
        for q, text in checks.items():
            assert "Test case failed" in text and "AssertionError: `" in text, (q, text)


def test_the_last_cell_tells_a_colab_student_what_to_submit(ran):
    lab, kind, nb, folder = ran
    export = next(c for c in nb.cells if "grader.export(" in c.source)
    assert COLAB_SUBMIT in colab.output_text(export)
    assert "File > Download > Download .ipynb" in COLAB_SUBMIT
    assert not list(folder.glob("*.zip"))


# --------------------------------------------------------------------------- grading
# An answer that passes its public check and fails its hidden one (from the answer corpus): it
# scores zero only if grading used the autograder's own tests, not the public ones the setup
# cell carries.
WELL_FORMED_WRONG = {
    "lab3-parallelism": ("q1_device_put", {"q1_device_put", "q2_inspect"},
                         'A_sharded = jax.device_put(A, NamedSharding(mesh, P("x")))\n'),
    "lab4-shard-map": ("q2_global_sum", {"q2_global_sum"},
                       'global_sum = jax.shard_map(lambda b: lax.pmean(jnp.sum(b), "i"), '
                       'mesh=mesh, in_specs=P("i"), out_specs=P())\n'),
    # a training script whose process 1 writes the output file too
    "lab5-scaling": ("q9_multi_process", {"q9_multi_process"},
                     next(a["code"] for a in yaml.safe_load(
                         (ROOT / "tests/answers/lab5-scaling/q9_multi_process.yaml").read_text()
                     )["wrong"] if a["name"] == "every_process_saves")),
    # the plain scan: right numbers, every residual stored
    "lab6-memory": ("q1_remat_scan", {"q1_remat_scan"},
                    next(a["code"] for a in yaml.safe_load(
                        (ROOT / "tests/answers/lab6-memory/q1_remat_scan.yaml").read_text()
                    )["wrong"] if a["name"] == "no_checkpoint")),
}


@pytest.fixture(scope="module", params=LABS)
def downloaded(request, tmp_path_factory):
    """Two Colab downloads, named as Colab names them: the solution, and the solution with one
    well-formed wrong answer."""
    lab = request.param
    subs = tmp_path_factory.mktemp("downloaded") / "submissions"
    subs.mkdir()
    solution = colab.colabify(colab.read(release_paths(lab)["solution"]))
    nbformat.write(solution, subs / f"{lab}.ipynb")
    question, _, code = WELL_FORMED_WRONG[lab]
    check = next(i for i, c in enumerate(solution.cells)
                 if c.source.strip() == f'grader.check("{question}")')
    solution.cells[check - 1].source = colab.ANSWER_MARK + "\n" + code
    nbformat.write(solution, subs / f"{lab} (1).ipynb")
    return lab, subs


def _expected(lab, name):
    """{question: full marks?} for the submission ``name``."""
    _, lose, _ = WELL_FORMED_WRONG[lab]
    return {q: not (name.endswith("(1).ipynb") and q in lose) for q in _questions(lab)}


def test_colab_downloads_grade_with_otter_run(downloaded, tmp_path):
    lab, subs = downloaded
    for path in sorted(subs.iterdir()):
        assert colab.read(path).metadata["colab"]
        scores = release.question_scores(release.otter_run(
            path, release_paths(lab)["autograder"], tmp_path))
        assert {q: s == p > 0 for q, (s, p) in scores.items()} == _expected(lab, path.name), (
            path.name, scores)


def test_colab_downloads_grade_with_jaxlab_grade(downloaded, tmp_path):
    lab, subs = downloaded
    out = tmp_path / "grades"
    proc = subprocess.run([sys.executable, "-m", "jaxlab", "grade", str(subs), "-o", str(out),
                           "--autograder", str(release_paths(lab)["autograder"])],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    df = pd.read_csv(out / "final_grades.csv").set_index("file")
    possible = df.loc["points-per-question"]
    for path in sorted(subs.iterdir()):
        row = df.loc[path.name]
        assert row["grading_status"] == "Completed", (path.name, row["grading_status"])
        got = {q: float(row[q]) == float(possible[q]) > 0 for q in _questions(lab)}
        assert got == _expected(lab, path.name), (path.name, row.to_dict())
