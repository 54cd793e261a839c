"""``jaxlab slurm``: grade a batch as a Slurm job array, one shard per task, then the report.

Writes two batch scripts under OUTDIR/.jaxlab/slurm/: ``grade.sbatch``, an array
(``--array=0-(N-1)``) whose task K runs ``jaxlab grade ... --shard K/N --workers C``, and
``report.sbatch``, which runs ``jaxlab report OUTDIR`` and is submitted with
``--dependency=afterany:<array job>`` (it runs when every task has ended, however it ended, and
says what is missing). With ``submit`` both are handed to ``sbatch``. Before that, every shard's
manifest is written, so ``jaxlab status`` knows what a queued task holds.

Each task points JAXLAB_CACHE_DIR at a folder local to its node: the first task on a node warms
the compilation cache there, the others on that node wait for it (``warmup.warm`` holds a lock),
and later tasks on that node find it warm. OUTDIR, the submissions and this Python must be on a
file system every node sees.
"""

import dataclasses
import os
import pathlib
import shlex
import subprocess
import sys

from ..engine.autograder import shipped_autograder
from ..engine.submissions import collect
from . import shard as shards

FOLDER = "slurm"  # under OUTDIR/.jaxlab
# the first task on a node warms the cache here; the next tasks there read it
NODE_CACHE = "${TMPDIR:-/tmp}/jaxlab-cache-$(id -u)"


class SlurmError(RuntimeError):
    """sbatch refused a script or is missing; the message has its words."""


@dataclasses.dataclass(frozen=True)
class Jobs:
    grade_script: pathlib.Path
    report_script: pathlib.Path
    array_job: str | None = None  # job ids, when submitted
    report_job: str | None = None


def slurm(*, paths, output_dir="grades", tasks, cpus_per_task=4, time=None, partition=None,
          mem_per_cpu=None, node_cache=NODE_CACHE, autograder=None, assignment=None,
          grade_args=(), only=None, submit=False, show=True):
    """Write (and with ``submit``, submit) the array and report scripts for ``paths``.

    ``tasks``: how many shards (array tasks); ``cpus_per_task``: cores per task, one kernel on
    each (``--workers``); ``time``, ``partition``, ``mem_per_cpu``: passed to Slurm as given
    (None: the cluster's default). ``grade_args``: further ``jaxlab grade`` options for every
    task (e.g. ``["--timeout", "300"]``). ``only``: indexes of the tasks to submit (a
    resubmission of tasks that did not finish; their scripts are rewritten, the other shards'
    manifests kept).
    """
    if tasks < 1 or cpus_per_task < 1:
        raise ValueError("--tasks and --cpus-per-task must be at least 1")
    only = sorted(set(only or ()))
    if any(not 0 <= k < tasks for k in only):
        raise ValueError(f"--only takes task indexes from 0 to {tasks - 1}; got {only}")
    out = pathlib.Path(output_dir).resolve()
    paths = [pathlib.Path(p).resolve() for p in paths]
    subs = collect(paths, exclude=[out])
    if not subs:
        raise FileNotFoundError("no .ipynb or .zip submissions found")
    zip_path = pathlib.Path(autograder or shipped_autograder(assignment, [s.path for s in subs]))
    zip_path = zip_path.resolve()
    folder = shards.state_dir(out) / FOLDER
    (folder / "logs").mkdir(parents=True, exist_ok=True)
    if not only:
        shards.plan(out, subs, tasks, shards.keep_autograder(out, zip_path))

    def header(name, log, cpus, array=None):
        lines = ["#!/bin/bash", f"#SBATCH --job-name={name}", f"#SBATCH --cpus-per-task={cpus}",
                 f"#SBATCH --output={folder / 'logs' / log}", f"#SBATCH --chdir={os.getcwd()}"]
        lines += [f"#SBATCH --array={array}"] if array else []
        lines += [f"#SBATCH --time={time}"] if time else []
        lines += [f"#SBATCH --partition={partition}"] if partition else []
        lines += [f"#SBATCH --mem-per-cpu={mem_per_cpu}"] if mem_per_cpu else []
        return lines

    jaxlab = [sys.executable, "-m", "jaxlab"]
    grade_cmd = " ".join(
        [*map(shlex.quote, [*jaxlab, "grade", *map(str, paths), "-o", str(out),
                            "--autograder", str(zip_path), *grade_args]),
         f'--shard "$SLURM_ARRAY_TASK_ID/{tasks}"', '--workers "$SLURM_CPUS_PER_TASK"'])
    cache = node_cache if node_cache == NODE_CACHE else shlex.quote(str(node_cache))
    grade_script = folder / "grade.sbatch"
    grade_script.write_text("\n".join(header("jaxlab-grade", "grade-%A_%a.log", cpus_per_task,
                                             f"0-{tasks - 1}") + [
        "# Written by `jaxlab slurm`. Task K grades shard K of the batch into the shared OUTDIR.",
        f"# Run one task again (it resumes): sbatch --array=K {grade_script}",
        "set -euo pipefail",
        "# node-local: the first task on a node warms the compilation cache, the rest read it",
        f"export JAXLAB_CACHE_DIR={cache}",
        f"exec {grade_cmd}", ""]))
    report_script = folder / "report.sbatch"
    report_script.write_text("\n".join(header("jaxlab-report", "report-%j.log", 1) + [
        "# Written by `jaxlab slurm`; submitted with --dependency=afterany:<the grade array>.",
        "set -euo pipefail",
        f"exec {shlex.join([*jaxlab, 'report', str(out)])}", ""]))
    jobs = Jobs(grade_script, report_script)
    array_opt = [f"--array={','.join(map(str, only))}"] if only else []
    if submit:
        array_job = _sbatch([*array_opt, str(grade_script)])
        report_job = _sbatch([f"--dependency=afterany:{array_job}", str(report_script)])
        jobs = dataclasses.replace(jobs, array_job=array_job, report_job=report_job)
    if show:
        _describe(jobs, out, tasks, len(subs), array_opt)
    return jobs


def _sbatch(args):
    try:
        done = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True)
    except FileNotFoundError:
        raise SlurmError("sbatch is not on PATH: run this on a Slurm login node") from None
    if done.returncode != 0:
        raise SlurmError(f"sbatch {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip().split(";")[0]  # "jobid[;cluster]"


def _describe(jobs, out, tasks, n, array_opt):
    print(f"jaxlab slurm: {n} submissions in {tasks} shard{'s' if tasks != 1 else ''}; "
          f"scripts in {jobs.grade_script.parent}", file=sys.stderr)
    if jobs.array_job:
        print(f"jaxlab slurm: submitted array job {jobs.array_job} and report job "
              f"{jobs.report_job} (after it); watch with `jaxlab status {out}`", file=sys.stderr)
    else:
        print("jaxlab slurm: submit with\n"
              f"  array=$(sbatch --parsable {' '.join(array_opt + [str(jobs.grade_script)])})\n"
              f"  sbatch --dependency=afterany:$array {jobs.report_script}", file=sys.stderr)
