"""What `jaxlab slurm` hands every task's `jaxlab grade`: exactly the options the instructor
gave, each parsed back by `jaxlab grade` to the value `jaxlab slurm` parsed, and nothing it was
not given, whatever click is installed (`python -m pytest tests/grade/test_slurm_options.py`
is what to run against another click before widening the range pyproject.toml allows).

Also what each task asks (CPUs, memory, time) against the nodes `sinfo` lists: the decision to
refuse an array no node could run (tests/grade/test_slurm.py refuses one on a real cluster).

No grading and no Slurm: the scripts are written, not submitted.
"""

import pathlib
import shlex

import pytest
from click.core import ParameterSource
from click.testing import CliRunner

from jaxlab.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
ZIP = ROOT / "autograder" / "lab3-parallelism-autograder.zip"
GRADE, SLURM = main.commands["grade"], main.commands["slurm"]
# options both verbs take; slurm resolves the autograder itself and passes --autograder, and
# its --only (which tasks to submit) is its own, not grade's --only (which submissions)
SHARED = sorted({p.name for p in GRADE.params} & {p.name for p in SLURM.params}
                - {"paths", "output_dir", "autograder", "assignment", "only"})
OPTION = {p.name: p for p in SLURM.params}


@pytest.fixture
def subs(tmp_path):
    folder = tmp_path / "subs"
    folder.mkdir()
    (folder / "a.ipynb").write_text((ROOT / "student/lab3-parallelism/lab3-parallelism.ipynb")
                                    .read_text())
    return folder


def given(name, subs):
    """Command-line words setting option ``name`` to something other than its default."""
    default = OPTION[name].default
    values = {"timeout": "300", "cell_timeout": "45", "memory_mb": "2000", "processes": "64",
              "cpus": "0.5", "disk_mb": "300", "warm_up": str(subs / "a.ipynb"),
              "sandbox": "require"}
    if OPTION[name].is_flag:
        return [OPTION[name].opts[0]]
    assert name in values, f"give the new shared option --{name} a test value here"
    assert values[name] != str(default), name
    return [OPTION[name].opts[0], values[name]]


def write_scripts(subs, tmp_path, *options):
    out = tmp_path / "grades"
    args = ["slurm", str(subs), "-o", str(out), "--tasks", "2", "--autograder", str(ZIP),
            *options]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    slurm_ctx = SLURM.make_context("slurm", args[1:])
    command = (out / ".jaxlab/slurm/grade.sbatch").read_text().splitlines()[-1]
    assert command.startswith("exec ")
    words = shlex.split(command.removeprefix("exec ").replace("$SLURM_ARRAY_TASK_ID", "1")
                        .replace("$SLURM_CPUS_PER_TASK", "4"))
    assert words[1:4] == ["-m", "jaxlab", "grade"], words
    return slurm_ctx, GRADE.make_context("grade", words[4:]), words[4:]


def test_options_not_given_are_left_to_jaxlab_grade(subs, tmp_path):
    _, task, words = write_scripts(subs, tmp_path)
    assert [w for w in words if w.startswith("--")] == \
        ["--autograder", "--shard", "--workers"], words
    for name in SHARED:
        assert task.get_parameter_source(name) == ParameterSource.DEFAULT, (name, words)
    assert task.params["force"] is False and task.params["shard"] == "1/2"


@pytest.mark.parametrize("name", SHARED)
def test_each_option_given_reaches_the_task_as_given(name, subs, tmp_path):
    words = given(name, subs)
    slurm_ctx, task, argv = write_scripts(subs, tmp_path, *words)
    assert task.get_parameter_source(name) == ParameterSource.COMMANDLINE, argv
    assert task.params[name] == slurm_ctx.params[name], argv
    for other in set(SHARED) - {name}:  # and it alone
        assert task.get_parameter_source(other) == ParameterSource.DEFAULT, (other, argv)


def test_all_options_given_at_once_and_one_given_at_its_default(subs, tmp_path):
    words = [w for name in SHARED for w in given(name, subs)]
    words = [w for w in words if w != "--sandbox" and w != "require"] + ["--sandbox", "auto"]
    slurm_ctx, task, argv = write_scripts(subs, tmp_path, *words)
    for name in SHARED:
        assert task.get_parameter_source(name) == ParameterSource.COMMANDLINE, (name, argv)
        assert task.params[name] == slurm_ctx.params[name], (name, argv)
    assert task.params["sandbox"] == "auto" and task.params["force"] is True


def test_the_assignment_picks_the_zip_the_task_is_given(subs, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "grades"
    result = CliRunner().invoke(main, ["slurm", str(subs), "-o", str(out), "--tasks", "1",
                                       "--assignment", "lab3-parallelism"])
    assert result.exit_code == 0, result.output
    command = (out / ".jaxlab/slurm/grade.sbatch").read_text().splitlines()[-1]
    assert f"--autograder {ZIP}" in command and "--assignment" not in command



# what each task asks against what sinfo says the partition's nodes offer
def nodes(*sizes, partition="batch", max_time="1-00:00:00"):
    from jaxlab.grade.run.slurm import Node, seconds

    return [Node(f"n{i}", partition, True, cpus, mem, seconds(max_time), max_time)
            for i, (cpus, mem) in enumerate(sizes)]


@pytest.mark.parametrize("text,expected", [
    ("30", 1800), ("30:15", 1815), ("2:00:00", 7200), ("1-12", 36 * 3600),
    ("1-12:30", 36 * 3600 + 1800), ("2-00:00:01", 48 * 3600 + 1), ("infinite", float("inf")),
    ("UNLIMITED", float("inf")), ("soon", None), ("1:2:3:4", None)])
def test_slurm_times_read_as_sbatch_reads_them(text, expected):
    from jaxlab.grade.run.slurm import seconds

    assert seconds(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("512", 512), ("512M", 512), ("2G", 2048), ("2g", 2048), ("1T", 1024 ** 2), ("1024K", 1),
    ("lots", None), ("2GB!", None)])
def test_slurm_memory_sizes_read_as_megabytes(text, expected):
    from jaxlab.grade.run.slurm import megabytes

    assert megabytes(text) == expected


def test_a_task_that_fits_some_node_is_not_refused():
    from jaxlab.grade.run.slurm import refusal

    cluster = nodes((2, 4000), (16, 64000))
    assert refusal(cluster, cpus_per_task=16) is None
    assert refusal(cluster, cpus_per_task=16, mem_per_cpu="3G", time="23:59:59") is None
    assert refusal(cluster, cpus_per_task=2, mem_per_cpu="2000", time="1-00:00:00") is None
    assert refusal([], cpus_per_task=999) is None  # sinfo said nothing: left to sbatch
    # a comma list of partitions runs in whichever has room
    both = nodes((2, 4000), partition="small") + nodes((32, 9000), partition="wide")
    assert refusal(both, cpus_per_task=32) is None


@pytest.mark.parametrize("ask,words", [
    (dict(cpus_per_task=17), "--cpus-per-task 17 is more CPUs than any node of partition batch "
                             "has (the largest, n1, has 16)"),
    (dict(cpus_per_task=4, mem_per_cpu="20G"), "--mem-per-cpu 20G asks 81920 MB for a task of 4 "
                                               "CPUs, more than any node of partition batch has "
                                               "(the largest, n0, has 70000 MB)"),
    (dict(cpus_per_task=1, mem_per_cpu="80000"), "--mem-per-cpu 80000 asks 80000 MB for a task "
                                                 "of 1 CPU, more than any node"),
    (dict(cpus_per_task=16, mem_per_cpu="2G"), "--cpus-per-task 16 with --mem-per-cpu 2G (32768 "
                                               "MB) fits no node of partition batch (those with "
                                               "16 CPUs have at most 8000 MB)"),
    (dict(cpus_per_task=2, time="1-00:00:01"), "--time 1-00:00:01 is longer than partition "
                                               "batch lets a job run (its MaxTime is "
                                               "1-00:00:00)"),
])
def test_a_task_no_node_could_run_is_refused_naming_the_option(ask, words):
    from jaxlab.grade.run.slurm import refusal

    why = refusal(nodes((4, 70000), (16, 8000)), **ask)
    assert why.startswith(words), why
    assert why.endswith("no task could ever start there, so nothing was submitted")
