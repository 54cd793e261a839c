"""`jaxlab slurm` on a real one-node Slurm cluster (munged, slurmctld, slurmd started here): the
array's report equals one `jaxlab grade` of the same folder, a finished task resubmitted grades
nothing, a task cancelled midway and resubmitted alone completes it with nothing lost or graded
twice, an array no node could run is refused before submission, and `jaxlab status` shows why a
queued task waits.
"""

import json
import re
import time

import nbformat
import pandas as pd
import psutil
import pytest

from jaxlab.grade import grade
from jaxlab.grade.output.results import CSV, SUMMARIES
from jaxlab.grade.run.shard import Shard, current_split, record_key, shard_of, status
from jaxlab.grade.run.slurm import TooBig, queue, slurm

from nbedit import answer_cell, write
from slurmcluster import Cluster

pytestmark = pytest.mark.slow  # kernels, sandboxes or services: not in make test-quick

SETTINGS = dict(timeout=120, cell_timeout=60, memory_mb=1500)
SLOW_S = 8  # one submission sleeps this long, so a task can be cancelled in the middle


def folder(lab, root):
    """Seven submissions: right, blank, wrong in two ways, not a notebook, and a slow one that
    lands in shard 1 of 2 after its first submission (so cancelling that task interrupts it)."""
    sol = lab.notebook
    write(sol(), root / "solution.ipynb")
    blank = sol()
    for name, src in {"y": "y = ...", "double": "def double(x):\n    ...",
                      "y_mean": "y_mean = ..."}.items():
        blank.cells[answer_cell(blank, name)].source = src
    write(blank, root / "blank.ipynb")
    for k in (3, 4):
        nb = sol()
        nb.cells[answer_cell(nb, "double")].source = f"def double(x):\n    return {k} * x"
        write(nb, root / f"wrong-double-{k}.ipynb")
    nb = sol()
    nb.cells[answer_cell(nb, "y")].source = \
        "y = jax.device_put(jnp.arange(8.0) * 2, NamedSharding(mesh, P()))"
    write(nb, root / "replicated.ipynb")
    (root / "not_json.ipynb").write_text("this is not JSON")
    slow = next(n for n in (f"slow-{i}.ipynb" for i in range(100)) if shard_of(n, 2) == 1)
    nb = sol()
    nb.cells.insert(answer_cell(nb, "y_mean") + 1,
                    nbformat.v4.new_code_cell(f"import time\ntime.sleep({SLOW_S})"))
    write(nb, root / slow)
    return root


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("slurm")).start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def subs(lab, tmp_path_factory):
    return folder(lab, tmp_path_factory.mktemp("subs"))


@pytest.fixture(scope="module")
def whole(lab, subs, tmp_path_factory):
    """The same folder graded by one `jaxlab grade` on this machine."""
    out = tmp_path_factory.mktemp("whole")
    assert grade(paths=[str(subs)], output_dir=str(out), autograder=str(lab.autograder),
                 warm_up=str(lab.solution), workers=2, show=False, **SETTINGS)
    return out


GRADE_ARGS = ["--timeout", "120", "--cell-timeout", "60", "--memory", "1500"]


def submit(cluster, lab, subs, out, node_cache, **kw):
    """`jaxlab slurm --submit` for a 2-task array, one CPU each, as the CLI would."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(cluster.conf))
        return slurm(paths=[str(subs)], output_dir=str(out), tasks=2, cpus_per_task=1,
                     autograder=str(lab.autograder), node_cache=str(node_cache),
                     grade_args=["--warm-up", str(lab.solution), *GRADE_ARGS],
                     submit=True, show=False, **kw)


def jaxlab(cluster, *args):
    """The `jaxlab` command line, run here against the test cluster: (exit code, output)."""
    from click.testing import CliRunner

    from jaxlab.cli import main

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SLURM_CONF", str(cluster.conf))
        result = CliRunner().invoke(main, list(map(str, args)))
    return result.exit_code, result.output


def record_files(out):
    """{record file name: (its bytes, its mtime in ns)}."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns)
            for p in (out / ".jaxlab" / "records").glob("*.json")}


def task_logs(out, array_job):
    return {p.name: p.read_text()
            for p in (out / ".jaxlab" / "slurm" / "logs").glob(f"grade-{array_job}_*.log")}


def test_a_two_task_array_and_its_report_job_write_what_one_batch_writes(
        cluster, lab, subs, whole, tmp_path):
    out = tmp_path / "grades"
    jobs = submit(cluster, lab, subs, out, tmp_path / "node-cache")
    assert cluster.wait(jobs.report_job, timeout=600)["JobState"] == "COMPLETED", \
        cluster.run("cat", *map(str, (out / ".jaxlab" / "slurm" / "logs").glob("*"))).stdout
    # the same rows, byte for byte, and the same class page
    assert (out / CSV).read_text() == (whole / CSV).read_text()
    assert (out / "report.html").read_text() == (whole / "report.html").read_text()
    assert sorted(p.name for p in (out / SUMMARIES).iterdir()) == \
        sorted(p.name for p in (whole / SUMMARIES).iterdir())
    # each task graded its own shard, on its own CPU, and one warm-up served both
    logs = task_logs(out, jobs.array_job)
    assert len(logs) == 2, logs.keys()
    text = "\n".join(logs.values())
    assert text.count("warmed now") == 1 and text.count("warmed before") == 1, text
    for k in (0, 1):
        n = sum(shard_of(p.name, 2) == k for p in subs.iterdir())
        assert f"shard {k}/2 holds {n} of the 7 submissions" in text
        # progress in a log is lines, not a bar redrawn with carriage returns
        assert f"jaxlab grade: shard {k}/2: graded {n} of {n} (100%)" in text, text
    assert "\r" not in text, text
    assert "grade-%A_%a.log" in jobs.grade_script.read_text()
    assert "--array=0-1" in jobs.grade_script.read_text()

    # a finished task resubmitted as the instructor would (the CLI, without --force) grades
    # nothing and leaves every record as it was
    before, csv = record_files(out), (out / CSV).read_text()
    began = time.monotonic()
    code, said = jaxlab(cluster, "slurm", subs, "-o", out, "--tasks", 2, "--cpus-per-task", 1,
                        "--autograder", lab.autograder, "--node-cache", tmp_path / "node-cache",
                        "--warm-up", lab.solution, *GRADE_ARGS, "--only", 1, "--submit")
    assert code == 0, said
    array_job, report_job = re.search(r"submitted array job (\d+) and report job (\d+)",
                                      said).groups()
    task = cluster.wait(array_job)
    assert cluster.wait(report_job)["JobState"] == "COMPLETED"
    print(f"\n--only 1 --submit of a complete shard: the task ran {task['RunTime']}, "
          f"{time.monotonic() - began:.1f} s to its report job's end")
    (log,) = task_logs(out, array_job).values()
    n = sum(shard_of(p.name, 2) == 1 for p in subs.iterdir())
    assert f"shard 1/2: {n} graded before, grading 0" in log, log
    assert "--force" not in jobs.grade_script.read_text()
    assert record_files(out) == before
    assert (out / CSV).read_text() == csv


def test_b_a_cancelled_task_resubmitted_alone_completes_the_grade(
        cluster, lab, subs, whole, tmp_path):
    out = tmp_path / "grades"
    cache = tmp_path / "node-cache"
    jobs = submit(cluster, lab, subs, out, cache)
    files = current_split(out).manifests[1].files
    records = out / ".jaxlab" / "records"

    def graded():
        return {f for f in files if (records / f"{record_key(f)}.json").exists()}

    while len(graded()) < 1:  # cancel task 1 once it has graded something, not everything
        assert cluster.queued(jobs.array_job), "the array ended before anything was graded"
        time.sleep(0.1)
    cluster.run("scancel", f"{jobs.array_job}_1")
    before = {f: (records / f"{record_key(f)}.json").read_bytes() for f in graded()}
    assert 1 <= len(before) < len(files)
    report = cluster.wait(jobs.report_job)
    # the report ran after the cancelled task (afterany) and said the grade is incomplete
    assert report["JobState"] == "FAILED"
    rows = {s.shard.index: s for s in status(output_dir=out, show=False)}
    assert rows[0].remaining == 0 and rows[1].remaining == len(files) - len(before)
    assert len(pd.read_csv(out / CSV)) - 1 == 7 - rows[1].remaining
    # scancel ended every process of the task: kernels, workers, the grader
    left = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
        except (psutil.Error, OSError):
            continue
        if env.get("SLURM_ARRAY_JOB_ID") == jobs.array_job:
            left.append((p.pid, p.cmdline()))
    assert not left, left

    again = submit(cluster, lab, subs, out, cache, only=[1])
    assert "--array=1" not in again.grade_script.read_text()  # the script is the same
    assert cluster.wait(again.report_job)["JobState"] == "COMPLETED"
    assert (out / CSV).read_text() == (whole / CSV).read_text()
    # what was graded before the cancel was not graded again
    assert {f: (records / f"{record_key(f)}.json").read_bytes() for f in before} == before
    (log,) = task_logs(out, again.array_job).values()
    assert f"shard 1/2: {len(before)} graded before, grading {len(files) - len(before)}" in log
    assert len(list(records.glob("*.json"))) == 7
    assert all(s.remaining == 0 for s in status(output_dir=out, show=False))


def test_c_an_array_no_node_can_run_is_refused_before_submission(cluster, lab, subs,
                                                                  tmp_path):
    out = tmp_path / "grades"
    too_many = cluster.cpus + 1
    code, said = jaxlab(cluster, "slurm", subs, "-o", out, "--tasks", 2, "--cpus-per-task",
                        too_many, "--autograder", lab.autograder, "--submit")
    assert code == 1
    assert " ".join(said.split()) == (
        f"Error: --cpus-per-task {too_many} is more CPUs than any node of partition test has "
        f"(the largest, {cluster.node}, has {cluster.cpus}): no task could ever start there, so "
        "nothing was submitted"), said
    assert not out.exists()  # nothing written
    assert not cluster.run("squeue", "-h").stdout.strip()  # nothing submitted
    with pytest.MonkeyPatch.context() as mp, pytest.raises(TooBig):  # the API refuses alike
        mp.setenv("SLURM_CONF", str(cluster.conf))
        slurm(paths=[str(subs)], output_dir=str(out), tasks=2, cpus_per_task=too_many,
              autograder=str(lab.autograder), submit=True, show=False)
    assert not out.exists()


def test_d_status_shows_why_slurm_keeps_a_task_waiting(cluster, lab, subs, tmp_path):
    out = tmp_path / "grades"

    def rows():
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", str(cluster.conf))
            return [(r.state, r.queue) for r in status(output_dir=out, queue=queue(out),
                                                       show=False)]

    cluster.run("scontrol", "update", "PartitionName=test", "State=DOWN")
    try:  # a partition taken down: Slurm takes the array and keeps its tasks pending
        jobs = submit(cluster, lab, subs, out, tmp_path / "node-cache")
        waiting = [("queued", "pending (PartitionDown)")] * 2
        deadline = time.monotonic() + 60
        while rows() != waiting and time.monotonic() < deadline:  # said on its next pass
            time.sleep(0.5)
        assert rows() == waiting
        code, said = jaxlab(cluster, "status", out)
        assert code == 1, said
        for k in (0, 1):
            assert f"shard {k}/2 in the scheduler's queue: pending (PartitionDown)" in said, said
        cluster.run("scancel", jobs.array_job, jobs.report_job)
        cluster.wait(jobs.report_job, timeout=60)
        cluster.wait(jobs.array_job, timeout=60)
        assert rows() == [("queued", None)] * 2  # Slurm holds none of them now
    finally:
        cluster.run("scancel", "--user=root", check=False)
        cluster.run("scontrol", "update", "PartitionName=test", "State=UP")


def test_shards_split_by_file_key_stably_and_completely():
    names = [f"student-{i:04d}.ipynb" for i in range(2000)]
    for n in (1, 2, 7, 20):
        parts = [[f for f in names if Shard(k, n).holds(f)] for k in range(n)]
        assert sorted(sum(parts, [])) == names  # each in exactly one shard
        # adding submissions moves none of the others
        more = names + [f"late-{i}.ipynb" for i in range(300)]
        assert all(shard_of(f, n) == k for k, part in enumerate(parts) for f in part)
        assert all(Shard(shard_of(f, n), n).holds(f) for f in more)
    sizes = [sum(shard_of(f, 20) == k for f in names) for k in range(20)]
    assert min(sizes) > 60 and max(sizes) < 140  # 100 each on average


@pytest.mark.parametrize("text", ["2/2", "-1/3", "1", "a/b", "3/0"])
def test_a_shard_outside_0_to_n_minus_1_is_refused_with_the_rule(text):
    with pytest.raises(ValueError, match="0 <= K < N"):
        Shard.parse(text)


def test_a_shard_grades_its_share_and_the_report_names_what_is_missing(lab, subs, whole,
                                                                         tmp_path, capsys):
    from jaxlab.grade.run.report import report

    out = tmp_path / "grades"
    assert grade(paths=[str(subs)], output_dir=str(out), autograder=str(lab.autograder),
                 warm_up=str(lab.solution), shard="0/2", workers=1, show=False, **SETTINGS)
    mine = {p.name for p in subs.iterdir() if shard_of(p.name, 2) == 0}
    graded = {json.loads(p.read_text())["file"] for p in (out / ".jaxlab/records").iterdir()}
    assert graded == mine
    assert not (out / CSV).exists()  # the shared files are the report's
    assert report(output_dir=out, show=False) is False
    assert "shard 1 of 2: never started" in capsys.readouterr().err
    df = pd.read_csv(out / CSV).set_index("file")
    assert set(df.index) == {"points-per-question"} | mine
    expected = pd.read_csv(whole / CSV).set_index("file").loc[df.index]
    pd.testing.assert_frame_equal(df, expected)
    html = (out / "report.html").read_text()
    assert "Incomplete" in html and "shard 1 of 2: never started" in html


def test_jaxlab_slurm_writes_the_array_and_report_scripts_and_plans_every_shard(
        lab, subs, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from jaxlab.cli import main

    monkeypatch.chdir(tmp_path)
    out = tmp_path / "grades"
    result = CliRunner().invoke(main, [
        "slurm", str(subs), "-o", str(out), "--tasks", "3", "--cpus-per-task", "4",
        "--time", "0:30:00", "--partition", "short", "--autograder", str(lab.autograder),
        "--timeout", "300", "--sandbox", "require", "--force"])
    assert result.exit_code == 0, result.output
    script = (out / ".jaxlab/slurm/grade.sbatch").read_text()
    for line in ("#SBATCH --array=0-2", "#SBATCH --cpus-per-task=4", "#SBATCH --time=0:30:00",
                 "#SBATCH --partition=short", f"#SBATCH --chdir={tmp_path}"):
        assert line in script.splitlines(), script
    command = script.splitlines()[-1]
    assert command.startswith("exec ") and '--shard "$SLURM_ARRAY_TASK_ID/3"' in command
    assert '--workers "$SLURM_CPUS_PER_TASK"' in command
    # the options given, as `jaxlab grade` takes them; the defaults left to it
    assert "--timeout 300.0" in command and "--sandbox require" in command
    assert "--force" in command and "--cell-timeout" not in command
    assert f"--autograder {lab.autograder}" in command
    assert 'export JAXLAB_CACHE_DIR=${TMPDIR:-/tmp}/jaxlab-cache-$(id -u)' in script
    report = (out / ".jaxlab/slurm/report.sbatch").read_text()
    assert report.splitlines()[-1].endswith(f"-m jaxlab report {out}")
    assert "sbatch --dependency=afterany:$array" in result.output
    # every shard is planned, so status knows what each queued task holds
    rows = status(output_dir=out, show=False)
    assert [r.state for r in rows] == \
        ["queued" if any(shard_of(p.name, 3) == k for p in subs.iterdir()) else "empty"
         for k in range(3)]
    assert sum(r.remaining for r in rows) == 7
    result = CliRunner().invoke(main, ["status", str(out)])
    assert result.exit_code == 1 and "queued" in result.output
    bad = CliRunner().invoke(main, ["slurm", str(subs), "-o", str(out), "--tasks", "3",
                                    "--only", "5", "--autograder", str(lab.autograder)])
    assert bad.exit_code == 2 and "from 0 to 2" in bad.output
