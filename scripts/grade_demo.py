"""Build a folder of Lab 3 submissions covering every fault and tampering case, grade it once.

    .venv/bin/python scripts/grade_demo.py /tmp/demo       # then look at /tmp/demo/grades/

The folder holds the solution, the blank student notebook, a renamed correct submission, an
infinite loop, a memory hog, a kernel killer and one notebook per tampering attempt.
"""

import argparse
import copy
import pathlib
import shutil
import subprocess
import sys

import nbformat
import pandas as pd

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAB = "lab3-parallelism"

TAMPERING = {
    "tamper-otter-runner": """
import otter.test_files.exception_test as et
from otter.test_files.abstract_test import TestCaseResult
def _always_pass(self, env):
    self.test_case_results = [TestCaseResult(test_case=tc, message="ok", passed=True)
                              for tc in self.test_cases]
et.ExceptionTestFile.run = _always_pass
""",
    "tamper-allclose": """
import numpy as np, jax.numpy as jnp
from jax.sharding import NamedSharding
np.allclose = jnp.allclose = lambda *a, **k: True
NamedSharding.is_equivalent_to = lambda *a, **k: True
""",
    "tamper-fake-results": """
import json, pathlib
fake = {"tests": [{"name": "q1_device_put", "score": 1.0, "max_score": 1.0}]}
for where in (pathlib.Path("results.json"), pathlib.Path("results") / "results.json"):
    where.parent.mkdir(exist_ok=True)
    where.write_text(json.dumps(fake))
""",
    "tamper-printed-report": """
for q in ["q1_device_put", "q2_inspect", "q5_dp_auto"]:
    print(f"{q} results: All test cases passed!")
""",
    "tamper-equal-to-anything": """
class Anything:
    shape = (4, 16)
    def __eq__(self, other):
        return True
A_sharded = Anything()
""",
}

FAULTS = {
    "infinite-loop": "while True:\n    pass",
    "memory-hog": "hog = [bytearray(2**28) for _ in range(64)]",
    "kernel-killer": "import os\nos._exit(1)",
}


def with_cell(nb, source, after):
    """A copy of ``nb`` with a code cell inserted after the cell whose source contains ``after``."""
    nb = copy.deepcopy(nb)
    i = next(i for i, c in enumerate(nb.cells) if after in c.source)
    nb.cells.insert(i + 1, nbformat.v4.new_code_cell(source))
    return nb


def build(folder):
    subs = folder / "submissions"
    subs.mkdir(parents=True)
    solution = ROOT / "solutions" / LAB / f"{LAB}.ipynb"
    student = ROOT / "student" / LAB / f"{LAB}.ipynb"
    shutil.copy(solution, subs / f"{LAB}.ipynb")
    shutil.copy(student, subs / "blank.ipynb")
    shutil.copy(solution, subs / "Lab3 - Jane Doe (1).ipynb")
    sol = nbformat.read(solution, as_version=4)
    # the loop sits after Task 1: that cell is interrupted and every other question keeps credit
    nbformat.write(with_cell(sol, FAULTS["infinite-loop"], 'grader.check("q1_device_put")'),
                   subs / "infinite-loop.ipynb")
    for name in ("memory-hog", "kernel-killer"):
        nbformat.write(with_cell(sol, FAULTS[name], 'grader.check("q4_propagation")'),
                       subs / f"{name}.ipynb")
    # each attempt sits on a copy of the solution whose Task 1 answer is wrong (A + 1), so a
    # full mark on Task 1 could only come from the tampering
    wrong = copy.deepcopy(sol)
    cell = next(c for c in wrong.cells if c.source.startswith("### Your code here\nA_sharded"))
    cell.source = cell.source.replace("jax.device_put(A, sharding)", "jax.device_put(A + 1, sharding)")
    for name, source in TAMPERING.items():
        nbformat.write(with_cell(wrong, source, 'grader.check("q1_device_put")'),
                       subs / f"{name}.ipynb")
    return subs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=pathlib.Path)
    ap.add_argument("--cell-timeout", default="60")
    args = ap.parse_args()
    if args.folder.exists():
        shutil.rmtree(args.folder)
    subs = build(args.folder)
    out = args.folder / "grades"
    subprocess.run([sys.executable, "-m", "jaxlab", "grade", str(subs), "-o", str(out),
                    "--cell-timeout", args.cell_timeout, "--autograder",
                    str(ROOT / "autograder" / f"{LAB}-autograder.zip")], check=True)
    df = pd.read_csv(out / "final_grades.csv")
    with pd.option_context("display.max_colwidth", 200, "display.width", 250):
        print(df[["file", "total_points_earned", "grading_status"]].to_string(index=False))


if __name__ == "__main__":
    main()
