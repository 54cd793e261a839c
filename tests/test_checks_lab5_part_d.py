"""Lab 5 Part D (q9_multi_process): the checks run a student's training script again as two
processes joined by jax.distributed, and judge what it did.

Most wrong scripts are graded through the answer corpus (tests/answers/lab5-scaling); this file
checks what the corpus cannot: that the trusted reference is the lab's recipe, that the re-run
stops hanging or failing processes, that it works inside the grading sandbox on one core, and
that the notebook's own `launch` reports what went wrong.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time
import types

import nbformat
import numpy as np
import psutil
import pytest
import yaml

from jaxlab.checks import lab5
from labs import ROOT, release_paths

pytestmark = pytest.mark.slow  # two processes per test (gloo), some in the sandbox

LAB = "lab5-scaling"
CORPUS = yaml.safe_load((ROOT / "tests" / "answers" / LAB / "q9_multi_process.yaml").read_text())


def corpus_script(kind, name):
    """The `train_script` of one answer of the corpus."""
    entry = next(a for a in CORPUS[kind] if a["name"] == name)
    scope = {}
    exec(entry["code"], scope)
    return scope["train_script"]


def verdict_message(ev):
    try:
        lab5.verdict("q9_multi_process", ev)
    except AssertionError as exc:
        return str(exc)
    return None


def master_cells():
    return [c.source for c in nbformat.read(release_paths(LAB)["master"], as_version=4).cells
            if c.cell_type == "code"]


_EARLIER = set()


@pytest.fixture(autouse=True)
def _earlier_processes():
    """Children of this test process from before the test (other tests' kernels, in a full run)."""
    _EARLIER.clear()
    _EARLIER.update(p.pid for p in psutil.Process().children(recursive=True))


def leftover_processes():
    """Processes the test started that are still running."""
    return [p for p in psutil.Process().children(recursive=True) if p.pid not in _EARLIER
            and p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


# --------------------------------------------------------------------------- the reference
def test_the_checks_write_the_model_module_the_notebook_writes():
    cell = next(s for s in master_cells() if s.startswith("%%writefile pd_model.py\n"))
    assert cell.split("\n", 1)[1].strip() == lab5.PD_MODEL_SOURCE.strip()


def test_reference_is_single_process_training_of_the_lab_recipe():
    """float64 NumPy backpropagation = jax.grad of pd_model.loss, trained as pd_train_step
    trains (float32 on one device), within the tolerance; the nearest wrong trainings are far."""
    import jax

    model = types.ModuleType("pd_model")
    exec(lab5.PD_MODEL_SOURCE, model.__dict__)
    x, y, init = lab5._pd_fresh_data(np.random.default_rng(7))
    params = [(init[f"W{i}"], init[f"b{i}"]) for i in range(3)]
    assert [p[0].shape[1] for p in params] == model.LAYER_SIZES[1:]
    assert (model.STEPS, model.STEP_SIZE) == (lab5.PD_STEPS, lab5.PD_STEP_SIZE)

    @jax.jit
    def step(params, x, y):
        grads = jax.grad(model.loss)(params, x, y)
        return [(W - model.STEP_SIZE * dW, b - model.STEP_SIZE * db)
                for (W, b), (dW, db) in zip(params, grads)]

    trained = params
    for _ in range(model.STEPS):
        trained = step(trained, x, y)
    expected = lab5._pd_reference(params, x, y)
    assert lab5._pd_close_to([tuple(np.asarray(a) for a in p) for p in trained], expected)
    share = len(x) // 2
    for wrong in (lab5._pd_reference(params, x[:share], y[:share]),
                  lab5._pd_reference(params, x[share:], y[share:]),
                  lab5._pd_reference(params, x, y, step_size=8 * lab5.PD_STEP_SIZE),
                  lab5._pd_reference(params, x, y, steps=lab5.PD_STEPS - 1)):
        gap = max(np.abs(a - b).max() for p, q in zip(wrong, expected) for a, b in zip(p, q))
        assert gap > 100 * lab5.PD_TRAIN_ATOL


# --------------------------------------------------------------------------- the re-run
def test_a_correct_script_passes_and_the_records_show_what_each_process_did():
    ev = lab5.probe("q9_multi_process", {"train_script": corpus_script("correct", "lab_recipe")})
    fresh = ev["fresh"]
    assert verdict_message(ev) is None
    assert fresh["returncodes"] == [0, 0] and not fresh["timed_out"]
    n = lab5.PD_FRESH_ROWS
    for i, record in enumerate(fresh["records"]):
        assert len(record["initialize"]) == 1
        assert record["at_exit"] == {"process_index": i, "process_count": 2, "device_count": 8,
                                     "local_device_count": 4}
        x_call, y_call = record["local_data"]
        assert x_call["shape"] == [n // 2, 1] and x_call["global_shape"] == [n, 1]
        assert x_call["values"] == fresh["x"][i * n // 2:(i + 1) * n // 2, 0].tolist()
        assert x_call["processes"] == [0, 1] and x_call["shard_shape"] == [n // 8, 1]
    assert fresh["records"][0]["writes"] and not fresh["records"][1]["writes"]
    for record in fresh["records"]:  # step 1's settings before initialize, step 4's placement
        assert [(c["name"], c["value"], c["after_initialize"]) for c in record["config"]][:2] == [
            ("jax_num_cpu_devices", "4", False),
            ("jax_cpu_collectives_implementation", "'gloo'", False)]
        # JAX's own calls place leaves on one local device first (on the mesh: 8 devices)
        placed = [x for call in record["placed"] for x in call if x["devices"] == 8]
        assert {tuple(x["shape"]) for x in placed} >= {(1, 64), (64,), (64, 64), (64, 1), (1,)}
        assert all(x["replicated"] and x["processes"] == [0, 1] for x in placed)
    assert fresh["records"][1]["printed"] == ""
    assert not leftover_processes()


def test_a_script_that_hangs_is_stopped_at_the_timeout_with_both_processes(monkeypatch):
    monkeypatch.setattr(lab5, "PD_TIMEOUT", 4)
    script = "import time\nprint('waiting', flush=True)\ntime.sleep(600)\n"
    start = time.monotonic()
    ev = lab5.probe("q9_multi_process", {"train_script": script})
    assert time.monotonic() - start < 30
    assert ev["fresh"]["timed_out"] and ev["fresh"]["still_running"] == [0, 1]
    message = verdict_message(ev)
    assert message.startswith("`train_script` was still running after 4 s on new data")
    assert "process 0 last printed 'waiting'" in message
    assert not leftover_processes()


def test_when_one_process_fails_the_other_is_stopped_and_the_error_named():
    script = textwrap.dedent("""\
        import sys, time
        if sys.argv[3] == "1":
            raise ValueError("no data for this process")
        time.sleep(600)  # process 0 would wait for ever for process 1
        """)
    start = time.monotonic()
    ev = lab5.probe("q9_multi_process", {"train_script": script})
    assert time.monotonic() - start < lab5.PD_GRACE + 20
    assert ev["fresh"]["first_failed"] == 1 and not ev["fresh"]["timed_out"]
    message = verdict_message(ev)
    assert "process 1 (started as `python pd_train.py COORDINATOR 2 1 DATA_FILE OUT_FILE`) " \
           "stopped with `ValueError: no data for this process` (line 3 of your script)" in message
    assert "Traceback" not in message and 'File "' not in message
    assert not leftover_processes()


def test_a_process_that_leaves_without_python_exiting_is_reported():
    script = "import os\nos._exit(0)\n"
    message = verdict_message(lab5.probe("q9_multi_process", {"train_script": script}))
    assert message.startswith("`train_script`: process 0 ended without exiting normally")


def test_the_error_of_a_chained_traceback_and_its_line_in_the_script():
    folder = "/tmp/jaxlab-q9-abc"
    log = textwrap.dedent(f"""\
        step 0
        Traceback (most recent call last):
          File "{folder}/pd_boot.py", line 80, in <module>
            runpy.run_path(script, run_name="__main__")
          File "{folder}/pd_train.py", line 17, in <module>
            x = jax.make_array_from_process_local_data(rows, x_local)
        jax.errors.SimplifiedTraceback: For simplicity, JAX has removed its internal frames.

        The above exception was the direct cause of the following exception:

        Traceback (most recent call last):
          File "{folder}/pd_train.py", line 17, in <module>
            x = jax.make_array_from_process_local_data(rows, x_local)
        ValueError: Unable to compute global shape
        """)
    assert lab5._pd_error_of(log, folder) == ("`ValueError: Unable to compute global shape`", 17)
    assert lab5._pd_error_of("F0000 check failed: gloo\n", folder) == \
        ("`F0000 check failed: gloo`", None)
    jax_note = textwrap.dedent(f"""\
        Traceback (most recent call last):
          File "{folder}/pd_train.py", line 24, in <module>
            params = jax.device_put(params, replicated)
        jax.errors.JaxRuntimeError: INVALID_ARGUMENT: Multiprocess computations aren't implemented
        --------------------
        For simplicity, JAX has removed its internal frames from the traceback of the following
        """)
    assert lab5._pd_error_of(jax_note, folder) == (
        "`jax.errors.JaxRuntimeError: INVALID_ARGUMENT: Multiprocess computations aren't "
        "implemented`", 24)


def test_rows_a_process_passed_are_said_in_words():
    assert lab5._pd_rows_words(list(range(160, 320)), 160) == "rows 160 to 319"
    assert lab5._pd_rows_words(list(range(1, 320, 2)), 160) == \
        "every second row from row 1 (1, 3, ...)"
    assert lab5._pd_rows_words(list(range(159, -1, -1)), 160) == \
        "rows 159 down to 0 (in reverse order)"
    assert lab5._pd_rows_words([3, 0, 1, 2], 4) == "rows 3, 0, 1, 2, ... (not rows in order)"


def test_fresh_data_holds_every_value_once_so_rows_read_back_from_values():
    for seed in range(20):
        x, y, _ = lab5._pd_fresh_data(np.random.default_rng(seed))
        assert len(np.unique(x)) == len(x) == lab5.PD_FRESH_ROWS
        assert len(np.unique(y)) == len(y)
        call = {"values": x[10:20, 0].tolist()}
        assert lab5._pd_rows_of(call, x) == list(range(10, 20))


def test_gloo_between_two_processes_works_inside_the_grading_sandbox_on_one_core(tmp_path):
    """jaxlab grade's bubblewrap sandbox: no network but its own loopback, its own host name,
    one core. The checks run there as the flat modules of the autograder zip."""
    from jaxlab.grade.engine import sandbox

    reason = sandbox.unavailable_reason()
    if reason:
        pytest.skip(reason)
    folder = sandbox.KernelFolder.create(tmp_path)
    shutil.copy(lab5.__file__, folder.work / "jaxlab_lab5.py")
    shutil.copy(lab5.form.__file__, folder.work / "jaxlab_form.py")
    (folder.work / "script.py").write_text(corpus_script("correct", "lab_recipe"))
    check = ("import jaxlab_lab5, pathlib\n"
             "ev = jaxlab_lab5.probe('q9_multi_process', "
             "{'train_script': pathlib.Path('script.py').read_text()})\n"
             "print(ev['fresh']['returncodes'], ev['fresh']['logs'][0][-300:])\n"
             "jaxlab_lab5.verdict('q9_multi_process', ev)\nprint('passed')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "XLA_"))}
    run = subprocess.run([*sandbox.bwrap_argv(folder, cpu=0), sys.executable, "-c", check],
                         capture_output=True, text=True, timeout=300, env=env)
    assert run.stdout.strip().endswith("passed"), run.stdout[-2000:] + run.stderr[-2000:]


# --------------------------------------------------------------------------- the notebook
@pytest.fixture()
def notebook_launch(tmp_path, monkeypatch):
    """The notebook's `launch`, defined by its own cell, in a folder of its own."""
    monkeypatch.chdir(tmp_path)
    cell = next(s for s in master_cells() if "def launch(" in s)
    scope = {}
    exec(cell, scope)
    return scope


def test_the_notebook_launch_returns_what_each_process_printed(notebook_launch, tmp_path):
    (tmp_path / "hi.py").write_text(
        "import sys\nprint('[Gloo] Rank 0 is connected to 7 peer ranks. Expected number of "
        "connected peer ranks is : 7')\n"
        "print('[Gloo] Rank 0 is connected to 1')\nprint(' peer ranks. ')\n"  # cut by a newline
        "print(sys.argv[1:])\n")
    outputs = notebook_launch["launch"]("hi.py", "a", 7)
    assert [o.splitlines()[-1].split(", ")[1:] for o in outputs] == \
        [["'2'", "'0'", "'a'", "'7']"], ["'2'", "'1'", "'a'", "'7']"]]
    assert all("Gloo" not in o and o.startswith("['127.0.0.1:") for o in outputs)


def test_the_notebook_launch_reports_a_failure_and_stops_the_rest(notebook_launch, tmp_path):
    (tmp_path / "bad.py").write_text(
        "import sys, time\nif sys.argv[3] == '1':\n    raise KeyError('x')\ntime.sleep(600)\n")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        notebook_launch["launch"]("bad.py")
    assert time.monotonic() - start < notebook_launch["PD_GRACE"] + 20
    text = str(info.value)
    assert "did not all succeed" in text
    assert "process 1: failed with exit code 1" in text and "KeyError: 'x'" in text
    assert "process 0: stopped: still running" in text
    assert not leftover_processes()


def test_the_notebook_launch_says_when_this_machine_has_no_address(notebook_launch, tmp_path):
    """gloo looks up the machine's own name; where it has no address (a chroot, some containers)
    the processes fail with `gloo/transport/tcp/device.cc:99 rv == 0`: say what to fix."""
    import socket

    def no_address(host, *args, **kwargs):
        if host == "student-box":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return socket.getaddrinfo(host, *args, **kwargs)

    notebook_launch["socket"] = types.SimpleNamespace(
        **{**vars(socket), "gethostname": lambda: "student-box", "getaddrinfo": no_address})
    (tmp_path / "bad.py").write_text("raise SystemExit(1)\n")
    with pytest.raises(RuntimeError) as info:
        notebook_launch["launch"]("bad.py")
    assert "add the line `127.0.0.1 student-box` to /etc/hosts" in str(info.value)
    notebook_launch["socket"] = socket  # where the name resolves, no such advice
    with pytest.raises(RuntimeError) as info:
        notebook_launch["launch"]("bad.py")
    assert "/etc/hosts" not in str(info.value)


def test_the_notebook_launch_stops_both_at_its_timeout(notebook_launch, tmp_path):
    (tmp_path / "slow.py").write_text("import time\nprint('started', flush=True)\n"
                                      "time.sleep(600)\n")
    with pytest.raises(RuntimeError) as info:
        notebook_launch["launch"]("slow.py", timeout=3)
    text = str(info.value)
    assert "were not all done after 3 s" in text and text.count("stopped: still running") == 2
    assert "started" in text
    assert not leftover_processes()


def test_gloo_chatter_goes_however_its_threads_interleave_it(notebook_launch, tmp_path):
    """gloo writes each connection message a piece at a time from several threads (seen in a
    release: '[Gloo] Rank \\n5 is connected to 7 peer ranks. '): every interleaving of four
    threads' pieces between two of the script's lines leaves exactly the script's lines."""
    import random

    rng = random.Random(0)
    wanted = "process 1: before\nprocess 1: after 52\n12 rows\n"
    for trial in range(2000):
        pieces = [["[Gloo] Rank ", str(rank), " is connected to ", "7", " peer ranks. ",
                   "Expected number of connected peer ranks is : ", "7", "\n"]
                  for rank in range(4, 8)]
        chatter = []
        while any(pieces):
            chatter.append(rng.choice([p for p in pieces if p]).pop(0))
        text = "process 1: before\n" + "".join(chatter) + "process 1: after 52\n12 rows\n"
        assert notebook_launch["pd_quiet"](text) == wanted, text
        log = tmp_path / "log.txt"
        log.write_text(text)
        assert lab5._pd_read_log(log) == wanted, text


def test_a_process_that_raised_is_named_before_one_the_runtime_aborted_first():
    """Which process exits first is a race: under load the runtime aborts one (signal 6) when
    its peer fails, sometimes before the peer has printed why. The message names the exception."""
    script = textwrap.dedent("""\
        import os, sys, time
        if sys.argv[3] == "0":
            os.abort()
        time.sleep(1)
        raise ValueError("no data for this process")
        """)
    ev = lab5.probe("q9_multi_process", {"train_script": script})
    assert ev["fresh"]["first_failed"] == 0 and ev["fresh"]["returncodes"] == [-6, 1]
    message = verdict_message(ev)
    assert "process 1 (started as `python pd_train.py COORDINATOR 2 1 DATA_FILE OUT_FILE`) " \
           "stopped with `ValueError: no data for this process` (line 5 of your script)" in message
    assert not leftover_processes()


def test_an_exception_followed_by_a_long_native_crash_dump_is_still_what_the_log_keeps(tmp_path):
    """Under load the runtime aborts a process after it raised (signal 6): the native stack dump
    after the exception is longer than the tail the checks keep, and it says nothing."""
    folder = "/tmp/jaxlab-q9-abc"
    log = textwrap.dedent(f"""\
        step 0
        Traceback (most recent call last):
          File "{folder}/pd_train.py", line 24, in <module>
            params = jax.device_put(params, replicated)
          File "/venv/lib/python3.11/site-packages/jax/_src/api.py", line 2650, in device_put
            return _device_put(x)
        jax.errors.JaxRuntimeError: INVALID_ARGUMENT: Multiprocess computations aren't implemented
        --------------------
        For simplicity, JAX has removed its internal frames from the traceback of the following
        """) + "*** SIGABRT received at time=1764123456 on cpu 1 ***\n" + \
        "".join(f"PC: @     0x7f2b478a{i:04x}  (unknown)\n" for i in range(lab5.PD_LOG_TAIL // 20))
    path = tmp_path / "process-0.log"
    path.write_text(log)
    kept = lab5._pd_read_log(path)
    assert len(kept) <= lab5.PD_LOG_TAIL
    assert lab5._pd_error_of(kept, folder) == (
        "`jax.errors.JaxRuntimeError: INVALID_ARGUMENT: Multiprocess computations aren't "
        "implemented`", 24)
    short = "step 0\nstep 1\n"
    path.write_text(short)
    assert lab5._pd_read_log(path) == short


def test_a_warm_compilation_cache_does_not_change_what_a_script_without_gloo_is_told(
        monkeypatch, tmp_path):
    """JAX's cache key leaves out the CPU collectives: a script without gloo that loaded the
    lab recipe's cached executables aborted (signal 6) instead of raising. The processes run
    without the kernel's cache."""
    for name, value in {"JAX_COMPILATION_CACHE_DIR": str(tmp_path),
                        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1"}.items():
        monkeypatch.setenv(name, value)
    recipe = lab5.probe("q9_multi_process", {"train_script": corpus_script("correct", "lab_recipe")})
    assert recipe["fresh"]["returncodes"] == [0, 0]
    ev = lab5.probe("q9_multi_process",
                    {"train_script": corpus_script("wrong", "no_cpu_collectives")})
    assert "needs the gloo collectives to compute across processes" in verdict_message(ev)


def test_a_pair_waiting_for_each_other_is_stopped_once_it_uses_no_cpu(monkeypatch):
    """Both processes idle (here asleep; in a real script, each in a collective the other never
    joins) are stuck: stopped after PD_STUCK_SECONDS without CPU, well before PD_TIMEOUT."""
    script = "import time\nprint('waiting', flush=True)\ntime.sleep(600)\n"
    start = time.monotonic()
    ev = lab5.probe("q9_multi_process", {"train_script": script})
    took = time.monotonic() - start
    assert lab5.PD_STUCK_SECONDS <= took < lab5.PD_STUCK_SECONDS + 20 < lab5.PD_TIMEOUT
    fresh = ev["fresh"]
    assert fresh["stuck"] >= lab5.PD_STUCK_SECONDS and not fresh["timed_out"]
    assert fresh["still_running"] == [0, 1]
    message = verdict_message(ev)
    assert message.startswith("`train_script` got stuck on new data")
    assert "both processes had used no CPU for" in message and "were stopped" in message
    assert "process 0 last printed 'waiting'" in message
    assert not leftover_processes()


def test_a_busy_pair_is_not_stuck():
    script = ("import time\nend = time.monotonic() + 2 * " + str(lab5.PD_STUCK_SECONDS) +
              "\nwhile time.monotonic() < end:\n    pass\n")
    ev = lab5.probe("q9_multi_process", {"train_script": script})
    assert ev["fresh"]["returncodes"] == [0, 0] and not ev["fresh"]["stuck"]
