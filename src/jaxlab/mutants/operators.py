"""Mutation operators: small faults seeded into a solution's answer cell, one at a time.

Each operator looks at one node of the cell's concrete syntax tree (libcst, which keeps the
rest of the cell exactly as written) and proposes replacements for it. ``mutants(source)``
applies every proposal on its own and returns the distinct programs that compile.

Two families. General faults any program can have (Clegg et al.'s classes of student
mistakes): an arithmetic or comparison operator swapped, a constant off by one, a term dropped
or repeated, arguments swapped, another axis, ``mean`` for ``sum``, a transpose added or
removed, another dtype, a type conversion dropped, a guard or a statement removed, two
statements swapped, a condition negated. And faults of what these labs teach (conceptual
mutants: the misconceptions of sharding and collectives): a ``PartitionSpec`` entry swapped,
dropped or replaced by ``None``, the mesh's axes transposed, ``Explicit`` for ``Auto``, one
collective for another, a ``ppermute`` ring reversed or shifted, ``jax.jit`` or
``jax.checkpoint`` removed, another remat policy, ``lax.scan`` unrolled into a Python loop,
``in_specs``/``out_specs`` replicated, ``check_vma`` turned off, a collective over another mesh
axis, a wrapper (``device_put``, ``pcast``, ``checkpoint_name``, ``stop_gradient``) dropped.

A string that holds a whole Python program (Lab 5's training script) is mutated inside.
"""

import ast
import dataclasses
import hashlib

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider

DEFAULT = cst.MaybeSentinel.DEFAULT


@dataclasses.dataclass(frozen=True)
class Mutant:
    operator: str  # the operator's name (a key of OPERATORS)
    line: int  # of the answer cell (for people: keys do not depend on it)
    before: str  # the code the operator changed ...
    after: str  # ... and what it became
    code: str  # the whole mutated cell
    occurrence: int = 0  # among mutants with the same operator, before and after

    @property
    def key(self):
        """A name that stays while the cell changes elsewhere: operator, change, occurrence."""
        text = f"{self.operator}\0{self.before}\0{self.after}\0{self.occurrence}"
        return f"{self.operator}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"

    @property
    def change(self):
        return f"{_one_line(self.before)}  ->  {_one_line(self.after)}"


def _one_line(text, width=90):
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


# --------------------------------------------------------------------------- helpers
def _code(node):
    return cst.Module([]).code_for_node(node)


def _dotted(node):
    """'jax.lax.psum' for the expression ``jax.lax.psum``; None for anything else."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr.value}"
    return None


def _last(node):
    """The last part of a called name: 'psum' for ``lax.psum`` and ``psum``."""
    name = _dotted(node)
    return None if name is None else name.rsplit(".", 1)[-1]


def _renamed(node, new):
    """``node`` (a Name or an Attribute) with its last part called ``new``."""
    if isinstance(node, cst.Name):
        return node.with_changes(value=new)
    return node.with_changes(attr=node.attr.with_changes(value=new))


def _args(args):
    """An argument list with fresh commas (so dropping or moving one leaves valid code)."""
    return [a.with_changes(comma=DEFAULT) for a in args]


def _positional(call):
    return [a for a in call.args if a.keyword is None and not a.star]


def _keyword(call, name):
    return next((a for a in call.args if a.keyword is not None and a.keyword.value == name), None)


def _expr(text):
    return cst.parse_expression(text)


def _call_of(node, *names):
    return isinstance(node, cst.Call) and _last(node.func) in names


# --------------------------------------------------------------------------- operators
# name -> (family, function(node, context) -> replacements: each a node, or for a whole block
# a tuple (block, the code it changed, what that code became, the statement changed))
OPERATORS = {}


def operator(name, family):
    def register(fn):
        OPERATORS[name] = (family, fn)
        return fn
    return register


ARITHMETIC = {cst.Add: cst.Subtract, cst.Subtract: cst.Add, cst.Multiply: cst.Divide,
              cst.Divide: cst.Multiply, cst.FloorDivide: cst.Divide, cst.Power: cst.Multiply,
              cst.Modulo: cst.FloorDivide}
AUGMENTED = {cst.AddAssign: cst.SubtractAssign, cst.SubtractAssign: cst.AddAssign,
             cst.MultiplyAssign: cst.DivideAssign, cst.DivideAssign: cst.MultiplyAssign}


@operator("arithmetic", "general")
def _arithmetic(node, ctx):
    if isinstance(node, cst.BinaryOperation) and type(node.operator) in ARITHMETIC:
        op = node.operator
        yield node.with_changes(operator=ARITHMETIC[type(op)](
            whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after))
    if isinstance(node, cst.AugAssign) and type(node.operator) in AUGMENTED:
        op = node.operator
        yield node.with_changes(operator=AUGMENTED[type(op)](
            whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after))


COMPARISON = {cst.LessThan: cst.LessThanEqual, cst.LessThanEqual: cst.LessThan,
              cst.GreaterThan: cst.GreaterThanEqual, cst.GreaterThanEqual: cst.GreaterThan,
              cst.Equal: cst.NotEqual, cst.NotEqual: cst.Equal, cst.Is: cst.IsNot,
              cst.IsNot: cst.Is, cst.In: cst.NotIn, cst.NotIn: cst.In}


@operator("comparison", "general")
def _comparison(node, ctx):
    if not isinstance(node, cst.Comparison):
        return
    for i, target in enumerate(node.comparisons):
        op = target.operator
        if type(op) not in COMPARISON:
            continue
        new = COMPARISON[type(op)](whitespace_before=op.whitespace_before,
                                   whitespace_after=op.whitespace_after)
        targets = list(node.comparisons)
        targets[i] = target.with_changes(operator=new)
        yield node.with_changes(comparisons=targets)


@operator("constant", "general")
def _constant(node, ctx):
    if isinstance(node, cst.Integer):
        value = int(node.evaluated_value)
        yield cst.Integer(str(value + 1))
        if value > 0:
            yield cst.Integer(str(value - 1))
    elif isinstance(node, cst.Float):
        value = float(node.evaluated_value)
        yield cst.Float(repr(value * 2 if value else 1.0))


@operator("range", "general")
def _range(node, ctx):
    """A loop's range off by one at its end: ``range(n)`` -> ``range(n + 1)``, ``range(n - 1)``
    (an integer end is the constant operator's)."""
    if _call_of(node, "range") and isinstance(node.func, cst.Name) and _positional(node):
        end = _positional(node)[0 if len(_positional(node)) == 1 else 1]
        if isinstance(end.value, cst.Integer):
            return
        for op in ("+", "-"):
            args = list(node.args)
            args[args.index(end)] = end.with_changes(value=_expr(f"({_code(end.value)}) {op} 1"))
            yield node.with_changes(args=args)


@operator("drop-term", "general")
def _drop_term(node, ctx):
    if isinstance(node, cst.BinaryOperation) and isinstance(
            node.operator, (cst.Add, cst.Subtract, cst.Multiply, cst.Divide, cst.MatrixMultiply)):
        yield node.left
        if not isinstance(node.operator, cst.Divide):
            yield node.right


@operator("extra-term", "general")
def _extra_term(node, ctx):
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator,
                                                            (cst.Add, cst.Subtract)):
        yield node.with_changes(right=cst.BinaryOperation(
            node.right, cst.Multiply(whitespace_before=cst.SimpleWhitespace(" "),
                                     whitespace_after=cst.SimpleWhitespace(" ")),
            cst.Integer("2"), lpar=[cst.LeftParen()], rpar=[cst.RightParen()]))


# functions whose two arguments commute: swapping them is the same program
COMMUTATIVE = ("max", "min", "maximum", "minimum", "add", "multiply", "logaddexp", "hypot",
               "isclose", "allclose", "array_equal")


@operator("swap-args", "general")
def _swap_args(node, ctx):
    if not isinstance(node, cst.Call) or _last(node.func) in COMMUTATIVE + DISPLAY:
        return
    args = list(node.args)
    spots = [i for i, a in enumerate(args) if a.keyword is None and not a.star]
    for i, j in zip(spots, spots[1:]):
        if j != i + 1 or _code(args[i].value) == _code(args[j].value):
            continue
        new = list(args)
        new[i], new[j] = args[i].with_changes(value=args[j].value), \
            args[j].with_changes(value=args[i].value)
        yield node.with_changes(args=new)


OTHER_AXIS = {0: 1, 1: 0, -1: -2, -2: -1}


@operator("axis", "general")
def _axis(node, ctx):
    if not isinstance(node, cst.Call):
        return
    for i, arg in enumerate(node.args):
        if arg.keyword is None or arg.keyword.value not in ("axis", "scatter_dimension",
                                                            "split_axis", "concat_axis"):
            continue
        try:
            value = ast.literal_eval(_code(arg.value))
        except (ValueError, SyntaxError):
            continue
        if isinstance(value, int):
            args = list(node.args)
            args[i] = arg.with_changes(value=_expr(str(OTHER_AXIS.get(value, 0))))
            yield node.with_changes(args=args), _code(arg), _code(args[i]), node


REDUCTIONS = {"mean": "sum", "sum": "mean", "max": "min", "min": "max", "maximum": "minimum",
              "minimum": "maximum", "argmax": "argmin", "argmin": "argmax", "nanmean": "nansum",
              "prod": "sum"}


@operator("reduction", "general")
def _reduction(node, ctx):
    if isinstance(node, cst.Call) and _last(node.func) in REDUCTIONS and isinstance(
            node.func, (cst.Name, cst.Attribute)):
        yield node.with_changes(func=_renamed(node.func, REDUCTIONS[_last(node.func)]))


@operator("transpose", "general")
def _transpose(node, ctx):
    if isinstance(node, cst.Attribute) and node.attr.value == "T":
        yield node.value
    if _call_of(node, "transpose", "swapaxes", "moveaxis"):
        owner = _dotted(node.func.value) if isinstance(node.func, cst.Attribute) else None
        if owner in ("jnp", "np", "numpy", "jax.numpy", "lax", "jax.lax"):
            if _positional(node):  # jnp.transpose(x, ...) -> x
                yield _positional(node)[0].value
        elif isinstance(node.func, cst.Attribute):  # x.transpose(...) -> x
            yield node.func.value
    if isinstance(node, cst.BinaryOperation) and isinstance(node.operator, cst.MatrixMultiply):
        for side in ("left", "right"):
            operand = getattr(node, side)
            if isinstance(operand, (cst.Name, cst.Attribute, cst.Subscript, cst.Call)) and not (
                    isinstance(operand, cst.Attribute) and operand.attr.value == "T"):
                yield node.with_changes(**{side: cst.Attribute(operand, cst.Name("T"))})


DTYPES = {"float32": "bfloat16", "bfloat16": "float32", "float16": "float32",
          "float64": "float32", "int32": "float32", "int8": "int32"}


@operator("dtype", "general")
def _dtype(node, ctx):
    if isinstance(node, cst.Attribute) and node.attr.value in DTYPES and \
            _dotted(node.value) in ("jnp", "np", "numpy", "jax.numpy"):
        yield _renamed(node, DTYPES[node.attr.value])


@operator("conversion", "general")
def _conversion(node, ctx):
    """A type the task states, lost: ``float(x)`` -> ``x``; a returned tuple as a list."""
    if _call_of(node, "float", "int", "bool", "tuple", "list") and isinstance(
            node.func, cst.Name) and len(node.args) == 1 and node.args[0].keyword is None:
        yield node.args[0].value
    if isinstance(node, cst.Return) and isinstance(node.value, cst.Tuple):
        yield node.with_changes(value=cst.List(
            [e.with_changes(comma=DEFAULT) for e in node.value.elements]))


def _block_edits(node):
    """The statements of a block (a cell or an indented body), if ``node`` is one."""
    if isinstance(node, cst.Module):
        return list(node.body)
    if isinstance(node, cst.IndentedBlock):
        return list(node.body)
    return None


def _stmt(stmt):
    """A statement's code, without the comments and blank lines above it."""
    return _code(stmt.with_changes(leading_lines=[])).strip()


def _with_body(node, body):
    if not body:
        body = [cst.SimpleStatementLine([cst.Pass()])]
    return node.with_changes(body=body)


def _ends_flow(block):
    last = block.body[-1] if isinstance(block, cst.IndentedBlock) and block.body else None
    if isinstance(last, cst.SimpleStatementLine):
        return isinstance(last.body[-1], (cst.Return, cst.Raise, cst.Continue, cst.Break))
    return False


@operator("guard", "general")
def _guard(node, ctx):
    """An ``if`` that leaves early (return, raise, continue, break) removed."""
    body = _block_edits(node)
    if body is None:
        return
    for i, stmt in enumerate(body):
        if isinstance(stmt, cst.If) and stmt.orelse is None and _ends_flow(stmt.body):
            yield _with_body(node, body[:i] + body[i + 1:]), _stmt(stmt), "(removed)", stmt


@operator("negate", "general")
def _negate(node, ctx):
    if isinstance(node, (cst.If, cst.While)):
        yield node.with_changes(test=cst.UnaryOperation(
            cst.Not(), node.test.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])))


def _assigned(stmt):
    names = set()
    if isinstance(stmt, cst.SimpleStatementLine):
        for small in stmt.body:
            targets = [t.target for t in small.targets] if isinstance(small, cst.Assign) else \
                [small.target] if isinstance(small, (cst.AugAssign, cst.AnnAssign)) else []
            for t in targets:
                names |= {n.value for n in _names(t)}
    return names


def _names(node):
    """The names an assignment target binds or changes (``d[k] = v`` changes ``d``)."""
    if isinstance(node, cst.Name):
        return [node]
    if isinstance(node, (cst.Subscript, cst.Attribute)):
        return _names(node.value)
    if isinstance(node, (cst.Tuple, cst.List)):
        return [n for e in node.elements for n in _names(e.value)]
    return []


DISPLAY = ("print", "visualize_array_sharding", "display")


def _is_plain(stmt):
    """A simple statement that is neither an import, a docstring nor a display of a value."""
    return isinstance(stmt, cst.SimpleStatementLine) and not any(
        isinstance(s, (cst.Import, cst.ImportFrom)) or (
            isinstance(s, cst.Expr) and isinstance(s.value, (cst.SimpleString,
                                                             cst.ConcatenatedString)))
        or (isinstance(s, cst.Expr) and _call_of(s.value, *DISPLAY))
        for s in stmt.body)


@operator("drop-statement", "general")
def _drop_statement(node, ctx):
    """A step left out: a name assigned again (or updated), or a call made for its effect."""
    body = _block_edits(node)
    if body is None:
        return
    seen = set()
    for i, stmt in enumerate(body):
        names = _assigned(stmt)
        updates = isinstance(stmt, cst.SimpleStatementLine) and any(
            isinstance(s, cst.AugAssign) for s in stmt.body)
        effect = isinstance(stmt, cst.SimpleStatementLine) and all(
            isinstance(s, cst.Expr) and isinstance(s.value, cst.Call) for s in stmt.body)
        if _is_plain(stmt) and ((names and names <= seen) or updates or effect):
            yield _with_body(node, body[:i] + body[i + 1:]), _stmt(stmt), "(removed)", stmt
        seen |= names


def _reads(stmt):
    return {n.value for n in _walk(stmt) if isinstance(n, cst.Name)}


def _independent(a, b):
    """Two assignments neither of which reads or writes what the other writes: in either
    order the same program (a trivially equivalent mutant, not generated)."""
    wa, wb = _assigned(a), _assigned(b)
    only_assignments = all(isinstance(s, (cst.Assign, cst.AugAssign, cst.AnnAssign))
                           for stmt in (a, b) for s in stmt.body)
    return bool(only_assignments and wa and wb and not (wa & wb) and not (wa & _reads(b))
                and not (wb & _reads(a)))


@operator("swap-statements", "general")
def _swap_statements(node, ctx):
    body = _block_edits(node)
    if body is None:
        return
    for i in range(len(body) - 1):
        if _is_plain(body[i]) and _is_plain(body[i + 1]) and not _independent(body[i],
                                                                                  body[i + 1]):
            new = list(body)
            new[i], new[i + 1] = body[i + 1], body[i]
            yield _with_body(node, new), f"{_stmt(body[i])}; {_stmt(body[i + 1])}", \
                f"{_stmt(body[i + 1])}; {_stmt(body[i])}", body[i]


# --------------------------------------------------------------------------- what the labs teach
SPEC_CALLS = ("P", "PartitionSpec")


@operator("spec", "jax")
def _spec(node, ctx):
    """A PartitionSpec entry swapped with the next, dropped, or replaced by None."""
    if not _call_of(node, *SPEC_CALLS) or any(a.keyword or a.star for a in node.args):
        return
    args = list(node.args)
    for i, arg in enumerate(args):
        if i + 1 < len(args) and _code(arg.value) != _code(args[i + 1].value):
            new = list(args)
            new[i], new[i + 1] = args[i + 1], args[i]
            yield node.with_changes(args=_args(new))
        yield node.with_changes(args=_args(args[:i] + args[i + 1:]))
        if not (isinstance(arg.value, cst.Name) and arg.value.value == "None"):
            new = list(args)
            new[i] = arg.with_changes(value=cst.Name("None"))
            yield node.with_changes(args=_args(new))


@operator("mesh", "jax")
def _mesh(node, ctx):
    """The mesh's axes transposed: its shape or its names reversed."""
    if not _call_of(node, "make_mesh", "Mesh"):
        return
    for i, arg in enumerate(_positional(node)[:2]):
        if isinstance(arg.value, (cst.Tuple, cst.List)) and len(arg.value.elements) > 1:
            elements = [e.with_changes(comma=DEFAULT) for e in arg.value.elements][::-1]
            args = list(node.args)
            args[args.index(arg)] = arg.with_changes(value=arg.value.with_changes(
                elements=elements))
            yield node.with_changes(args=args)


@operator("axis-type", "jax")
def _axis_type(node, ctx):
    if isinstance(node, cst.Attribute) and node.attr.value in ("Explicit", "Auto") and \
            _last(node.value) == "AxisType":
        yield _renamed(node, "Auto" if node.attr.value == "Explicit" else "Explicit")


COLLECTIVE_SWAPS = {"psum": ("pmean", "all_gather"), "pmean": ("psum", "all_gather"),
                    "all_gather": ("psum",), "psum_scatter": ("psum",),
                    "all_to_all": ("all_gather",), "pmax": ("psum",)}
AXIS_ARG = {"psum": 1, "pmean": 1, "pmax": 1, "all_gather": 1, "psum_scatter": 1,
            "ppermute": 1, "all_to_all": 1, "axis_index": 0, "axis_size": 0}


@operator("collective", "jax")
def _collective(node, ctx):
    """One collective for another (keeping the operand and the axis)."""
    if not isinstance(node, cst.Call) or _last(node.func) not in COLLECTIVE_SWAPS:
        return
    name = _last(node.func)
    positional = _positional(node)
    axis = _keyword(node, "axis_name") or (positional[1] if len(positional) > 1 else None)
    if not positional or axis is None:
        return
    for other in COLLECTIVE_SWAPS[name]:
        args = [positional[0], axis.with_changes(keyword=None, equal=DEFAULT)]
        if other == "all_gather" and name in ("all_to_all",):
            args.append(cst.Arg(cst.Name("True"), keyword=cst.Name("tiled"),
                                equal=cst.AssignEqual(cst.SimpleWhitespace(""),
                                                      cst.SimpleWhitespace(""))))
        yield node.with_changes(func=_renamed(node.func, other), args=_args(args))


@operator("axis-name", "jax")
def _axis_name(node, ctx):
    """A collective over another of the cell's mesh axes."""
    if not isinstance(node, cst.Call) or _last(node.func) not in AXIS_ARG:
        return
    position = AXIS_ARG[_last(node.func)]
    positional = _positional(node)
    arg = _keyword(node, "axis_name") or (positional[position]
                                          if len(positional) > position else None)
    if arg is None or not isinstance(arg.value, cst.SimpleString):
        return
    for other in sorted(set(ctx["axis_names"]) - {arg.value.evaluated_value}):
        args = list(node.args)
        args[args.index(arg)] = new = arg.with_changes(value=cst.SimpleString(repr(other)))
        yield node.with_changes(args=args), f"{_last(node.func)}(..., {_code(arg).strip(', ')})", \
            f"{_last(node.func)}(..., {_code(new).strip(', ')})", node


@operator("ppermute", "jax")
def _ppermute(node, ctx):
    """A ring's permutation reversed, or its destinations shifted by one."""
    if not _call_of(node, "ppermute"):
        return
    positional = _positional(node)
    arg = _keyword(node, "perm") or (positional[2] if len(positional) > 2 else None)
    if arg is None:
        return
    perm = _code(arg.value)
    for text in (f"[(_d, _s) for _s, _d in {perm}]",
                 f"list(zip([_s for _s, _ in {perm}], [_d for _, _d in {perm}][1:] + "
                 f"[_d for _, _d in {perm}][:1]))"):
        args = list(node.args)
        args[args.index(arg)] = arg.with_changes(value=_expr(text))
        yield node.with_changes(args=args), f"perm={perm}", f"perm={text}", node


def _decorators(node, names):
    """FunctionDef ``node`` without each decorator that applies one of ``names``."""
    for i, deco in enumerate(node.decorators):
        expr = deco.decorator
        target = expr.args[0].value if _call_of(expr, "partial") and expr.args else (
            expr.func if isinstance(expr, cst.Call) else expr)
        if _last(target) in names:
            yield (node.with_changes(decorators=node.decorators[:i] + node.decorators[i + 1:]),
                   f"@{_code(expr)}", "(decorator removed)", deco)


@operator("jit", "jax")
def _jit(node, ctx):
    if isinstance(node, cst.FunctionDef):
        yield from _decorators(node, ("jit",))
    if _call_of(node, "jit") and _positional(node):
        yield _positional(node)[0].value


POLICIES = ("nothing_saveable", "everything_saveable", "dots_saveable")


@operator("checkpoint", "jax")
def _checkpoint(node, ctx):
    """``jax.checkpoint`` removed, or its policy changed for a built-in one."""
    if isinstance(node, cst.FunctionDef):
        yield from _decorators(node, ("checkpoint", "remat"))
    if _call_of(node, "checkpoint", "remat") and _positional(node):
        yield _positional(node)[0].value
    if isinstance(node, cst.Call) and _keyword(node, "policy") is not None:
        arg = _keyword(node, "policy")
        for policy in POLICIES:
            if policy not in _code(arg.value):
                args = list(node.args)
                args[args.index(arg)] = arg.with_changes(
                    value=_expr(f"jax.checkpoint_policies.{policy}"))
                yield node.with_changes(args=args), f"policy={_code(arg.value)}", \
                    f"policy=jax.checkpoint_policies.{policy}", node
        yield node.with_changes(args=_args([a for a in node.args if a is not arg])), \
            f"policy={_code(arg.value)}", "(no policy)", node


SCAN_HELPER = '''
def __mutant_scan(f, init, xs=None, length=None, reverse=False, unroll=1, **_):
    """lax.scan as a Python loop (the mutation analysis's unrolled scan)."""
    import jax
    import jax.numpy as jnp
    n = length if xs is None else jax.tree.leaves(xs)[0].shape[0]
    carry, ys = init, []
    for i in (reversed(range(n)) if reverse else range(n)):
        carry, y = f(carry, None if xs is None else jax.tree.map(lambda a: a[i], xs))
        ys.append(y)
    ys = ys[::-1] if reverse else ys
    return carry, jax.tree.map(lambda *a: jnp.stack(a), *ys) if ys else None
'''


@operator("scan", "jax")
def _scan(node, ctx):
    """``lax.scan`` as a Python loop (``__mutant_scan``, defined at the top of the mutant)."""
    if _call_of(node, "scan") and _dotted(node.func) in ("lax.scan", "jax.lax.scan", "scan"):
        yield node.with_changes(func=cst.Name("__mutant_scan"))


@operator("specs", "jax")
def _specs(node, ctx):
    """A shard_map's in_specs or out_specs replicated (``P()``)."""
    if not isinstance(node, cst.Call) or _last(node.func) not in ("shard_map", "partial"):
        return
    for name in ("in_specs", "out_specs"):
        arg = _keyword(node, name)
        if arg is not None and _code(arg.value).replace(" ", "") != "P()":
            args = list(node.args)
            args[args.index(arg)] = arg.with_changes(value=_expr("P()"))
            yield node.with_changes(args=args), f"{name}={_code(arg.value)}", f"{name}=P()", node


@operator("check-vma", "jax")
def _check_vma(node, ctx):
    if not isinstance(node, cst.Call) or _keyword(node, "out_specs") is None:
        return
    args = [a for a in node.args if not (a.keyword and a.keyword.value in ("check_vma",
                                                                              "check_rep"))]
    off = cst.Arg(cst.Name("False"), keyword=cst.Name("check_vma"),
                  equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")))
    name = _last(node.args[0].value) if _last(node.func) == "partial" else _last(node.func)
    yield node.with_changes(args=_args(args + [off])), f"{name}(...)", \
        f"{name}(..., check_vma=False)", node


# the same function from the math module and from NumPy: NumPy's returns NumPy scalars, not
# the plain Python numbers a task may ask for
MATH_NUMPY = ("ceil", "floor", "sqrt", "exp", "log", "log2", "prod", "isclose")


@operator("math-numpy", "general")
def _math_numpy(node, ctx):
    """``math.ceil`` for ``np.ceil`` and back: another return type for the same number."""
    if _call_of(node, *MATH_NUMPY) and isinstance(node.func, cst.Attribute):
        owner = _dotted(node.func.value)
        if owner in ("math", "np", "numpy"):
            yield node.with_changes(func=node.func.with_changes(
                value=cst.Name("np" if owner == "math" else "math")))


WRAPPERS = ("device_put", "pcast", "checkpoint_name", "stop_gradient", "block_until_ready",
            "with_sharding_constraint", "reshard")


@operator("unwrap", "jax")
def _unwrap(node, ctx):
    if _call_of(node, *WRAPPERS) and _positional(node):
        yield _positional(node)[0].value


# --------------------------------------------------------------------------- applying them
class _Sites(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self):
        self.nodes, self.lines = [], {}

    def on_visit(self, node):
        if _call_of(node, *DISPLAY):  # what a cell prints or draws is not graded
            return False
        # a statement's line is that of its code, past the comments above it
        self.lines[node] = self.get_metadata(PositionProvider, node).start.line
        self.nodes.append(node)
        return True


class _Replace(cst.CSTTransformer):
    def __init__(self, target, replacement):
        self.target, self.replacement = target, replacement

    def on_leave(self, original_node, updated_node):
        return self.replacement if original_node is self.target else updated_node


def _axis_names(module):
    """Strings the cell uses as mesh axis names (in P(...), make_mesh, collectives)."""
    names = set()
    for node in _walk(module):
        if _call_of(node, *SPEC_CALLS, "make_mesh", *AXIS_ARG):
            for sub in _walk(node):
                if isinstance(sub, cst.SimpleString) and sub.evaluated_value.isidentifier():
                    names.add(sub.evaluated_value)
    return names


def _walk(node):
    yield node
    for child in node.children:
        yield from _walk(child)


def _program_string(node):
    """A string literal holding a Python program of a few statements (a script to run)."""
    if not isinstance(node, cst.SimpleString) or not node.quote.endswith(('"""', "'''")):
        return None
    try:
        text = node.evaluated_value
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    return text if len(tree.body) >= 3 else None


def _mutants_of(source, operators):
    module = cst.parse_module(source)
    wrapper = MetadataWrapper(module)
    sites = _Sites()
    wrapper.visit(sites)
    ctx = {"axis_names": _axis_names(wrapper.module)}
    for node in sites.nodes:
        line = sites.lines[node]
        inner = _program_string(node)
        if inner is not None:  # a script: its own mutants, put back in the same quotes
            for m in mutants(inner, operators):
                if node.quote not in m.code and not m.code.endswith("\\"):
                    replacement = node.with_changes(
                        value=f"{node.prefix}{node.quote}{m.code}{node.quote}")
                    yield m.operator, line + m.line - 1, m.before, m.after, \
                        wrapper.module.visit(_Replace(node, replacement)).code
            continue
        for name in operators:
            for proposal in OPERATORS[name][1](node, ctx):
                # an operator proposes a node, or a block with (what it changed, what that
                # became, the statement whose line to give)
                replacement, before, after, anchor = proposal if isinstance(proposal, tuple) \
                    else (proposal, _code(node), _code(proposal), node)
                line = sites.lines.get(anchor, line)
                code = wrapper.module.visit(_Replace(node, replacement)).code
                if "__mutant_scan(" in code:
                    code = SCAN_HELPER.lstrip() + "\n\n" + code
                yield name, line, before, after, code


def mutants(source, operators=None):
    """Every distinct mutant of ``source`` (a cell's code) that compiles, in cell order."""
    operators = list(OPERATORS) if operators is None else list(operators)
    unknown = set(operators) - set(OPERATORS)
    if unknown:
        raise ValueError(f"unknown mutation operators: {sorted(unknown)}")
    seen, found, counts = {_normal(source)}, [], {}
    for name, line, before, after, code in _mutants_of(source, operators):
        normal = _normal(code)
        if normal is None or normal in seen:
            continue
        seen.add(normal)
        n = counts[name, before, after] = counts.get((name, before, after), -1) + 1
        found.append(Mutant(name, line, before, after, code, n))
    return found


def _normal(code):
    """The program ``code`` compiles to, ignoring layout (None if it does not compile)."""
    try:
        return ast.dump(ast.parse(code))
    except SyntaxError:
        return None
