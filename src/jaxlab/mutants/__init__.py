"""``jaxlab mutants``: mutation analysis of a lab's hidden checks (see ``analysis``)."""

import pathlib
import shlex
import sys

from .. import corpus
from . import operators as ops
from .analysis import Analysis, analyse, plan  # noqa: F401  (the API)


def _question_line(console, outcomes):
    """'q1_remat_scan: 31 mutants, 28 killed by a check, 1 by a limit, 2 survived, 95 s' for
    the question just done."""
    if outcomes:
        killed = sum(o.status == "killed" for o in outcomes)
        limit = sum(o.status == "limit" for o in outcomes)
        console.print(f"{outcomes[0].question}: {len(outcomes)} mutants, {killed} killed by a "
                      f"check, {limit} by a limit, {len(outcomes) - killed - limit} survived, "
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
            counts["killed" if outcome.status in ("killed", "limit") else "survived"] += 1
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


def listing(lab, *, root=".", questions=None, operators=None, out=None):
    """Print every mutant ``jaxlab mutants`` would grade for ``lab`` (question, key, line,
    change, a line each), then how many per question and per operator, without grading any
    (no kernel: the releases are read). Returns the (question, mutant) pairs."""
    import collections

    out = out or sys.stdout
    root = pathlib.Path(root)
    if lab not in corpus.labs(root):
        raise ValueError(f"no released lab {lab!r} with an answer corpus under {root}; "
                         f"labs: {', '.join(corpus.labs(root)) or 'none'}")
    pairs = plan(corpus.Release(lab, root), questions, operators)
    for question, m in pairs:
        print(f"{question}\t{m.key}\tline {m.line}\t{m.change}", file=out)
    per_question = collections.Counter(q for q, _ in pairs)
    per_operator = collections.Counter(m.operator for _, m in pairs)
    print(f"{lab}: {len(pairs)} mutants", file=out)
    print("per question: " + ", ".join(f"{q} {n}" for q, n in per_question.items()), file=out)
    print("per operator: " + ", ".join(f"{name} {per_operator[name]}" for name in ops.OPERATORS
                                       if per_operator[name]), file=out)
    return pairs
