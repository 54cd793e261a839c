"""Issue 16's resource attacks, each from a graded notebook, in one batch with two honest
submissions: a fork bomb, a thread flood, a child process that widens its CPU affinity, and a
disk filler. Each is contained, its row says why, the honest rows grade in full with no
"grader error", nothing of the batch is left running and the disk space comes back.

The fork bomb and the thread flood replace the q3 answer cell (attack, then the answer): the
kernel is stopped at the process cap and graded again without that cell, so they cost q3 and
nothing else. The affinity and disk attacks sit after the q3 answer and spoil it unless they
worked (tests/grade/attacks.py's pattern), so q3 scores only for an attack that got through.
"""

import os
import pathlib
import shutil
import subprocess
import tempfile

import nbformat
import pandas as pd
import psutil
import pytest

from jaxlab.grade import grade
from jaxlab.grade.engine.cgroup import BATCH_PREFIX, Parent, unavailable_reason as no_cgroups
from jaxlab.grade.engine import sandbox
from jaxlab.grade.engine.sandbox import KernelFolder, disk_cap_reason

from attacks import CELL
from nbedit import answer_cell, write

pytestmark = pytest.mark.slow  # kernels, sandboxes or services: not in make test-quick

DISK_MB = 64  # small, so that the filler hits it in well under a second
SETTINGS = dict(workers=2, timeout=120, cell_timeout=60, memory_mb=1500, disk_mb=DISK_MB)
FULL = {"q1": 2.0, "q2": 1.0, "q3": 1.0}
LOST_Q3 = {"q1": 2.0, "q2": 1.0, "q3": 0.0}
ANSWER = "y_mean = float(jnp.mean(y))"
NOBODY = 65534

# replace the q3 answer cell: the attack, then the answer
FORK_BOMB = """\
import subprocess, time
subprocess.Popen(["bash", "-c", "bomb() { bomb | bomb & }; bomb"])  # jaxlab-fork-bomb
time.sleep(5)
"""
THREAD_FLOOD = """\
import threading, time
stop = threading.Event()
threads = []
for _ in range(5000):
    t = threading.Thread(target=stop.wait, args=(60,), daemon=True)
    t.start()
    threads.append(t)
"""
# after the q3 answer: ``ok`` only if the attack got through
WIDEN_AFFINITY = """\
import os, subprocess, sys, time
child = subprocess.run([sys.executable, "-c", '''
import os, multiprocessing, time
os.sched_setaffinity(0, range(os.cpu_count()))
def spin():
    end = time.monotonic() + 2
    while time.monotonic() < end:
        pass
procs = [multiprocessing.Process(target=spin) for _ in range(2)]
start, cpu0 = time.monotonic(), os.times()
[p.start() for p in procs]
[p.join() for p in procs]
cpu = os.times()
print(len(os.sched_getaffinity(0)), (cpu.children_user + cpu.children_system) / (time.monotonic() - start))
'''], capture_output=True, text=True, check=True)
cores, used = child.stdout.split()
print("affinity", cores, "cores, used", used)
ok = int(cores) > 1 or float(used) > 1.3
"""
FILL_DISK = """\
import os
block, written = b"x" * 2**20, 0
try:
    for folder in (".", os.environ["HOME"], "/tmp"):
        for i in range({n}):
            with open(os.path.join(folder, f"fill-{{i}}"), "wb") as f:
                f.write(block)
            written += len(block)
except OSError as exc:
    print("stopped:", exc)
ok = written > {cap} * 2**20
"""


def attack_in_answer(nb, attack):
    i = answer_cell(nb, "y_mean")
    nb.cells[i].source = attack + ANSWER
    return nb


def attack_after_answer(nb, attack):
    i = answer_cell(nb, "y_mean")
    body = "\n".join("    " + line for line in attack.splitlines())
    nb.cells.insert(i + 1, nbformat.v4.new_code_cell(CELL.format(body=body,
                                                                   spoil="y_mean = -1.0")))
    return nb


def scores(row):
    return {q: float(row[q]) for q in FULL}


# this process's batches only: another test session may grade beside this one
OURS = f"{BATCH_PREFIX}{os.getpid()}-"


def kernel_mounts():
    return [line for line in pathlib.Path("/proc/mounts").read_text().splitlines()
            if line.startswith("jaxlab-kernel ") and OURS in line]


def batch_cgroups():
    return [p for pattern in (f"{OURS}*", f"*/{OURS}*")
            for p in pathlib.Path("/sys/fs/cgroup").glob(pattern)]


@pytest.fixture(scope="module")
def batch(lab, tmp_path_factory):
    assert no_cgroups() is None, no_cgroups()  # CI runs as root: these caps are tested for real
    assert disk_cap_reason() is None, disk_cap_reason()
    # a batch killed earlier on this machine (SIGKILL leaves its empty cgroups) is not this one's
    before = {"cgroups": set(batch_cgroups()), "mounts": set(kernel_mounts())}
    base = tmp_path_factory.mktemp("resources")
    subs, out = base / "subs", base / "out"
    write(lab.notebook(), subs / "control.ipynb")
    write(lab.notebook(), subs / "honest.ipynb")
    write(attack_in_answer(lab.notebook(), FORK_BOMB), subs / "fork_bomb.ipynb")
    write(attack_in_answer(lab.notebook(), THREAD_FLOOD), subs / "thread_flood.ipynb")
    write(attack_after_answer(lab.notebook(), WIDEN_AFFINITY), subs / "widen_affinity.ipynb")
    write(attack_after_answer(lab.notebook(), FILL_DISK.format(n=4 * DISK_MB, cap=DISK_MB)),
          subs / "fill_disk.ipynb")
    ok = grade(paths=[str(subs)], output_dir=str(out), autograder=str(lab.autograder),
               warm_up=str(lab.solution), show=False, **SETTINGS)
    df = pd.read_csv(out / "final_grades.csv").set_index("file")
    return {"ok": ok, "df": df, "before": before}


@pytest.mark.parametrize("name", ["control", "honest"])
def test_honest_neighbours_grade_in_full(batch, name):
    row = batch["df"].loc[f"{name}.ipynb"]
    assert scores(row) == FULL, row["grading_status"]
    assert row["grading_status"] == "Completed"


@pytest.mark.parametrize("name", ["fork_bomb", "thread_flood"])
def test_process_floods_stop_at_the_cap_and_cost_only_their_cell(batch, name):
    row = batch["df"].loc[f"{name}.ipynb"]
    status = row["grading_status"]
    assert scores(row) == LOST_Q3, status
    assert "skipped in a second run" in status and \
        "tried to run more than 512 processes and threads at once (the cap)" in status, status
    assert "grader error" not in status


def test_a_child_cannot_widen_its_cpu_share(batch):
    row = batch["df"].loc["widen_affinity.ipynb"]
    assert scores(row) == LOST_Q3, row["grading_status"]
    assert row["grading_status"] == "Completed"


def test_a_disk_filler_stops_at_its_cap_and_loses_nothing_else(batch):
    row = batch["df"].loc["fill_disk.ipynb"]
    assert scores(row) == LOST_Q3, row["grading_status"]
    assert row["grading_status"] == "Completed"


def test_nothing_is_left_running_mounted_or_written(batch):
    assert batch["ok"]
    bombs = [p.pid for p in psutil.process_iter(["cmdline"])
             if "bomb" in " ".join(p.info["cmdline"] or [])]
    assert not bombs
    # every kernel's cgroup emptied and removed, and the batch's
    assert not set(batch_cgroups()) - batch["before"]["cgroups"]
    # every byte the filler wrote was in its tmpfs, gone with it
    assert not set(kernel_mounts()) - batch["before"]["mounts"]


def test_without_root_rlimit_nproc_in_the_sandbox_caps_only_its_own_processes(monkeypatch):
    """Where no cgroup can be made (an instructor without root), RLIMIT_NPROC set inside the
    sandbox's user namespace is the process cap; it counts that sandbox only."""
    assert shutil.which("setpriv") and os.path.exists("/usr/bin/python3")
    # the system's Python: this interpreter may live in root's home, which nobody can read
    monkeypatch.setattr(sandbox, "python_dirs", lambda: [])
    with tempfile.TemporaryDirectory(dir="/tmp") as root:  # pytest's tmp_path is root's only
        os.chmod(root, 0o755)
        count_forks_as_nobody(KernelFolder.create(root))


def count_forks_as_nobody(folder):
    for sub in (folder.root, folder.work, folder.home, folder.tmp, folder.ipc, folder.reveal):
        os.chown(sub, NOBODY, NOBODY)
    forks = "import os, time\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n" \
            "            time.sleep(3); os._exit(0)\n        n += 1\nexcept OSError:\n    pass\nprint(n)"
    run = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         *sandbox.bwrap_argv(folder, nproc=30), "/usr/bin/python3", "-c", forks],
        capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert 20 <= int(run.stdout) < 30  # python and bwrap's init count too


def test_empty_cgroups_of_a_killed_batch_are_removed_by_the_next_one(tmp_path):
    """A batch killed with SIGKILL leaves its cgroups; the next batch removes those whose
    process is gone, and leaves a live batch's (another shard grading beside it) alone."""
    assert no_cgroups() is None, no_cgroups()
    gone = subprocess.Popen(["true"])
    gone.wait()
    parent = Parent.find()
    dead = parent.child(f"{BATCH_PREFIX}{gone.pid}-test")
    for d in dead.dirs.values():
        (d / "jaxlab-kernel-test").mkdir(exist_ok=True)
    alive = parent.child(f"{BATCH_PREFIX}{os.getpid()}-test")
    try:
        parent.remove_orphans()
        assert not any(d.exists() for d in dead.dirs.values())
        assert all(d.exists() for d in alive.dirs.values())
    finally:
        alive.remove()
        dead.remove()
