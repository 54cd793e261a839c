"""The traced programs a question's probe recorded, as a bag of normalised dataflow steps.

The probes keep what ``jax.make_jaxpr`` gave for a student's function: its printed jaxpr
(``"jaxpr"``: Labs 3 and 4) or its equations as plain data (``"program": {"steps": ...}``:
Lab 5). Each equation becomes one step, ``primitive:output types<-what made its inputs``: the
primitives that produced each operand (``arg`` for an argument, ``lit`` for a literal constant),
so variable names and constants never count, and nor does the order of independent lines; nested
jaxprs (jit, shard_map, scan bodies) contribute their own equations. The similarity check
(``output.similarity``) compares these bags between submissions.
"""

import collections
import re

MAX_STEPS = 4000  # per question, before counting: a long unrolled loop adds nothing new
MAX_COUNT = 16  # how often one step counts at most

_HEAD = re.compile(r"^(\s*)((?:[A-Za-z_]\w*:\S+\s*)+?)\s*=\s*([a-z_][\w\-]*)(.*)$")
_LAMBDA = re.compile(r"\{\s*lambda\s*([^;]*);([^.]*)\.\s*let")
_TYPE = re.compile(r"^([a-z]+\d*(?:\[[^\]]*\])?)")


def tokens(evidence):
    """{step: count} over every traced program in ``evidence`` (plain data)."""
    steps = []
    for kind, value in _programs(evidence):
        steps.extend(_jaxpr_steps(value) if kind == "jaxpr" else _plain_steps(value))
        if len(steps) >= MAX_STEPS:
            break
    counts = collections.Counter(steps[:MAX_STEPS])
    return {k: min(v, MAX_COUNT) for k, v in sorted(counts.items())}


def _programs(node):
    if isinstance(node, dict):
        if isinstance(node.get("jaxpr"), str):
            yield "jaxpr", node["jaxpr"]
        elif isinstance(node.get("program"), dict) and isinstance(node["program"].get("steps"),
                                                                  list):
            yield "steps", node["program"]["steps"]
        for k, v in node.items():
            if k not in ("jaxpr", "program"):
                yield from _programs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _programs(v)


def _plain_steps(steps):
    out = []
    for s in steps:
        if isinstance(s, dict) and "prim" in s:
            shapes = ",".join("x".join(map(str, o)) for o in s.get("out", []))
            ins = ",".join(sorted("x".join(map(str, i)) for i in s.get("in", [])))
            out.append(f"{s['prim']}:{shapes}<-{ins}")
    return out


def _jaxpr_steps(text):
    """Steps of a printed jaxpr, read line by line: an equation's head ``outs = prim[...`` may
    leave its parameters open (with nested jaxprs inside) until a line ``] ins``."""
    scopes = [{}]  # var -> the primitive that made it, per lambda
    open_eqns = []  # (indent, primitive, outs) whose parameters are still open
    steps = []

    def made(name):
        if ":" in name or re.match(r"^-?[\d.]", name) or name in ("True", "False"):
            return "lit"
        return scopes[-1].get(name, "?")

    def emit(prim, outs, ins):
        types = ",".join(_type(t) for _, t in outs)
        steps.append(f"{prim}:{types}<-{','.join(sorted(made(i) for i in ins))}")
        for name, _ in outs:
            scopes[-1][name] = prim

    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # a kernel's JAX may print it in colour
    # a short jaxpr prints on one line: give its lambda, equations and result lines of their own
    text = re.sub(r"(\.\s*let)\s+", r"\1\n", text)
    text = re.sub(r"\s+(in\s+\()", r"\n\1", text)
    for line in text.splitlines():
        lam = _LAMBDA.search(line)
        if lam:
            scopes.append({v.split(":")[0]: "arg" for v in (lam[1] + " " + lam[2]).split()
                           if ":" in v})
            continue
        stripped = line.strip()
        if re.match(r"^in\b.*\}\s*$", stripped) or stripped == "}":
            if len(scopes) > 1:
                scopes.pop()
            continue
        if stripped.startswith("]") and open_eqns:
            indent, prim, outs = open_eqns.pop()
            emit(prim, outs, stripped[1:].split())
            continue
        m = _HEAD.match(line)
        if not m:
            continue
        outs = [tuple(v.split(":", 1)) for v in m[2].split()]
        prim, rest = m[3], m[4]
        if rest.startswith("["):
            depth, end = 0, None
            for i, ch in enumerate(rest):
                depth += ch == "["
                depth -= ch == "]"
                if depth == 0:
                    end = i
                    break
            if end is None:
                open_eqns.append((m[1], prim, outs))
                continue
            rest = rest[end + 1:]
        emit(prim, outs, _operands(rest))
    return steps


def _operands(rest):
    """'d f' or '2.0:f32[]' -> operand words (a literal keeps its ':type')."""
    return [w for w in re.split(r"\s+(?![^\[]*\])", rest.strip()) if w]


def _type(t):
    m = _TYPE.match(t)
    return m[1] if m else t
