"""The autograder zip's own entry point (what Gradescope and ``otter grade`` run) grades with
jaxlab's engine: the tampering submissions of test_batch.py, graded one container run each
through the zip's ``run_otter.py`` on a folder laid out as ``/autograder``, get zero for what
they tampered with and say so; honest ones score as ``otter run`` scores them, in otter's
results.json shape, and ``results.pkl`` (what ``otter grade`` reads) agrees.

The Gradescope-sized run (an environment built from the zip alone, 768 MB, half a CPU) of the
real labs is scripts/gradescope_fit.py's; its figures are in docs/grading.md.
"""

import concurrent.futures
import json
import pathlib
import shutil
import subprocess
import sys
import zipfile

import dill
import pytest

from jaxlab.release import engine_entries, write_stable_zip

from nbedit import write
from test_batch import FULL, NONE, POINTS, submissions, with_cell

pytestmark = pytest.mark.slow  # kernels, sandboxes or services: not in make test-quick

# what a notebook run as the container's root could do to the grader (its parent process):
# rewrite its entry point, forge its results, read the hidden tests, kill it
HOSTILE = """\
import os, pathlib, signal
argv = pathlib.Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\\0")
entry, root = pathlib.Path(argv[1].decode()), pathlib.Path(argv[2].decode())
attempts = {
    "entry": lambda: entry.write_text("print('owned')"),
    "results": lambda: (root / "results" / "results.json").write_text('{"score": 99}'),
    "tests": lambda: next((root / "source" / "tests").iterdir()).read_text(),
    "kill": lambda: os.kill(os.getppid(), signal.SIGKILL),
}
for name, attempt in attempts.items():
    try:
        attempt()
        print(name, "done")
    except OSError as exc:
        print(name, type(exc).__name__)
"""

CASES = {  # name -> (expected scores, words in the status)
    "solution.ipynb": (FULL, ["Completed"]),
    "wrong.ipynb": (NONE, ["Completed"]),
    "patch_runner.ipynb": (NONE, ["TAMPERING", "q1, q2, q3"]),
    "patch_allclose.ipynb": (NONE, ["TAMPERING", "q1"]),
    "patch_sharding.ipynb": ({"q1": 0.0, "q2": 1.0, "q3": 1.0}, ["TAMPERING", "q1"]),
    "fake_results.ipynb": (NONE, ["TAMPERING"]),
    "fake_results_file.ipynb": (NONE, ["TAMPERING", "results.json"]),
    "fake_report.ipynb": (NONE, ["TAMPERING", "imitating"]),
    "always_equal.ipynb": (NONE, ["TAMPERING", "equal any object"]),
    "hostile.ipynb": (FULL, ["Completed"]),
}


def run_container(zip_path, notebook, root, timeout=300):
    """One container run: /autograder's layout in ``root``, the zip's run_otter.py on it."""
    for sub in ("source", "submission", "results"):
        (root / sub).mkdir(parents=True)
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(root / "source")
    shutil.copy(notebook, root / "submission" / notebook.name)
    run = subprocess.run([sys.executable, str(root / "source" / "run_otter.py"), str(root)],
                         capture_output=True, text=True, timeout=timeout)
    results = root / "results" / "results.json"
    assert results.exists(), run.stdout[-2000:] + run.stderr[-2000:]
    return json.loads(results.read_text()), root / "results" / "results.pkl"


def test_the_notebook_cannot_touch_the_grader(graded, tmp_path_factory):
    """Run as another user than the container's root: the grader's entry point unchanged, its
    results its own, and it lived to write them (the scores above)."""
    results, pkl = graded["hostile.ipynb"]
    entry = pkl.parents[1] / "source" / "run_otter.py"
    assert "owned" not in entry.read_text()
    assert results.get("score") != 99 and scores(results) == FULL


@pytest.fixture(scope="module")
def graded(lab, tmp_path_factory):
    base = tmp_path_factory.mktemp("container")
    zip_path = base / "fixture-autograder.zip"
    write_stable_zip(lab.autograder, zip_path, extra=engine_entries())
    made = submissions(lab, base / "subs")
    made["hostile.ipynb"] = (write(with_cell(lab.notebook(), "y", HOSTILE),
                                   base / "subs" / "hostile.ipynb"),)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(run_container, zip_path, made[name][0], base / f"ag-{i}")
                   for i, name in enumerate(CASES)}
        return {name: f.result() for name, f in futures.items()}


def scores(results):
    return {t["name"]: t["score"] for t in results["tests"] if t["name"] in POINTS}


@pytest.mark.parametrize("name", list(CASES))
def test_each_submission_scores_and_says_so_through_the_zip(graded, name):
    results, _ = graded[name]
    expected, words = CASES[name]
    assert scores(results) == expected, results["output"][:2000]
    status = results["output"].split("\n")[0]
    assert status.startswith("grading_status: ") and "sandboxed by the container" in status
    for word in words:
        assert word in status, status
    if "TAMPERING" not in words:
        assert "TAMPERING" not in status


def test_results_pkl_is_what_otter_grade_reads_and_agrees(graded):
    for name, (results, pkl) in graded.items():
        with open(pkl, "rb") as f:
            pickled = dill.load(f)
        assert {q: pickled.get_score(q) for q in POINTS} == scores(results), name


def test_honest_results_json_matches_otter_run(graded, lab, tmp_path):
    """Same tests, scores, max scores and visibility as otter's own containerized run."""
    otter = pathlib.Path(sys.executable).with_name("otter")
    notebook = tmp_path / "solution.ipynb"
    shutil.copy(lab.solution, notebook)
    subprocess.run([str(otter), "run", "-a", str(lab.autograder), "-o", str(tmp_path),
                    str(notebook)], check=True, capture_output=True)
    theirs = json.loads((tmp_path / "results.json").read_text())
    ours, _ = graded["solution.ipynb"]
    shape = lambda r: [(t["name"], t.get("score"), t.get("max_score"), t.get("visibility"))  # noqa: E731
                       for t in r["tests"]]
    assert shape(ours) == shape(theirs)


# What students see on Gradescope. The release's setting, read from the results.json the released
# Lab 4 zip writes for a notebook with three wrong answers (from its answer corpus); the
# publish-later setting an instructor may choose (README, "What students see on Gradescope"),
# on the fixture's zip with that otter_config.json.
MISTAKES = {"q7_loss_dp": "psum_of_means", "q2_global_sum": "pmean_of_block_sums",
            "q3_matmul_allgather": "no_collective_local_product"}


def _with_config(zip_path, dest, config):
    with zipfile.ZipFile(zip_path) as zf:
        entries = {n: zf.read(n) for n in zf.namelist()}
    entries["otter_config.json"] = json.dumps(
        {**json.loads(entries.get("otter_config.json", b"{}")), **config}).encode()
    with zipfile.ZipFile(dest, "w") as zf:
        for n, data in entries.items():
            zf.writestr(n, data)
    return dest


def test_each_lost_question_shows_its_reason_at_submission_by_default(tmp_path):
    import nbformat

    from jaxlab import corpus

    lab = "lab4-shard-map"
    by_id = {a.id: a for a in corpus.load_answers(lab)}
    answers = [by_id[f"{lab}/{q}/wrong/{name}"] for q, name in MISTAKES.items()]
    notebook = tmp_path / f"{lab}.ipynb"
    nbformat.write(corpus.Release(lab).notebook_with(answers), notebook)
    results, _ = run_container(corpus.Release(lab).autograder, notebook, tmp_path / "ag",
                               timeout=900)
    tests = {t["name"]: t for t in results["tests"]}
    for a in answers:
        test = tests[a.question]
        assert test["score"] == 0 and test["visibility"] == "visible", test
        assert a.message in test["output"], (a.id, test["output"])
        assert "Traceback" not in test["output"]
    kept = [t for name, t in tests.items() if "max_score" in t and name not in MISTAKES]
    assert kept and all(t["score"] == t["max_score"] and t["visibility"] == "visible"
                        for t in kept)
    assert tests["Public Tests"]["visibility"] == "visible"


def test_publish_later_shows_each_reason_once_grades_are_published(lab, tmp_path_factory):
    base = tmp_path_factory.mktemp("publish-later")
    write_stable_zip(lab.autograder, base / "engine.zip", extra=engine_entries())
    zip_path = _with_config(base / "engine.zip", base / "later.zip",
                            {"show_hidden": True, "show_all_public": False})
    made = submissions(lab, base / "subs")
    results, _ = run_container(zip_path, made["wrong.ipynb"][0], base / "ag")
    tests = {t["name"]: t for t in results["tests"]}
    assert {q: tests[q]["score"] for q in POINTS} == NONE
    for q, name in {"q1": "y", "q2": "double", "q3": "y_mean"}.items():
        assert tests[q]["visibility"] == "after_published"
        assert f"`{name}" in tests[q]["output"].split(f"{q} - 2 result:")[1], tests[q]["output"]
    assert tests["Public Tests"]["visibility"] == "visible"
