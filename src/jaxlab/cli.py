"""The ``jaxlab`` command: a thin click layer over the keyword-only APIs of each verb."""

import sys

import inspect

import click

from .grade import grade as grade_api
from .grade.sandbox import Mode

SANDBOX_MODES = [m.value for m in Mode]
# the CLI shows and passes the API's own defaults, which live in one place
GRADE_DEFAULTS = {k: p.default for k, p in inspect.signature(grade_api).parameters.items()
                  if p.default is not inspect.Parameter.empty}


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


@main.command()
@click.argument("paths", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("-o", "--output-dir", default=GRADE_DEFAULTS["output_dir"], show_default=True,
              help="Where final_grades.csv, summaries and plots are written.")
@click.option("--workers", type=int, default=None,
              help="Submissions graded at once (default: one per core).")
@click.option("--timeout", type=float, default=GRADE_DEFAULTS["timeout"], show_default=True,
              help="Wall-clock limit in seconds for one submission.")
@click.option("--cell-timeout", type=float, default=GRADE_DEFAULTS["cell_timeout"],
              show_default=True,
              help="Limit in seconds for one cell; a cell over it is interrupted.")
@click.option("--memory", "memory_mb", type=int, default=GRADE_DEFAULTS["memory_mb"],
              show_default=True,
              help="Memory cap per submission in MiB.")
@click.option("--processes", type=int, default=GRADE_DEFAULTS["processes"], show_default=True,
              help="Processes and threads one submission's sandbox may run at once.")
@click.option("--cpus", type=float, default=GRADE_DEFAULTS["cpus"], show_default=True,
              help="CPU time per submission, in cores.")
@click.option("--disk", "disk_mb", type=int, default=GRADE_DEFAULTS["disk_mb"],
              show_default=True,
              help="What one submission may write (its folder, home and /tmp), in MiB.")
@click.option("--assignment", default=None,
              help="Which shipped lab to grade against (default: guessed from the notebooks).")
@click.option("--autograder", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Any otter autograder zip instead of a shipped one.")
@click.option("--warm-up", "warm_up", type=click.Path(exists=True, dir_okay=False),
              default=None,
              help="Your solution notebook, graded once per autograder and machine to write the "
                   "compilation cache every kernel reads (default: the shipped solution).")
@click.option("--force", is_flag=True, help="Grade again what OUTPUT_DIR already holds.")
@click.option("--sandbox", type=click.Choice(SANDBOX_MODES), default=GRADE_DEFAULTS["sandbox"],
              show_default=True,
              help="Run each kernel in a bubblewrap sandbox: 'auto' where bwrap runs (else say "
                   "so in every row), 'require' to refuse grading without it, 'off' never.")
def grade(paths, output_dir, workers, timeout, cell_timeout, memory_mb, processes, cpus, disk_mb,
          assignment, autograder, warm_up, force, sandbox):
    """Grade submissions (.ipynb, grader.export() zips, or folders of them) without Docker."""
    try:
        ok = grade_api(paths=list(paths), output_dir=output_dir, workers=workers,
                       timeout=timeout, cell_timeout=cell_timeout, memory_mb=memory_mb,
                       processes=processes, cpus=cpus, disk_mb=disk_mb, assignment=assignment, autograder=autograder, warm_up=warm_up,
                       force=force, sandbox=sandbox)
    except (ValueError, FileNotFoundError) as exc:  # which autograder to use
        raise click.UsageError(str(exc)) from None
    sys.exit(0 if ok else 1)
