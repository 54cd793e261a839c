"""An otter zip without a jaxlab checks module is graded by otter's tests in the kernel."""

import zipfile

import pandas as pd
import pytest

from jaxlab.grade import grade

from nbedit import write
from test_batch import PATCH_RUNNER, wrong

pytestmark = pytest.mark.slow  # kernels, sandboxes or services: not in make test-quick


@pytest.fixture(scope="module")
def generic_batch(lab, tmp_path_factory):
    root = tmp_path_factory.mktemp("generic")
    plain = root / "plain-autograder.zip"
    with zipfile.ZipFile(lab.autograder) as src, zipfile.ZipFile(plain, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename == "files/jaxlab_fixture.py":  # no longer a declared checks module
                data = data.replace(b"JAXLAB_CHECKS = 1", b"")
            dst.writestr(item, data)
    subs = root / "subs"
    write(lab.notebook(), subs / "solution.ipynb")
    write(wrong(lab.notebook(), PATCH_RUNNER), subs / "patched.ipynb")
    out = root / "out"
    assert grade(paths=[str(subs)], output_dir=str(out), autograder=str(plain), workers=2,
                 timeout=60, cell_timeout=10, memory_mb=1200, show=False)
    return pd.read_csv(out / "final_grades.csv").set_index("file")


def test_generic_zip_grades_in_the_kernel_and_says_it_is_not_tamper_checked(generic_batch):
    row = generic_batch.loc["solution.ipynb"]
    assert row["total_points_earned"] == 4
    assert "not tamper-checked" in row["grading_status"]


def test_generic_zip_trusts_the_kernel_so_a_patched_runner_wins_there(generic_batch):
    # the documented limit of the fallback: without a checks module the kernel decides
    row = generic_batch.loc["patched.ipynb"]
    assert "not tamper-checked" in row["grading_status"]
    assert row["total_points_earned"] == 4
