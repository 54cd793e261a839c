"""The trusted warm-up writes the compilation cache once; every kernel after it reads it, read-only.

Real kernels and real batches on the fixture lab; each test gets its own JAXLAB_CACHE_DIR.
"""

import nbformat
import pandas as pd
import pytest
from nbclient import NotebookClient

from jaxlab.grade import grade
from jaxlab.grade.engine import warmup
from jaxlab.grade.engine.kernel import Kernel, kernel_env
from jaxlab.grade.engine.sandbox import unavailable_reason

from nbedit import write

pytestmark = pytest.mark.slow  # kernels, sandboxes or services: not in make test-quick

SETTINGS = dict(workers=1, timeout=120, cell_timeout=60, memory_mb=1500, sandbox="require")
FULL = {"q1": 2.0, "q2": 1.0, "q3": 1.0}
JIT_CELL = """\
import jax, jax.numpy as jnp
print(jax.jit(lambda x: x * {k} + 1)(jnp.arange(4.0)).sum())
"""


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    assert unavailable_reason() is None, "bubblewrap must run here: " + str(unavailable_reason())
    monkeypatch.setenv("JAXLAB_CACHE_DIR", str(tmp_path / "jaxlab-cache"))


def run_in_sandbox(tmp_path, cache, source, writable):
    """Run one cell in a sandboxed kernel given ``cache``; its outputs."""
    kernel = Kernel.start(kernel_env(cache, cache_writable=writable), tmp_path, sandboxed=True,
                          cache_dir=cache, cache_writable=writable)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    try:
        NotebookClient(nb, km=kernel.km, timeout=120, kernel_name=kernel.km.kernel_name,
                       allow_errors=True).execute()
    finally:
        kernel.close()
    return nb.cells[0].outputs


def entries(cache):
    return sorted(p.name for p in cache.glob("jit_*"))


def test_entries_written_under_one_folder_name_are_read_under_another(tmp_path):
    # the warm-up writes into a temporary folder renamed into place; JAX's default put the
    # folder's path into every key, and none of the 103 Lab 3 entries was ever read
    warming = tmp_path / "warming"
    warming.mkdir()
    run_in_sandbox(tmp_path, warming, JIT_CELL.format(k=3), writable=True)
    written = entries(warming)
    assert written, "the writable cache got no entry"
    final = tmp_path / "final"
    warming.rename(final)
    outputs = run_in_sandbox(tmp_path, final, JIT_CELL.format(k=3), writable=True)
    assert not [o for o in outputs if o.output_type == "error"], outputs
    assert entries(final) == written, "the same program compiled again: its entry was not read"


def test_a_kernel_with_the_read_only_cache_compiles_new_programs_and_writes_nothing(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    run_in_sandbox(tmp_path, cache, JIT_CELL.format(k=3), writable=True)
    before = entries(cache)
    outputs = run_in_sandbox(tmp_path, cache, JIT_CELL.format(k=5) + """
import os
try:
    open(os.environ["JAX_COMPILATION_CACHE_DIR"] + "/by-a-kernel", "w")
except OSError as exc:
    print("refused:", type(exc).__name__)
""", writable=False)
    text = "".join(o.get("text", "") for o in outputs)
    assert not [o for o in outputs if o.output_type == "error"], outputs
    assert "34.0" in text  # 5 * (0 + 1 + 2 + 3) + 4 * 1: the new program ran
    assert "refused: OSError" in text
    assert entries(cache) == before and not (cache / "by-a-kernel").exists()


def grade_fixture(lab, tmp_path, name, warm_up):
    subs = tmp_path / f"subs-{name}"
    write(lab.notebook(), subs / "solution.ipynb")
    out = tmp_path / f"out-{name}"
    assert grade(paths=[str(subs)], output_dir=str(out), autograder=str(lab.autograder),
                 warm_up=warm_up and str(warm_up), show=False, **SETTINGS)
    return pd.read_csv(out / "final_grades.csv").set_index("file").loc["solution.ipynb"]


def test_the_first_batch_warms_the_cache_and_later_batches_only_read_it(lab, tmp_path):
    row = grade_fixture(lab, tmp_path, "first", lab.solution)
    assert {q: float(row[q]) for q in FULL} == FULL and row["grading_status"] == "Completed"
    cache = warmup.read(warmup.folder_for(lab.autograder))
    assert cache is not None and cache.complete, cache
    assert (cache.earned, cache.possible) == (4, 4)
    written = entries(cache.folder)
    assert written
    marker = (cache.folder / warmup.MARKER).read_text()
    row = grade_fixture(lab, tmp_path, "second", lab.solution)
    assert {q: float(row[q]) for q in FULL} == FULL and row["grading_status"] == "Completed"
    assert (cache.folder / warmup.MARKER).read_text() == marker, "warmed a second time"
    assert entries(cache.folder) == written, "a kernel wrote into the cache"


def test_a_warm_up_notebook_that_does_not_score_in_full_is_reported(lab, tmp_path, capsys):
    row = grade_fixture(lab, tmp_path, "blank-warm-up", lab.student)
    assert {q: float(row[q]) for q in FULL} == FULL
    err = capsys.readouterr().err
    assert "WARNING" in err and "does not score in full" in err and "0/4" in err, err


def test_a_warm_up_that_cannot_be_graded_leaves_no_cache_and_the_batch_grades(lab, tmp_path,
                                                                               capsys):
    broken = tmp_path / "broken.ipynb"
    broken.write_text("{ this is not a notebook")
    row = grade_fixture(lab, tmp_path, "broken-warm-up", broken)
    assert {q: float(row[q]) for q in FULL} == FULL and row["grading_status"] == "Completed"
    assert "could not grade" in capsys.readouterr().err
    assert warmup.read(warmup.folder_for(lab.autograder)) is None
    assert not list(warmup.folder_for(lab.autograder).parent.glob("*"))  # no leftovers


def test_batches_starting_together_warm_once_the_others_wait_and_read_it(lab, tmp_path):
    import threading
    import time

    calls = []

    def grade_one(cache_dir, notebook):
        calls.append(cache_dir)
        time.sleep(1.0)  # the others arrive while this one warms
        (cache_dir / "jit_entry").write_text("compiled")
        return 4, 4, "Completed"

    got = []
    batches = [threading.Thread(target=lambda: got.append(warmup.warm(
        zip_path=lab.autograder, notebook=lab.solution, grade_one=grade_one)))
        for _ in range(3)]
    for t in batches:
        t.start()
    for t in batches:
        t.join()
    assert len(calls) == 1
    assert sorted(c.warmed_now for c in got) == [False, False, True]
    assert {c.folder for c in got} == {warmup.folder_for(lab.autograder)}
    assert (warmup.folder_for(lab.autograder) / "jit_entry").exists()
