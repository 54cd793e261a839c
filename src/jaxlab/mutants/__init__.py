"""``jaxlab mutants``: mutation analysis of a lab's hidden checks (see ``analysis``)."""

import pathlib
import shlex
import sys

from .. import corpus
from .analysis import Analysis, analyse  # noqa: F401  (the API)


def _question_line(console, outcomes):
    """'q1_remat_scan: 31 mutants, 29 killed, 2 survived, 95 s' for the question just done."""
    if outcomes:
        killed = sum(o.status == "killed" for o in outcomes)
        console.print(f"{outcomes[0].question}: {len(outcomes)} mutants, {killed} killed, "
                      f"{len(outcomes) - killed} survived, "
                      f"{sum(o.seconds for o in outcomes):.0f} s", highlight=False)


def report_path(root, lab):
    return pathlib.Path(root) / "docs" / "mutants" / f"{lab}.md"


def mutants(lab, *, root=".", questions=None, operators=None, report=None, console=None):
    """Analyse ``lab`` (every graded question, every operator unless narrowed), show the tables
    and write the markdown report: to ``report``, or, for a whole lab, to
    ``docs/mutants/<lab>.md``. Returns the Analysis."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, \
        TimeElapsedColumn, TimeRemainingColumn

    console = console or Console(stderr=True)
    root = pathlib.Path(root)
    if lab not in corpus.labs(root):
        raise ValueError(f"no released lab {lab!r} with an answer corpus under {root}; "
                         f"labs: {', '.join(corpus.labs(root)) or 'none'}")
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("killed {task.fields[killed]} · survived {task.fields[survived]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    counts = {"killed": 0, "survived": 0}
    console.print(f"{lab}: running the solution once, then its mutants")
    # bars on a terminal; in a log (CI, a batch job), a line per question as it finishes
    with Progress(*columns, console=console, disable=not console.is_terminal) as bars:
        task = bars.add_task(lab, total=None, killed=0, survived=0)
        done = []  # the outcomes of the question under way, for a log's line

        def progress(outcome, finished, total):
            if not console.is_terminal and done and outcome.question != done[0].question:
                _question_line(console, done)
                done.clear()
            done.append(outcome)
            counts["killed" if outcome.status == "killed" else "survived"] += 1
            bars.update(task, completed=finished, total=total,
                        description=f"{lab} {outcome.question}", **counts)

        analysis = analyse(lab, root=root, questions=questions, operators=operators,
                           progress=progress)
        if not console.is_terminal:
            _question_line(console, done)
    from .report import markdown, terminal

    terminal(analysis, console)
    whole = questions is None and operators is None
    target = report or (report_path(root, lab) if whole else None)
    if target:
        command = "jaxlab mutants " + " ".join(shlex.quote(a) for a in sys.argv[2:]) \
            if sys.argv[1:2] == ["mutants"] else f"jaxlab mutants {lab}"
        pathlib.Path(target).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(target).write_text(markdown(analysis, command))
        console.print(f"report: {target}")
    return analysis
