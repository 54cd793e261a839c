"""Each attack of issue 10's *Why*, tried from a graded notebook, is blocked by the sandbox.

Every attack submission is the fixture's solution plus one cell after the q3 answer that tries
the attack and sets ``y_mean`` right only if it worked; so q3 scores only for a working attack,
and q1, q2 show the rest of the submission graded normally. All are graded in one batch.
"""

import os
import shutil
import socket
import threading

import pandas as pd
import pytest

from jaxlab.grade import grade
from jaxlab.grade.engine import warmup
from jaxlab.grade.engine.sandbox import unavailable_reason

from attacks import ATTACKS, attack_notebook
from nbedit import write

pytestmark = pytest.mark.slow  # kernels, sandboxes or services: not in make test-quick

SETTINGS = dict(workers=2, timeout=120, cell_timeout=30, memory_mb=1500)
FULL = {"q1": 2.0, "q2": 1.0, "q3": 1.0}
BLOCKED = {"q1": 2.0, "q2": 1.0, "q3": 0.0}



class Listener(threading.Thread):
    """A TCP service on the grading machine's loopback that hands out a token."""

    def __init__(self, token):
        super().__init__(daemon=True)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.token, self.connections = self.sock.getsockname()[1], token, 0

    def run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.sendall(self.token.encode())


@pytest.fixture(scope="module")
def attacked(lab, tmp_path_factory):
    assert unavailable_reason() is None, "bubblewrap must run here: " + str(unavailable_reason())
    base = tmp_path_factory.mktemp("attacks")
    home = base / "instructor-home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_ed25519").write_text("instructor-secret-key")
    listener = Listener("network-token")
    listener.start()
    subs, out = base / "subs", base / "out"
    # every kernel reads the compilation cache the trusted warm-up (the solution) wrote
    cache = warmup.folder_for(lab.autograder)
    targets = {"listener_port": listener.port, "secret": home / ".ssh" / "id_ed25519",
               "autograder": lab.autograder, "subs": subs, "out": out, "cache": cache,
               "grader_pid": os.getpid()}
    for name in ATTACKS:
        write(attack_notebook(lab.notebook(), name, targets), subs / f"{name}.ipynb")
    write(lab.notebook(), subs / "control.ipynb")
    ok = grade(paths=[str(subs)], output_dir=str(out), autograder=str(lab.autograder),
               warm_up=str(lab.solution), show=False, **SETTINGS)
    listener.sock.close()
    df = pd.read_csv(out / "final_grades.csv").set_index("file")
    return {"ok": ok, "df": df, "out": out, "listener": listener, "targets": targets}


def scores(row):
    return {q: float(row[q]) for q in FULL}


def test_control_grades_in_full_in_the_sandbox(attacked):
    row = attacked["df"].loc["control.ipynb"]
    assert scores(row) == FULL, row["grading_status"]
    assert row["grading_status"] == "Completed"


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_is_blocked_and_the_rest_grades_normally(attacked, name):
    row = attacked["df"].loc[f"{name}.ipynb"]
    assert scores(row) == BLOCKED, f"{name}: {row['grading_status']}"
    assert row["grading_status"].startswith("Completed"), row["grading_status"]
    assert "not sandboxed" not in row["grading_status"]


def test_network_listener_saw_no_connection(attacked):
    assert attacked["listener"].connections == 0


def test_nothing_was_written_into_the_grade_folder_or_the_cache(attacked):
    cache = attacked["targets"]["cache"]
    assert (cache / warmup.MARKER).is_file() and list(cache.glob("jit_*")), \
        "the warm-up did not write the cache the kernels were to read"
    assert not list(attacked["out"].rglob("*pwned*"))
    assert not list(cache.rglob("*pwned*"))


def test_require_refuses_and_auto_says_not_sandboxed_where_bwrap_is_missing(lab, tmp_path,
                                                                         monkeypatch, capsys):
    write(lab.notebook(), tmp_path / "subs" / "solution.ipynb")
    bin_dir = tmp_path / "bin"  # a PATH with python's tools but no bwrap
    bin_dir.mkdir()
    for tool in ("taskset",):
        if shutil.which(tool):
            os.symlink(shutil.which(tool), bin_dir / tool)
    monkeypatch.setenv("PATH", str(bin_dir))
    out = tmp_path / "out"
    assert grade(paths=[str(tmp_path / "subs")], output_dir=str(out),
                 autograder=str(lab.autograder), sandbox="require", show=False) is False
    assert "bubblewrap (bwrap) is not installed" in capsys.readouterr().err
    assert not (out / "final_grades.csv").exists()
    assert grade(paths=[str(tmp_path / "subs")], output_dir=str(out),
                 autograder=str(lab.autograder), sandbox="auto", show=False, **SETTINGS)
    assert "not sandboxed: bubblewrap (bwrap) is not installed" in capsys.readouterr().err
    row = pd.read_csv(out / "final_grades.csv").set_index("file").loc["solution.ipynb"]
    assert scores(row) == FULL
    assert row["grading_status"] == "Completed; not sandboxed: bubblewrap (bwrap) is not installed"


def test_off_runs_unsandboxed_and_says_so(lab, tmp_path):
    nb = lab.notebook()
    write(nb, tmp_path / "subs" / "solution.ipynb")
    out = tmp_path / "out"
    assert grade(paths=[str(tmp_path / "subs")], output_dir=str(out),
                 autograder=str(lab.autograder), sandbox="off", show=False, **SETTINGS)
    row = pd.read_csv(out / "final_grades.csv").set_index("file").loc["solution.ipynb"]
    assert row["grading_status"] == "Completed; not sandboxed: --sandbox=off"
