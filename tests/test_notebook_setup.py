"""The setup cell of each lab: 8 devices on a CPU machine, a plain message when it is too late."""

import nbformat
import pytest

from labs import LABS, release_paths, run_python


def setup_cell(lab):
    nb = nbformat.read(release_paths(lab)["student"], as_version=4)
    return next(c.source for c in nb.cells if "N_DEVICES = 8" in c.source)


@pytest.mark.parametrize("lab", LABS)
def test_setup_cell_gives_eight_cpu_devices_on_a_cpu_machine(lab):
    proc = run_python(setup_cell(lab) + "\nassert len(devices) == 8, devices\n")
    assert proc.returncode == 0, proc.stderr
    assert "Using 8 CPU devices." in proc.stdout


@pytest.mark.parametrize("lab", LABS)
def test_setup_cell_asks_for_a_restart_when_jax_already_started_with_one_device(lab):
    proc = run_python("import jax\njax.devices()\n" + setup_cell(lab))
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: JAX is already running with 1 CPU device(s)")
    assert "Restart the kernel" in last


def test_every_lab_has_the_same_setup_cell():
    """The setup cell is written out in each master (otter assign takes each notebook whole, so
    there is nothing to import it from); this keeps the copies from drifting apart."""
    first, *others = LABS
    for lab in others:
        assert setup_cell(lab) == setup_cell(first), f"{lab}'s setup cell differs from {first}'s"
