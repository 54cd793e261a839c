"""Build a folder of Lab 3 submissions covering every fault, tampering and attack case, grade it
with one ``jaxlab grade`` call.

    .venv/bin/python scripts/grade_demo.py /tmp/demo       # then look at /tmp/demo/grades/

The folder holds the solution, the blank student notebook, a renamed correct submission, an
infinite loop, a memory hog (after Task 4, and one in Task 3's answer), a kernel killer, one
notebook per tampering attempt, and one per attack on the grading machine of issue 10
(tests/grade/attacks.py: network, the instructor's home, the hidden checks, other submissions,
the grade folder, the compilation cache, the grader's processes), each answering Task 1 right
only if its attack worked, plus a control with the same cell that attacks nothing.
"""

import argparse
import copy
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import threading

import nbformat
import pandas as pd

from jaxlab.grade.engine import warmup

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAB = "lab3-parallelism"
sys.path.insert(0, str(ROOT / "tests" / "grade"))
from attacks import ATTACKS, attack_notebook  # noqa: E402  (shared with the tests)

SPOIL_Q1 = "A_sharded = jax.device_put(A + 1, sharding)"
Q1_ANSWER = "### Your code here\nA_sharded"

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


def serve_token(token):
    """A service on this machine's loopback that hands ``token`` to whoever connects."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            conn, _ = server.accept()
            with conn:
                conn.sendall(token)

    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


def build(folder, targets):
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
    # issue 10's attacks, after Task 1's answer: Task 1 stays right only if the attack worked
    q1 = next(i for i, c in enumerate(sol.cells) if c.source.startswith(Q1_ANSWER))
    for name in ATTACKS:
        nbformat.write(attack_notebook(copy.deepcopy(sol), name, targets, q1, SPOIL_Q1),
                       subs / f"attack-{name}.ipynb")
    control = with_cell(sol, "ok = True\nif not ok:\n    " + SPOIL_Q1, Q1_ANSWER)
    nbformat.write(control, subs / "control.ipynb")
    # a memory hog inside Task 3's answer: a second run without that cell keeps the rest
    hog = copy.deepcopy(sol)
    cell = next(c for c in hog.cells
                if c.source.startswith("### Your code here") and "shard_shapes" in c.source)
    cell.source += "\n" + FAULTS["memory-hog"]
    nbformat.write(hog, subs / "memory-hog-in-q3.ipynb")
    return subs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=pathlib.Path)
    ap.add_argument("--cell-timeout", default="60")
    ap.add_argument("--sandbox", default="require")
    args = ap.parse_args()
    if args.folder.exists():
        shutil.rmtree(args.folder)
    home = args.folder / "instructor-home"  # stands in for the instructor's ~/.ssh
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("instructor-secret-key")
    out = args.folder / "grades"
    targets = {"listener_port": serve_token(b"network-token"),
               "secret": home / ".ssh" / "id_ed25519",
               "autograder": ROOT / "autograder" / f"{LAB}-autograder.zip",
               "subs": args.folder / "submissions", "out": out, "grader_pid": os.getpid(),
               "cache": warmup.folder_for(ROOT / "autograder" / f"{LAB}-autograder.zip")}
    subs = build(args.folder, targets)
    subprocess.run([sys.executable, "-m", "jaxlab", "grade", str(subs), "-o", str(out),
                    "--cell-timeout", args.cell_timeout, "--sandbox", args.sandbox,
                    "--autograder", str(targets["autograder"])], check=True)
    df = pd.read_csv(out / "final_grades.csv")
    questions = [c for c in df.columns if c.startswith("q")]
    df["short"] = df[questions].apply(
        lambda r: " ".join(f"{q.split('_')[0]}={r[q]:g}" for q in questions), axis=1)
    with pd.option_context("display.max_colwidth", 400, "display.width", 400):
        print(df[["file", "total_points_earned", "short", "grading_status"]].to_string(index=False))
    print("files written into the grade folder by kernels:", sorted(
        str(p.relative_to(out)) for p in out.rglob("*pwned*")) or "none")
    print("files written into the compilation cache by kernels:", sorted(
        p.name for p in targets["cache"].rglob("*pwned*")) or "none")


if __name__ == "__main__":
    main()
