"""The ``jaxlab`` command: a thin click layer over the keyword-only APIs of each verb."""

import inspect
import sys

import click
from click.core import ParameterSource

from .grade.engine.gradescope import BadExport
from .grade.engine.sandbox import Mode
from .grade.output.gradebook import BadCanvasRoster
from .grade.output.late import BadPolicy
from .grade.run.batch import grade as grade_api
from .grade.run.slurm import slurm as slurm_api
from .mutants import mutants as mutants_api
from .mutants.operators import OPERATORS

SANDBOX_MODES = [m.value for m in Mode]
# the CLI shows and passes the API's own defaults, which live in one place
def _defaults(api):
    return {k: p.default for k, p in inspect.signature(api).parameters.items()
            if p.default is not inspect.Parameter.empty}


GRADE_DEFAULTS = _defaults(grade_api)
SLURM_DEFAULTS = _defaults(slurm_api)
MUTANTS_DEFAULTS = _defaults(mutants_api)


@click.group()
def main():
    """Build and grade the JAX parallelism labs."""


@main.command()
@click.option("--check", is_flag=True,
              help="Exit non-zero if the committed releases differ from what the masters build.")
@click.option("--root", type=click.Path(exists=True, file_okay=False), default=".",
              show_default=True, help="Repository root holding assignments/.")
@click.option("--colab-url", default=None, metavar="BASE_URL",
              help="Put an 'Open in Colab' badge linking to BASE_URL/<lab>/<lab>.ipynb in each "
                   "student notebook ('' removes it; default: keep what student/ has).")
@click.argument("names", nargs=-1)
def release(check, root, colab_url, names):
    """Build student/, solutions/ and autograder/ from the masters in assignments/."""
    from .release import release as run_release

    ok = run_release(root=root, names=list(names) or None, check=check, colab_url=colab_url)
    sys.exit(0 if ok else 1)


# options `jaxlab grade` and `jaxlab slurm` share (slurm passes them on to every task)
SHARED = [
    click.option("--timeout", type=float, default=GRADE_DEFAULTS["timeout"], show_default=True,
                 help="Wall-clock limit in seconds for one submission."),
    click.option("--cell-timeout", type=float, default=GRADE_DEFAULTS["cell_timeout"],
                 show_default=True,
                 help="Limit in seconds for one cell; a cell over it is interrupted."),
    click.option("--memory", "memory_mb", type=int, default=GRADE_DEFAULTS["memory_mb"],
                 show_default=True, help="Memory cap per submission in MiB."),
    click.option("--processes", type=int, default=GRADE_DEFAULTS["processes"], show_default=True,
                 help="Processes and threads one submission's sandbox may run at once."),
    click.option("--cpus", type=float, default=GRADE_DEFAULTS["cpus"], show_default=True,
                 help="CPU time per submission, in cores."),
    click.option("--disk", "disk_mb", type=int, default=GRADE_DEFAULTS["disk_mb"],
                 show_default=True,
                 help="What one submission may write (its folder, home and /tmp), in MiB."),
    click.option("--assignment", default=None,
                 help="Which shipped lab to grade against (default: guessed from the notebooks)."),
    click.option("--autograder", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="Any otter autograder zip instead of a shipped one."),
    click.option("--warm-up", "warm_up", type=click.Path(exists=True, dir_okay=False,
                                                         resolve_path=True),
                 default=None,
                 help="Your solution notebook, graded once per autograder and machine to write "
                      "the compilation cache every kernel reads (default: the shipped solution)."),
    click.option("--force", is_flag=True, help="Grade again what OUTPUT_DIR already holds."),
    click.option("--sandbox", type=click.Choice(SANDBOX_MODES), default=GRADE_DEFAULTS["sandbox"],
                 show_default=True,
                 help="Run each kernel in a bubblewrap sandbox: 'auto' where bwrap runs (else say "
                      "so in every row), 'require' to refuse grading without it, 'off' never."),
]

def _all(options):
    """A decorator applying ``options`` in their listed order."""
    def apply(f):
        for option in reversed(options):
            f = option(f)
        return f
    return apply


shared_options = _all(SHARED)


# what a course adds around grading (`jaxlab grade` and `jaxlab report`; kept in OUTPUT_DIR)
COURSE = [
    click.option("--deadline", default=None, metavar="TIME",
                 help="The deadline with its time zone, e.g. '2025-03-07 23:59 America/New_York' "
                      "or 2025-03-07T23:59-05:00 (needs Gradescope's export for submission "
                      "times; kept for later reports)."),
    click.option("--late-penalty", default=None, metavar="RATE",
                 help="Percent of the points off per started day or hour late: 10%/day, 2%/hour."),
    click.option("--grace", default=None, metavar="DURATION",
                 help="Lateness forgiven, e.g. 15m (past it, lateness counts from the deadline)."),
    click.option("--late-cap", default=None, metavar="PERCENT",
                 help="The most a late penalty takes, e.g. 50%."),
    click.option("--cutoff", default=None, metavar="DURATION|TIME",
                 help="Zero after this long past a student's deadline (e.g. 5d), or after this "
                      "time (with its zone)."),
    click.option("--extensions", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="CSV of extensions: a column email, sid or name, and a column 'extension' "
                      "(2d, 36h) or 'deadline' (a time with its zone)."),
    click.option("--canvas-roster", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="Canvas's gradebook export, to give canvas_grades.csv the students' Canvas "
                      "IDs and the assignment's column (kept for later reports)."),
    click.option("--canvas-assignment", default=None, metavar="TITLE",
                 help="The column of the Canvas gradebook export to fill, e.g. 'Lab 4: shard_map "
                      "(90210)' (default: the one titled as the lab is named; kept for later "
                      "reports)."),
    click.option("--template", type=click.Path(exists=True, dir_okay=False), default=None,
                 help="The student notebook as released, whose starter code the similarity check "
                      "leaves out (default: the shipped one for the autograder)."),
]

course_options = _all(COURSE)


def given_options(ctx, names):
    """The options among ``names`` that the user gave, as a command line taking them again.

    Click's own record of where each value came from decides, not a comparison with the
    default: click 8.5 gives a flag declared without a default a sentinel default, which a
    ``False`` flag differs from."""
    args = []
    for param in ctx.command.params:
        if param.name not in names or ctx.get_parameter_source(param.name) in (
                None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP):
            continue
        value = ctx.params[param.name]
        if param.is_flag:  # `--flag` (or its `--no-flag` side, when it has one)
            args += [param.opts[0]] if value else param.secondary_opts[:1]
        elif value is not None:
            args += [param.opts[0], str(value)]
    return args


class BadInput(click.ClickException):
    """An export, roster, extensions file or policy that cannot be used: its one sentence,
    without the "Usage: ... Try --help" a mistyped command gets; exit status 2, as before."""

    exit_code = 2


def _grade_errors(call):
    try:
        return call()
    except (BadExport, BadCanvasRoster, BadPolicy) as exc:
        raise BadInput(str(exc)) from None
    except (ValueError, FileNotFoundError) as exc:  # which autograder, --shard, --only
        raise click.UsageError(str(exc)) from None


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--output-dir", default=GRADE_DEFAULTS["output_dir"], show_default=True,
              help="Where final_grades.csv, summaries and plots are written.")
@click.option("--workers", type=int, default=None,
              help="Submissions graded at once (default: one per core this process may use).")
@click.option("--shard", default=None, metavar="K/N",
              help="Grade only shard K of N (from 0) into OUTPUT_DIR, which the other shards "
                   "share; `jaxlab report OUTPUT_DIR` then writes the CSV and the class report.")
@click.option("--only", multiple=True, metavar="NAME",
              help="Grade again only this submission (file name, export folder, or a student's "
                   "name, email or SID; repeatable), keep every other grade, rewrite the class's "
                   "files.")
@shared_options
@course_options
def grade(paths, output_dir, workers, shard, only, **options):
    """Grade submissions (.ipynb, grader.export() zips, folders of them, or Gradescope's
    Export Submissions archive or folder) without Docker."""
    ok = _grade_errors(lambda: grade_api(paths=list(paths), output_dir=output_dir,
                                         workers=workers, shard=shard, only=list(only) or None,
                                         **options))
    sys.exit(0 if ok else 1)


@main.command()
@click.argument("output_dir", type=click.Path(exists=True, file_okay=False))
@course_options
def report(output_dir, **options):
    """Write final_grades.csv, summaries, plots and report.html from every shard's records
    (with Gradescope's export: the gradebook files, the late policy applied).

    Exits non-zero while some shard's submissions have no record yet (what is graded is
    written all the same, and the missing shards are named)."""
    from .grade.run.report import report as report_api

    ok = _grade_errors(lambda: report_api(output_dir=output_dir, **options))
    sys.exit(0 if ok else 1)


@main.command()
@click.argument("output_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--template", type=click.Path(exists=True, dir_okay=False), default=None,
              help="The student notebook as released (default: the one kept in OUTPUT_DIR).")
def similar(output_dir, template):
    """Pairs of submissions in OUTPUT_DIR more alike than the task forces (writes
    similar_pairs.csv; `jaxlab report` also puts them on report.html)."""
    from .grade.run.report import similar as similar_api

    _grade_errors(lambda: similar_api(output_dir=output_dir, template=template))


@main.command()
@click.argument("output_dir", type=click.Path(exists=True, file_okay=False))
def status(output_dir):
    """Done, failed and remaining submissions per shard of OUTPUT_DIR (and, for the tasks
    `jaxlab slurm --submit` submitted, what Slurm says of those it still holds)."""
    from .grade.run.shard import status as status_api
    from .grade.run.slurm import queue

    rows = _grade_errors(lambda: status_api(output_dir=output_dir, queue=queue(output_dir)))
    sys.exit(0 if all(r.remaining == 0 for r in rows) else 1)


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--output-dir", default=GRADE_DEFAULTS["output_dir"], show_default=True,
              help="The shared folder every task grades into.")
@click.option("--tasks", type=int, required=True, help="Array tasks, one shard each.")
@click.option("--cpus-per-task", type=int, default=SLURM_DEFAULTS["cpus_per_task"],
              show_default=True, help="Cores per task: one kernel on each.")
@click.option("--time", default=None, help="Slurm time limit per task (default: the cluster's).")
@click.option("--partition", default=None, help="Slurm partition (default: the cluster's).")
@click.option("--mem-per-cpu", default=None,
              help="Slurm memory per core, e.g. 2G (default: the cluster's).")
@click.option("--node-cache", default=SLURM_DEFAULTS["node_cache"], show_default=True,
              help="Node-local folder for the compilation cache, warmed once per node.")
@click.option("--only", default=None, metavar="K[,K...]",
              help="Submit only these tasks (resubmit those that did not finish).")
@click.option("--submit", is_flag=True, help="Submit the array and the report job with sbatch.")
@shared_options
def slurm(paths, output_dir, tasks, cpus_per_task, time, partition, mem_per_cpu, node_cache,
          only, submit, autograder, assignment, **options):
    """Grade as a Slurm job array (one shard per task), then the report in a dependent job."""
    from .grade.run.slurm import SlurmError

    # the shared options given, as `jaxlab grade` takes them; the rest keep its defaults
    grade_args = given_options(click.get_current_context(), options)
    try:
        only = [int(k) for k in only.split(",")] if only else None
    except ValueError:
        raise click.UsageError(f"--only takes task indexes like 1,3; got {only!r}") from None
    try:
        _grade_errors(lambda: slurm_api(
            paths=list(paths), output_dir=output_dir, tasks=tasks, cpus_per_task=cpus_per_task,
            time=time, partition=partition, mem_per_cpu=mem_per_cpu, node_cache=node_cache,
            autograder=autograder, assignment=assignment, grade_args=grade_args, only=only,
            submit=submit))
    except SlurmError as exc:
        raise click.ClickException(str(exc)) from None


def _operators_epilog():
    """The operators and what each does, for `jaxlab mutants --help` (from their docstrings)."""
    from .mutants.operators import describe

    return "\b\nOperators (--operator):\n" + "\n".join(
        f"  {name}: {what}" for name, what in describe().items())


@main.command(epilog=_operators_epilog())
@click.argument("lab")
@click.option("--question", "questions", multiple=True, metavar="QUESTION",
              help="Only this graded question (repeatable; default: every one).")
@click.option("--operator", "operators", multiple=True, type=click.Choice(list(OPERATORS)),
              help="Only this mutation operator (repeatable; default: every one; listed below).")
@click.option("--list", "list_only", is_flag=True,
              help="Print the mutants (key, line, change) and how many each operator makes, "
                   "without grading them (no kernel).")
@click.option("--report", type=click.Path(dir_okay=False), default=MUTANTS_DEFAULTS["report"],
              help="Write the markdown report here (default for a whole lab: "
                   "docs/mutants/LAB.md).")
@click.option("--root", type=click.Path(exists=True, file_okay=False),
              default=MUTANTS_DEFAULTS["root"], show_default=True,
              help="Repository root holding the releases, tests/answers/ and tests/mutants/.")
def mutants(lab, questions, operators, list_only, report, root):
    """Mutation analysis of LAB's hidden checks: seed small faults into the solution's answers,
    grade each with the shipped checks, and report every mutant that keeps full marks.

    A mutant stopped by its time limit is run once more with three times the limit; if it is
    stopped again it is reported as killed by a limit. Exits non-zero while a mutant survives
    that tests/mutants/LAB.yaml does not decide equivalent by its key (a gap in the checks, or a
    survivor waiting for a person's decision)."""
    if list_only:
        from .mutants import listing

        try:
            listing(lab, root=root, questions=list(questions) or None,
                    operators=list(operators) or None)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        return
    try:
        analysis = mutants_api(lab, root=root, questions=list(questions) or None,
                               operators=list(operators) or None, report=report)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    sys.exit(0 if not analysis.of("gap") and not analysis.of("undecided") else 1)
