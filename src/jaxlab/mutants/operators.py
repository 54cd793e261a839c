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
import functools
import hashlib
import importlib
import inspect

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


def describe():
    """name -> what the operator does (its docstring, on one line)."""
    return {name: " ".join((fn.__doc__ or "").split()).replace("``", "`")
            for name, (_, fn) in OPERATORS.items()}


ARITHMETIC = {cst.Add: cst.Subtract, cst.Subtract: cst.Add, cst.Multiply: cst.Divide,
              cst.Divide: cst.Multiply, cst.FloorDivide: cst.Divide, cst.Power: cst.Multiply,
              cst.Modulo: cst.FloorDivide}
AUGMENTED = {cst.AddAssign: cst.SubtractAssign, cst.SubtractAssign: cst.AddAssign,
             cst.MultiplyAssign: cst.DivideAssign, cst.DivideAssign: cst.MultiplyAssign}


@operator("arithmetic", "general")
def _arithmetic(node, ctx):
    """An arithmetic operator swapped: ``+``/``-``, ``*``/``/``, ``//`` and ``**`` and ``%`` (also augmented)."""
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
    """A comparison made strict or loose, or negated: ``<``/``<=``, ``==``/``!=``, ``in``/``not in``."""
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
    """A number off by one (an integer +1 or -1), a float doubled (0 becomes 1.0)."""
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
    """A term or factor dropped from a sum, difference, product or quotient."""
    if isinstance(node, cst.BinaryOperation) and isinstance(
            node.operator, (cst.Add, cst.Subtract, cst.Multiply, cst.Divide, cst.MatrixMultiply)):
        yield node.left
        if not isinstance(node.operator, cst.Divide):
            yield node.right


@operator("extra-term", "general")
def _extra_term(node, ctx):
    """A term counted twice: ``a + b`` -> ``a + (b * 2)``."""
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
    """Two neighbouring positional arguments exchanged (not of functions that commute)."""
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
    """Another axis: ``axis=``, ``scatter_dimension=``, ``split_axis=``, ``concat_axis=`` (0 and 1, -1 and -2)."""
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
    """Another reduction: ``mean`` for ``sum`` and back, ``max``/``min``, ``argmax``/``argmin``."""
    if isinstance(node, cst.Call) and _last(node.func) in REDUCTIONS and isinstance(
            node.func, (cst.Name, cst.Attribute)):
        yield node.with_changes(func=_renamed(node.func, REDUCTIONS[_last(node.func)]))


@operator("transpose", "general")
def _transpose(node, ctx):
    """A transpose removed (``.T``, ``transpose``, ``swapaxes``) or added to an operand of ``@``."""
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
    """Another dtype: ``float32``/``bfloat16``, ``float16``, ``float64``, ``int32``, ``int8``."""
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
    """The condition of an ``if`` or ``while`` negated."""
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
    """Two neighbouring statements that depend on each other exchanged."""
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
    """``AxisType.Explicit`` for ``AxisType.Auto`` and back."""
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


def _perm_arg(node):
    """The ``perm`` argument of ``lax.ppermute(x, axis, perm)`` or of
    ``partial(lax.ppermute, axis_name=..., perm=...)`` (Lab 4's ``shift``); else None."""
    if _call_of(node, "ppermute"):
        positional = _positional(node)
        return _keyword(node, "perm") or (positional[2] if len(positional) > 2 else None)
    if _call_of(node, "partial") and node.args and _last(node.args[0].value) == "ppermute":
        return _keyword(node, "perm")
    return None


@operator("ppermute", "jax")
def _ppermute(node, ctx):
    """A ring's permutation reversed, or its destinations shifted by one."""
    arg = _perm_arg(node)
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
    """``jax.jit`` removed (a decorator or a call)."""
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
    """``shard_map``'s replication checks turned off (``check_vma=False``)."""
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
    """A wrapper dropped: ``device_put``, ``pcast``, ``checkpoint_name``, ``stop_gradient``, ``block_until_ready``, ``with_sharding_constraint``, ``reshard``."""
    if _call_of(node, *WRAPPERS) and _positional(node):
        yield _positional(node)[0].value


# the operators before issue 45 (see ``mutants``: their mutants keep their keys)
ESTABLISHED = frozenset(OPERATORS)


# --------------------------------------------------------------------------- mistakes students make
# Faults that answers written by outside readers showed and no earlier operator made (issue
# 45): the wrong mesh or axis, the specs of two operands exchanged, a keyword left out, a ring
# open at one end, the right values moved the wrong way, a precision lost or kept, an argument
# of an API call left out. They read the notebook's earlier cells too (``ctx``: meshes,
# shardings, functions and imports defined before the answer cell).

def _callee(node):
    """The function a call applies: ``f`` for ``f(...)`` and for ``partial(f, ...)``."""
    if _call_of(node, "partial") and node.args:
        return _last(node.args[0].value)
    return _last(node.func) if isinstance(node, cst.Call) else None


MESH_CALLS = ("make_mesh", "Mesh", "AbstractMesh")


def _other_meshes(ctx, current, need=None):
    """Meshes of the notebook to pass instead of ``current``: those having every axis in
    ``need`` (default: the axes of the current mesh, or for a mesh the cell receives, those its
    specs name), and not built by the same call (the same mesh under another name)."""
    meshes = ctx["meshes"]
    axes, code = meshes.get(current, (None, None))
    if need is None:
        need = set(axes) if axes is not None else set(ctx["axis_names"]) & ctx["all_axes"]
    for other in sorted(meshes):
        other_axes, other_code = meshes[other]
        if other != current and other_axes is not None and need <= other_axes and \
                other_code != code:
            yield other


@operator("wrong-mesh", "jax")
def _wrong_mesh(node, ctx):
    """Another of the notebook's meshes passed: in ``NamedSharding(mesh, ...)`` (any mesh with
    the axes its literal spec names: every mesh for ``P()``), ``shard_map(mesh=...)`` or
    ``jax.set_mesh`` (a mesh with the same axes); another sharding given to
    ``jax.device_put``."""
    if not isinstance(node, cst.Call):
        return
    callee, positional = _callee(node), _positional(node)
    if callee in ("NamedSharding", "shard_map", "set_mesh", "use_mesh"):
        arg = _keyword(node, "mesh") or (positional[0] if positional and callee in (
            "NamedSharding", "set_mesh", "use_mesh") else None)
        spec = _keyword(node, "spec") or (positional[1] if len(positional) > 1 else None)
        need = None
        if callee == "NamedSharding" and spec is not None and _call_of(spec.value, *SPEC_CALLS) \
                and not any(a.star for a in spec.value.args):
            need = {s.evaluated_value for s in _walk(spec.value)
                    if isinstance(s, cst.SimpleString)}
        others = lambda name: _other_meshes(ctx, name, need)  # noqa: E731
    elif callee == "device_put":
        arg = _keyword(node, "device") or (positional[1] if len(positional) > 1 else None)
        others = lambda name: (s for s in sorted(ctx["shardings"]) if s != name and  # noqa: E731
                               ctx["shardings"][s] != ctx["shardings"].get(name))
    else:
        return
    if arg is None or not isinstance(arg.value, cst.Name):
        return
    for other in others(arg.value.value):
        args = list(node.args)
        args[args.index(arg)] = new = arg.with_changes(value=cst.Name(other))
        yield node.with_changes(args=args), f"{callee}(... {_code(arg).strip(', ')} ...)", \
            f"{callee}(... {_code(new).strip(', ')} ...)", node


@operator("mesh-axis", "jax")
def _mesh_axis(node, ctx):
    """One mesh axis for another in a ``PartitionSpec``: ``P('data')`` -> ``P('model')`` (an
    axis of a mesh that has the one replaced, and not already in the spec)."""
    if not _call_of(node, *SPEC_CALLS):
        return
    strings = [s for s in _walk(node) if isinstance(s, cst.SimpleString)
               and s.evaluated_value.isidentifier()]
    used = {s.evaluated_value for s in strings}
    for s in strings:
        axis = s.evaluated_value
        siblings = set().union(*(axes for axes, _ in ctx["meshes"].values()
                                 if axes is not None and axis in axes)) or ctx["axis_names"]
        for other in sorted(siblings - used):
            yield node.deep_replace(s, s.with_changes(value=f"{s.quote}{other}{s.quote}"))


@operator("swap-specs", "jax")
def _swap_specs(node, ctx):
    """The specs of two operands exchanged in a ``shard_map``'s ``in_specs`` or ``out_specs``."""
    if _callee(node) != "shard_map":
        return
    for name in ("in_specs", "out_specs"):
        arg = _keyword(node, name)
        if arg is None or not isinstance(arg.value, cst.Tuple):
            continue
        elements = list(arg.value.elements)
        for i in range(len(elements)):
            for j in range(i + 1, len(elements)):
                if _code(elements[i].value) == _code(elements[j].value):
                    continue
                new = list(elements)
                new[i] = elements[i].with_changes(value=elements[j].value)
                new[j] = elements[j].with_changes(value=elements[i].value)
                args = list(node.args)
                args[args.index(arg)] = changed = arg.with_changes(
                    value=arg.value.with_changes(elements=new))
                yield node.with_changes(args=args), _code(arg).strip(", "), \
                    _code(changed).strip(", "), node


# keywords whose omission is a mistake the labs' texts name; a boolean one is also flipped
KEYWORDS = ("tiled", "preferred_element_type", "sharding", "out_sharding", "out_shardings",
            "in_shardings", "static_argnums", "static_argnames", "donate_argnums",
            "donate_argnames", "axis_name", "check_vma", "keepdims", "axis_types")


@operator("keyword", "jax")
def _keyword_fault(node, ctx):
    """A keyword argument dropped or, if boolean, flipped: ``tiled=True``,
    ``preferred_element_type``, a restore target's ``sharding=``, ``out_sharding``,
    ``static_argnums``/``donate_argnums``, ``axis_name`` (where it is optional),
    ``check_vma``, ``keepdims``, ``axis_types``."""
    if not isinstance(node, cst.Call):
        return
    for arg in node.args:
        name = arg.keyword.value if arg.keyword is not None else None
        if name not in KEYWORDS or (name == "axis_name" and _callee(node) in AXIS_ARG):
            continue
        yield node.with_changes(args=_args([a for a in node.args if a is not arg])), \
            _code(arg).strip(", "), "(dropped)", node
        if isinstance(arg.value, cst.Name) and arg.value.value in ("True", "False"):
            flipped = arg.with_changes(value=cst.Name(
                "False" if arg.value.value == "True" else "True"))
            args = list(node.args)
            args[args.index(arg)] = flipped
            yield node.with_changes(args=args), _code(arg).strip(", "), \
                _code(flipped).strip(", "), node


RING_HELPERS = '''
def __mutant_open_ring(perm):
    # the ring without its wrap-around pair: the pair whose step is not the others'
    import collections
    pairs = [tuple(p) for p in perm]
    step = collections.Counter(d - s for s, d in pairs).most_common(1)[0][0]
    wrap = next((p for p in pairs if p[1] - p[0] != step), pairs[-1])
    return [p for p in pairs if p != wrap]


def __mutant_turn_pair(perm):
    # the first pair's direction reversed
    pairs = [tuple(p) for p in perm]
    return [pairs[0][::-1]] + pairs[1:]
'''


def _literal_pairs(value):
    try:
        pairs = ast.literal_eval(_code(value))
    except (ValueError, SyntaxError):
        return None
    ok = isinstance(pairs, (list, tuple)) and len(pairs) > 1 and all(
        isinstance(p, tuple) and len(p) == 2 for p in pairs)
    return [tuple(p) for p in pairs] if ok else None


@operator("ring-fault", "jax")
def _ring_fault(node, ctx):
    """A partial ring fault in a ``ppermute`` permutation: the wrap-around pair dropped (where
    the permutation wraps: a ``%`` in it, or a literal pair against the others' step), or its
    first pair's direction reversed (JAX refuses a permutation with a repeated device)."""
    arg = _perm_arg(node)
    if arg is None:
        return
    perm = _code(arg.value)
    pairs = _literal_pairs(arg.value)
    if pairs is not None:
        steps = [d - s for s, d in pairs]
        common = max(set(steps), key=steps.count)
        wrap = [p for p in pairs if p[1] - p[0] != common][:1]
        texts = ([repr([p for p in pairs if p not in wrap])] if wrap else []) + \
            [repr([pairs[0][::-1]] + pairs[1:])]
    else:
        source = ctx["assigned"].get(perm, perm) if isinstance(arg.value, cst.Name) else perm
        texts = ([f"__mutant_open_ring({perm})"] if "%" in source else []) + \
            [f"__mutant_turn_pair({perm})"]
    for text in texts:
        args = list(node.args)
        args[args.index(arg)] = arg.with_changes(value=_expr(text))
        yield node.with_changes(args=args), f"perm={perm}", f"perm={text}", node


COMMUNICATION_HELPERS = '''
def __mutant_own_block(total, axis_name, scatter_dimension=0, tiled=False):
    # psum_scatter's values from a psum: this device's block of the whole sum
    from jax import lax
    n = lax.psum(1, axis_name)
    size = total.shape[scatter_dimension] // n
    block = lax.dynamic_slice_in_dim(total, lax.axis_index(axis_name) * size, size,
                                     scatter_dimension)
    return block if tiled else lax.squeeze(block, (scatter_dimension,))


def __mutant_gathered_permute(x, axis_name, perm):
    # ppermute's values from an all_gather: every block gathered, the one sent here kept
    import jax
    import jax.numpy as jnp
    from jax import lax
    n = lax.psum(1, axis_name)
    source = [-1] * n
    for s, d in perm:
        source[d] = s
    me = jnp.asarray(source)[lax.axis_index(axis_name)]

    def receive(a):
        everything = lax.all_gather(a, axis_name)
        return jnp.where(me >= 0, everything[jnp.maximum(me, 0)], jnp.zeros_like(a))
    return jax.tree.map(receive, x)
'''

COLLECTIVES = ("psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "ppermute",
               "all_to_all")


def _grad_target(stmt):
    """The name a statement assigns the gradients of ``jax.grad(f)(...)`` or
    ``jax.value_and_grad(f)(...)`` to, if it does."""
    if not isinstance(stmt, cst.SimpleStatementLine) or len(stmt.body) != 1 or \
            not isinstance(stmt.body[0], cst.Assign) or len(stmt.body[0].targets) != 1:
        return None
    assign = stmt.body[0]
    call = assign.value
    if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Call)):
        return None
    target = assign.targets[0].target
    if _last(call.func.func) == "grad" and isinstance(target, cst.Name):
        return target.value
    if _last(call.func.func) == "value_and_grad" and isinstance(target, cst.Tuple) and \
            len(target.elements) == 2 and isinstance(target.elements[1].value, cst.Name):
        return target.elements[1].value.value
    return None


@operator("communication", "jax")
def _communication(node, ctx):
    """The same values moved another way: ``psum_scatter`` as a ``psum`` and a slice of this
    device's block, a ``ppermute`` step as an ``all_gather`` keeping the block sent here (a
    ring as all-gathers), a ``pmean``/``psum`` of the gradients inserted after ``jax.grad``
    in a function that communicates (the gradient is then averaged or summed twice)."""
    if _call_of(node, "psum_scatter") and _positional(node):
        positional = _positional(node)
        axis = _keyword(node, "axis_name") or (positional[1] if len(positional) > 1 else None)
        if axis is None:
            return
        dim = _keyword(node, "scatter_dimension") or (
            positional[2] if len(positional) > 2 else None)
        tiled = _keyword(node, "tiled") or (positional[3] if len(positional) > 3 else None)
        total = f"{_code(_renamed(node.func, 'psum'))}({_code(positional[0].value)}, " \
            f"{_code(axis.value)})"
        yield _expr(f"__mutant_own_block({total}, {_code(axis.value)}, "
                    f"{_code(dim.value) if dim else 0}, {_code(tiled.value) if tiled else False})")
    if _perm_arg(node) is not None:
        if _call_of(node, "ppermute"):
            yield node.with_changes(func=cst.Name("__mutant_gathered_permute"))
        else:  # partial(lax.ppermute, ...)
            args = list(node.args)
            args[0] = args[0].with_changes(value=cst.Name("__mutant_gathered_permute"))
            yield node.with_changes(args=args)
    body = node.body if isinstance(node, cst.FunctionDef) and isinstance(
        node.body, cst.IndentedBlock) else None
    if body is None:
        return
    axes = sorted({s.evaluated_value for call in _walk(body) if _call_of(call, *COLLECTIVES)
                   for s in _walk(call) if isinstance(s, cst.SimpleString)
                   and s.evaluated_value.isidentifier()})
    statements = list(body.body)
    for i, stmt in enumerate(statements):
        grads = _grad_target(stmt)
        if grads is None:
            continue
        for axis in axes:
            for reduce in ("pmean", "psum"):
                line = f"{grads} = jax.tree.map(lambda _g: jax.lax.{reduce}(_g, {axis!r}), " \
                    f"{grads})"
                new = statements[:i + 1] + [cst.parse_statement(line + "\n")] + \
                    statements[i + 1:]
                yield node.with_changes(body=body.with_changes(body=new)), _stmt(stmt), \
                    f"{_stmt(stmt)}; {line}", stmt


CAST_HELPER = '''
def __mutant_cast(tree, dtype):
    # every floating-point number of tree cast to dtype
    import jax
    import jax.numpy as jnp

    def cast(a):
        if isinstance(a, float) or (hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.floating)):
            return jnp.asarray(a).astype(dtype)
        return a
    return jax.tree.map(cast, tree)
'''

SOFTMAX = ("softmax", "log_softmax", "logsumexp")
LOOPS = {"scan": 1, "fori_loop": 3, "while_loop": 2}  # the position of the initial carry


def _casts(ctx):
    return ("bfloat16", "float32") if ctx["low_precision"] else ("bfloat16",)


def _counted(value):
    """Whether an augmented assignment only counts (``n += 1``): no precision to lose."""
    return isinstance(value, cst.Integer)


@operator("cast", "jax")
def _cast(node, ctx):
    """A cast removed (``x.astype(T)`` -> ``x``, ``lax.convert_element_type``, a ``dtype=``
    argument dropped) or inserted (``__mutant_cast``: bfloat16, and float32 where the cell
    uses bfloat16) on an accumulator (``a += ...``, ``a = a + ...``), the initial carry of a
    scan or loop, parameters (``params = ...``, what an ``update`` or a ``step`` of the
    parameters returns) or a
    softmax's input."""
    if _call_of(node, "astype") and isinstance(node.func, cst.Attribute):
        yield node.func.value
    if _call_of(node, "convert_element_type") and _positional(node):
        yield _positional(node)[0].value
    if isinstance(node, cst.Call) and _keyword(node, "dtype") is not None:
        arg = _keyword(node, "dtype")
        yield node.with_changes(args=_args([a for a in node.args if a is not arg])), \
            _code(arg).strip(", "), "(dropped)", node

    def wrapped(expr, dtype):
        code = _code(expr)
        return _expr(f"__mutant_cast({f'({code})' if isinstance(expr, cst.Tuple) and not expr.lpar else code}, {dtype!r})")

    if isinstance(node, cst.AugAssign) and isinstance(node.operator, tuple(AUGMENTED)) and \
            not _counted(node.value):
        op = _code(node.operator).strip().rstrip("=")
        for dtype in _casts(ctx):
            yield cst.Assign([cst.AssignTarget(node.target)], _expr(
                f"__mutant_cast({_code(node.target)} {op} ({_code(node.value)}), {dtype!r})"))
    if isinstance(node, cst.Assign) and len(node.targets) == 1 and \
            isinstance(node.targets[0].target, cst.Name):
        name = node.targets[0].target.value
        reads = {n.value for n in _walk(node.value) if isinstance(n, cst.Name)}
        if (name in reads or "param" in name) and not _call_of(node.value, "__mutant_cast"):
            for dtype in _casts(ctx):
                yield node.with_changes(value=wrapped(node.value, dtype))
    if isinstance(node, cst.Call) and _last(node.func) in (*LOOPS, *SOFTMAX):
        position = LOOPS.get(_last(node.func), 0)
        positional = _positional(node)
        if len(positional) > position:
            for dtype in _casts(ctx):
                args = list(node.args)
                args[args.index(positional[position])] = positional[position].with_changes(
                    value=wrapped(positional[position].value, dtype))
                yield node.with_changes(args=args)
    if isinstance(node, cst.FunctionDef) and _updates_parameters(node):
        returns = [r for r in _walk(node.body) if isinstance(r, cst.Return) and r.value
                   and r in _own_statements(node.body)]
        for ret in returns:
            for dtype in _casts(ctx):
                new = ret.with_changes(value=wrapped(ret.value, dtype))
                yield node.deep_replace(ret, new), _code(ret).strip(), _code(new).strip(), ret


def _updates_parameters(node):
    """Whether a function takes parameters or a training state and gives them back updated
    (``adam_update``, ``train_step(params, ...)``, ``zero_step(state, ...)``)."""
    names = [p.name.value for p in node.params.params]
    return "update" in node.name.value or "step" in node.name.value and any(
        "param" in n or n == "state" for n in names)


def _own_statements(block):
    """The small statements of a function's body, not of the functions it defines."""
    found = set()

    def visit(node):
        if isinstance(node, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            return
        if isinstance(node, cst.BaseSmallStatement):
            found.add(node)
        for child in node.children:
            visit(child)
    for stmt in block.body:
        visit(stmt)
    return found


def _method(func):
    """The name a call calls: ``restore`` for ``ocp.StandardCheckpointer().restore``."""
    return func.attr.value if isinstance(func, cst.Attribute) else \
        func.value if isinstance(func, cst.Name) else None


# defaults that select another form of the call (dropping the argument raises, or changes
# what the call is about): not dropped
OTHER_FORM = ("partial", "where", "scan", "jit", "shard_map", "vmap", "grad", "checkpoint")
# modules whose functions' signatures are read to find an argument with a default
SIGNATURE_MODULES = ("jax", "numpy", "math", "orbax", "optax", "functools")


@functools.lru_cache(maxsize=None)
def _library_defaults(path):
    """Whether each positional parameter of the function at dotted ``path`` has a default
    (None where it cannot be read, or takes ``*args``)."""
    parts = path.split(".")
    if parts[0] not in SIGNATURE_MODULES:
        return None
    try:
        obj = importlib.import_module(parts[0])
        for i, part in enumerate(parts[1:], 1):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                obj = importlib.import_module(".".join(parts[:i + 1]))
        params = list(inspect.signature(obj).parameters.values())
    except Exception:  # not importable, or no signature (a builtin): not read
        return None
    return _defaults_of(params)


def _defaults_of(params):
    out = []
    for p in params:
        if p.kind is inspect.Parameter.VAR_POSITIONAL:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            out.append(p.default is not inspect.Parameter.empty)
    return tuple(out)


def _defaults(ctx, func):
    name = _dotted(func)
    if name is None:
        return None
    if name in ctx["functions"]:
        return ctx["functions"][name]
    head, _, rest = name.partition(".")
    if head in ctx["aliases"]:
        return _library_defaults(ctx["aliases"][head] + (f".{rest}" if rest else ""))
    return None


@operator("drop-arg", "jax")
def _drop_arg(node, ctx):
    """An argument left out of an API call: Orbax's ``restore(path)`` without its target, the
    whole data passed to ``jax.make_array_from_process_local_data`` where this process's share
    is asked (its slice dropped), a call's last positional argument dropped where the callee
    (a function of the notebook, JAX, NumPy, Orbax) has a default for it."""
    if isinstance(node, cst.Call) and _method(node.func) == "restore" and len(node.args) > 1 \
            and _positional(node):
        yield node.with_changes(args=_args(_positional(node)[:1]))
    if isinstance(node, cst.Call) and _method(node.func) == "StandardRestore" and node.args:
        yield node.with_changes(args=[])
    if _call_of(node, "make_array_from_process_local_data"):
        for arg in _positional(node)[1:2]:
            if isinstance(arg.value, cst.Subscript):
                args = list(node.args)
                args[args.index(arg)] = arg.with_changes(value=arg.value.value)
                yield node.with_changes(args=args)
    if isinstance(node, cst.Assign) and len(node.targets) == 1:  # x_local = data[mine]
        target, value = node.targets[0].target, node.value
        pairs = [(target, value)] if not isinstance(target, cst.Tuple) else list(zip(
            [e.value for e in target.elements], [e.value for e in value.elements])) \
            if isinstance(value, cst.Tuple) and len(value.elements) == len(target.elements) \
            else []
        for name, part in pairs:
            if isinstance(name, cst.Name) and name.value in ctx["local_data"] and \
                    isinstance(part, cst.Subscript):
                yield node.deep_replace(part, part.value), _code(part), _code(part.value), node
    if isinstance(node, cst.Call) and _method(node.func) not in ("restore", *OTHER_FORM):
        positional = _positional(node)
        defaults = _defaults(ctx, node.func)
        # a call's one argument is what it is about (jax.jit(f), where f defaults to None
        # for decorator use): only a later one is dropped
        if len(positional) > 1 and defaults and len(positional) == len(
                [a for a in node.args if a.keyword is None]) and \
                len(positional) <= len(defaults) and defaults[len(positional) - 1]:
            last = positional[-1]
            yield node.with_changes(args=_args([a for a in node.args if a is not last])), \
                _code(node), _code(node.with_changes(
                    args=_args([a for a in node.args if a is not last]))), node


HELPERS = {"__mutant_scan": SCAN_HELPER, "__mutant_open_ring": RING_HELPERS,
           "__mutant_turn_pair": RING_HELPERS, "__mutant_own_block": COMMUNICATION_HELPERS,
           "__mutant_gathered_permute": COMMUNICATION_HELPERS, "__mutant_cast": CAST_HELPER}


# the names the labs import these modules as, where the cell's scope does not say
ALIASES = {"jax": "jax", "jnp": "jax.numpy", "lax": "jax.lax", "np": "numpy", "math": "math",
           "ocp": "orbax.checkpoint"}


def _context(module, scope=()):
    """What the operators know of the cell and the notebook before it (``scope``: the code of
    the earlier cells): axis names, meshes (name -> (axes or None, the call that built it)),
    shardings, functions (name -> whether each positional parameter has a default), imports
    (alias -> module path), names passed as a process's data, what each name was assigned."""
    ctx = {"axis_names": _axis_names(module), "meshes": {}, "shardings": {}, "functions": {},
           "aliases": dict(ALIASES), "local_data": set(), "assigned": {},
           "low_precision": "bfloat16" in module.code or "float16" in module.code}
    trees = []
    for source in [*scope, module.code]:
        try:
            trees.append(ast.parse(source))
        except SyntaxError:
            continue
    # functions that build a mesh (Lab 4's one_d_mesh("i")): what they return is a mesh
    ctx["mesh_factories"] = {node.name for tree in trees for node in ast.walk(tree)
                             if isinstance(node, ast.FunctionDef) and any(
                                 isinstance(c, ast.Call) and _ast_last(c.func) in MESH_CALLS
                                 for c in ast.walk(node))}
    for tree in trees:
        _read_context(tree, ctx)
    ctx["all_axes"] = set().union(*(a for a, _ in ctx["meshes"].values() if a is not None))
    return ctx


def _ast_last(node):
    return node.attr if isinstance(node, ast.Attribute) else \
        node.id if isinstance(node, ast.Name) else None


def _read_context(tree, ctx):
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                ctx["aliases"][alias.asname or alias.name.split(".")[0]] = \
                    alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                ctx["aliases"][alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.FunctionDef):
            args = node.args.posonlyargs + node.args.args
            ctx["functions"][node.name] = None if node.args.vararg else tuple(
                i >= len(args) - len(node.args.defaults) for i in range(len(args)))
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
            ctx["assigned"][name] = ast.unparse(value)
            if isinstance(value, ast.Call) and _ast_last(value.func) in MESH_CALLS:
                names = value.args[1] if len(value.args) > 1 else next(
                    (k.value for k in value.keywords if k.arg == "axis_names"), None)
                try:
                    axes = frozenset(ast.literal_eval(names))
                except (ValueError, TypeError, SyntaxError):
                    axes = None
                ctx["meshes"][name] = (axes, ast.unparse(value))
            elif isinstance(value, ast.Call) and _ast_last(value.func) in ctx["mesh_factories"]:
                axes = frozenset(a.value for a in value.args if isinstance(a, ast.Constant)
                                 and isinstance(a.value, str))
                ctx["meshes"][name] = (axes or None, ast.unparse(value))
            elif isinstance(value, ast.Call) and _ast_last(value.func) == "NamedSharding":
                ctx["shardings"][name] = ast.unparse(value)
        elif isinstance(node, ast.Call) and _ast_last(node.func) == \
                "make_array_from_process_local_data" and len(node.args) > 1 and \
                isinstance(node.args[1], ast.Name):
            ctx["local_data"].add(node.args[1].id)


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


def _mutants_of(source, operators, scope):
    module = cst.parse_module(source)
    wrapper = MetadataWrapper(module)
    sites = _Sites()
    wrapper.visit(sites)
    ctx = _context(wrapper.module, scope)
    for node in sites.nodes:
        line = sites.lines[node]
        inner = _program_string(node)
        if inner is not None:  # a script: its own mutants, put back in the same quotes
            for m in mutants(inner, operators):  # its own program: no notebook scope
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
                for helper, text in HELPERS.items():  # what a mutant calls, defined at its top
                    if f"{helper}(" in code:
                        code = text.lstrip() + "\n\n" + code
                yield name, line, before, after, code


def mutants(source, operators=None, scope=()):
    """Every distinct mutant of ``source`` (a cell's code) that compiles, in cell order.
    ``scope``: the code of the notebook's cells before it (meshes, shardings and functions
    defined there are what the cell may use instead of its own)."""
    operators = list(OPERATORS) if operators is None else list(operators)
    unknown = set(operators) - set(OPERATORS)
    if unknown:
        raise ValueError(f"unknown mutation operators: {sorted(unknown)}")
    proposed = [(*p, _normal(p[-1])) for p in _mutants_of(source, operators, tuple(scope))]
    proposed = [p for p in proposed if p[-1] is not None]
    # the same program from two operators is one mutant; the operators that existed before
    # issue 45 keep theirs, so the keys decided in tests/mutants/ still name them
    seen, kept = {_normal(source)}, set()
    for i in sorted(range(len(proposed)), key=lambda i: (proposed[i][0] not in ESTABLISHED, i)):
        normal = proposed[i][-1]
        if normal not in seen:
            seen.add(normal)
            kept.add(i)
    found, counts = [], {}
    for i in sorted(kept):
        name, line, before, after, code, _ = proposed[i]
        n = counts[name, before, after] = counts.get((name, before, after), -1) + 1
        found.append(Mutant(name, line, before, after, code, n))
    return found


def _normal(code):
    """The program ``code`` compiles to, ignoring layout (None if it does not compile)."""
    try:
        return ast.dump(ast.parse(code))
    except SyntaxError:
        return None
