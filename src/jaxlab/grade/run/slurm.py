"""``jaxlab slurm``: grade a batch as a Slurm job array, one shard per task, then the report.

Writes two batch scripts under OUTDIR/.jaxlab/slurm/: ``grade.sbatch``, an array
(``--array=0-(N-1)``) whose task K runs ``jaxlab grade ... --shard K/N --workers C``, and
``report.sbatch``, which runs ``jaxlab report OUTDIR`` and is submitted with
``--dependency=afterany:<array job>`` (it runs when every task has ended, however it ended, and
says what is missing). With ``submit`` both are handed to ``sbatch``. Before that, every shard's
manifest is written, so ``jaxlab status`` knows what a queued task holds, and what each task asks
(CPUs, memory, time) is compared with what the partition's nodes offer (``sinfo``): an array no
node could ever run is refused, naming the option, rather than left pending forever. The job ids
submitted are kept in ``jobs.json`` beside the scripts, so ``jaxlab status`` can show what Slurm
says of each queued task (``queue``).

Each task points JAXLAB_CACHE_DIR at a folder local to its node: the first task on a node warms
the compilation cache there, the others on that node wait for it (``warmup.warm`` holds a lock),
and later tasks on that node find it warm. OUTDIR, the submissions and this Python must be on a
file system every node sees.
"""

import dataclasses
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys

from ..engine.autograder import shipped_autograder
from ..engine.submissions import collect
from . import shard as shards

FOLDER = "slurm"  # under OUTDIR/.jaxlab
JOBS = "jobs.json"  # in FOLDER: {"count": N, "tasks": {K: array job id}, "report": job id}
# the first task on a node warms the cache here; the next tasks there read it
NODE_CACHE = "${TMPDIR:-/tmp}/jaxlab-cache-$(id -u)"


class SlurmError(RuntimeError):
    """sbatch refused a script or is missing; the message has its words."""


class TooBig(SlurmError):
    """No node of the partition could ever run one task of the array; the message names the
    option and the largest node."""


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
    manifests kept). With ``submit``, an array that no node of the partition could ever run
    (``refusal``) raises ``TooBig`` before anything is written or submitted.
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
    if submit:  # before anything is written: a refused array leaves OUTDIR as it was
        why = refusal(_nodes(partition), cpus_per_task=cpus_per_task, mem_per_cpu=mem_per_cpu,
                      time=time)
        if why:
            raise TooBig(why)
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
        _remember(folder, tasks, only or range(tasks), array_job, report_job)
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


def _remember(folder, count, indexes, array_job, report_job):
    """Note which array job runs each task (a resubmission replaces its tasks' ids)."""
    path = folder / JOBS
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict) or known.get("count") != count:
        known = {"count": count, "tasks": {}}
    known["tasks"].update({str(k): array_job for k in indexes})
    known["report"] = report_job
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=1, sort_keys=True))
    tmp.replace(path)


def queue(output_dir):
    """{Shard: what Slurm says of its task} for the tasks ``jaxlab slurm --submit`` submitted
    into OUTDIR that Slurm still holds, e.g. "pending (PartitionConfig)" or "running" (the
    reason is Slurm's own word); {} when nothing was submitted from here or squeue cannot say."""
    try:
        known = json.loads((shards.state_dir(output_dir) / FOLDER / JOBS).read_text())
        count, tasks = int(known["count"]), {str(k): str(v) for k, v in known["tasks"].items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}
    try:
        done = subprocess.run(["squeue", "-h", "-r", "-j", ",".join(sorted(set(tasks.values()))),
                               "-o", "%F|%K|%T|%r"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if done.returncode != 0:
        return {}
    said = {}
    for line in done.stdout.splitlines():
        job, index, state, reason = (line.split("|") + ["", "", "", ""])[:4]
        if tasks.get(index) == job:
            words = state.lower() + (f" ({reason})" if reason not in ("", "None") else "")
            said[shards.Shard(int(index), count)] = words
    return said


@dataclasses.dataclass(frozen=True)
class Node:
    """One node of a partition, as ``sinfo`` lists it."""

    name: str
    partition: str
    default: bool  # its partition is the cluster's default
    cpus: int
    memory_mb: float
    max_time_s: float  # the partition's MaxTime (inf: none)
    max_time: str  # as sinfo writes it


def _nodes(partition):
    """The nodes of ``partition`` (None: the default one) as ``sinfo`` lists them; [] when
    sinfo cannot be asked (sbatch then gives its own error)."""
    cmd = ["sinfo", "-h", "-N", "-o", "%P|%N|%c|%m|%l"] + (["-p", partition] if partition else [])
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    nodes = []
    for line in done.stdout.splitlines() if done.returncode == 0 else []:
        try:
            part, name, cpus, mem, limit = line.strip().split("|")
            most = seconds(limit)
            nodes.append(Node(name, part.rstrip("*"), part.endswith("*"),
                              int(cpus.rstrip("+")), float(mem.rstrip("+")),
                              math.inf if most is None else most, limit))
        except (ValueError, TypeError):
            continue  # a line this sinfo writes otherwise: leave the judgement to Slurm
    return [n for n in nodes if n.default] if partition is None else nodes


def megabytes(text):
    """Slurm's memory size ("2G", "512" in MB, "1T") in MB; None when it is not one."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)\s*", str(text), re.IGNORECASE)
    if not m:
        return None
    return float(m[1]) * {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 ** 2}[m[2].upper()]


def seconds(text):
    """Slurm's time ("30", "30:00", "1:00:00", "2-12", "2-12:30:00", "infinite") in seconds;
    None when it is not one."""
    t = str(text).strip().lower()
    if t in ("infinite", "unlimited"):
        return math.inf
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", t)
    if not m:
        return None
    days, a, b, c = m.groups()
    if days is not None:  # days-hours[:minutes[:seconds]]
        h, mi, s = int(a), int(b or 0), int(c or 0)
        return ((int(days) * 24 + h) * 60 + mi) * 60 + s
    if c is not None:  # hours:minutes:seconds
        return (int(a) * 60 + int(b)) * 60 + int(c)
    return int(a) * 60 + int(b or 0)  # minutes[:seconds]


def refusal(nodes, *, cpus_per_task, mem_per_cpu=None, time=None):
    """Why no node in ``nodes`` (one or more partitions, from ``sinfo``) could ever run a task
    asking ``cpus_per_task`` cores, ``mem_per_cpu`` per core and ``time``, in one sentence
    naming the option and the largest node; None when some node could (or nothing is known).
    Slurm itself accepts such an array and leaves it pending forever (reason
    ``PartitionConfig`` or ``PartitionTimeLimit``)."""
    per_cpu = megabytes(mem_per_cpu) if mem_per_cpu else None
    memory = per_cpu * cpus_per_task if per_cpu is not None else None
    limit = seconds(time) if time else None
    partitions = {}
    for n in nodes:
        partitions.setdefault(n.partition, []).append(n)
    reasons = []
    for name, members in partitions.items():
        where = f"partition {name}"
        most = max(members, key=lambda n: n.cpus)
        roomiest = max(members, key=lambda n: n.memory_mb)
        never = "no task could ever start there, so nothing was submitted"
        if cpus_per_task > most.cpus:
            reasons.append(f"--cpus-per-task {cpus_per_task} is more CPUs than any node of "
                           f"{where} has (the largest, {most.name}, has {most.cpus}): {never}")
        elif memory is not None and memory > roomiest.memory_mb:
            cores = f"{cpus_per_task} CPU{'s' if cpus_per_task != 1 else ''}"
            reasons.append(f"--mem-per-cpu {mem_per_cpu} asks {memory:.0f} MB for a task of "
                           f"{cores}, more than any node of {where} has (the largest, "
                           f"{roomiest.name}, has {roomiest.memory_mb:.0f} MB): {never}")
        elif memory is not None and not any(n.cpus >= cpus_per_task and n.memory_mb >= memory
                                            for n in members):
            reasons.append(f"--cpus-per-task {cpus_per_task} with --mem-per-cpu {mem_per_cpu} "
                           f"({memory:.0f} MB) fits no node of {where} (those with "
                           f"{cpus_per_task} CPUs have at most "
                           f"{max(n.memory_mb for n in members if n.cpus >= cpus_per_task):.0f} "
                           f"MB): {never}")
        elif limit is not None and limit > most.max_time_s:
            reasons.append(f"--time {time} is longer than {where} lets a job run (its "
                           f"MaxTime is {most.max_time}): {never}")
        else:
            return None
    return reasons[0] if reasons else None


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
