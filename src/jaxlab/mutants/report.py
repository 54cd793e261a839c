"""What ``jaxlab mutants`` shows: a table per question and per operator, every survivor with its
change and what was found or decided (markdown for ``docs/mutants/<lab>.md``, rich for the
terminal)."""

import collections
import datetime

from . import operators as ops


def _counts(outcomes):
    c = collections.Counter(o.status for o in outcomes)
    counted = len(outcomes) - c["equivalent"]
    score = c["killed"] / counted if counted else 1.0
    return [len(outcomes), c["killed"], c["equivalent"], c["gap"], c["undecided"],
            f"{100 * score:.1f}%"]


HEAD = ["mutants", "killed", "equivalent", "gaps", "undecided", "score"]


def rows_by(outcomes, key):
    groups = collections.defaultdict(list)
    for o in outcomes:
        groups[key(o)].append(o)
    return {name: _counts(group) for name, group in groups.items()}


def _questions(analysis):
    order = list(dict.fromkeys(o.question for o in analysis.outcomes))
    rows = rows_by(analysis.outcomes, lambda o: o.question)
    return [[q, *rows[q]] for q in order] + [["**all**", *_counts(analysis.outcomes)]]


def _operators(analysis):
    rows = rows_by(analysis.outcomes, lambda o: o.mutant.operator)
    return [[name, ops.OPERATORS[name][0], *rows[name]] for name in ops.OPERATORS if name in rows]


def _md_table(head, rows):
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return lines


def _code(text):
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`"


def markdown(analysis, command):
    """The report as a markdown page."""
    survivors = [o for o in analysis.outcomes if o.status != "killed"]
    minutes, seconds = divmod(round(analysis.seconds), 60)
    lines = [
        f"# Mutation analysis of {analysis.lab}'s checks", "",
        f"`{command}` on {datetime.date.today().isoformat()}: {len(analysis.outcomes)} mutants "
        f"of the solution's answer cells graded by the shipped checks in {minutes} min "
        f"{seconds} s (the solution's own run: {analysis.solution_seconds:.0f} s). Mutation "
        f"score, killed / (all − equivalent): **{100 * analysis.score():.1f}%**.", "",
        "*killed*: the question loses points; *gap*: full marks although the probe recorded "
        "other values, shapes, dtypes, shardings or errors than for the solution on the same "
        "inputs; *undecided*: full marks with the same evidence, waiting for a person's "
        "decision; *equivalent*: decided so on the task's text (`tests/mutants/"
        f"{analysis.lab}.yaml`). How to read and act on it: docs/architecture.md.", "",
        "## Per question", "", *_md_table(["question", *HEAD], _questions(analysis)), "",
        "## Per operator", "", *_md_table(["operator", "family", *HEAD], _operators(analysis)),
        ""]
    for status in ("gap", "undecided", "equivalent"):
        chosen = [o for o in survivors if o.status == status]
        if not chosen:
            continue
        lines += [f"## {status.capitalize()}{'s' if status == 'gap' else ''} ({len(chosen)})", ""]
        for o in chosen:
            m = o.mutant
            lines.append(f"- **{o.question}** `{m.key}` line {m.line}: {_code(m.before)} → "
                         f"{_code(m.after)}")
            if o.decision:
                free = f" (the text leaves `{o.decision['evidence']}` free)" \
                    if "evidence" in o.decision else ""
                lines.append(f"  - decided equivalent{free}: “{o.decision['text']}” — "
                             f"{o.decision['why']}")
            if status != "equivalent" or o.detail != "the same evidence":
                lines.append(f"  - evidence: {o.detail}")
        lines.append("")
    undecided = [o for o in survivors if o.status == "undecided"]
    if undecided:  # a start for the decisions file: each still to be read against the text
        lines += [f"To decide one as equivalent, add it to `tests/mutants/{analysis.lab}.yaml` "
                  "with the task's sentence that allows it (or kill it with a stronger check):",
                  "", "```yaml"]
        for question in dict.fromkeys(o.question for o in undecided):
            lines += [f"{question}:", "  equivalent:"]
            for o in (o for o in undecided if o.question == question):
                lines += [f"  - key: {o.mutant.key}", f"    change: {o.mutant.change!r}",
                          "    text: ...", "    why: ..."]
        lines += ["```", ""]
    killed = [o for o in analysis.outcomes if o.status == "killed"]
    if killed:
        lines += [f"## Killed ({len(killed)}), with what the student would read", ""]
        for question in dict.fromkeys(o.question for o in killed):
            mine = [o for o in killed if o.question == question]
            lines += [f"<details><summary>{question}: {len(mine)}</summary>", ""]
            lines += [f"- line {o.mutant.line} {o.mutant.operator}: {_code(o.mutant.change)} — "
                      f"{o.detail}" for o in mine]
            lines += ["", "</details>", ""]
    if analysis.stale_decisions:
        lines += ["## Decisions naming no surviving mutant", ""]
        lines += [f"- `{d['key']}` {_code(d['change'])}" for d in analysis.stale_decisions]
        lines.append("")
    return "\n".join(lines)


def terminal(analysis, console):
    """The per-question table, then every survivor that is not decided equivalent."""
    from rich.table import Table

    table = Table(title=f"{analysis.lab}: mutation analysis ({analysis.seconds / 60:.1f} min)")
    for name in ["question", *HEAD]:
        table.add_column(name, justify="left" if name == "question" else "right")
    for row in _questions(analysis):
        table.add_row(*[str(c).replace("**", "") for c in row])
    console.print(table)
    for o in analysis.outcomes:
        if o.status in ("gap", "undecided"):
            style = "red" if o.status == "gap" else "yellow"
            console.print(f"[{style}]{o.status}[/] {o.question} {o.mutant.key} line "
                          f"{o.mutant.line}: {o.mutant.change}", highlight=False, markup=True)
            console.print(f"    {o.detail}", highlight=False, markup=False)
    for d in analysis.stale_decisions:
        console.print(f"stale decision {d['key']}: {d['change']} (no surviving mutant)",
                      highlight=False, markup=False)

