"""What ``jaxlab mutants`` shows: a table per question and per operator, every survivor with its
change and what was found or decided, every kill by a limit with the limit it hit, the killed
mutants' messages counted by kind with a sample of each (``messages``) (markdown for
``docs/mutants/<lab>.md``, rich for the terminal)."""

import collections
import datetime

from . import messages as msgs
from . import operators as ops

HEAD = ["mutants", "killed by a check", "killed by a limit", "equivalent", "gaps", "undecided",
        "score", "time"]


def duration(seconds):
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def _counts(outcomes, seconds=None):
    c = collections.Counter(o.status for o in outcomes)
    counted = len(outcomes) - c["equivalent"]
    score = (c["killed"] + c["limit"]) / counted if counted else 1.0
    seconds = sum(o.seconds for o in outcomes) if seconds is None else seconds
    return [len(outcomes), c["killed"], c["limit"], c["equivalent"], c["gap"], c["undecided"],
            f"{100 * score:.1f}%", duration(seconds)]


def rows_by(outcomes, key):
    groups = collections.defaultdict(list)
    for o in outcomes:
        groups[key(o)].append(o)
    return {name: _counts(group) for name, group in groups.items()}


def _questions(analysis):
    order = list(dict.fromkeys(o.question for o in analysis.outcomes))
    rows = rows_by(analysis.outcomes, lambda o: o.question)
    return [[q, *rows[q]] for q in order] + [
        ["**all**", *_counts(analysis.outcomes, analysis.seconds)]]


def _operators(analysis):
    rows = rows_by(analysis.outcomes, lambda o: o.mutant.operator)
    return [[name, ops.OPERATORS[name][0], *rows[name]] for name in ops.OPERATORS if name in rows]


def _md_table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _code(text):
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`"


TITLES = {"gap": "Gaps", "undecided": "Undecided", "equivalent": "Equivalent",
          "limit": "Killed by a limit"}


def _survivors(analysis, statuses):
    """A section per status: each mutant, its change, and what was found or decided."""
    lines = []
    for status in statuses:
        chosen = analysis.of(status)
        if not chosen:
            continue
        lines += [f"## {TITLES[status]} ({len(chosen)})", ""]
        for o in chosen:
            m = o.mutant
            lines.append(f"- **{o.question}** `{m.key}` line {m.line}: {_code(m.before)} → "
                         f"{_code(m.after)}")
            if o.decision:
                lines.append(f"  - decided equivalent: “{o.decision['text']}” — "
                             f"{o.decision['why']}")
            lines += [f"  - undecided: {why}" for why in o.why]
            if status == "limit":
                lines.append(f"  - {o.detail}")
            elif not (status == "undecided" or status == "equivalent" and
                      o.detail == "the same evidence"):
                lines.append(f"  - evidence: {o.detail}")
            if o.rerun:
                lines.append(f"  - {o.rerun}")
        lines.append("")
    return lines


def _kinds_of(outcome, analysis):
    """' — kinds: generic (hidden), internals (public)' for a killed mutant's messages."""
    found = msgs.of_outcome(outcome, tuple(analysis.graded.get(outcome.question, ())))
    return " — kinds: " + ", ".join(
        f"{msgs.LABELS[m.kind]} ({'hidden' if m.hidden else 'public'})" for m in found) \
        if found else ""


def _kind_row(name, mutants, messages):
    c = msgs.counts(messages)
    hidden = sum(m.hidden for m in messages)
    return [name, mutants, f"{len(messages)} ({hidden} / {len(messages) - hidden})",
            *[c[k] for k in msgs.KINDS]]


def _message_kinds(analysis, messages):
    """The section on what the killed mutants' students read: counts per kind (per question,
    hidden and public cases apart) and a fixed-seed sample of each kind for a person."""
    killed = [o for o in analysis.outcomes if o.status in ("killed", "limit")]
    if not killed:
        return []
    head = ["question", "killed mutants", "messages (hidden / public)",
            *[msgs.LABELS[k] for k in msgs.KINDS]]
    rows = []
    for question in dict.fromkeys(o.question for o in killed):
        rows.append(_kind_row(question, sum(o.question == question for o in killed),
                              [m for m in messages if m.question == question]))
    rows.append(_kind_row("**all**", len(killed), messages))
    rows.append(_kind_row("all, hidden cases", "", [m for m in messages if m.hidden]))
    rows.append(_kind_row("all, public cases", "", [m for m in messages if not m.hidden]))
    lines = [f"## Messages of the killed mutants ({len(messages)})", "",
             "What the student reads for each killed mutant: the message of every failing case "
             "of its question (the hidden case, which holds the points and is shown on "
             "Gradescope, and the public cases `grader.check` runs), and for a kill by a limit "
             "the timeout. Each message's kind comes from the first rule that applies "
             "(`src/jaxlab/mutants/messages.py`): *internals*: a traceback, a path or module "
             "of the grader, a repr of evidence, \"could not be checked\", or an exception "
             "other than the check's AssertionError; *timeout*: a kill by a limit or a stopped "
             "run; *student's exception*: it names the exception the student's code raised; "
             "\"not defined yet\" is *generic* where a cell raised or a statement was left "
             "out, else *misleading*; a type message is *names the fault* for a mutant that "
             "changes a type, *generic* where None was found, else *misleading*; *names the "
             "fault*: it names a graded variable in backticks, says what was expected and has "
             "a word of the mutant's operator family (or an identifier the mutant changed); "
             "else *generic*. The rules are heuristics: read the sample below. Target: no "
             "misleading message and no internals.", "",
             *_md_table(head, rows), ""]
    for kind in msgs.KINDS:
        chosen = msgs.sample(messages, kind)
        if not chosen:
            continue
        mine = sum(m.kind == kind for m in messages)
        lines += [f"### {msgs.LABELS[kind].capitalize()}: {len(chosen)} of {mine}, drawn "
                  f"with seed {msgs.SAMPLE_SEED}", ""]
        for m in chosen:
            text = " ".join(m.text.split())
            text = text if len(text) <= 400 else text[:397] + "..."
            lines += [f"- **{m.question}** {m.operator} {_code(m.change)}, "
                      f"{'hidden' if m.hidden else 'public'} case — {text}",
                      f"  - rule: {m.rule}"]
        lines.append("")
    return lines


def markdown(analysis, command):
    """The report as a markdown page."""
    lines = [
        f"# Mutation analysis of {analysis.lab}'s checks", "",
        f"`{command}` on {datetime.date.today().isoformat()}: {len(analysis.outcomes)} mutants "
        f"of the solution's answer cells graded by the shipped checks in "
        f"{duration(analysis.seconds)} (the solution's own run: "
        f"{analysis.solution_seconds:.0f} s). Mutation score, killed / (all − equivalent): "
        f"**{100 * analysis.score():.1f}%**.", "",
        "*killed by a check*: the question loses points; *killed by a limit*: the mutant ran "
        "past its time limit or killed the kernel, and again when run once more with "
        "three times the limit (the student would read a timeout, not a check's message); "
        "*gap*: full marks although the probe recorded other values, shapes, dtypes, "
        "shardings or errors than for the solution on the same inputs; *undecided*: full "
        "marks and no difference the probe can tell, waiting for a person's decision by key "
        "(why, for each); *equivalent*: decided so on the task's text (`tests/mutants/"
        f"{analysis.lab}.yaml`). *time*: grading the mutants (the **all** row: the whole "
        "analysis, the solution's runs included). How to read and act on it: "
        "docs/architecture.md.", "",
        "## Per question", "", *_md_table(["question", *HEAD], _questions(analysis)), "",
        "## Per operator", "", *_md_table(["operator", "family", *HEAD], _operators(analysis)),
        ""]
    lines += _survivors(analysis, ("gap", "undecided"))
    undecided = analysis.of("undecided")
    if undecided:  # a start for the decisions file: each still to be read against the text
        lines += [f"To decide one as equivalent, add it to `tests/mutants/{analysis.lab}.yaml` "
                  "with the task's whole sentence that allows it (or kill it with a stronger "
                  "check):", "", "```yaml"]
        for question in dict.fromkeys(o.question for o in undecided):
            lines += [f"{question}:", "  equivalent:"]
            for o in (o for o in undecided if o.question == question):
                lines += [f"  - key: {o.mutant.key}", f"    change: {o.mutant.change!r}",
                          "    text: ...", "    why: ..."]
        lines += ["```", ""]
    lines += _survivors(analysis, ("equivalent", "limit"))
    messages = msgs.of_analysis(analysis)
    lines += _message_kinds(analysis, messages)
    killed = analysis.of("killed")
    if killed:
        lines += [f"## Killed by a check ({len(killed)}), with what the student would read", ""]
        for question in dict.fromkeys(o.question for o in killed):
            mine = [o for o in killed if o.question == question]
            lines += [f"<details><summary>{question}: {len(mine)}</summary>", ""]
            lines += [f"- line {o.mutant.line} {o.mutant.operator}: {_code(o.mutant.change)} — "
                      f"{o.detail}" + (f" ({o.rerun})" if o.rerun else "") +
                      _kinds_of(o, analysis) for o in mine]
            lines += ["", "</details>", ""]
    if analysis.stale_decisions:
        lines += ["## Decisions naming no surviving mutant", ""]
        lines += [f"- `{d['key']}` {_code(d['change'])}" for d in analysis.stale_decisions]
        lines.append("")
    return "\n".join(lines)


def terminal(analysis, console):
    """The per-question table, then every survivor that is not decided equivalent (with why it
    is undecided) and every kill by a limit."""
    from rich.table import Table

    table = Table(title=f"{analysis.lab}: mutation analysis ({duration(analysis.seconds)})")
    for name in ["question", *HEAD]:
        table.add_column(name, justify="left" if name == "question" else "right")
    for row in _questions(analysis):
        table.add_row(*[str(c).replace("**", "") for c in row])
    console.print(table)
    styles = {"gap": "red", "undecided": "yellow", "limit": "magenta"}
    for o in analysis.outcomes:
        if o.status in styles:
            label = "killed by a limit" if o.status == "limit" else o.status
            console.print(f"[{styles[o.status]}]{label}[/] {o.question} {o.mutant.key} line "
                          f"{o.mutant.line}: {o.mutant.change}", highlight=False, markup=True)
            for line in (*(o.why or (o.detail,)), *((o.rerun,) if o.rerun else ())):
                console.print(f"    {line}", highlight=False, markup=False)
    for d in analysis.stale_decisions:
        console.print(f"stale decision {d['key']}: {d['change']} (no surviving mutant)",
                      highlight=False, markup=False)
    messages = msgs.of_analysis(analysis)
    if messages:
        c = msgs.counts(messages)
        console.print(f"messages of the killed mutants ({len(messages)}): " + ", ".join(
            f"{msgs.LABELS[k]} {c[k]}" for k in msgs.KINDS), highlight=False, markup=False)
