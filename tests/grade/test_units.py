"""The pieces that stand alone: a session's phases on a tiny notebook, the model, stop reasons."""

import dataclasses
import json
import pathlib
import zipfile

import pandas as pd
import pytest

from jaxlab.grade import grade
from jaxlab.grade.engine.autograder import read_autograder
from jaxlab.grade.engine.kernel import Kernel, kernel_env
from jaxlab.grade.model import EvidenceLayout, Limits, Record, Settings, Stop, StopKind
from jaxlab.grade.engine.sandbox import unavailable_reason
from jaxlab.grade.engine.session import Session

from nbedit import write

LIMITS = Limits(timeout=60, cell_timeout=3, memory_mb=600, output_cap_mb=1)


@pytest.fixture(params=[True, False], ids=["sandboxed", "unsandboxed"])
def kernel(request, tmp_path):
    if request.param:
        assert unavailable_reason() is None
    k = Kernel.start(kernel_env(), tmp_path, cpu=0, sandboxed=request.param)
    yield k
    k.close()


@pytest.mark.slow
def test_session_runs_phases_in_order_and_keeps_state_between_them(kernel, tmp_path):
    with Session(kernel, LIMITS) as s:
        assert s.run(["x = 41", "1 / 0", "import time\nwhile True:\n    time.sleep(0.01)",
                      "x += 1\nprint('x is', x)",
                      "import os\nprint(sorted(os.sched_getaffinity(0)))"], [3, 5, 8, 9, 10])
        reveal = kernel.folder.reveal / "later"
        reveal.mkdir()  # a folder made between phases is seen by the running kernel
        (reveal / "hidden.txt").write_text("revealed")
        assert s.run([f"print(open({str(reveal / 'hidden.txt')!r}).read(), x)"])
    r = s.result
    assert r.stop is None
    assert r.cell_errors == [(5, "ZeroDivisionError: division by zero")]
    assert r.timed_out_cells == [8]
    assert 3 <= r.cell_seconds < r.seconds  # the student's cells only (one ran into its 3 s limit)
    assert r.outputs == [(9, "x is 42\n"), (10, "[0]\n")]  # pinned to the core it was given
    assert [c.outputs[0]["text"] for c in s.nb.cells[-1:]] == ["revealed 42\n"]
    assert kernel.tree() == []  # leaving the session killed the kernel


@pytest.mark.parametrize("source, kind", [
    ("import os\nos._exit(3)", StopKind.DIED),
    ("hog = []\nwhile True:\n    hog.append(bytearray(b'x' * 50 * 2**20))", StopKind.MEMORY),
    # a process the kernel starts later counts too (the watchdog looks for new ones every 1 s)
    ("import subprocess, sys, time\ntime.sleep(1.5)\nsubprocess.run([sys.executable, '-c', "
     "'hog = []\\nwhile True: hog.append(bytearray(50 * 2**20))'])", StopKind.MEMORY),
])
@pytest.mark.slow
def test_session_says_which_cell_stopped_the_kernel_and_why(kernel, source, kind):
    # the hog must reach the cap before the cell limit: first-touch page faults ran at ~60 MiB/s
    # on a loaded 2-core machine here, so the cell gets a minute and the cap is low
    limits = dataclasses.replace(LIMITS, cell_timeout=60, memory_mb=300)
    with Session(kernel, limits) as s:
        assert not s.run(["y = 1", source, "z = 2"], [2, 4, 6])
        assert not s.run(["print('grader')"])  # nothing runs on a dead kernel
    assert s.result.stop.kind is kind and s.result.stop.cell == 4
    assert s.result.stop.is_fault
    assert len(s.nb.cells) == 2


@pytest.mark.slow
def test_session_over_the_submission_timeout_is_a_timeout_stop(kernel):
    limits = dataclasses.replace(LIMITS, timeout=4, cell_timeout=30)
    with Session(kernel, limits) as s:
        s.run(["import time\ntime.sleep(60)"], [7])
    assert s.result.stop == Stop(StopKind.TIMEOUT, 7, False, "")
    assert not s.result.stop.is_fault


def test_stop_reasons_in_words_and_which_are_faults():
    assert Stop(StopKind.TIMEOUT, 3).describe(60) == "ran over 60 s in cell 3 and was killed"
    assert Stop(StopKind.DIED, None, True).describe(60) == \
        "the kernel died while the grader read the answers"
    assert Stop(StopKind.MEMORY, 2, detail="memory use 9 MiB").describe(1) == \
        "killed in cell 2: memory use 9 MiB"
    assert Stop(StopKind.PROCESSES, 5, detail="it tried to run more").describe(1) == \
        "killed in cell 5: it tried to run more"
    assert [Stop(k, 1).is_fault for k in StopKind] == [False, True, True, False, True]
    assert not Stop(StopKind.DIED, None, True).is_fault  # no student cell to skip


def test_record_and_settings_survive_a_round_trip_through_json(tmp_path):
    stop = Stop(StopKind.MEMORY, 12, False, "memory use 5000 MiB went over the cap")
    record = Record("a/sub.ipynb", "ab" * 32, status="Completed", outcomes={"q1": "pass"},
                    questions={"q1": {"path": "q1.py", "all_or_nothing": False, "cases": []}},
                    flags=["x"], stop=None, skipped={"cell": 12, "reason": stop},
                    sandboxed=True, peak_mb=800, seconds=3.5,
                    phases={"student": 2.5, "probe": 0.5}, cell_seconds=2.4)
    record.write(tmp_path / "r.json")
    assert Record.read(tmp_path / "r.json") == record
    assert json.loads((tmp_path / "r.json").read_text())["skipped"]["reason"]["kind"] == "memory"
    settings = Settings("/ag", {"/ag/x.py": "00"}, "/scratch", LIMITS, sandboxed=True, cpu=1,
                        cache_dir="/cache")
    assert Settings.from_json(settings.to_json()) == settings


def test_evidence_layout_names_what_the_grader_did_not_write(tmp_path):
    layout = EvidenceLayout(tmp_path)
    for path in (layout.probe("q1"), layout.probe("q1").with_suffix(".npz"), layout.claim("q2"),
                 tmp_path / "results.json"):
        path.write_text("{}")
    assert layout.strangers(["q1", "q2"]) == ["results.json"]


def test_checks_module_is_recognised_by_its_declared_marker_only(lab, tmp_path):
    with zipfile.ZipFile(lab.autograder) as zf:
        zf.extractall(tmp_path / "ag")
    assert read_autograder(tmp_path / "ag").checks_module == "jaxlab_fixture"
    path = tmp_path / "ag" / "files" / "jaxlab_fixture.py"
    path.write_text(path.read_text().replace("JAXLAB_CHECKS = 1", "# JAXLAB_CHECKS = 1"))
    assert read_autograder(tmp_path / "ag").checks_module is None


def test_notebook_of_another_assignment_gets_a_clear_row_not_zeros(lab, tmp_path):
    nb = lab.notebook()
    nb.metadata["otter"]["assignment_name"] = "lab4-shard-map"
    write(nb, tmp_path / "subs" / "other.ipynb")
    write(lab.notebook(), tmp_path / "subs" / "right.ipynb")
    assert grade(paths=[str(tmp_path / "subs")], output_dir=str(tmp_path / "out"),
                 autograder=str(lab.autograder), show=False, workers=1, timeout=60)
    df = pd.read_csv(tmp_path / "out" / "final_grades.csv").set_index("file")
    assert df.loc["other.ipynb", "grading_status"] == (
        "this notebook is for assignment 'lab4-shard-map', but the autograder grades "
        "'fixture'; grade it with that assignment's autograder")
    assert df.loc["right.ipynb", "total_points_earned"] == 4


def test_a_python_environment_under_tmp_is_still_there_inside_the_sandbox(monkeypatch):
    """CI may check the repository out under /tmp: the sandbox's own /tmp must not hide it."""
    import subprocess
    import tempfile

    from jaxlab.grade.engine import sandbox

    with tempfile.TemporaryDirectory(dir="/tmp") as env, \
            tempfile.TemporaryDirectory(dir="/tmp") as root:
        tool = pathlib.Path(env) / "bin" / "hello"
        tool.parent.mkdir()
        tool.write_text("#!/bin/sh\necho hello from the environment\n")
        tool.chmod(0o755)
        monkeypatch.setattr(sandbox, "python_dirs",
                            lambda dirs=sandbox.python_dirs(): [*dirs, pathlib.Path(env)])
        folder = sandbox.KernelFolder.create(root)
        run = subprocess.run([*sandbox.bwrap_argv(folder), str(tool)], capture_output=True,
                             text=True, timeout=60)
    assert run.stdout == "hello from the environment\n", run.stderr


def test_kernels_read_the_cache_and_only_the_warm_up_may_write_it(tmp_path):
    from jaxlab.grade.engine import sandbox
    from jaxlab.grade.engine.kernel import NEVER_WRITE_S

    read = kernel_env(tmp_path)
    assert read["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path)
    assert read["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == NEVER_WRITE_S
    assert kernel_env(tmp_path, cache_writable=True)[
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] == "0"
    # the path of the folder must not enter JAX's cache keys (see test_warmup.py)
    assert read["JAX_PERSISTENT_CACHE_ENABLE_XLA_CACHES"] == "none"
    assert not any(k.startswith("JAX_COMPILATION") for k in kernel_env(None))
    folder = sandbox.KernelFolder.create(tmp_path)
    argv = sandbox.bwrap_argv(folder, cache_dir=tmp_path)
    assert argv[argv.index(str(tmp_path)) - 1] == "--ro-bind"
    argv = sandbox.bwrap_argv(folder, cache_dir=tmp_path, cache_writable=True)
    assert argv[argv.index(str(tmp_path)) - 1] == "--bind"


def test_the_warm_up_notebook_is_the_solution_shipped_beside_the_zip(tmp_path, monkeypatch):
    from jaxlab.grade.engine import warmup

    (tmp_path / "autograder").mkdir()
    zip_path = tmp_path / "autograder" / "lab9-x-autograder.zip"
    zip_path.write_bytes(b"zip")
    assert warmup.shipped_solution(zip_path) is None
    solution = tmp_path / "solutions" / "lab9-x" / "lab9-x.ipynb"
    solution.parent.mkdir(parents=True)
    solution.write_text("{}")
    assert warmup.shipped_solution(zip_path) == solution
    monkeypatch.setenv("JAXLAB_CACHE_DIR", str(tmp_path / "c"))
    first = warmup.folder_for(zip_path)
    assert first.parent == tmp_path / "c" / "compile-cache"
    zip_path.write_bytes(b"another zip")
    assert warmup.folder_for(zip_path) != first  # a rebuilt autograder warms again


def test_the_sandbox_hides_the_package_that_holds_the_hidden_checks():
    from jaxlab.grade.engine.sandbox import hidden_package_dirs

    assert any((d / "checks" / "lab3.py").is_file() and (d / "grade").is_dir()
               for d in hidden_package_dirs()), hidden_package_dirs()


def test_the_shipped_autograders_are_found_from_any_folder(tmp_path, monkeypatch):
    from jaxlab.grade.engine.autograder import shipped_autograder

    monkeypatch.chdir(tmp_path)  # no autograder/ here: the checkout's own
    root = pathlib.Path(__file__).resolve().parents[2]
    assert shipped_autograder("lab3-parallelism") == \
        root / "autograder" / "lab3-parallelism-autograder.zip"


def test_the_sandbox_host_name_resolves_to_its_own_loopback(tmp_path):
    """gloo (JAX's collectives between processes on CPU) listens on the address of the host
    name; inside the sandbox there is no DNS, so its own /etc/hosts must name it."""
    import subprocess
    import sys

    from jaxlab.grade.engine import sandbox

    reason = sandbox.unavailable_reason()
    if reason:
        pytest.skip(reason)
    folder = sandbox.KernelFolder.create(tmp_path)
    code = "import socket; print(socket.gethostname(), socket.gethostbyname(socket.gethostname()))"
    run = subprocess.run([*sandbox.bwrap_argv(folder), sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == [sandbox.SANDBOX_HOSTNAME, "127.0.0.1"], run.stderr


def test_a_claim_that_disagrees_is_tampering_except_where_the_verdict_rests_on_timings(tmp_path):
    """Lab 3's q9 times calls: the kernel's own check times again, so its passing claim beside a
    failing verdict is load; on q1 the same disagreement is flagged. Points follow the verdict."""
    from jaxlab.checks import lab3
    from jaxlab.grade.engine import judge

    root = pathlib.Path(__file__).resolve().parents[2]
    with zipfile.ZipFile(root / "autograder" / "lab3-parallelism-autograder.zip") as zf:
        zf.extractall(tmp_path / "ag")
    autograder = read_autograder(tmp_path / "ag")
    layout = EvidenceLayout(tmp_path / "evidence")
    layout.folder.mkdir()
    claimed = ["q1_device_put", "q9_timing"]
    for q in claimed:
        cases = [[True, ""] for _ in autograder.tests[q].test_cases]
        layout.claim(q).write_text(json.dumps({"cases": cases}))
    decided = judge.verdicts(autograder, lab3, layout)  # no probe evidence: every verdict fails
    assert [q for q, v in decided.items() if v.measured] == ["q9_timing"] == list(lab3.MEASURED)
    judgement = judge.score(autograder, decided, layout)
    assert judgement.flags == [
        "the kernel reported q1_device_put as passed but the trusted check failed"]
    points = {tf.name: sum(tc.points or 0 for tc, r in zip(tf.test_cases, tf.test_case_results)
                           if r.passed) for tf in judgement.test_files}
    assert points["q1_device_put"] == points["q9_timing"] == 0


def test_a_check_that_raises_is_a_grader_error_never_tampering(tmp_path):
    """A trusted verdict that raises something other than its AssertionError is the grader's
    fault (seen: a bfloat16 loss the evidence could not carry): the question scores zero with
    a message that says so, the status says GRADER ERROR, and the kernel's passing claim beside
    it is no sign of tampering. A failing verdict beside the same claim still is."""
    import types

    from jaxlab.checks import form
    from jaxlab.grade.engine import judge
    from jaxlab.grade.engine.worker import _status
    from jaxlab.grade.engine.session import Execution
    from jaxlab.grade.model import Record

    root = pathlib.Path(__file__).resolve().parents[2]
    with zipfile.ZipFile(root / "autograder" / "lab3-parallelism-autograder.zip") as zf:
        zf.extractall(tmp_path / "ag")
    autograder = read_autograder(tmp_path / "ag")
    layout = EvidenceLayout(tmp_path / "evidence")
    layout.folder.mkdir()
    broken, wrong = "q1_device_put", "q3_partition_specs"

    def verdict(q, ev):
        if q == broken:
            float(b"j@")  # ValueError, as the bfloat16 evidence once gave
        raise AssertionError("`x` has the wrong values")

    checks = types.SimpleNamespace(QUESTIONS={broken: None, wrong: None}, verdict=verdict)
    for q in (broken, wrong):
        form.dump_evidence({"evidence": {}, "equal_to_anything": []}, layout.probe(q))
        cases = [[True, ""] for _ in autograder.tests[q].test_cases]
        layout.claim(q).write_text(json.dumps({"cases": cases}))
    decided = judge.verdicts(autograder, checks, layout)
    assert decided[broken].outcome == "error" and decided[broken].grader_error.startswith(
        "ValueError: could not convert")
    assert "error in the grader, not in your answer" in decided[broken].message
    assert "j@" not in decided[broken].message  # no internals for the student
    judgement = judge.score(autograder, decided, layout)
    assert judgement.flags == [f"the kernel reported {wrong} as passed but the trusted check failed"]
    assert judgement.grader_errors == [f"{broken} ({decided[broken].grader_error})"]
    record = Record(file="x.ipynb", sha256="", flags=judgement.flags,
                    grader_errors=judgement.grader_errors)
    status = _status(Execution(), record, 600, tamper_checked=True)
    assert f"GRADER ERROR (not the student's): the check of {broken} (ValueError" in status
    assert f"TAMPERING SUSPECTED: the kernel reported {wrong} as passed" in status
    assert Record.from_dict(json.loads(json.dumps(record.to_dict()))).grader_errors == \
        record.grader_errors


def test_reaping_orphans_spares_the_whole_tree_of_the_next_kernel_even_what_it_forks_later():
    """The worker kills every process left from a job except the next, prestarted kernel. That
    kernel may still be starting (bwrap forks, then the kernel): a child it forks after the
    worker looked must be spared too, and an orphan of the job must not."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from jaxlab.grade.engine import process

    starting = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, time\ntime.sleep(1)\n"
         "subprocess.Popen(['sleep', '30'])\ntime.sleep(30)"], start_new_session=True)
    orphan = subprocess.Popen(["sleep", "30"])
    try:
        assert psutil.Process(starting.pid).children() == []  # it has not forked yet
        time.sleep(2)
        late = psutil.Process(starting.pid).children()
        assert len(late) == 1  # and now it has
        found = {p.pid for p in process.descendants(spare={starting.pid})}
        assert orphan.pid in found
        assert starting.pid not in found and late[0].pid not in found
    finally:
        os.killpg(starting.pid, signal.SIGKILL)
        orphan.kill()
        starting.wait()
        orphan.wait()


def test_a_broken_cell_explains_the_questions_whose_names_it_assigns_and_no_other():
    from jaxlab.grade.engine import blame
    from jaxlab.grade.engine.judge import Verdict
    from jaxlab.grade.engine.session import CellFault, traceback_line

    tb = ["\x1b[36mCell\x1b[39m\x1b[36m \x1b[39m\x1b[32mIn[7]\x1b[39m\x1b[32m, line 2\x1b[39m\n",
          "\x1b[36mCell\x1b[39m In[3], line 9, in f\n"]
    assert traceback_line(tb) == 2 and traceback_line(["no cell here"]) is None
    cells = [(4, "### Your code here\nA = jax.device_put(s, A0)\n"), (6, "B = A + 1\n"),
             (8, "C = 3\n")]
    faults = {4: CellFault("raised", "TypeError: bad", traceback_line(tb)),
              8: CellFault("timed out", line=1, seconds=20)}
    decided = {
        "q1": Verdict(False, "`A` is not defined yet", "fail", undefined="A"),
        "q2": Verdict(False, "`B` has the wrong values", "fail"),
        "q3": Verdict(True, None, "pass"),
        "q4": Verdict(False, "`C` is 3", "fail"),
    }
    names = {"q1": ("A",), "q2": ("B",), "q3": ("C",), "q4": ("A", "C")}
    labels = {4: "your answer cell for q1", 6: "your cell that starts `B = A + 1`",
              8: "your cell that starts `C = 3`"}
    out = blame.explain(decided, faults, cells, names, labels)
    assert out["q1"].message == (
        "`A` was never set: your answer cell for q1 raised TypeError: bad at line 2 "
        "(`A = jax.device_put(s, A0)`). Fix that and run the cell again; then run this check.")
    assert out["q2"] == decided["q2"]  # its own cell ran; what it computed is its message
    assert out["q3"] == decided["q3"]  # passed: nothing to explain
    assert out["q4"].message.startswith(
        "Your cell that starts `C = 3` did not finish within the per-cell limit of 20 s and was "
        "stopped at line 1 (`C = 3`): an endless loop") and \
        out["q4"].message.endswith("Then the check found: `C` is 3")
