"""What `jaxlab slurm` hands every task's `jaxlab grade`: exactly the options the instructor
gave, each parsed back by `jaxlab grade` to the value `jaxlab slurm` parsed, and nothing it was
not given, whatever click is installed (`python -m pytest tests/grade/test_slurm_options.py`
is what to run against another click before widening the range pyproject.toml allows).

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
# options both verbs take; slurm resolves the autograder itself and passes --autograder
SHARED = sorted({p.name for p in GRADE.params} & {p.name for p in SLURM.params}
                - {"paths", "output_dir", "autograder", "assignment"})
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

