"""Measure the similarity check on a class built from the answer corpus.

    .venv/bin/python benchmarks/similarity_class.py [--lab lab4-shard-map] [--students 40]
                                                    [--copies 12] [--big 1000] [--seed 0]
                                                    [--train-steps 0] [--full-probe]

A class of ``--students`` independent students, each answering every question with a corpus
answer (tests/answers/<lab>/, correct and wrong alike, drawn at random: honest students share
answers often, as a class does where the task leaves few ways), plus ``--copies`` planted copies
of some of them made the ways copiers work: variables renamed, independent lines reordered,
comments and blank lines changed, a helper variable inlined, one answer replaced by another; a
copy applies one of these, or all of them. Each distinct answer code, copies' included, is
traced for real: the lab's solution notebook runs once in this process, then each answer runs
in a copy of its globals and the lab's own probe (``jaxlab_<lab>.probe``, what the grading
kernel runs) records its program, which ``engine.traces`` turns into steps; the answers a
record keeps come from the built notebook through ``engine.cells.answer_regions``, as the worker
does. Prints the planted pairs flagged (recall), independent pairs flagged (false positives),
and the time of the check on ``--big`` synthetic submissions from the same generator (copies
there reuse their original's traced steps).

Shortcuts keep the build to minutes (``--full-probe`` drops them): the probe's compiled calls
(``_run``: the values a verdict reads) are skipped, its search for an input seed clear of ReLU
kinks runs once and its seed is reused, and the notebook's ``train`` helper runs
``--train-steps`` steps (its own 1,000 otherwise) when an answer calls it. None touches what is
compared: the probe traces the student's function with ``jax.make_jaxpr`` on inputs of fixed
shapes and layouts, whatever their values and whatever was computed before. (In full, a
q10 answer took ~100 s on the loaded 2-core machine: hours for the class.) The claim is checked
in the run: the first answer of each question is traced both ways and must give the same steps.
"""

import argparse
import ast
import contextlib
import copy
import functools
import inspect
import io
import os
import pathlib
import random
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("PJRT_NPROC", "16")

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import nbformat  # noqa: E402
import yaml  # noqa: E402

from jaxlab.grade.engine.cells import answer_regions  # noqa: E402
from jaxlab.grade.engine.traces import tokens  # noqa: E402
from jaxlab.grade.model import Record  # noqa: E402
from jaxlab.grade.output import similarity  # noqa: E402

PROMPT = "### Your code here"
KINDS = ("rename", "reorder", "comments", "inline", "one changed")


# --------------------------------------------------------------------------- copiers
class _Rename(ast.NodeTransformer):
    def __init__(self, names):
        self.names = names

    def visit_Name(self, node):
        if node.id in self.names:
            node.id = self.names[node.id]
        return node

    def visit_arg(self, node):
        if node.arg in self.names:
            node.arg = self.names[node.arg]
        return node

    def visit_FunctionDef(self, node):
        if node.name in self.names:
            node.name = self.names[node.name]
        self.generic_visit(node)
        return node


def rename(code, keep):
    tree = ast.parse(code)
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            own.add(node.id)
        elif isinstance(node, ast.arg):
            own.add(node.arg)
        elif isinstance(node, ast.FunctionDef):
            own.add(node.name)
    names = {n: f"my_{n}" for n in sorted(own - set(keep))}
    return ast.unparse(_Rename(names).visit(tree)) if names else None


def _uses(stmt):
    reads = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    writes = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    writes |= {n.name for n in ast.walk(stmt) if isinstance(n, ast.FunctionDef)}
    return reads, writes


def reorder(code, keep):
    tree = ast.parse(code)
    bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    for body in bodies:
        for i in range(len(body) - 1):
            a, b = body[i], body[i + 1]
            if isinstance(b, ast.Return) or isinstance(a, ast.Return):
                continue
            ra, wa = _uses(a)
            rb, wb = _uses(b)
            if not (wa & rb or wb & ra or wa & wb):
                body[i], body[i + 1] = b, a
                return ast.unparse(tree)
    return None


def comments(code, keep):
    lines = [ln for ln in code.splitlines() if not ln.strip().startswith("#")]
    out = ["# my answer, worked out below", ""]
    for ln in lines:
        out.append(ln)
        if ln and not ln.startswith((" ", "\t", "@")) and not ln.rstrip().endswith((",", "(")):
            out.append("")
    return "\n".join(out)


def inline(code, keep):
    """Inline a variable assigned once and read once after it, within one body."""
    tree = ast.parse(code)
    bodies = [tree.body] + [n.body for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)]
    for body in bodies:
        for i, stmt in enumerate(body):
            if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0], ast.Name)) or stmt.targets[0].id in keep:
                continue
            name = stmt.targets[0].id
            later = [n for s in body[i + 1:] for n in ast.walk(s)
                     if isinstance(n, ast.Name) and n.id == name]
            if len(later) == 1 and isinstance(later[0].ctx, ast.Load):
                value = stmt.value

                class Sub(ast.NodeTransformer):
                    def visit_Name(self, node):
                        return copy.deepcopy(value) if node is later[0] else node

                for j in range(i + 1, len(body)):
                    body[j] = Sub().visit(body[j])
                del body[i]
                return ast.unparse(tree)
    return None


COPIERS = {"rename": rename, "reorder": reorder, "comments": comments, "inline": inline}


# --------------------------------------------------------------------------- the lab in process
class Lab:
    def __init__(self, lab, *, shortcuts=True, train_steps=0):
        import importlib.util

        self.name = lab
        self.template = nbformat.read(ROOT / "student" / lab / f"{lab}.ipynb", as_version=4)
        solution = nbformat.read(ROOT / "solutions" / lab / f"{lab}.ipynb", as_version=4)
        checks_src = ROOT / "src" / "jaxlab" / "checks"
        import jaxlab.checks.form as form

        sys.modules["jaxlab_form"] = form
        number = lab.split("-")[0]
        spec = importlib.util.spec_from_file_location(f"jaxlab_{number}", checks_src / f"{number}.py")
        self.checks = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(self.checks)
        self.corpus = {}
        for path in sorted((ROOT / "tests" / "answers" / lab).glob("*.yaml")):
            raw = yaml.safe_load(path.read_text())
            self.corpus[path.stem] = [a["code"] for a in raw.get("correct", []) + raw.get("wrong", [])]
        self.globals = {"__name__": "__main__"}
        for cell in solution.cells:
            src = cell.source
            if cell.cell_type != "code" or cell.get("metadata", {}).get("editable") is False \
                    or "grader" in src or src.lstrip().startswith(("%", "!")):
                continue
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(compile(src, "<solution>", "exec"), self.globals)
            except Exception as exc:  # e.g. Part D's processes: leave that question out
                print(f"  (solution cell skipped: {type(exc).__name__}: {str(exc)[:80]})")
        self.traced, self.failed = {}, {}
        self.shortcuts = shortcuts
        self.train_steps = train_steps
        self.replaced = _value_helpers(self.checks)

    def trace(self, question, code, full=False):
        """The steps of the program the lab's probe traces for ``code`` (cached per distinct
        answer). Unless ``full`` or shortcuts are off, the notebook's ``train`` runs
        ``train_steps`` steps and the probe's compiled calls (``_run``: the values that grade)
        are skipped; ``check_shortcuts`` shows neither changes the traced program."""
        key = (question, code, full or not self.shortcuts)
        if key not in self.traced:
            g = dict(self.globals)
            short = not key[2]
            train = g.get("train")
            if short and callable(train) and "steps" in inspect.signature(train).parameters:
                g["train"] = functools.partial(train, steps=self.train_steps)
            kept = {name: getattr(self.checks, name) for name in self.replaced} if short else {}
            try:
                for name in kept:
                    setattr(self.checks, name, self.replaced[name])
                with contextlib.redirect_stdout(io.StringIO()):
                    exec(compile(code, "<answer>", "exec"), g)
                    names = self.checks.QUESTIONS[question].names
                    ev = self.checks.probe(question, {n: g.get(n) for n in names})
                self.traced[key] = tokens(ev)
            except Exception as exc:  # a wrong answer may raise: its record has no program
                self.traced[key] = {}
                self.failed[key] = f"{type(exc).__name__}: {str(exc)[:60]}"
            finally:
                for name, helper in kept.items():
                    setattr(self.checks, name, helper)
        return self.traced[key]

    def check_shortcuts(self):
        """For the first answer of each question: (questions whose program traced with the
        shortcuts equals the one traced in full, questions compared)."""
        if not self.shortcuts:
            return None
        same = [q for q, answers in self.corpus.items()
                if (short := self.trace(q, answers[0])) and short == self.trace(q, answers[0],
                                                                              full=True)]
        return same, len(self.corpus)

    def record(self, file, answers, traced=True, programs=None):
        nb = copy.deepcopy(self.template)
        for q, code in answers.items():
            for cell in nb.cells:
                if cell.cell_type == "code" and cell.source.startswith(PROMPT) \
                        and _question_after(nb, cell) == q:
                    cell.source = code
        progs = programs if programs is not None else \
            {q: self.trace(q, code) for q, code in answers.items()} if traced else {}
        return Record(file=file, sha256="", answers=answer_regions(nb),
                      programs={q: p for q, p in progs.items() if p})


def _value_helpers(checks):
    """Replacements for the probe's helpers that compute values a verdict reads, never the
    traced program: its compiled calls (``_run``: skipped) and its search for a fresh input seed
    clear of ReLU kinks (``_kink_free_seed``: done once, its seed reused)."""
    out = {}
    if hasattr(checks, "_run"):
        out["_run"] = lambda *a, **k: {}
    if hasattr(checks, "_kink_free_seed"):
        search, found = checks._kink_free_seed, []

        def once(*args, **kwargs):
            if not found:
                found.append(search(*args, **kwargs))
            return found[0]

        out["_kink_free_seed"] = once
    return out


def _question_after(nb, cell):
    seen = False
    for c in nb.cells:
        if c is cell:
            seen = True
        elif seen and c.cell_type == "code" and "grader.check(" in c.source:
            return c.source.split('"')[1]
    return None


def build(lab, students, copies, rng, traced=True, copy_programs=False):
    questions = list(lab.corpus)
    honest = [{q: rng.choice(lab.corpus[q]) for q in questions} for _ in range(students)]
    records = [lab.record(f"student{i:04d}", a, traced) for i, a in enumerate(honest)]
    planted, kinds = [], []
    for c in range(copies):
        src = c % students
        kind = KINDS[c % len(KINDS)] if c < 2 * len(KINDS) else "all"
        answers = dict(honest[src])
        steps = KINDS[:-1] if kind == "all" else (kind,) if kind != "one changed" else ()
        for q in questions:
            keep = lab.checks.QUESTIONS[q].names
            for step in steps:
                done = COPIERS[step](answers[q], keep)
                answers[q] = done if done else answers[q]
        if kind in ("one changed", "all"):
            q = rng.choice(questions)
            answers[q] = rng.choice([a for a in lab.corpus[q] if a != honest[src][q]])
        programs = {q: lab.trace(q, honest[src][q]) for q in questions} if copy_programs else None
        records.append(lab.record(f"copy{c:03d}_of_{src:04d}", answers, traced, programs))
        planted.append(frozenset((f"student{src:04d}", records[-1].file)))
        kinds.append(kind)
    return records, planted, kinds


def report(result, records, planted):
    """Print recall and false positives; the flagged pairs."""
    flagged = {frozenset((p.a, p.b)) for p in result.flagged}
    shown = {frozenset((p.a, p.b)) for p in result.pairs[:similarity.SHOWN]}
    top = {frozenset((p.a, p.b)) for p in result.pairs[:len(planted)]}
    n = len(records)
    independent = n * (n - 1) // 2 - len(planted)
    print(f"  recall: {len(flagged & set(planted))}/{len(planted)} planted pairs flagged, "
          f"{len(top & set(planted))}/{len(planted)} among the top {len(planted)} pairs, "
          f"{len(shown & set(planted))} among the {similarity.SHOWN} the page lists first")
    print(f"  false positives: {len(flagged - set(planted))} of {independent} independent pairs "
          "flagged")
    return flagged


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lab", default="lab4-shard-map")
    ap.add_argument("--students", type=int, default=40)
    ap.add_argument("--copies", type=int, default=12)
    ap.add_argument("--big", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-steps", type=int, default=0,
                    help="steps the notebook's train helper runs when an answer calls it")
    ap.add_argument("--full-probe", action="store_true",
                    help="no shortcuts: answers train in full and the probe compiles and runs "
                         "what it checks (hours on a loaded 2-core machine)")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.monotonic()
    lab = Lab(args.lab, shortcuts=not args.full_probe, train_steps=args.train_steps)
    print(f"{args.lab}: {len(lab.corpus)} questions, {sum(map(len, lab.corpus.values()))} corpus "
          f"answers; solution run in {time.monotonic() - t0:.0f} s")
    regions = answer_regions(lab.template)
    t1 = time.monotonic()
    records, planted, kinds = build(lab, args.students, args.copies, rng)
    print(f"traced {len(lab.traced)} distinct answers in {time.monotonic() - t1:.0f} s")
    empty = [k for k, v in lab.traced.items() if not v]
    print(f"  {len(empty)} of them traced nothing ({len(lab.failed)} raised, e.g. "
          f"{next(iter(lab.failed.values()), '-')})")
    result = similarity.compare(records, regions)
    print(f"class of {len(records)} ({args.students} students + {len(planted)} planted copies), "
          f"threshold {result.threshold:.1f}, check took {result.seconds:.1f} s")
    flagged = report(result, records, planted)
    for kind in dict.fromkeys(kinds):
        got = [p in flagged for p, k in zip(planted, kinds) if k == kind]
        print(f"  {kind:12s} {sum(got)}/{len(got)} flagged")
    big_copies = args.big // 10
    t1 = time.monotonic()
    big, big_planted, _ = build(lab, args.big - big_copies, big_copies, rng, copy_programs=True)
    print(f"{args.big} synthetic submissions ({big_copies} planted copies; built in "
          f"{time.monotonic() - t1:.0f} s)")
    result = similarity.compare(big, regions)
    print(f"  the check took {result.seconds:.1f} s, threshold {result.threshold:.1f}")
    report(result, big, big_planted)
    checked = lab.check_shortcuts()
    if checked is not None:
        print(f"shortcuts checked: the first answer of {len(checked[0])} of {checked[1]} "
              "questions traces the same program with them as in full")


if __name__ == "__main__":
    main()
