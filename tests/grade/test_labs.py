"""The real labs through ``jaxlab grade``: Lab 4's solution and blank notebook score as with
``otter run``, and a memory hog in Lab 3's q3 answer costs only q3.
"""

import json
import pathlib
import subprocess
import sys

import nbformat
import pandas as pd

from jaxlab.grade import grade
from jaxlab.grade.engine.autograder import open_autograder

from nbedit import write

ROOT = pathlib.Path(__file__).resolve().parents[2]
HOG = "\nhog = []\nwhile True:\n    hog.append(bytearray(b'x' * 50 * 2**20))\n"


def release(lab, kind):
    return ROOT / kind / lab / f"{lab}.ipynb"


def zip_of(lab):
    return ROOT / "autograder" / f"{lab}-autograder.zip"


def scores(out):
    df = pd.read_csv(out / "final_grades.csv").set_index("file")
    return df.drop("points-per-question"), df.loc["points-per-question"]


def otter_run(autograder, notebook, out):
    otter = pathlib.Path(sys.executable).with_name("otter")
    out.mkdir(parents=True)
    subprocess.run([str(otter), "run", "-a", str(autograder), "-o", str(out), str(notebook)],
                   check=True, capture_output=True)
    tests = json.loads((out / "results.json").read_text())["tests"]
    return {t["name"]: float(t["score"]) for t in tests if "score" in t}


def test_lab4_solution_full_and_blank_zero_as_otter_run_scores_them(tmp_path):
    lab = "lab4-shard-map"
    subs = tmp_path / "subs"
    for kind in ("solutions", "student"):
        write(nbformat.read(release(lab, kind), as_version=4), subs / f"{kind}.ipynb")
    assert grade(paths=[str(subs)], output_dir=str(tmp_path / "out"), autograder=str(zip_of(lab)),
                 show=False, workers=2, sandbox="require")
    df, points = scores(tmp_path / "out")
    questions = [q for q in points.index if q.startswith("q")]
    for kind, expected in (("solutions", points[questions].astype(float)),
                           ("student", 0.0 * points[questions].astype(float))):
        row = df.loc[f"{kind}.ipynb"]
        assert row[questions].astype(float).to_dict() == expected.to_dict(), row["grading_status"]
        theirs = otter_run(zip_of(lab), subs / f"{kind}.ipynb", tmp_path / f"otter-{kind}")
        assert theirs == row[questions].astype(float).to_dict()
    assert "TAMPERING" not in df.loc["solutions.ipynb", "grading_status"]


def test_lab3_memory_hog_in_q3_costs_only_q3(tmp_path):
    lab = "lab3-parallelism"
    ag = open_autograder(zip_of(lab), tmp_path / "ag")
    nb = nbformat.read(release(lab, "solutions"), as_version=4)
    q3 = next(i for i, c in enumerate(nb.cells) if c.cell_type == "code"
              and c.source.startswith("### Your code here") and "shard_shapes" in c.source)
    nb.cells[q3].source += HOG
    write(nb, tmp_path / "subs" / "hog.ipynb")
    assert grade(paths=[str(tmp_path / "subs")], output_dir=str(tmp_path / "out"),
                 autograder=str(zip_of(lab)), show=False, workers=1, memory_mb=2500,
                 sandbox="require")
    df, points = scores(tmp_path / "out")
    row = df.loc["hog.ipynb"]
    status = row["grading_status"]
    assert status.startswith("Completed"), status
    assert f"cell {q3} skipped in a second run" in status and "memory use" in status
    expected = {q: 0.0 if q == "q3_partition_specs" else p for q, p in ag.points.items()}
    assert {q: float(row[q]) for q in ag.points} == expected, status
    record = json.loads(next((tmp_path / "out" / ".jaxlab" / "records").glob("*.json")).read_text())
    assert record["skipped"]["cell"] == q3 and record["skipped"]["reason"]["kind"] == "memory"
