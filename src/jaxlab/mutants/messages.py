"""What the student reads when a mutant is killed, sorted by kind (issue 44's measurement).

Each failing test case of a killed mutant's question leaves a message; a kill by a limit leaves
a timeout. ``classify`` gives each one a kind by the first of these rules that applies (a rule
each, heuristics: a person reads the report's sample):

* **internals**: the student is shown our machinery: a traceback, a path or module of the
  grader (``jaxlab_lab4``, ``site-packages``), a repr of evidence (``{'kind': ...``), "could not
  be checked", "GRADER ERROR", a grading that failed, or an exception other than a check's
  ``AssertionError`` (it escaped a check: Lab 5 q8's "KeyError: 'output'");
* **timeout**: a kill by a limit, or a message that says the run was stopped (did not finish,
  got stuck, timed out);
* **student's exception**: the message names the exception the student's code raised ("was
  never set: ... raised TypeError", "on new data raised ValueError", "could not be traced ...:
  TypeError");
* "not defined yet" is **generic** when a replayed cell raised (the exception is lost) or the
  mutant left out a statement (the name really was never set), and **misleading** otherwise;
* a **type message** ("expected a Python int", "should be a function") is **names the fault**
  for a mutant that changes a type (``TYPE_OPERATORS``, ``//`` made ``/``), **generic** when
  what was found is None, and **misleading** otherwise (a value was changed, not its type);
* **names the fault**: the message names a graded variable in backticks, says what was expected
  (``EXPECTS``: "expected", "should", "is not", "N times the", ...) and, outside the backticked
  call it describes, has a fault word of the mutant's operator family (``FAMILIES``) or names an
  identifier the mutant changed (``pmean`` for ``psum`` -> ``pmean``);
* **generic**: any other message (correct, but not about what the mutant changed: "has the
  wrong values" for a collective or a spec, a message that names no graded variable).
"""

import dataclasses
import keyword
import random
import re

KINDS = ("fault", "exception", "generic", "timeout", "misleading", "internals")
LABELS = {"fault": "names the fault", "exception": "student's exception", "generic": "generic",
          "timeout": "timeout", "misleading": "misleading", "internals": "internals"}
SAMPLE_SEED = 44  # the number: the same sample on every run of the same outcomes
SAMPLE_SIZE = 10

# what a mutant's operator changes, and the words a message uses for it (operators.OPERATORS)
VALUES = r"\bwrong\b|differ|shape|\bexpected\b[^.;]*\d|\d[^.;]*;\s*expected|expected None|" \
         r"instead of|\btoo (?:large|small|many|few)\b|\btimes the\b|away from|\bsays\b"
TYPES = r"dtype|b?float\d*|\bint\d*\b|precision|\btype\b|tuple|\blist\b|Python (?:int|float)|" \
        r"NumPy|integer"
LAYOUT = r"PartitionSpec|\bP\(|\bspecs?\b|shard|replicat|split|\bmesh|\baxis|\baxes\b|layout|" \
         r"placed|Explicit|Auto\b"
COLLECTIVES = r"psum|pmean|pmax|pmin|all_gather|all_to_all|ppermute|psum_scatter|reduce[-_ ]" \
              r"scatter|all[-_ ]reduce|all[-_ ]gather|collective|\bring\b|permutation|" \
              r"check_vma|\bvma\b|varying|replicat|\baxis\b"
FAMILIES = {
    "values": VALUES,
    "types": TYPES,
    "layout": LAYOUT,
    "collectives": COLLECTIVES,
    "jit": r"jax\.jit|\bjit(?:ted)?\b|compil",
    "checkpoint": r"remat|checkpoint|residual|saved|saves|recompute|policy|memory",
    "scan": r"\bscan\b|lax\.scan|loop|unroll",
    "keyword": r"shape|" + LAYOUT + "|" + TYPES,
    "wrapper": LAYOUT + r"|device_put|pcast|varying|checkpoint_name|residual|saved|"
                        r"stop_gradient|gradient|block_until_ready|asynchronous|dispatch|ready",
    # Orbax's restore without its target, the whole data for a process's share: placement
    "argument": r"target|restore|abstract|process|share|\ball\b|whole|" + LAYOUT,
}
# a statement or an argument moved or left out changes whatever it did: any family's word
FAMILIES["structure"] = "|".join(FAMILIES[f] for f in ("values", "types", "layout",
                                                         "collectives", "jit", "checkpoint",
                                                         "scan"))
OPERATOR_FAMILY = {
    **dict.fromkeys(("arithmetic", "comparison", "constant", "range", "drop-term", "extra-term",
                     "axis", "reduction", "transpose", "guard", "negate"), "values"),
    **dict.fromkeys(("swap-args", "drop-statement", "swap-statements"), "structure"),
    **dict.fromkeys(("dtype", "cast", "conversion", "math-numpy"), "types"),
    **dict.fromkeys(("spec", "mesh", "axis-type", "specs", "wrong-mesh", "mesh-axis",
                     "swap-specs"), "layout"),
    **dict.fromkeys(("collective", "axis-name", "ppermute", "ring-fault", "communication",
                     "check-vma"), "collectives"),
    "jit": "jit", "checkpoint": "checkpoint", "scan": "scan", "keyword": "keyword",
    "unwrap": "wrapper", "drop-arg": "argument",
}
TYPE_OPERATORS = frozenset(op for op, family in OPERATOR_FAMILY.items() if family == "types")

INTERNALS = re.compile(
    r"Traceback \(most recent call last\)|File \"[^\"]+\", line \d+|site-packages|"
    r"/jaxlab/|\bjaxlab_(?:lab\d+|form)\b|__corpus|\{'kind':|could not be checked|"
    r"GRADER ERROR|grader failed|grading failed", re.I)
TIMEOUT = re.compile(r"did not finish|stopped after|got stuck|timed out|ran past its|"
                     r"killed the kernel", re.I)
EXCEPTION_NAME = r"[A-Z]\w*(?:Error|Exception|Exit|Interrupt)\b"
STUDENT_EXCEPTION = re.compile(
    rf"was never set:|\braised {EXCEPTION_NAME}|(?:stopped|failed|exited) with `?{EXCEPTION_NAME}|"
    rf"could not be (?:traced|compiled|lowered|run|restored|loaded)[^\n]*?[:(] ?{EXCEPTION_NAME}")
NOT_DEFINED = re.compile(r"is not defined yet")
TYPE_MESSAGE = re.compile(
    r"expected an? (?:Python )?(?:int|integer|float|scalar|number|tuple|list|dict|str|string|"
    r"array|jax\.Array|function)(?=\s*[.;,:(]|\s*$)|should be an? (?:Python \w+|int|float|"
    r"function|jax\.Array|tuple|list|dict)\b")
FOUND_NONE = re.compile(r"\b(?:returned|returns|is|it is|holds) None\b")
# a comparison with what was expected: said outright, or as what is missing or how far off
EXPECTS = re.compile(
    r"\bexpected\b|\bshould\b|\binstead\b|\bmust\b|\brather than\b|\bnever\b|\bwithout\b|"
    r"\b(?:is|are|was|were|does|did|has|have) not\b|\bhas no\b|\btimes (?:the|too)\b|"
    r"\btoo (?:large|small|many|few)\b|\baway from\b|\bdiffer|\bthe (?:true|right|correct)\b|"
    r"\bcompared? (?:to|with)\b|\bsays\b.*\bsays\b", re.I)
IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
HEAD = re.compile(r"^(\w+(?:\.\w+)*): ", re.S)  # "AssertionError: ..." as otter ends a failure


@dataclasses.dataclass
class Message:
    """One message a killed mutant leaves, with its kind and the rule that gave it."""

    question: str
    operator: str
    change: str
    hidden: bool  # the hidden case (the points) or a public one (grader.check)
    text: str  # what the student reads, without otter's framing
    kind: str = ""
    rule: str = ""


def student_text(message):
    """The message of an otter test case without otter's framing ("❌ Test case failed",
    "Error at line N in test q…:" and the test's own line, the same for every failure),
    as ``(exception name or None, text)``."""
    lines = message.strip().splitlines()
    if lines and lines[0].startswith("❌"):
        lines = lines[1:]
    if lines and lines[0].startswith("Error at line "):
        lines = lines[1:]
        while lines and lines[0].startswith("  "):  # the test's lines otter quotes
            lines = lines[1:]
    text = "\n".join(lines).strip()
    head = HEAD.match(text)
    return (head.group(1), text[head.end():].strip()) if head else (None, text)


def changed_names(before, after):
    """Identifiers of three letters or more that the mutant removed or brought in."""
    words = [set(IDENTIFIER.findall(t)) - set(keyword.kwlist) for t in (before, after)]
    return {w for w in words[0] ^ words[1] if len(w) >= 3}


def changes_type(operator, before, after):
    """Whether the mutant changes what type a value has: its operator's family is types, or it
    makes a floor division a true division (an int becomes a float)."""
    return operator in TYPE_OPERATORS or (operator == "arithmetic" and "//" in before
                                          and "//" not in after)


def names_graded(text, graded):
    """Whether the text names one of the question's graded variables in backticks (any name in
    backticks when they are not known)."""
    quoted = re.findall(r"`([^`]*)`", text)
    if not graded:
        return any(IDENTIFIER.match(q) for q in quoted)
    return any(re.match(rf"{re.escape(n)}\b", q) for q in quoted for n in graded)


def _without_calls(text, graded):
    """The text without the backticked spans that name a graded variable (a call such as
    `tp_forward(params, tokens, mesh, n_heads)` names its arguments, not a fault)."""
    return re.sub(r"`([^`]*)`", lambda q: "" if any(
        re.match(rf"{re.escape(n)}\b", q.group(1)) for n in graded) else q.group(0), text)


def classify(text, *, exception="AssertionError", operator="", before="", after="",
             graded=(), raised=(), limit=False):
    """(kind, rule) of a message: ``text`` as the student reads it, ``exception`` the name of
    the exception otter reports (None: not an exception); the mutant's ``operator`` and the code
    it changed (``before``, ``after``); the question's ``graded`` names; ``raised``: the
    exceptions of the replayed cells that raised; ``limit``: a kill by a limit."""
    if limit:
        return "timeout", "killed by a limit: the student reads a timeout"
    found = INTERNALS.search(text)
    if found:
        return "internals", f"shows our machinery ({found.group(0)!r})"
    if exception not in (None, "AssertionError"):
        return "internals", f"a {exception} escaped the check (not its AssertionError)"
    found = TIMEOUT.search(text)
    if found:
        return "timeout", f"says the run was stopped ({found.group(0)!r})"
    found = STUDENT_EXCEPTION.search(text)
    if found:
        return "exception", f"names the student's exception ({found.group(0)!r})"
    if NOT_DEFINED.search(text):
        if raised:
            return "generic", f"'not defined yet' where a cell raised {raised[0][:60]!r}"
        if operator == "drop-statement":
            return "generic", "'not defined yet' for a statement left out"
        return "misleading", "'not defined yet' although no cell raised and the name was set"
    found = TYPE_MESSAGE.search(text)
    if found:
        if changes_type(operator, before, after):
            return "fault", f"a type message ({found.group(0)!r}) for a mutant that changes a type"
        if FOUND_NONE.search(text):
            return "generic", f"a type message ({found.group(0)!r}) where None was found"
        return "misleading", (f"a type message ({found.group(0)!r}) for a mutant by "
                              f"{operator or 'a value operator'}, which changes a value, not "
                              "its type")
    if not names_graded(text, graded):
        return "generic", "names no graded variable in backticks"
    if not EXPECTS.search(text):
        return "generic", "does not say what was expected"
    family = OPERATOR_FAMILY.get(operator, "values")
    said = _without_calls(text, graded)
    found = re.search(FAMILIES[family], said)
    if found:
        return "fault", f"a {family} word ({found.group(0)!r}) for a mutant by {operator or '?'}"
    names = sorted(n for n in changed_names(before, after) - set(graded)
                   if re.search(rf"\b{re.escape(n)}\b", said))
    if names:
        return "fault", f"names what the mutant changed ({names[0]!r})"
    return "generic", f"no {family} word for a mutant by {operator or '?'}"


def of_outcome(outcome, graded=()):
    """The classified messages a killed mutant (by a check or a limit) leaves: each failing
    case's message, a kill by a limit its stop; none for a survivor."""
    m = outcome.mutant
    common = dict(operator=m.operator, before=m.before, after=m.after, graded=graded,
                  raised=tuple(getattr(outcome, "raised", ()) or ()))
    found = []

    def add(hidden, text, exception="AssertionError", **extra):
        kind, rule = classify(text, exception=exception, **common, **extra)
        found.append(Message(outcome.question, m.operator, m.change, hidden, text, kind, rule))

    if outcome.status == "limit":
        add(True, outcome.detail, limit=True)
    elif outcome.status == "killed":
        cases = getattr(outcome, "messages", ()) or ()
        if not cases:  # a grading that failed, or an older outcome without its messages
            add(True, outcome.detail, exception=None)
        for hidden, raw in cases:
            exception, text = student_text(raw)
            add(hidden, text, exception=exception)
    return found


def of_analysis(analysis):
    graded = getattr(analysis, "graded", {}) or {}
    return [msg for o in analysis.outcomes
            for msg in of_outcome(o, tuple(sorted(graded.get(o.question, ()))))]


def counts(messages):
    """kind -> how many of ``messages``, in KINDS order."""
    return {kind: sum(m.kind == kind for m in messages) for kind in KINDS}


def sample(messages, kind, size=SAMPLE_SIZE, seed=SAMPLE_SEED):
    """Up to ``size`` messages of ``kind``, drawn with a fixed seed (in their order)."""
    mine = [i for i, m in enumerate(messages) if m.kind == kind]
    chosen = sorted(random.Random(f"{seed}-{kind}").sample(mine, min(size, len(mine))))
    return [messages[i] for i in chosen]
