"""``report.html``: one self-contained page saying how each question went and why points were lost.

Per question, in notebook order: the shares of full marks, partial credit, zero, error and
timed out (the categories of ``tally.per_question``), and the reasons students lost points:
the failure messages grouped by their shape (``shape``: the same sentence with other numbers,
quoted names, identifiers or arrays is one reason), most common first, with a count and a few
example submissions linked to their feedback. Then every submission, linked to its summary.

No script, no external file: inline CSS, relative links to the summaries beside it, so the page
opens from the folder (or a copy of it) in any browser.
"""

import collections
import dataclasses
import html
import pathlib
import re
import urllib.parse

from .results import GRADESCOPE, SUMMARIES, stem
from .tally import CATEGORIES, COLOURS, in_notebook_order, per_question

PAGE = "report.html"
REASONS_SHOWN = 6  # per question, before "more reasons"
EXAMPLES = 3  # example submissions per reason
MESSAGE_CHARS = 600  # a message longer than this is cut (tracebacks)

# What varies between two students' copies of one message. Order matters: arrays first (they
# hold numbers), then partition specs, quoted and backticked text, then numbers.
_ARRAY = re.compile(r"\b(?:Array|array|DeviceArray)\((?:[^()]|\([^()]*\))*\)"
                    r"|\[[\[\]\s\d.,eE+\-…]*\d[\[\]\s\d.,eE+\-…]*\]")
_SPEC = re.compile(r"\b(?:P|PartitionSpec)\([^()]*\)")  # P('x', None) and P(None, 'y') alike
_QUOTED = re.compile(r"'[^'\n]{0,80}'|\"[^\"\n]{0,80}\"")
_BACKTICKED = re.compile(r"`[^`\n]{1,120}`")
_NUMBER = re.compile(r"(?<![\w.])(?:0x[0-9a-fA-F]+|[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
                     r"(?![\w])")


def shape(message):
    """``message`` with what differs between students replaced by placeholders."""
    s = _ARRAY.sub("[…]", message)
    s = _SPEC.sub("P(…)", s)
    s = _QUOTED.sub("'…'", s)
    s = _BACKTICKED.sub("`…`", s)
    s = _NUMBER.sub("#", s)
    return " ".join(s.split())


@dataclasses.dataclass
class Reason:
    """One shape of failure message for one question, and who got it."""

    shape: str
    messages: collections.Counter  # the concrete messages, most common shown
    files: list

    @property
    def example(self):
        return self.messages.most_common(1)[0][0]


def lost_points_message(record, question):
    """Why ``record`` lost points on ``question``, as the student's feedback says it."""
    if record.catastrophic:
        return record.status or "nothing could be graded"
    data = record.questions.get(question)
    if not data:
        return "not graded: " + (record.status or "no result for this question")
    failed = [c for c in data["cases"] if not c["passed"]]
    with_points = [c for c in failed if c.get("points")]
    for case in with_points or failed:
        if case.get("message"):
            return str(case["message"]).strip()[:MESSAGE_CHARS]
    return "failed (no message)"


def reasons(records, question, categories):
    """The Reasons ``question`` lost points for, most common first (submissions that could not
    be graded at all are left to the page's list of them)."""
    groups = {}
    for r in records:
        if categories[(r.file, question)] == "full marks" or r.catastrophic:
            continue
        message = lost_points_message(r, question)
        g = groups.setdefault(shape(message), Reason(shape(message), collections.Counter(), []))
        g.messages[message] += 1
        g.files.append(r.file)
    return sorted(groups.values(), key=lambda g: (-len(g.files), g.shape))


def _link(folder, file, suffix):
    return f"{folder}/{urllib.parse.quote(stem(file))}{suffix}"


def _pct(part, whole):
    return f"{100 * part / whole:.0f}%" if whole else "–"


CSS = """
:root { --full: %s; --partial: %s; --zero: %s; --error: %s; --timeout: %s;
        --ink: #1b1b1b; --muted: #5b5b5b; --rule: #d9d9d9; --bg: #fafafa; }
* { box-sizing: border-box; }
body { font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: var(--ink); margin: 0; background: white; }
main { max-width: 1080px; margin: 0 auto; padding: 24px 28px 60px; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 19px; margin: 0; }
h3 { font-size: 14px; margin: 14px 0 6px; color: var(--muted); text-transform: uppercase;
     letter-spacing: .04em; }
.sub { color: var(--muted); margin: 0 0 18px; }
.warn { background: #fff4e5; border-left: 4px solid var(--zero); padding: 8px 12px;
        margin: 0 0 16px; }
.legend { display: flex; flex-wrap: wrap; gap: 14px; margin: 6px 0 14px; font-size: 13px; }
.legend span::before { content: ""; display: inline-block; width: 11px; height: 11px;
                       margin-right: 5px; vertical-align: -1px; background: var(--c); }
.bar { display: flex; height: 22px; border-radius: 3px; overflow: hidden; background: #eee; }
.bar > div { background: var(--c); color: black; font-size: 12px; line-height: 22px;
             text-align: center; overflow: hidden; white-space: nowrap; }
.bar > div.dark { color: white; }
table { border-collapse: collapse; width: 100%%; }
th, td { padding: 5px 8px; border-bottom: 1px solid var(--rule); text-align: left;
         vertical-align: top; }
th { font-size: 12px; color: var(--muted); font-weight: 600; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
.overview td.bar-cell { width: 48%%; }
.overview a { font-weight: 600; }
section.question { border-top: 2px solid var(--ink); margin-top: 30px; padding-top: 12px; }
.qhead { display: flex; justify-content: space-between; align-items: baseline; gap: 16px;
         margin-bottom: 8px; }
.qhead .stats { color: var(--muted); font-size: 14px; }
.counts { display: flex; flex-wrap: wrap; gap: 6px 18px; font-size: 13px; margin: 6px 0 0; }
.counts b { font-variant-numeric: tabular-nums; }
.reason { display: grid; grid-template-columns: 92px 1fr; gap: 4px 14px; padding: 9px 0;
          border-bottom: 1px solid var(--rule); }
.reason .n { font-size: 20px; font-weight: 650; text-align: right; line-height: 1.1; }
.reason .n small { display: block; font-size: 12px; font-weight: 400; color: var(--muted); }
.reason .msg { font-family: ui-monospace, "DejaVu Sans Mono", Menlo, monospace; font-size: 13px;
               background: var(--bg); border-left: 3px solid var(--zero); padding: 5px 9px;
               white-space: pre-wrap; overflow-wrap: anywhere; }
.reason .who { grid-column: 2; font-size: 13px; color: var(--muted); }
.none { color: var(--muted); font-style: italic; }
details summary { cursor: pointer; color: var(--muted); margin: 8px 0; font-size: 14px; }
.hist { display: flex; align-items: flex-end; gap: 3px; height: 110px; margin: 8px 0 2px;
        padding-top: 18px; }
.hist div { flex: 1; background: #0072B2; min-height: 1px; position: relative; }
.hist div span { position: absolute; top: -17px; width: 100%%; text-align: center;
                 font-size: 11px; color: var(--muted); }
.hist-axis { display: flex; justify-content: space-between; font-size: 11px;
             color: var(--muted); }
.cell { display: inline-block; min-width: 34px; padding: 0 4px; border-radius: 3px;
        text-align: center; font-size: 12px; background: var(--c); }
.cell.dark { color: white; }
td.status { font-size: 12px; color: var(--muted); max-width: 330px; }
.summary-grid { display: grid; grid-template-columns: 1fr 330px; gap: 28px; align-items: start; }
@media (max-width: 800px) { .summary-grid { grid-template-columns: 1fr; } }
@media print { section.question { break-inside: avoid-page; } }
""" % COLOURS

_VAR = dict(zip(CATEGORIES, ("--full", "--partial", "--zero", "--error", "--timeout")))
_DARK = {"timed out"}  # categories whose colour needs white text


def _style(category):
    return f"--c: var({_VAR[category]})"


def _bar(counts, n):
    parts = []
    for category in CATEGORIES:
        k = counts.get(category, 0)
        if not k:
            continue
        share = 100 * k / n
        label = f"{share:.0f}%" if share >= 7 else ""
        dark = "dark" if category in _DARK else ""
        parts.append(f'<div class="{dark}" style="{_style(category)};'
                     f'width:{share:.3f}%" title="{category}: {k} of {n} ({share:.0f}%)">'
                     f"{label}</div>")
    return f'<div class="bar">{"".join(parts)}</div>'


def render(records, autograder, waiting=(), similar=None):
    """The page's HTML for ``records`` (in file order) graded with ``autograder``; ``waiting``
    says in words what is not graded yet; ``similar``: the similarity check's result
    (``similarity.compare``), a section of its own after the questions."""
    from . import similarity

    e = html.escape
    questions = in_notebook_order(autograder.points)
    long = per_question(records, autograder)
    categories = {(r.file, r.question): r.category for r in long.itertuples()}
    points = {(r.file, r.question): r.points for r in long.itertuples()}
    n = len(records)
    possible = sum(autograder.points.values())
    totals = [sum(points[(r.file, q)] for q in questions) for r in records]
    percents = sorted(100 * t / possible if possible else 0.0 for t in totals)
    median = percents[len(percents) // 2] if n % 2 else \
        (percents[n // 2 - 1] + percents[n // 2]) / 2 if n else 0.0
    name = autograder.assignment_name or "assignment"

    out = [f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
           f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
           f"<title>{e(name)}: class report</title><style>{CSS}{similarity.CSS if similar else ''}"
           "</style></head><body><main>",
           f"<h1>{e(name)}: what the class got wrong</h1>",
           f'<p class="sub">{n} submission{"s" if n != 1 else ""} · {len(questions)} questions · '
           f"{possible:g} points · median score {median:.0f}%</p>"]
    if waiting:
        out.append(f'<p class="warn"><b>Incomplete:</b> {e("; ".join(waiting))}. Run those '
                   "shards again, then <code>jaxlab report</code>.</p>")
    out.append('<div class="legend">' + "".join(
        f'<span style="{_style(c)}">{e(c)}</span>' for c in CATEGORIES) + "</div>")

    # overview: one bar per question, and the distribution of totals
    rows = []
    for q in questions:
        counts = collections.Counter(categories[(r.file, q)] for r in records)
        lost = n - counts["full marks"]
        rows.append(f'<tr><td><a href="#{e(q)}">{e(q)}</a></td>'
                    f'<td class="num">{autograder.points[q]:g}</td>'
                    f'<td class="bar-cell">{_bar(counts, n) if n else ""}</td>'
                    f'<td class="num">{_pct(lost, n)}</td></tr>')
    bins = [0] * 10
    for p in percents:
        bins[min(int(p // 10), 9)] += 1
    top = max(bins) or 1
    hist = "".join(f'<div style="height:{100 * b / top:.1f}%" title="{10 * i}–{10 * i + 10}%: '
                   f'{b}"><span>{b or ""}</span></div>' for i, b in enumerate(bins))
    out.append('<div class="summary-grid"><table class="overview"><thead><tr><th>question</th>'
               '<th class="num">points</th><th>how it went</th><th class="num">lost points'
               '</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table>"
               f'<div><h3>Total scores</h3><div class="hist">{hist}</div><div class="hist-axis">'
               "<span>0%</span><span>50%</span><span>100%</span></div>"
               '<p class="sub" style="font-size:12px">submissions per tenth of the points</p>'
               "</div></div>")
    broken = [r for r in records if r.catastrophic]
    if broken:
        out.append(f'<h3>Not graded at all ({len(broken)})</h3><table class="broken"><tbody>' +
                   "".join(f'<tr><td><a href="{e(_link(SUMMARIES, r.file, ".txt"))}">'
                           f'{e(r.file)}</a></td><td class="status">{e(r.status)}</td></tr>'
                           for r in broken) + "</tbody></table>")

    # per question
    for q in questions:
        counts = collections.Counter(categories[(r.file, q)] for r in records)
        scores = [points[(r.file, q)] for r in records]
        mean = sum(scores) / n if n else 0.0
        data = " ".join(f'data-{c.replace(" ", "-")}="{counts.get(c, 0)}"' for c in CATEGORIES)
        out.append(f'<section class="question" id="{e(q)}" data-question="{e(q)}" {data}>'
                   f'<div class="qhead"><h2>{e(q)} <small>({autograder.points[q]:g} pt)</small>'
                   f'</h2><span class="stats">mean {mean:.2f} of {autograder.points[q]:g}</span>'
                   f"</div>{_bar(counts, n) if n else ''}<div class=\"counts\">" + "".join(
                       f'<span><b>{counts.get(c, 0)}</b> {e(c)} ({_pct(counts.get(c, 0), n)})'
                       f"</span>" for c in CATEGORIES) + "</div>")
        found = reasons(records, q, categories)
        lost = n - counts["full marks"]
        out.append(f"<h3>Why {lost} submission{'s' if lost != 1 else ''} lost points</h3>"
                   if lost else '<p class="none">Nobody lost points here.</p>')
        items = []
        if broken:  # one reason, in its place by count
            found = sorted(found + [Reason("", collections.Counter(), [r.file for r in broken])],
                           key=lambda g: -len(g.files))
        for g in found:
            k = len(g.files)
            if not g.shape:  # the submissions above that nothing could be graded of
                items.append(f'<div class="reason" data-count="{k}"><div class="n">{k}<small>'
                             f'{_pct(k, lost)}</small></div><div class="who" style="grid-column:'
                             f'2">not graded at all (listed at the top)</div></div>')
                continue
            examples = ", ".join(
                f'<a href="{e(_link(SUMMARIES, f, ".txt"))}">{e(f)}</a>'
                for f in g.files[:EXAMPLES]) + (f" and {k - EXAMPLES} more" if k > EXAMPLES else "")
            variants = len(g.messages)
            also = f" · {variants} variants of this message" if variants > 1 else ""
            items.append(f'<div class="reason" data-count="{k}"><div class="n">{k}<small>'
                         f'{_pct(k, lost)}</small></div><div class="msg">'
                         f'{e(g.example)}</div><div class="who">e.g. {examples}{e(also)}</div>'
                         "</div>")
        out.append("".join(items[:REASONS_SHOWN]))
        if len(items) > REASONS_SHOWN:
            more = len(items) - REASONS_SHOWN
            out.append(f"<details><summary>{more} more reason{'s' if more != 1 else ''}"
                       f"</summary>{''.join(items[REASONS_SHOWN:])}</details>")
        out.append("</section>")

    if similar is not None:
        out.append(similarity.section(similar, lambda f: _link(SUMMARIES, f, ".txt")))

    # every submission
    head = "".join(f'<th class="num" title="{e(q)}">{e(q.split("_")[0])}</th>' for q in questions)
    rows = []
    for r, total in zip(records, totals):
        cells = "".join(
            f'<td class="num"><span class="cell {"dark" if c in _DARK else ""}" '
            f'style="{_style(c)}" title="{e(q)}: {c}">{points[(r.file, q)]:g}</span></td>'
            for q in questions for c in [categories[(r.file, q)]])
        status = r.status or ""
        summary = e(_link(SUMMARIES, r.file, ".txt"))
        rows.append(f'<tr data-file="{e(r.file)}"><td><a href="{summary}">'
                    f'{e(r.file)}</a> <small>(<a href="{e(_link(GRADESCOPE, r.file, ".json"))}">'
                    f"json</a>)</small></td>{cells}<td class=\"num\"><b>{total:g}</b></td>"
                    f'<td class="num">{_pct(total, possible)}</td><td class="status" '
                    f'title="{e(status)}">{e(status[:140] + ("…" if len(status) > 140 else ""))}'
                    "</td></tr>")
    out.append('<section class="question" id="submissions"><div class="qhead"><h2>Every '
               'submission</h2><span class="stats">name links to its feedback</span></div>'
               f'<table><thead><tr><th>file</th>{head}<th class="num">total</th>'
               f'<th class="num">%</th><th>grading status</th></tr></thead><tbody>'
               + "".join(rows) + "</tbody></table></section>")
    out.append("</main></body></html>\n")
    return "".join(out)


def write(out, records, autograder, waiting=(), similar=None):
    path = pathlib.Path(out) / PAGE
    tmp = path.with_name(PAGE + ".tmp")
    tmp.write_text(render(records, autograder, waiting, similar), encoding="utf-8")
    tmp.replace(path)
    return path
