import dataclasses
import pathlib
import shutil
import subprocess
import sys

import nbformat
import pytest

import jaxlab.checks.form

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@dataclasses.dataclass
class Lab:
    autograder: pathlib.Path
    solution: pathlib.Path
    student: pathlib.Path

    def notebook(self):
        return nbformat.read(self.solution, as_version=4)


@pytest.fixture(scope="session")
def lab(tmp_path_factory):
    """The fixture assignment built with ``otter assign`` (which also checks the solution)."""
    src = tmp_path_factory.mktemp("master")
    for name in ("fixture.ipynb", "jaxlab_fixture.py"):
        shutil.copy(FIXTURES / name, src / name)
    shutil.copy(jaxlab.checks.form.__file__, src / "jaxlab_form.py")
    dist = src / "dist"
    otter = pathlib.Path(sys.executable).with_name("otter")
    subprocess.run([str(otter), "assign", "fixture.ipynb", "dist"], cwd=src, check=True,
                   capture_output=True)
    (zip_path,) = (dist / "autograder").glob("*.zip")
    return Lab(zip_path, dist / "autograder" / "fixture.ipynb", dist / "student" / "fixture.ipynb")
