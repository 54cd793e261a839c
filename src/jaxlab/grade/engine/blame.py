"""Say which of the student's cells broke a question, in the student's terms.

A check sees values only: a name whose cell raised before setting it reads as None ("not
defined yet"), and the next question that uses it fails with the same words. When a cell of the
student's that assigns a question's graded names raised, ran over the per-cell limit, or was
skipped because it killed the kernel, the question's message says so instead, with the student's
own exception and line, from the worker's record of the run (never the kernel's word for it).
"""

import dataclasses

from ...checks.form import assigned_names, fault_words, never_set


def explain(decided, faults, cells, names, labels):
    """``decided`` (question -> Verdict) with the messages of failed questions that a broken
    cell explains. ``faults``: cell index -> session.CellFault; ``cells``: the student's
    (index, source); ``names``: question -> its graded names; ``labels``: index -> words."""
    sources = dict(cells)
    assigns = {i: assigned_names(sources[i]) for i in faults if i in sources}
    out = {}
    for q, v in decided.items():
        wanted = set(names.get(q, ()))
        broken = [i for i in sorted(assigns) if assigns[i] & wanted]
        if v.passed or not broken:
            out[q] = v
            continue
        undefined = getattr(v, "undefined", None)
        cell = next((i for i in reversed(broken) if undefined in assigns[i]), broken[-1])
        words = _words(faults[cell], sources[cell])
        where = labels.get(cell, f"your cell {cell}")
        if undefined in assigns[cell]:
            message = never_set(undefined, where, words)
        else:
            message = f"{where[0].upper()}{where[1:]} {words}. Then the check found: {v.message}"
        out[q] = dataclasses.replace(v, message=message)
    return out


def _words(fault, source):
    lines = source.splitlines()
    code = lines[fault.line - 1] if fault.line and 0 < fault.line <= len(lines) else ""
    return fault_words(fault.kind, error=fault.error, line=fault.line, code=code,
                       seconds=fault.seconds, detail=fault.detail)
