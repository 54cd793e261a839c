"""Each lab's student notebook, run exactly as a Colab student runs it: the notebook alone in an
empty folder, a kernel whose shell reports Colab, an environment without otter-grader (the setup
cell installs it). A notebook downloaded from Colab is graded in test_grading_paths.py."""

import importlib
import subprocess

import nbformat
import pytest

import colab
from labs import LABS, release_paths
from jaxlab.release.standalone import COLAB_SUBMIT

pytestmark = pytest.mark.slow  # kernels, sandboxes or services: not in make test-quick

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


# Downloads from Colab grade on every path: test_grading_paths.py grades one per lab.
