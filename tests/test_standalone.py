"""The student notebook's setup cell outside Colab: offline with otter installed it needs no
network, `grader.export()` still makes the submission zip, and it never replaces files it did not
write (an autograder's tests and helpers)."""

import shutil
import subprocess
import sys
import zipfile

import nbformat
import pytest

from labs import LABS, release_paths

LAB = LABS[0]


def _setup_source(lab):
    nb = nbformat.read(release_paths(lab)["student"], as_version=4)
    return next(c.source for c in nb.cells if c.source.startswith("#@title Setup"))


def _ipython(script, cwd, offline=False):
    """Run an IPython script (magics allowed) with this venv's IPython, optionally with no
    network at all (a fresh network namespace holds only a loopback that is down)."""
    (cwd / "run.ipy").write_text(script)
    cmd = [sys.executable, "-m", "IPython", "--quick", "--no-banner", "run.ipy"]
    if offline:
        cmd = ["unshare", "--user", "--map-root-user", "--net", *cmd]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)


def _unshare_works():
    return shutil.which("unshare") and subprocess.run(
        ["unshare", "--user", "--map-root-user", "--net", "true"]).returncode == 0


@pytest.mark.skipif(not _unshare_works(), reason="no user and network namespaces here")
def test_setup_cell_offline_with_otter_installed_writes_the_checks_and_creates_grader(tmp_path):
    shutil.copy(release_paths(LAB)["student"], tmp_path)
    proc = _ipython(_setup_source(LAB) + "\nprint('grader is', type(grader).__name__)\n"
                    "import socket\ntry:\n    socket.create_connection(('pypi.org', 443), 5)\n"
                    "    print('network reachable')\nexcept OSError:\n"
                    "    print('no network')\n", tmp_path, offline=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grader is LabNotebook" in proc.stdout and "no network" in proc.stdout
    assert (tmp_path / "jaxlab_form.py").is_file() and (tmp_path / "tests").is_dir()


def test_export_still_makes_the_zip_outside_colab(tmp_path):
    shutil.copy(release_paths(LAB)["student"], tmp_path)
    proc = _ipython(_setup_source(LAB) + "\ngrader.export(pdf=False, display_link=False)\n",
                    tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    zips = list(tmp_path.glob(f"{LAB}_*.zip"))
    assert len(zips) == 1
    assert f"{LAB}.ipynb" in zipfile.ZipFile(zips[0]).namelist()


def test_setup_cell_keeps_files_it_did_not_write_and_refreshes_its_own(tmp_path):
    shutil.copy(release_paths(LAB)["student"], tmp_path)
    (tmp_path / "tests").mkdir()
    autograders = tmp_path / "tests" / "q1_device_put.py"
    autograders.write_text("# the autograder's own test, hidden cases included\n")
    (tmp_path / "jaxlab_form.py").write_text("# the autograder's helpers\n")
    assert _ipython(_setup_source(LAB), tmp_path).returncode == 0
    assert autograders.read_text() == "# the autograder's own test, hidden cases included\n"
    assert (tmp_path / "jaxlab_form.py").read_text() == "# the autograder's helpers\n"
    own = tmp_path / "tests" / "q2_inspect.py"
    first = own.read_text()
    own.write_text(first.splitlines(keepends=True)[0] + "# an older version\n")
    assert _ipython(_setup_source(LAB), tmp_path).returncode == 0
    assert own.read_text() == first


def test_setup_cell_writes_nothing_while_otter_grades(tmp_path):
    """otter's grading (otter run, otter grade, Gradescope) starts with init_grading_mode; the
    autograder's tests and helpers are then in place and the setup cell leaves the folder alone."""
    shutil.copy(release_paths(LAB)["student"], tmp_path)
    proc = _ipython('from otter import Notebook\nNotebook.init_grading_mode("/nonexistent")\n'
                    + _setup_source(LAB) + "\nprint('grader is', type(grader).__name__)\n",
                    tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "grader is LabNotebook" in proc.stdout
    left = {p.name for p in tmp_path.iterdir()} - {"run.ipy", ".OTTER_LOG"}
    assert left == {f"{LAB}.ipynb"}
