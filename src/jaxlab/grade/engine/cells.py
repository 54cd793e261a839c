"""Which cells of a submission are the student's, and the grader's cells that run after them.

The grader's cells run in the untrusted kernel: a probe per question turns the graded names into
plain data (JSON + npz, no pickle), and a claim runs otter's own tests there; both only write
files into the evidence folder, which the trusted worker judges.
"""

import ast

OTTER_CALLS = {"check", "check_all", "export", "to_pdf", "run_plugin", "submit"}
IGNORE_TAG = "otter_ignore"


def student_cells(nb):
    """(index, source) of the code cells otter's grading would run as the student's own."""
    graders = _grader_names(nb)
    return [(i, cell.source) for i, cell in enumerate(nb.cells)
            if cell.cell_type == "code" and not any(skip(cell, graders) for skip in SKIPPED)]


def _ignored_by_otter(cell, graders):
    meta = cell.get("metadata", {})
    return IGNORE_TAG in meta.get("tags", []) or meta.get("otter", {}).get("ignore", False)


def _only_otter_calls(cell, graders):
    return _is_otter_cell(cell.source, graders)


# each predicate removes only cells that hold no student code; add one for a new kind of cell
SKIPPED = (_ignored_by_otter, _only_otter_calls)


def _grader_names(nb):
    names = {"grader"}
    for cell in nb.cells:
        try:
            tree = ast.parse(cell.source) if cell.cell_type == "code" else None
        except SyntaxError:
            continue
        for node in ast.walk(tree) if tree else ():
            if isinstance(node, ast.Assign) and _is_notebook_call(node.value):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


def _is_notebook_call(node):
    return isinstance(node, ast.Call) and (
        isinstance(node.func, ast.Attribute) and node.func.attr == "Notebook"
        or isinstance(node.func, ast.Name) and node.func.id == "Notebook")


def _is_otter_cell(source, graders):
    """Whether every statement is otter's init, a grader.check/export call or a bare ``grader``.

    Skipping such a cell only removes calls into otter, never student code.
    """
    try:
        body = ast.parse(source).body
    except SyntaxError:
        return False
    if not body:
        return False
    for stmt in body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            mods = [a.name for a in stmt.names] if isinstance(stmt, ast.Import) else [stmt.module]
            if all(m == "otter" for m in mods):
                continue
        elif isinstance(stmt, ast.Assign) and _is_notebook_call(stmt.value):
            continue
        elif isinstance(stmt, ast.Expr):
            v = stmt.value
            if isinstance(v, ast.Name) and v.id in graders:
                continue
            if isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute) \
                    and isinstance(v.func.value, ast.Name) and v.func.value.id in graders \
                    and v.func.attr in OTTER_CALLS:
                continue
        return False
    return True


# --------------------------------------------------------------------------- grader cells
PROBE_CELL = '''\
def _jaxlab_probe():
    import importlib, sys
    sys.path.insert(0, {private!r})
    for name in ({module!r}, "jaxlab_form"):
        sys.modules.pop(name, None)
    checks, form = importlib.import_module({module!r}), importlib.import_module("jaxlab_form")
    ns = globals()
    names = checks.QUESTIONS[{question!r}].names
    out = {{"equal_to_anything": []}}
    try:
        out["evidence"] = checks.probe({question!r}, {{n: ns.get(n) for n in names}})
    except BaseException as exc:
        out["error"] = f"{{type(exc).__name__}}: {{exc}}"
    class Stranger:
        pass
    for n in names:
        try:
            eq = ns.get(n) == Stranger()
            if eq is True or type(eq).__name__ == "bool_" and bool(eq):
                out["equal_to_anything"].append(n)
        except BaseException:
            pass
    form.dump_evidence(out, {path!r})
    if "evidence" in out and hasattr(form, "remember_probe"):  # otter's test reuses it
        form.remember_probe({question!r}, [ns.get(n) for n in names], {path!r})
_jaxlab_probe()
del _jaxlab_probe
'''

CLAIM_CELL = '''\
def _jaxlab_claim():
    import json, sys
    from otter.nbmeta_config import NBMetadataConfig
    from otter.test_files import create_test_file
    sys.path.insert(0, {private!r})
    claim = {{}}
    try:
        tf = create_test_file({test!r}, NBMetadataConfig())
        cases, done = list(tf.test_cases), {{}}
        # the cases holding points first; for a question the jaxlab checks judge, the 0-point
        # (public) cases only where one of those failed: where they pass, so does the trusted
        # verdict, which then decides the public cases too (judge.score)
        for part in ([c for c in cases if c.points], [c for c in cases if not c.points]):
            if part and not ({judged!r} and done and all(r[0] for r in done.values())):
                tf.test_cases = part
                tf.run(globals())
                done.update((id(r.test_case), [bool(r.passed), str(r.message or "")[:4000]])
                            for r in tf.test_case_results)
        claim["cases"] = [done.get(id(c)) for c in cases]
    except BaseException as exc:
        claim["error"] = f"{{type(exc).__name__}}: {{exc}}"
    with open({path!r}, "w") as f:
        json.dump(claim, f)
_jaxlab_claim()
del _jaxlab_claim
'''


def probe_cells(questions, module, private, layout):
    """Cells appended after the student's: one probe of the jaxlab checks per question."""
    return [PROBE_CELL.format(private=str(private), module=module, question=q,
                              path=str(layout.probe(q))) for q in questions]


def claim_cells(tests, private, layout, judged=()):
    """Cells running otter's own tests in the kernel, for the questions in ``tests``; for those
    in ``judged`` (a jaxlab verdict decides them) the public cases only where a pointed one
    fails."""
    return [CLAIM_CELL.format(private=str(private), test=str(test),
                              path=str(layout.claim(q)), judged=q in judged)
            for q, test in tests.items()]




# --------------------------------------------------------------------------- labels
PROMPT = "### Your code here"


def cell_labels(nb):
    """index -> how a message names each of the student's code cells: the answer cell of a
    question (the one under '### Your code here' before its ``grader.check``), else its first
    line (notebook interfaces number no cells)."""
    graders = _grader_names(nb)
    labels, code = {}, [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    for k, (i, cell) in enumerate(code):
        after = code[k + 1][1].source if k + 1 < len(code) else ""
        checked = _checked_questions(after, graders)
        first = next((ln.strip() for ln in cell.source.splitlines()
                      if ln.strip() and ln.strip() != PROMPT), "")
        if checked and cell.source.lstrip().startswith(PROMPT):
            labels[i] = f"your answer cell for {checked[0]} (under '{PROMPT}')"
        else:
            labels[i] = f"your cell that starts `{first[:60]}`" if first else f"cell {i}"
    return labels


# --------------------------------------------------------------------------- answers
MAX_ANSWER_CHARS = 20_000  # per question: a pasted dataset must not bloat every record


def answer_regions(nb):
    """question -> the code cells of its part of the notebook: those after the previous
    ``grader.check`` cell up to its own (the student's answer and the starter code around it,
    which the similarity check removes with the released notebook). Cells the course locked
    (``editable: false``, the setup cell) and otter's own cells are left out."""
    graders = _grader_names(nb)
    regions, pending = {}, []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        checked = _checked_questions(cell.source, graders)
        if checked:
            for q in checked:
                regions.setdefault(q, []).extend(pending)
            pending = []
            continue
        meta = cell.get("metadata", {})
        if meta.get("editable") is False or any(skip(cell, graders) for skip in SKIPPED):
            continue
        if cell.source.strip():
            pending.append(cell.source)
    out = {}
    for q, cells in regions.items():
        kept, size = [], 0
        for source in cells:
            if size + len(source) > MAX_ANSWER_CHARS:
                break
            kept.append(source)
            size += len(source)
        out[q] = kept
    return out


def _checked_questions(source, graders):
    """The questions a cell checks with ``grader.check("q")``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "check" and isinstance(node.func.value, ast.Name) \
                and node.func.value.id in graders and node.args \
                and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            found.append(node.args[0].value)
    return found
