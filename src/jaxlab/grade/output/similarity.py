"""Pairs of submissions whose answers are more alike than the task forces: evidence for a person to
read, never a grade change.

Per question, each submission's answer is compared two ways, from what its record keeps
(``Record.answers``, ``Record.programs``):

* **as code**: the cells of its part of the notebook with the released notebook's starter code
  removed (every line the template has, and copydetect's ``boilerplate`` for what is left),
  fingerprinted by copydetect (winnowing over Python tokens with names, strings and comments
  filtered out); the overlap of two fingerprint sets (Dice);
* **as a traced program**: the bag of dataflow steps of what the probes traced with
  ``jax.make_jaxpr`` (``engine.traces``), indifferent to names, constants, comments and the
  order of independent lines; the overlap of two bags (Dice).

The page shows each question's similarity as those two overlaps. Many pairs of a class agree
on a question because the task leaves few ways to answer it, so overlap alone says little: what
two answers share is weighed by how few of the class hold it (each fingerprint and step counts
``ln(n / holders)``: what everyone wrote counts nothing), that shared information is turned,
for each view, into how rare it is among the class's pairs on that question (the share of pairs
sharing at least as much: an empirical p-value), a question takes the rarer of its two views
(renaming leaves the code's fingerprints alone, reordering and inlining the program's steps;
adding the two views' shared information instead let a copy that changed its code but not its
program rank below honest pairs with the same popular answer), and a pair's score adds up
``-ln p`` over the questions (Fisher's statistic). A pair is flagged when its score is higher
than the highest score of any pair in classes made by shuffling each question's answers among
the students independently (same answers, same per-question agreement, no student's answers
tied together): ``FAMILY_ERROR`` of such classes would flag a pair.

What the page shows of a pair: every question where it is rarely alike, and every question the
two answered identically (the starter code aside), marked *common* where many pairs are as
alike; each pair's cells side by side, what copydetect finds in both highlighted except the
question's common lines (a line at least half the answers to it have, such as an import every
answer cell starts with: ``common_lines``), which weigh little in the score too (at most
ln 2 a fingerprint, against ln n for one only the pair has). A
low score is not innocence: what the class commonly wrote weighs little, so a copy of a student
whose answers are mostly the common ones scores low.
"""

import dataclasses
import html
import io
import math
import warnings

import numpy as np

K = 12  # fingerprints are k-grams of this many filtered chars (copydetect: 25, for whole
#        files; a notebook answer is often one line)
WINDOW = 1  # winnow window: copydetect's default (guarantee threshold = noise threshold)
MATCH_P = 0.1  # a question "matches" for a pair when at most this share of pairs is as alike
COMMON = 0.5  # a line at least this share of a question's answers have is nobody's evidence
COMMON_MIN = 3  # ... among at least this many answers (two students alone share nothing common)
MIN_CODE_CHARS = K  # filtered code shorter than one k-gram has no fingerprint
FAMILY_ERROR = 0.01  # chance that a class without copying shows a flagged pair
SHOWN = 10  # pairs on the page (flagged ones first)
PERMUTATION_BUDGET = 4e8  # entries gathered by the shuffles: seconds, whatever the class size


@dataclasses.dataclass
class Match:
    question: str
    similarity: float
    code: float | None  # None: one of the two has no code of its own here
    trace: float | None  # None: no traced program for one of the two
    p: float  # share of the class's pairs at least as alike on this question
    identical: int = 0  # the two answers are the same code: how many of the class wrote it
    answered: int = 0  # how many of the class answered with code

    @property
    def common(self):
        """Identical, but many pairs of the class are as alike: listed, not evidence."""
        return self.p > MATCH_P

    def words(self):
        """'q3 (100% / –)', 'q1 (identical, common: 5 of 10 answers)'."""
        if self.identical and self.common:
            return f"{self.question} (identical, common: {self.held()})"
        return f"{self.question} ({'identical · ' if self.identical else ''}" \
               f"{_pct(self.code)} / {_pct(self.trace)})"

    def held(self):
        return f"{self.identical} of {self.answered} answers"


@dataclasses.dataclass
class Answer:
    """One submission's answer to one question, as compared and as shown."""

    text: str  # its cells without the released notebook's lines: fingerprinted and shown
    fingerprint: object = None  # copydetect's CodeFingerprint of ``text``; None: too short
    common: tuple = ()  # (start, end) of each of its lines the page never highlights


@dataclasses.dataclass
class Pair:
    a: str
    b: str
    score: float
    flagged: bool
    matches: list  # Match: where they are rarely alike, most alike first, then the identical
    #                answers many pairs share (``Match.common``)


@dataclasses.dataclass
class Result:
    pairs: list  # Pair, highest score first (only the SHOWN top ones and every flagged one)
    threshold: float
    submissions: int
    questions: list
    compared: dict  # question -> how many submissions had something to compare
    code: dict  # (file, question) -> Answer
    seconds: float = 0.0
    who: dict = dataclasses.field(default_factory=dict)  # file -> its students, in words

    def named(self, file):
        """``file`` with its students when the roster names them."""
        return f"{file} ({self.who[file]})" if self.who.get(file) else file

    @property
    def flagged(self):
        return [p for p in self.pairs if p.flagged]


def strip_template(cells, template_lines):
    """The code of ``cells`` without the lines the released notebook has (compared stripped)."""
    kept = []
    for source in cells:
        for line in source.splitlines():
            s = line.strip()
            if s and s not in template_lines and not s.startswith("#"):
                kept.append(line.rstrip())
    return "\n".join(kept)


def common_lines(answers):
    """The lines (compared stripped) at least COMMON of ``answers`` (one question's, starter
    code removed) have, among at least COMMON_MIN non-empty answers; else none."""
    import collections

    given = [a for a in answers if a]
    if len(given) < COMMON_MIN:
        return set()
    held = collections.Counter(line for a in given
                               for line in {ln.strip() for ln in a.splitlines()})
    return {line for line, n in held.items() if n >= COMMON * len(given)}


def _spans(text, lines):
    """(start, end) of each line of ``text`` in ``lines`` (compared stripped)."""
    found, at = [], 0
    for line in text.splitlines(keepends=True):
        if line.strip() in lines:
            found.append((at, at + len(line)))
        at += len(line)
    return tuple(found)


def _fingerprint(code, boilerplate):
    from copydetect import CodeFingerprint

    return CodeFingerprint("answer.py", K, WINDOW, boilerplate=boilerplate, language="python",
                           fp=io.StringIO(code))


def compare(records, template=None, *, seed=0):
    """The similarity check over ``records`` (Record objects with ``answers``/``programs``);
    ``template``: question -> the released notebook's cells of that question (or None)."""
    import collections
    import time

    started = time.monotonic()
    records = [r for r in records if not r.catastrophic and (r.answers or r.programs)]
    files = [r.file for r in records]
    n = len(records)
    template = template or {}
    template_lines = {line.strip() for cells in template.values() for c in cells
                      for line in c.splitlines() if line.strip()}
    questions = sorted({q for r in records for q in (*r.answers, *r.programs)},
                       key=_natural)
    evidence, sims, code_of, compared, holders = {}, {}, {}, {}, {}
    for q in questions:
        boiler = np.array(sorted(_fingerprint("\n".join(template[q]), None).hashes),
                          dtype=np.int64) if template.get(q) else None
        prints, seen = [], {}  # seen: code -> its fingerprint (a class repeats short answers)
        texts = [strip_template(r.answers.get(q, []), template_lines) for r in records]
        common = common_lines(texts)
        for r, code in zip(records, texts):
            if code not in seen:
                fp = _fingerprint(code, boiler) if code else None
                seen[code] = None if fp is None or len(fp.filtered_code) < MIN_CODE_CHARS \
                    else fp
            prints.append(seen[code])
            code_of[(r.file, q)] = Answer(code, seen[code], _spans(code, common))
        holders[q] = collections.Counter(texts)
        code_sim, code_info = _overlaps([set(fp.hashes) if fp is not None else None
                                         for fp in prints])
        trace_sim, trace_info = _overlaps(_bag_sets([r.programs.get(q) or None
                                                     for r in records]))
        with warnings.catch_warnings():  # a pair with neither: no evidence (0)
            warnings.simplefilter("ignore", RuntimeWarning)
            sim = np.nan_to_num(np.nanmean(np.stack([code_sim, trace_sim]), axis=0), nan=0.0)
        compared[q] = sum(fp is not None or bool(r.programs.get(q))
                          for fp, r in zip(prints, records))
        evidence[q] = np.maximum(_rarity(code_info), _rarity(trace_info))
        sims[q] = (sim, code_sim, trace_sim)
    score = sum(evidence.values()) if questions else np.zeros((n, n))
    threshold = _null_threshold(evidence, n, seed)
    iu = np.triu_indices(n, 1)
    order = np.argsort(-score[iu], kind="stable")
    pairs = []
    for k in order:
        i, j = iu[0][k], iu[1][k]
        s = float(score[i, j])
        flagged = s > threshold
        if not flagged and len(pairs) >= SHOWN:
            break
        matches = []
        for q in questions:
            sim, code_sim, trace_sim = sims[q]
            p = math.exp(-evidence[q][i, j])
            text = code_of[(files[i], q)].text
            same = holders[q][text] if text and text == code_of[(files[j], q)].text else 0
            if (p <= MATCH_P and sim[i, j] > 0) or same:
                matches.append(Match(q, float(sim[i, j]), _num(code_sim[i, j]),
                                     _num(trace_sim[i, j]), p, same,
                                     sum(holders[q].values()) - holders[q][""]))
        # the rare first, most alike first; then the identical answers many others wrote
        matches.sort(key=lambda m: (m.common, m.p, -m.similarity))
        pairs.append(Pair(files[i], files[j], s, flagged, matches))
    return Result(pairs, threshold, n, questions, compared, code_of,
                  time.monotonic() - started)


def _natural(q):
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", q)]


def _num(x):
    return None if np.isnan(x) else float(x)


def _overlaps(sets):
    """Pairwise overlap of sets, through one sparse product: (Dice, NaN where either is None;
    shared information, the sum over shared items of ln(n / how many hold it), 0 where none):
    two students who share what most of the class wrote share little information."""
    from scipy import sparse

    n = len(sets)
    out, info = np.full((n, n), np.nan), np.zeros((n, n))
    present = [i for i, s in enumerate(sets) if s]
    if not present:
        return out, info
    vocab = {}
    rows, cols = [], []
    for k, i in enumerate(present):
        for h in sets[i]:
            rows.append(k)
            cols.append(vocab.setdefault(h, len(vocab)))
    x = sparse.csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(present), len(vocab)))
    shared = (x @ x.T).toarray()
    size = np.asarray(x.sum(axis=1)).ravel()
    held = np.asarray(x.sum(axis=0)).ravel()
    weighted = x.multiply(np.log(n / held)[None, :]).tocsr()
    idx = np.array(present)
    out[np.ix_(idx, idx)] = 2 * shared / (size[:, None] + size[None, :])
    info[np.ix_(idx, idx)] = (weighted @ x.T).toarray()
    return out, info


def _bag_sets(bags):
    """Multisets ({item: count}) as sets: a count c becomes c distinct items, so what two
    share is the sum of the smaller counts."""
    return [{(k, c) for k, v in bag.items() for c in range(int(v))} if bag else None
            for bag in bags]


def _rarity(sim):
    """-ln of the share of pairs sharing at least as much as each pair (0 where nothing)."""
    n = sim.shape[0]
    out = np.zeros_like(sim)
    if n < 2:
        return out
    iu = np.triu_indices(n, 1)
    values = sim[iu]
    ranked = np.sort(values)
    at_least = len(values) - np.searchsorted(ranked, values, side="left")
    e = np.where(values > 0, -np.log(at_least / len(values)), 0.0)
    out[iu] = e
    return out + out.T


def _null_threshold(evidence, n, seed):
    """The (1 - FAMILY_ERROR) quantile of the highest pair score over classes whose answers
    are shuffled among the students, each question on its own."""
    if n < 3 or not evidence:
        return float("inf")
    mats = list(evidence.values())
    rounds = int(min(1000, max(100, PERMUTATION_BUDGET / (len(mats) * n * n))))
    rng = np.random.default_rng(seed)
    iu = np.triu_indices(n, 1)
    best = np.empty(rounds)
    for t in range(rounds):
        total = np.zeros((n, n))
        for m in mats:
            p = rng.permutation(n)
            total += m[np.ix_(p, p)]
        best[t] = total[iu].max()
    return float(np.quantile(best, 1 - FAMILY_ERROR))


# --------------------------------------------------------------------------- the page's section
def section(result, link):
    """report.html's section for ``result``; ``link(file)`` is the href of a submission's
    feedback."""
    e = html.escape
    if result is None:
        return ""
    out = ['<section class="question similar" id="similar" data-similar-pairs='
           f'"{len(result.flagged)}"><div class="qhead"><h2>Similar submissions</h2>'
           f'<span class="stats">{result.submissions} compared · '
           f'{len(result.flagged)} pair{"s" if len(result.flagged) != 1 else ""} flagged'
           "</span></div>",
           '<p class="sub">Evidence for a person to read, not a grade: answers compared as code '
           "(starter code of the released notebook removed; copydetect's winnowed fingerprints) "
           "and as traced programs (jax.make_jaxpr, names and constants normalised). A pair's "
           "score adds up how rarely pairs of this class are as alike on each question; a "
           f"pair is flagged above {result.threshold:.1f}, which classes with the same answers "
           f"shuffled among students reach {FAMILY_ERROR:.0%} of the time. Questions answered "
           "identically are listed too, marked <i>common</i> where many pairs are as alike. "
           "Each pair opens to its cells side by side; the starter code and the lines at least "
           f"{COMMON:.0%} of a question's answers have (such as an import every cell starts "
           "with) are never highlighted.</p>",
           '<p class="sub low"><b>A low score does not mean a pair worked alone.</b> What most '
           "of the class wrote counts for little, so a copy of a student whose answers are "
           "mostly the common ones scores low, below honest pairs that share one rare answer; "
           "read the identical answers of the pairs listed, not only the flags.</p>"]
    if not result.pairs:
        out.append('<p class="none">Fewer than two submissions to compare.</p></section>')
        return "".join(out)
    out.append('<table class="pairs"><thead><tr><th>pair</th><th class="num">score</th>'
               "<th>questions alike (similarity: code / program)</th></tr></thead><tbody>")
    for k, p in enumerate(result.pairs):
        qs = ", ".join(e(m.words()) for m in p.matches) or "none rarely alike"
        mark = '<b class="flag">flagged</b> ' if p.flagged else ""
        out.append(f'<tr data-pair="{k}" data-a="{e(p.a)}" data-b="{e(p.b)}" '
                   f'data-flagged="{int(p.flagged)}"><td>{mark}<a href="{e(link(p.a))}">'
                   f'{e(result.named(p.a))}</a> · <a href="{e(link(p.b))}">'
                   f'{e(result.named(p.b))}</a></td>'
                   f'<td class="num">{p.score:.1f}</td><td>{qs}</td></tr>')
    out.append("</tbody></table>")
    for k, p in enumerate(result.pairs):
        matched = {m.question: m for m in p.matches}
        rest = [q for q in result.questions if q not in matched and
                any(getattr(result.code.get((f, q)), "text", "") for f in (p.a, p.b))]
        out.append(f'<details class="side" data-pair="{k}"{" open" if k == 0 else ""}>'
                   f"<summary>{e(result.named(p.a))} and {e(result.named(p.b))} (score "
                   f"{p.score:.1f}): their cells side by side</summary>")
        for q in [*matched, *rest]:
            m = matched.get(q)
            left, right = _highlighted(result, p.a, p.b, q)
            about = (f"identical, common: {m.held()} · as alike as {m.p:.0%} of pairs"
                     if m.common else f"{'identical · ' if m.identical else ''}code "
                     f"{_pct(m.code)} · program {_pct(m.trace)} · as alike as {m.p:.0%} of "
                     "pairs") if m else "not rarely alike"
            out.append(f'<h3>{e(q)} · {e(about)}</h3><div class="sbs">'
                       f'<div><div class="who">{e(result.named(p.a))}</div><pre>{left}</pre>'
                       f'</div><div><div class="who">{e(result.named(p.b))}</div>'
                       f"<pre>{right}</pre></div></div>")
        out.append("</details>")
    out.append("</section>")
    return "".join(out)


def _pct(x):
    return "–" if x is None else f"{100 * x:.0f}%"


def _highlighted(result, a, b, q):
    """Both answers to ``q`` escaped, what copydetect finds in both in <mark>, except the
    question's common lines (starter code is not shown at all)."""
    from copydetect import compare_files

    none = Answer("")
    first, second = result.code.get((a, q)) or none, result.code.get((b, q)) or none
    marked = [set(), set()]
    if first.fingerprint is not None and second.fingerprint is not None:
        _, _, slices = compare_files(first.fingerprint, second.fingerprint)
        for answer, found, chars in zip((first, second), slices, marked):
            for start, end in (found.T.astype(int) if found.size else ()):
                chars.update(range(start, end))
            for start, end in answer.common:
                chars.difference_update(range(start, end))
    return tuple(_marked(answer.text, chars) if answer.text else "(no code of its own)"
                 for answer, chars in zip((first, second), marked))


def _marked(text, chars):
    """``text`` escaped, the runs of the characters at ``chars`` in <mark>."""
    out, run = [], None
    for i, ch in enumerate(text + "\0"):
        hit = i in chars and ch != "\n"
        if hit != run:
            out.append("<mark>" if hit else "</mark>" if run else "")
            run = hit
        if i < len(text):
            out.append(html.escape(ch))
    return "".join(out)


CSS = """
.similar .flag { color: white; background: #CC79A7; padding: 0 5px; border-radius: 3px;
                 font-size: 12px; }
.similar table.pairs td { font-size: 13px; }
.similar details.side { margin: 10px 0 16px; border: 1px solid var(--rule); padding: 4px 10px; }
.similar .sbs { display: grid; grid-template-columns: 1fr 1fr; gap: 10px; }
.similar .sbs pre { font: 12px/1.4 ui-monospace, "DejaVu Sans Mono", Menlo, monospace;
                    background: var(--bg); padding: 6px 8px; margin: 0; white-space: pre-wrap;
                    overflow-wrap: anywhere; max-height: 420px; overflow: auto; }
.similar .sbs .who { font-size: 12px; color: var(--muted); margin-bottom: 2px; }
.similar mark { background: #ffe08a; }
"""


PAIRS_CSV = "similar_pairs.csv"


def write_csv(out, result):
    """``similar_pairs.csv``: the pairs shown, their score, whether flagged, which questions."""
    import csv
    import pathlib

    path = pathlib.Path(out) / PAIRS_CSV
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["a", "b", "score", "flagged", "threshold", "questions_alike", "a_students",
                    "b_students"])
        for p in result.pairs:
            w.writerow([p.a, p.b, f"{p.score:.2f}", int(p.flagged), f"{result.threshold:.2f}",
                        " ".join(m.question + (" (common)" if m.common else "")
                                 for m in p.matches), result.who.get(p.a, ""),
                        result.who.get(p.b, "")])
    return path


def print_pairs(result):
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"Most similar pairs of {result.submissions} submissions (flagged above "
                    f"{result.threshold:.1f}; {result.seconds:.1f} s)")
    for col in ("pair", "score", "flagged", "questions alike (code / program)"):
        t.add_column(col, justify="right" if col == "score" else "left")
    for p in result.pairs:
        t.add_row(f"{result.named(p.a)}  ·  {result.named(p.b)}", f"{p.score:.1f}",
                  "yes" if p.flagged else "", ", ".join(m.words() for m in p.matches))
    Console().print(t)
    print("A low score does not mean a pair worked alone: what most of the class wrote counts "
          "for little, so read the identical answers listed (marked common), not only the "
          "flags.")
