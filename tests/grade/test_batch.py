"""One real batch over faulty, bad and tampering submissions built from the fixture's solution."""

import json
import pathlib
import subprocess
import sys
import zipfile

import nbformat
import pandas as pd
import psutil
import pytest

from jaxlab.grade import grade

from nbedit import answer_cell, write

pytestmark = pytest.mark.slow  # kernels, sandboxes or services: not in make test-quick

MARKER = "jaxlab-grade-test-escapee"
WRONG = {
    "y": 'y = jax.device_put(jnp.zeros(8), NamedSharding(mesh, P("x")))',
    "double": "def double(x):\n    return 3 * x",
    "y_mean": "y_mean = 0.0",
}
POINTS = {"q1": 2.0, "q2": 1.0, "q3": 1.0}
FULL = {q: p for q, p in POINTS.items()}
NONE = {q: 0.0 for q in POINTS}


def with_cell(nb, after, source):
    nb.cells.insert(answer_cell(nb, after) + 1, nbformat.v4.new_code_cell(source))
    return nb


def wrong(nb, prelude=""):
    for name, source in WRONG.items():
        nb.cells[answer_cell(nb, name)].source = source
    if prelude:
        nb.cells.insert(answer_cell(nb, "y"), nbformat.v4.new_code_cell(prelude))
    return nb


PATCH_RUNNER = """\
import otter.test_files.exception_test as et
from otter.test_files import TestCaseResult
def run(self, env):
    self.test_case_results = [TestCaseResult(tc, "ok", True) for tc in self.test_cases]
et.ExceptionTestFile.run = run
"""
PATCH_ALLCLOSE = """\
import numpy as np
np.allclose = lambda *a, **k: True
jnp.allclose = lambda *a, **k: True
"""
PATCH_SHARDING = "NamedSharding.is_equivalent_to = lambda *a, **k: True"
FAKE_RESULTS = """\
import glob, json, os, pickle, threading, time
from otter.test_files import GradingResults
with open("results.pkl", "wb") as f:
    pickle.dump(GradingResults([]), f)
def forge():
    for _ in range(400):
        for d in glob.glob(os.getcwd() + "/../reveal/evidence-*"):
            for q in ("q1", "q2", "q3"):
                try:
                    with open(f"{d}/claim-{q}.json", "w") as f:
                        json.dump({"cases": [[True, ""], [True, ""]]}, f)
                    with open(f"{d}/results.json", "w") as f:
                        json.dump({"score": 4}, f)
                except OSError:
                    pass
        time.sleep(0.05)
threading.Thread(target=forge, daemon=True).start()
"""
FAKE_RESULTS_FILE = """\
import json
with open("results.json", "w") as f:
    json.dump({"tests": [{"name": "q1", "score": 2, "max_score": 2}]}, f)
"""
FAKE_REPORT = 'for q in ("q1", "q2", "q3"):\n    print(f"{q} results: All test cases passed!")'
ALWAYS_EQUAL = """\
class Anything:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__
y = double = y_mean = Anything()
"""
ESCAPE = f"""\
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "{MARKER}"],
                 start_new_session=True)
subprocess.Popen(["sh", "-c", "{sys.executable} -c 'import os, time; os.setsid(); time.sleep(300)' {MARKER} &"])
"""


def submissions(lab, root):
    """name -> (path, expected scores or None, words expected in grading_status)."""
    sol = lab.notebook
    made = {}

    def add(name, nb_or_bytes, scores, *words):
        path = root / name
        if isinstance(nb_or_bytes, bytes):
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(nb_or_bytes)
        else:
            write(nb_or_bytes, path)
        made[name] = (path, scores, words)

    add("solution.ipynb", sol(), FULL, "Completed")
    add("wrong.ipynb", wrong(sol()), NONE, "Completed")
    # faults
    add("loop.ipynb", with_cell(sol(), "double", "while True:\n    pass"), FULL,
        "per-cell limit", "interrupted")
    add("hang.ipynb", with_cell(sol(), "y_mean", "import signal\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass"), NONE, "Timed out")
    # a cell that kills the kernel is skipped in a second run; nothing else needs it here
    add("exit.ipynb", with_cell(sol(), "y", "import os\nos._exit(1)"), FULL, "Completed",
        "kernel died in cell", "skipped in a second run")
    add("memory.ipynb", with_cell(sol(), "y", "hog = []\nwhile True:\n"
        "    hog.append(bytearray(b'x' * 50 * 2**20))"), FULL, "Completed", "memory", "cap",
        "skipped in a second run")
    add("flood.ipynb", with_cell(sol(), "y_mean", "for _ in range(30):\n    print('x' * 10**5)"),
        FULL, "output over the cap")
    add("escape.ipynb", with_cell(sol(), "y_mean", ESCAPE), FULL, "Completed")
    # the sandbox's PID namespace: the kernel's parent is the namespace's init, not the worker
    add("kill_grader.ipynb", with_cell(sol(), "y", "import os, signal\n"
        "os.kill(os.getppid(), signal.SIGKILL)"), FULL, "Completed")
    # bad inputs
    add("not_json.ipynb", b"this is not JSON", NONE, "not valid JSON")
    add("not_notebook.ipynb", b'{"hello": 1}', NONE, "no list of cells")
    add("empty.ipynb", b"", NONE, "empty")
    add("no_notebook.zip", _zip({"README.txt": b"hi"}), NONE, "no notebook")
    add("export.zip", _zip({"fixture.ipynb": nbformat.writes(sol()).encode(),
                            ".OTTER_LOG": b"log"}), FULL, "Completed")
    deleted = sol()
    del deleted.cells[answer_cell(deleted, "y")]
    add("deleted.ipynb", deleted, {"q1": 0.0, "q2": 1.0, "q3": 0.0}, "NameError")
    reordered = sol()
    reordered.cells.insert(answer_cell(reordered, "y"),
                           reordered.cells.pop(answer_cell(reordered, "y_mean")))
    add("reordered.ipynb", reordered, {"q1": 2.0, "q2": 1.0, "q3": 0.0}, "NameError")
    raises = sol()  # the arguments of device_put swapped: y is never set, nor y_mean after it
    raises.cells[answer_cell(raises, "y")].source = \
        'y = jax.device_put(NamedSharding(mesh, P("x")), jnp.arange(8.0) * 2)'
    add("raises.ipynb", raises, {"q1": 0.0, "q2": 1.0, "q3": 0.0}, "raised errors")
    stuck = sol()  # waits forever before setting y
    stuck.cells[answer_cell(stuck, "y")].source = \
        "import time\nwhile True:\n    time.sleep(0.1)\n" + \
        stuck.cells[answer_cell(stuck, "y")].source
    add("stuck.ipynb", stuck, {"q1": 0.0, "q2": 1.0, "q3": 0.0}, "per-cell limit")
    exit_y = sol()  # kills the kernel before setting y: skipped in a second run
    exit_y.cells[answer_cell(exit_y, "y")].source = \
        "import os\nos._exit(1)\n" + exit_y.cells[answer_cell(exit_y, "y")].source
    add("exit_y.ipynb", exit_y, {"q1": 0.0, "q2": 1.0, "q3": 0.0}, "skipped in a second run")
    add("odd näme with spaces.ipynb", sol(), FULL, "Completed")
    add("a/same.ipynb", sol(), FULL, "Completed")
    add("b/same.ipynb", wrong(sol()), NONE, "Completed")
    # tampering, always with wrong answers
    add("patch_runner.ipynb", wrong(sol(), PATCH_RUNNER), NONE, "TAMPERING", "q1, q2, q3")
    add("patch_allclose.ipynb", wrong(sol(), PATCH_ALLCLOSE), NONE, "TAMPERING", "q1")
    replicated = sol()
    replicated.cells[answer_cell(replicated, "y")].source = \
        'y = jax.device_put(jnp.arange(8.0) * 2, NamedSharding(mesh, P()))'
    replicated.cells.insert(answer_cell(replicated, "y"), nbformat.v4.new_code_cell(PATCH_SHARDING))
    add("patch_sharding.ipynb", replicated, {"q1": 0.0, "q2": 1.0, "q3": 1.0}, "TAMPERING", "q1")
    add("fake_results.ipynb", wrong(sol(), FAKE_RESULTS), NONE, "TAMPERING")
    add("fake_results_file.ipynb", wrong(sol(), FAKE_RESULTS_FILE), NONE, "TAMPERING",
        "files named like grading results (results.json)")
    add("fake_report.ipynb", with_cell(wrong(sol()), "y_mean", FAKE_REPORT), NONE,
        "TAMPERING", "imitating")
    always = sol()
    for name in WRONG:
        always.cells[answer_cell(always, name)].source = "pass"
    always.cells.insert(answer_cell(always, "y") if False else 2,
                        nbformat.v4.new_code_cell(ALWAYS_EQUAL))
    add("always_equal.ipynb", always, NONE, "TAMPERING", "equal any object")
    return made


def _zip(members):
    import io

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


SETTINGS = dict(workers=2, timeout=60, cell_timeout=15, memory_mb=1200, output_cap_mb=1)


@pytest.fixture(scope="module")
def batch(lab, tmp_path_factory):
    root = tmp_path_factory.mktemp("subs")
    made = submissions(lab, root)
    out = root.parent / (root.name + "-out")
    ok = grade(paths=[str(root)], output_dir=str(out), autograder=str(lab.autograder), **SETTINGS)
    df = pd.read_csv(out / "final_grades.csv")
    return {"ok": ok, "made": made, "out": out, "root": root, "df": df.set_index("file")}


def file_of(name):
    return name.split("/")[-1] if not name.startswith(("a/", "b/")) else name


def test_batch_returns_true_and_grades_every_submission(batch):
    assert batch["ok"] is True
    assert set(batch["df"].index) == {"points-per-question"} | {file_of(n) for n in batch["made"]}


CASES = ["solution.ipynb", "wrong.ipynb", "loop.ipynb", "hang.ipynb", "exit.ipynb",
         "memory.ipynb", "flood.ipynb", "escape.ipynb", "kill_grader.ipynb", "not_json.ipynb",
         "not_notebook.ipynb", "empty.ipynb", "no_notebook.zip", "export.zip", "deleted.ipynb",
         "reordered.ipynb", "raises.ipynb", "stuck.ipynb", "exit_y.ipynb", "odd näme with spaces.ipynb", "a/same.ipynb", "b/same.ipynb",
         "patch_runner.ipynb", "patch_allclose.ipynb", "patch_sharding.ipynb",
         "fake_results.ipynb", "fake_results_file.ipynb", "fake_report.ipynb",
         "always_equal.ipynb"]


@pytest.mark.parametrize("name", CASES)
def test_each_submission_gets_its_scores_and_a_status_saying_what_happened(batch, name):
    _, scores, words = batch["made"][name]
    row = batch["df"].loc[file_of(name)]
    status = row["grading_status"]
    for word in words:
        assert word in status, status
    if scores is not None:
        got = {q: float(row[q]) for q in scores}
        assert got == scores, status
        assert float(row["total_points_earned"]) == sum(scores.values())
    if not any(w == "TAMPERING" for w in words):
        assert "TAMPERING" not in status


def _outputs(batch, name):
    gs = json.loads((batch["out"] / "gradescope-results" / f"{name[:-6]}.json").read_text())
    return {t["name"]: t["output"] for t in gs["tests"]}


def test_a_cell_that_raised_is_named_with_its_exception_and_line_not_as_undefined(batch):
    """The check finds `y` unset; the student reads why: their cell, their exception, its line,
    and, for the next question that needed `y`, the same for the cell it broke in turn."""
    out = _outputs(batch, "raises.ipynb")
    assert "`y` was never set: your cell that starts `y = jax.device_put(NamedSharding(mesh" \
        in out["q1"] and "raised TypeError" in out["q1"] and "at line 1" in out["q1"], out["q1"]
    assert "not defined yet" not in out["q1"]
    assert "`y_mean` was never set: your cell that starts `y_mean = float(jnp.mean(y))" in \
        out["q3"] and "raised NameError: name 'y' is not defined at line 1" in out["q3"], out["q3"]
    assert "Traceback" not in out["q1"] + out["q3"]


def test_a_cell_stopped_at_the_per_cell_limit_says_so_with_the_line_it_was_waiting_on(batch):
    out = _outputs(batch, "stuck.ipynb")["q1"]
    assert "`y` was never set: your cell that starts `import time` did not finish within the " \
        f"per-cell limit of {SETTINGS['cell_timeout']:g} s and was stopped at line 3 " \
        "(`time.sleep(0.1)`): an endless loop, or a wait that never ends" in out, out


def test_a_cell_skipped_for_killing_the_kernel_is_named_where_a_question_needs_it(batch):
    out = _outputs(batch, "exit_y.ipynb")["q1"]
    assert "`y` was never set: your cell that starts `import os` was not run: in a first run " \
        "it stopped the kernel (the kernel died in cell" in out, out


def test_csv_has_otter_grade_columns_and_points_row(batch):
    df = pd.read_csv(batch["out"] / "final_grades.csv")
    assert list(df.columns) == ["file", "q1", "q2", "q3", "total_points_earned",
                                "percent_correct", "grading_status"]
    first = df.iloc[0]
    assert first["file"] == "points-per-question" and first["grading_status"] == "--"
    assert [first[q] for q in POINTS] == list(POINTS.values())
    assert first["total_points_earned"] == 4 and first["percent_correct"] == 1
    assert list(df["file"][1:]) == sorted(df["file"][1:])


def test_summaries_gradescope_json_and_plot_are_written_per_submission(batch):
    out = batch["out"]
    assert (out / "grading-summaries" / "solution.txt").read_text().startswith(
        "q1 results: All test cases passed!")
    gs = json.loads((out / "gradescope-results" / "wrong.json").read_text())
    assert {t["name"]: t.get("score") for t in gs["tests"] if "max_score" in t} == NONE
    assert (out / "grading-summaries" / "a__same.txt").exists()
    assert (out / "score_distribution.png").stat().st_size > 0


def test_no_process_of_any_submission_survives_the_batch(batch):
    assert psutil.Process().children(recursive=True) == []
    leftovers = [p for p in psutil.process_iter(["cmdline"])
                 if any(MARKER in part for part in (p.info["cmdline"] or []))]
    assert leftovers == []


def test_rerun_skips_graded_submissions_and_regrades_only_missing_ones(batch, lab):
    out, records = batch["out"], batch["out"] / ".jaxlab" / "records"
    before = {p.name: p.stat().st_mtime_ns for p in records.glob("*.json")}
    csv_before = (out / "final_grades.csv").read_text()
    missing = next(p for p in records.glob("*.json")
                   if json.loads(p.read_text())["file"] == "wrong.ipynb")
    missing.unlink()
    assert grade(paths=[str(batch["root"])], output_dir=str(out), autograder=str(lab.autograder),
                 show=False, **SETTINGS)
    after = {p.name: p.stat().st_mtime_ns for p in records.glob("*.json")}
    assert after.keys() == before.keys()
    changed = {n for n in after if after[n] != before.get(n)}
    assert changed == {missing.name}
    assert (out / "final_grades.csv").read_text() == csv_before


@pytest.mark.parametrize("name", ["solution.ipynb", "deleted.ipynb"])
def test_scores_match_otter_run_and_gradescope_json_has_its_shape(batch, lab, name, tmp_path):
    otter = pathlib.Path(sys.executable).with_name("otter")
    subprocess.run([str(otter), "run", "-a", str(lab.autograder), "-o", str(tmp_path),
                    str(batch["made"][name][0])], check=True, capture_output=True)
    theirs = json.loads((tmp_path / "results.json").read_text())
    ours = json.loads((batch["out"] / "gradescope-results" / f"{name[:-6]}.json").read_text())
    assert [t["name"] for t in ours["tests"]] == [t["name"] for t in theirs["tests"]]
    row = batch["df"].loc[name]
    assert {t["name"]: t["score"] for t in theirs["tests"] if "score" in t} == \
        {q: float(row[q]) for q in POINTS}


def test_report_page_in_a_real_browser_has_every_question_and_the_csv_counts(batch, tmp_path):
    from html.parser import HTMLParser
    from urllib.parse import unquote, urlparse

    import matplotlib.image

    import browser

    out = batch["out"]
    page = out / "report.html"
    tree = browser.dom(page)

    class Read(HTMLParser):
        sections, rows, refs = [], [], []

        def handle_starttag(self, tag, attrs):
            a = dict(attrs)
            if "data-question" in a:
                self.sections.append(a)
            if tag == "tr" and "data-file" in a:
                self.rows.append(a["data-file"])
            self.refs += [(tag, k, v) for k, v in attrs if k in ("href", "src")]

    read = Read()
    read.feed(tree)
    df = pd.read_csv(out / "final_grades.csv").set_index("file")
    possible, rows = df.loc["points-per-question"], df.drop("points-per-question")
    assert [s["data-question"] for s in read.sections] == list(POINTS)  # notebook order
    for s in read.sections:
        q = s["data-question"]
        col = rows[q].astype(float)
        assert int(s["data-full-marks"]) == (col >= float(possible[q])).sum(), q
        assert int(s["data-partial"]) == ((col > 0) & (col < float(possible[q]))).sum(), q
        lost = int(s["data-zero"]) + int(s["data-error"]) + int(s["data-timed-out"])
        assert lost == (col == 0).sum(), q
    assert int(read.sections[2]["data-timed-out"]) >= 1  # hang.ipynb, killed on q3
    assert sorted(read.rows) == sorted(rows.index)
    # nothing fetched from anywhere: every reference is a link to a file beside the page
    assert read.refs and all(tag == "a" and k == "href" for tag, k, _ in read.refs)
    for _, _, ref in read.refs:
        if not ref.startswith("#"):
            assert not urlparse(ref).scheme and (out / unquote(ref)).is_file(), ref
    png = browser.screenshot(page, tmp_path / "report.png")
    image = matplotlib.image.imread(png)
    assert image.shape[:2] == (2400, 1200) and image.std() > 0.05
