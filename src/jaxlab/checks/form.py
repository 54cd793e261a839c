"""Evidence and form checks shared by every lab (shipped to students as ``jaxlab_form.py``).

A check runs in two steps. ``evidence(value)`` turns whatever a student's variable holds into
plain data (numbers, strings, lists, dicts and NumPy arrays), judging types by their exact
class so an object cannot pass itself off as an array. The ``expect_*`` functions and each
lab's hidden verdicts read only that plain data, so they can run in a process other than the
student's kernel (``jaxlab grade`` does that) as well as inside it (``grader.check``).

Nothing here knows an answer: hidden checks live in the ``labN`` modules, which students
never receive.
"""

import ast
import contextlib
import itertools
import json
import math
import os
import pathlib
import re
import traceback
from dataclasses import dataclass
from typing import Callable

import numpy as np

ARRAY_TYPE_NAMES = ("ArrayImpl",)


def _is_jax_array(value):
    cls = type(value)
    return cls.__name__ in ARRAY_TYPE_NAMES and cls.__module__.startswith(("jax", "jaxlib"))


def sharding_evidence(sharding):
    """Plain-data description of a ``jax.sharding.Sharding``."""
    kind = type(sharding).__name__
    ev = {"kind": kind, "repr": repr(sharding)}
    if kind == "NamedSharding":
        mesh = sharding.mesh
        ev["axis_names"] = [str(a) for a in mesh.axis_names]
        ev["mesh_shape"] = [int(mesh.shape[a]) for a in mesh.axis_names]
        ev["axis_types"] = [str(t).rsplit(".", 1)[-1] for t in mesh.axis_types]
        ev["device_ids"] = np.asarray(mesh.device_ids).tolist()
        ev["platform"] = str(mesh.devices.flat[0].platform)
        ev["spec"] = [_spec_entry(e) for e in sharding.spec]
    ev["devices"] = sorted(int(d.id) for d in sharding.device_set)
    return ev


def _spec_entry(entry):
    if entry is None:
        return None
    if isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)):
        return [str(e) for e in entry]
    return repr(entry)


def evidence(value):
    """Describe ``value`` as plain data; see the module docstring."""
    if value is None:
        return {"kind": "none"}
    if value is Ellipsis:
        return {"kind": "ellipsis"}
    cls = type(value)
    if cls is bool:
        return {"kind": "bool", "value": value}
    if cls in (int, float) or cls.__module__ == "numpy" and np.isscalar(value):
        if isinstance(value, (np.bool_, bool)):
            return {"kind": "bool", "value": bool(value)}
        if isinstance(value, (int, float, np.integer, np.floating)):
            return {"kind": "number", "value": float(value), "type": cls.__name__,
                    "is_int": isinstance(value, (int, np.integer))}
    if cls is str:
        return {"kind": "str", "value": value}
    if _is_jax_array(value):
        return _array_evidence(value)
    if cls is np.ndarray:
        if value.dtype == object:
            return {"kind": "other", "type": "numpy object array"}
        return {"kind": "ndarray", "shape": list(value.shape), "dtype": str(value.dtype),
                "value": np.array(value)}
    if cls in (tuple, list):
        return {"kind": cls.__name__, "items": [evidence(v) for v in value]}
    if cls in (set, frozenset):
        return {"kind": "set", "items": [evidence(v) for v in value]}
    if cls is dict:
        return {"kind": "dict", "items": [[evidence(k), evidence(v)] for k, v in value.items()]}
    if cls.__name__ in ("PartitionSpec", "P") and cls.__module__.startswith("jax"):
        return {"kind": "spec", "entries": [_spec_entry(e) for e in value]}
    if cls.__module__.startswith(("jax", "jaxlib")) and hasattr(value, "platform") \
            and hasattr(value, "id"):
        return {"kind": "device", "id": int(value.id), "platform": str(value.platform)}
    if callable(value):
        return {"kind": "callable", "type": cls.__name__,
                "name": str(getattr(value, "__name__", cls.__name__))}
    return {"kind": "other", "type": cls.__name__}


def _array_evidence(x):
    import jax

    ev = {"kind": "array", "shape": [int(n) for n in x.shape], "dtype": str(x.dtype)}
    try:
        ev["value"] = np.asarray(jax.device_get(x))
    except Exception as exc:  # deleted or donated buffers
        return {"kind": "other", "type": f"unreadable jax.Array ({exc})"}
    ev["sharding"] = sharding_evidence(x.sharding)
    ev["typeof"] = str(jax.typeof(x))
    return ev


def evidence_of(values):
    """Evidence of each of a question's values, by name: the default probe."""
    return {name: evidence(value) for name, value in values.items()}


# --------------------------------------------------------------------------- questions
@dataclass(frozen=True)
class Question:
    """A graded question: its variable names, a probe (runs in the student's kernel) and a
    verdict (judges the probe's plain data, raising AssertionError with a message)."""

    names: tuple
    verdict: Callable
    probe: Callable = evidence_of
    # probed before the other questions: a probe that gives back the kernel's compiled programs
    # (to make room for processes it starts) then costs the others no compiling again
    probe_first: bool = False


def free_kernel_memory():
    """Give back the kernel's compiled programs (JAX compiles them again when they are used) and
    the C library's free blocks. Measured on Lab 6's solution: the kernel's anonymous memory went
    from 431 to 208 MiB (without ``malloc_trim``, clearing alone freed nothing the system saw),
    and without it each probe's programs piled up to 673 MiB, past Gradescope's 768 MB with the
    grader beside it."""
    import ctypes
    import ctypes.util
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    try:  # glibc only
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


def question(names, verdict, probe=evidence_of, probe_first=False):
    return Question(names=tuple(names.split()), verdict=verdict, probe=probe,
                    probe_first=probe_first)


def probe_order(questions):
    """The keys of ``questions`` in the order to probe them: those marked probe_first first,
    each group in its own order (questions of a checks module without the mark keep theirs)."""
    return sorted(questions, key=lambda q: not getattr(questions[q], "probe_first", False))


def entry_points(questions):
    """A lab's ``probe``, ``verdict`` and ``check`` over its ``QUESTIONS``."""

    def probe(question, values):
        """Evidence for ``question`` from the student's ``values`` (in the student's kernel)."""
        return questions[question].probe(values)

    def verdict(question, ev):
        """Raise AssertionError with a message for the student unless the evidence is right."""
        questions[question].verdict(ev)

    def check(question, **values):
        names = questions[question].names
        ev = probed(question, values, names)
        verdict(question, transported(probe(question, values)) if ev is None else ev)

    return probe, verdict, check


def remember_probe(question, values, path):
    """The grader's probe cell, in the student's kernel: ``question`` was probed from these very
    ``values`` into the evidence file ``path``. otter's own test of the question (the grader's
    claim, run next in the same kernel) then judges that file instead of probing again: Lab 7's
    probes took ~54 CPU-s, twice over on Gradescope. The trusted verdict judges the same file, so
    an honest kernel claims what the grader decides and a patched one is still caught."""
    shell = _shell()
    if shell is not None:
        shell.__dict__.setdefault("_jaxlab_probed", {})[question] = \
            ([id(v) for v in values], str(path))


def probed(question, values, names):
    """The evidence ``remember_probe`` kept for ``question`` when ``values`` (name -> object)
    are the objects it was probed from (as the grader received it), else None. The hidden test
    passes the graded names only; a question's names may add the notebook's own inputs that its
    public check reads, which the probe received and nobody reassigns."""
    ids, path = getattr(_shell(), "_jaxlab_probed", {}).get(question, (None, None))
    if ids is None or len(ids) != len(names) or not any(n in values for n in names) or any(
            id(values[n]) != i for n, i in zip(names, ids) if n in values):
        return None
    try:
        return load_evidence(path)["evidence"]
    except (OSError, KeyError, ValueError):
        return None


# --------------------------------------------------------------------------- transport
def _is_extension(dtype):
    """Whether ``dtype`` is one JAX adds through ml_dtypes (bfloat16, the float8s, int4, ...):
    ``np.savez`` writes those as opaque void bytes, which load back as ``|V2`` and read as text
    (a bfloat16 loss once reached a check as b'j@')."""
    return dtype.type.__module__.startswith("ml_dtypes")


def _extension_dtype(name):
    import ml_dtypes

    dtype = getattr(ml_dtypes, name, None) if name.isidentifier() else None
    if dtype is None or not _is_extension(np.dtype(dtype)):
        raise ValueError(f"unknown array dtype {name!r} in the evidence")
    return np.dtype(dtype)


def _encode(ev):
    """(JSON text, {key: array}) of evidence: arrays (NumPy scalars as 0-d arrays) stored apart."""
    arrays = {}

    def strip(node):
        if isinstance(node, np.generic):  # np.float32(0.1): json cannot write it
            node = np.asarray(node)
        if isinstance(node, np.ndarray):
            key = f"a{len(arrays)}"
            if _is_extension(node.dtype):  # stored as its bits, with the dtype's name
                # (np.array keeps a 0-d array 0-d; ascontiguousarray made a bfloat16 loss 1-d)
                arrays[key] = np.array(node, order="C").view(f"u{node.dtype.itemsize}")
                return {"__array__": key, "dtype": node.dtype.name}
            arrays[key] = node
            return {"__array__": key}
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [strip(v) for v in node]
        if isinstance(node, float) and not math.isfinite(node):
            return {"__float__": repr(node)}
        return node

    return json.dumps(strip(ev)), arrays


def _decode(text, arrays):
    def restore(node):
        if isinstance(node, dict):
            if set(node) == {"__array__"}:
                return arrays[node["__array__"]]
            if set(node) == {"__array__", "dtype"}:
                return arrays[node["__array__"]].view(_extension_dtype(node["dtype"]))
            if set(node) == {"__float__"}:
                return float(node["__float__"])
            return {k: restore(v) for k, v in node.items()}
        if isinstance(node, list):
            return [restore(v) for v in node]
        return node

    return restore(json.loads(text))


def transported(ev):
    """``ev`` as the trusted grader receives it from the kernel (tuples as lists, NumPy scalars
    as 0-d arrays): ``check`` judges this too, so that a verdict in the kernel (otter) and one
    in the grader (jaxlab grade, the zip's entry point) see the same evidence."""
    return _decode(*_encode(ev))


def dump_evidence(ev, path):
    """Write evidence as JSON plus an ``.npz`` of its arrays (no pickle anywhere)."""
    text, arrays = _encode(ev)
    path = pathlib.Path(path)
    path.write_text(text)
    np.savez(path.with_suffix(".npz"), **arrays)


def load_evidence(path):
    path = pathlib.Path(path)
    with np.load(path.with_suffix(".npz"), allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    return _decode(path.read_text(), arrays)


# --------------------------------------------------------------------------- wording
def describe(ev):
    """A few words on what a variable holds, for failure messages."""
    kind = ev["kind"]
    if kind == "none":
        return "None"
    if kind == "ellipsis":
        return "`...` (the placeholder)"
    if kind == "array":
        return f"a jax.Array of shape {tuple(ev['shape'])} and dtype {ev['dtype']}"
    if kind == "ndarray":
        return f"a NumPy array of shape {tuple(ev['shape'])} (not a jax.Array)"
    if kind == "number":
        return f"the number {ev['value']:g}"
    if kind in ("tuple", "list", "set", "dict"):
        return f"a {kind} with {len(ev['items'])} items"
    if kind == "callable":
        return f"a function `{ev['name']}`"
    if kind == "spec":
        return f"a PartitionSpec {spec_repr(ev['entries'])}"
    return f"an object of type {ev.get('type', kind)}"


def spec_repr(entries):
    def one(e):
        if isinstance(e, list):
            return "(" + ", ".join(repr(x) for x in e) + ")"
        return repr(e)

    return "P(" + ", ".join(one(e) for e in entries) + ")"


def _axes(entry):
    if entry is None:
        return []
    return entry if isinstance(entry, list) else [entry]


def describe_sharding(sev):
    """Say in words how an array with this sharding evidence is laid out."""
    if sev["kind"] == "SingleDeviceSharding":
        return f"on a single device (device {sev['devices'][0]})"
    if sev["kind"] != "NamedSharding":
        return f"placed with a {sev['kind']} on devices {sev['devices']}"
    sizes = dict(zip(sev["axis_names"], sev["mesh_shape"]))
    used, parts = set(), []
    for dim, entry in enumerate(sev["spec"]):
        axes = _axes(entry)
        if axes:
            used.update(axes)
            ways = math.prod(sizes.get(a, 1) for a in axes)
            names = " and ".join(f"'{a}'" for a in axes)
            parts.append(f"dimension {dim} split {ways} ways over mesh axis {names}")
    rest = [a for a in sev["axis_names"] if a not in used and sizes[a] > 1]
    shape = sev["mesh_shape"]  # "the 8-device mesh", "the 2 × 4 mesh"
    mesh = f"{shape[0]}-device" if len(shape) == 1 else " × ".join(str(n) for n in shape)
    if not parts:
        return f"replicated on every device of the {mesh} mesh"
    text = ", ".join(parts)
    if rest:
        text += ", replicated over mesh axis " + " and ".join(f"'{a}'" for a in rest)
    return text + f" (spec {spec_repr(sev['spec'])} on the {mesh} mesh)"


# --------------------------------------------------------------------------- cells
# What a notebook cell assigns: the grader says which cell left a name unset (engine/blame.py),
# and a check in the student's own kernel does too (expect_defined).
def python_of(source):
    """A cell's source as Python (IPython magics such as %%writefile turned into calls)."""
    from IPython.core.inputtransformer2 import TransformerManager

    return TransformerManager().transform_cell(source)


def _targets(node, out):
    if isinstance(node, ast.Name):
        out.add(node.id)
    elif isinstance(node, (ast.Tuple, ast.List)):
        for elt in node.elts:
            _targets(elt, out)
    elif isinstance(node, ast.Starred):
        _targets(node.value, out)


def module_writes(body, out):
    """Names a list of statements binds at module level (not inside functions or classes)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                out.add((alias.asname or alias.name).split(".")[0])
            continue
        for child in ast.walk(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                  ast.Lambda)):
                continue
            if isinstance(child, (ast.Assign,)):
                for t in child.targets:
                    _targets(t, out)
            elif isinstance(child, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
                _targets(child.target, out)
            elif isinstance(child, ast.withitem) and child.optional_vars is not None:
                _targets(child.optional_vars, out)
            elif isinstance(child, ast.NamedExpr):
                _targets(child.target, out)
            elif isinstance(child, ast.Delete):
                for t in child.targets:
                    _targets(t, out)
        for child in ast.walk(node):  # nested defs inside if/with/try still bind names
            if child is not node and isinstance(child, (ast.FunctionDef, ast.ClassDef)):
                out.add(child.name)
    return out


def assigned_names(source):
    """The names a cell binds at module level; for a cell that does not parse (nothing of it
    runs), the names its lines start by assigning."""
    try:
        return module_writes(ast.parse(python_of(source)).body, set())
    except SyntaxError:
        return set(re.findall(r"^([A-Za-z_]\w*)\s*(?::[^=]*)?=(?!=)", source, re.M))


# --------------------------------------------------------------------------- form checks
def expect_defined(name, ev):
    """Fail unless ``name`` holds something other than None or the ``...`` placeholder. The
    AssertionError carries ``undefined``: the grader then says which of the student's cells
    broke before setting it (engine/blame.py), as ``kernel_fault`` does in their own kernel."""
    if ev["kind"] in ("none", "ellipsis"):
        fault = kernel_fault(name)
        exc = AssertionError(
            never_set(name, "the cell that assigns it", fault) if fault else
            f"`{name}` is not defined yet (it holds {describe(ev)}): write your answer in the "
            "cell under '### Your code here' and run it.")
        exc.undefined = name
        raise exc


def fault_words(kind, *, error="", line=None, code="", seconds=None, detail=""):
    """What happened to a student's cell, in words: ``kind`` is "raised", "timed out" or
    "skipped"; ``line`` and ``code`` where it raised or was stopped."""
    at = f" at line {line}" + (f" (`{code.strip()[:120]}`)" if code.strip() else "") \
        if line else ""
    if kind == "raised":
        return f"raised {error[:300]}{at}"
    if kind == "timed out":
        limit = f" within the per-cell limit of {seconds:g} s" if seconds else ""
        return (f"did not finish{limit} and was stopped{at}: an endless loop, or a wait that "
                "never ends (such as a collective that some device never reaches, or a "
                "process waiting for another)")
    return f"was not run: {detail}" if detail else "was not run"


def never_set(name, where, fault):
    """The message for a graded name that a failing cell never set."""
    return (f"`{name}` was never set: {where} {fault}. Fix that and run the cell again; then "
            "run this check.")


def _cell_line(exc):
    """The line of the cell's own code where ``exc`` was raised (IPython compiles each cell to
    a file of its own: the first frame of the traceback is the cell's)."""
    if isinstance(exc, SyntaxError):
        return exc.lineno
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_cell_file(f.filename)]
    return frames[0].lineno if frames else None


def _is_cell_file(filename):
    # ipykernel compiles a cell to <tmp>/ipykernel_<pid>/<hash>.py, IPython to <ipython-input-…>
    return bool(re.search(r"ipykernel_\d+[/\\]\d+\.py$|^<ipython-input-", filename or ""))


def exception_line(exc):
    """``exc`` in one line as a student reads it (a SyntaxError without its temporary file)."""
    if isinstance(exc, SyntaxError):
        return f"{type(exc).__name__}: {exc.msg}"
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return text[0] if text else type(exc).__name__


def _shell():
    """The IPython shell running this code, or None (the trusted grader runs none)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _record_cell(result):
    try:
        faults = _shell().__dict__.setdefault("_jaxlab_cell_faults", {})
        source = result.info.raw_cell or ""
        exc = result.error_before_exec or result.error_in_exec
        names = assigned_names(source)
        if exc is None:
            for name in names:
                faults.pop(name, None)
            return
        line = _cell_line(exc)
        lines = source.splitlines()
        code = lines[line - 1] if line and 0 < line <= len(lines) else ""
        if isinstance(exc, KeyboardInterrupt):
            words = fault_words("timed out", line=line, code=code)
        else:
            words = fault_words("raised", error=exception_line(exc), line=line, code=code)
        for name in names:
            faults[name] = words
    except Exception:  # never in the student's way
        pass


def watch_cells():
    """Remember, in the student's IPython kernel, how the last run of each cell that raised
    broke, by the names it assigns (a later clean run forgets it): ``expect_defined`` then names
    the student's own exception and line instead of "not defined yet". The setup cell calls it."""
    shell = _shell()
    if shell is None:
        return
    callbacks = shell.events.callbacks["post_run_cell"]
    if not any(getattr(cb, "__name__", "") == "_record_cell" for cb in callbacks):
        shell.events.register("post_run_cell", _record_cell)


def kernel_fault(name):
    """How the last run of a cell that assigns ``name`` broke (``fault_words``), as
    ``watch_cells`` recorded it in this kernel; None elsewhere."""
    return getattr(_shell(), "_jaxlab_cell_faults", {}).get(name)


def expect_array(name, ev, shape=None):
    expect_defined(name, ev)
    if ev["kind"] != "array":
        raise AssertionError(f"`{name}` should be a jax.Array; it is {describe(ev)}.")
    if shape is not None and tuple(ev["shape"]) != tuple(shape):
        raise AssertionError(
            f"`{name}` has shape {tuple(ev['shape'])}; expected shape {tuple(shape)}.")


def expect_on_mesh(name, ev, shape=None):
    """``name`` is a jax.Array laid out with a NamedSharding (placed on a mesh)."""
    expect_array(name, ev, shape)
    if ev["sharding"]["kind"] != "NamedSharding":
        raise AssertionError(
            f"`{name}` is not placed on a mesh: it lives {describe_sharding(ev['sharding'])}; "
            "expected it on the devices of a mesh. Place it with "
            "jax.device_put(..., NamedSharding(mesh, P(...))).")


def expect_callable(name, ev):
    expect_defined(name, ev)
    if ev["kind"] != "callable":
        raise AssertionError(f"`{name}` should be a function; it is {describe(ev)}.")


def expect_number(name, ev):
    expect_defined(name, ev)
    if ev["kind"] != "number" or not math.isfinite(ev["value"]):
        raise AssertionError(f"`{name}` should be a finite number (a float); it is {describe(ev)}.")


def expect_kind(name, ev, kind, what):
    expect_defined(name, ev)
    if ev["kind"] != kind:
        raise AssertionError(f"`{name}` should be {what}; it is {describe(ev)}.")


# --------------------------------------------------------------------------- shardings
def rebuild_sharding(sev):
    """Recreate the sharding described by ``sev`` on this process's devices.

    Device ids are mapped in sorted order onto local devices, so evidence taken on 8 GPUs or
    8 CPU devices rebuilds on the 8 CPU devices of a grading process.
    """
    import jax
    from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    ids = sorted({i for i in np.ravel(sev.get("device_ids", sev["devices"]))})
    local = jax.devices()
    if len(ids) > len(local):  # e.g. one GPU beside the 8 CPU devices the lab ran on
        local = jax.devices("cpu")
    if len(ids) > len(local):
        raise AssertionError(
            f"the array is spread over {len(ids)} devices but this grader has {len(local)}")
    by_id = dict(zip(ids, local))
    if sev["kind"] == "SingleDeviceSharding":
        return SingleDeviceSharding(by_id[sev["devices"][0]])
    if sev["kind"] != "NamedSharding":
        return None
    devices = np.vectorize(by_id.__getitem__, otypes=[object])(np.array(sev["device_ids"]))
    types = tuple(getattr(AxisType, t) for t in sev["axis_types"])
    mesh = Mesh(devices, tuple(sev["axis_names"]), axis_types=types)
    spec = PartitionSpec(*[tuple(e) if isinstance(e, list) else e for e in sev["spec"]])
    return NamedSharding(mesh, spec)


def is_laid_out_as(sev, ndim, spec):
    """Whether evidence ``sev`` describes the same layout as ``spec`` on the array's own mesh.

    Compares with ``Sharding.is_equivalent_to``, so ``P('x')`` and ``P('x', None)`` agree.
    """
    from jax.sharding import NamedSharding

    actual = rebuild_sharding(sev)
    if not isinstance(actual, NamedSharding):
        return False
    return actual.is_equivalent_to(NamedSharding(actual.mesh, spec), ndim)


# --------------------------------------------------------------------------- programs
def _sub_jaxprs(params):
    for value in params.values():
        for sub in value if isinstance(value, (list, tuple)) else (value,):
            if hasattr(sub, "eqns"):
                yield sub
            elif hasattr(getattr(sub, "jaxpr", None), "eqns"):  # a ClosedJaxpr
                yield sub.jaxpr


def _aval_shape(var):
    return [int(n) for n in getattr(var.aval, "shape", ())]


def _body(jaxpr):
    """Every equation under ``jaxpr`` in program order, nested ones (remat, jit,
    custom_jvp, scan bodies) inlined where they occur: ``[primitive, output shapes]``."""
    steps = []
    for eqn in jaxpr.eqns:
        steps.append([eqn.primitive.name, [_aval_shape(v) for v in eqn.outvars]])
        for sub in _sub_jaxprs(eqn.params):
            steps.extend(_body(sub))
    return steps


def _sums_of_copies(jaxpr):
    """How many psums under ``jaxpr`` add up a value every device already held the same: an
    operand that ``pvary`` (shard_map's replication bookkeeping) made from an invariant one, as
    ``pmean`` of a gradient that jax.grad has already all-reduced is. Such an all-reduce changes
    nothing (pmean) or multiplies by the number of devices (psum), and costs a collective."""
    copies = {id(v) for eqn in jaxpr.eqns if eqn.primitive.name == "pvary" for v in eqn.outvars}
    count = sum(1 for eqn in jaxpr.eqns if eqn.primitive.name in ("psum", "psum_invariant",
                                                                   "psum2")
                for v in eqn.invars if id(v) in copies)
    for eqn in jaxpr.eqns:
        for sub in _sub_jaxprs(eqn.params):
            count += _sums_of_copies(sub)
    return count


def _shard_maps(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            mesh = eqn.params["mesh"]
            found.append({
                "axis_names": [str(a) for a in mesh.axis_names],
                "mesh_shape": [int(mesh.shape[a]) for a in mesh.axis_names],
                "in": [[_aval_shape(v), [_spec_entry(e) for e in spec]]
                       for v, spec in zip(eqn.invars, eqn.params["in_specs"])],
                "out": [[_aval_shape(v), [_spec_entry(e) for e in spec]]
                        for v, spec in zip(eqn.outvars, eqn.params["out_specs"])],
                "body": _body(eqn.params["jaxpr"]),
                "sums_of_copies": _sums_of_copies(eqn.params["jaxpr"]),
            })
        else:
            for sub in _sub_jaxprs(eqn.params):
                found.extend(_shard_maps(sub))
    return found


def program_evidence(closed):
    """Plain data on ``closed = jax.make_jaxpr(fn)(*args)`` of a function as the student wrote
    it: the primitives at its top level (a function wrapped in ``jax.jit`` is one ``jit``
    equation), and for each ``shard_map`` inside it the global shape and spec of every operand
    and result (``in_specs``/``out_specs`` per leaf) and its body's equations in program order."""
    return {"top": [eqn.primitive.name for eqn in closed.jaxpr.eqns],
            "shard_maps": _shard_maps(closed.jaxpr)}


def is_jit_wrapped(program):
    """Whether the whole traced program is one ``jax.jit`` call (``pjit`` before JAX 0.7)."""
    return len(program["top"]) == 1 and program["top"][0] in ("jit", "pjit")


def operand_specs(program, shape):
    """The ``in_specs`` entries given to every shard_map operand of global ``shape``."""
    return [spec for sm in program["shard_maps"] for s, spec in sm["in"]
            if tuple(s) == tuple(shape)]


def split_dims(spec):
    """The dimensions a spec (plain entries) splits, with their mesh axes."""
    return {dim: axes for dim, axes in enumerate(spec) if _axes(axes)}


def expect_operands_split(name, program, shape, what, dim, wanted):
    """Every shard_map operand of global ``shape`` (``what``) in the student's ``program`` is
    split along dimension ``dim`` alone (replicated when ``dim`` is None), as the task's words
    ``wanted`` say."""
    for spec in operand_specs(program, shape):
        split = split_dims(spec)
        if list(split) == ([] if dim is None else [dim]):
            continue
        found = ("replicated on every device" if not split else
                 " and ".join(f"split along dimension {d}" for d in split))
        raise AssertionError(
            f"`{name}` hands {what} (shape {tuple(shape)}) to jax.shard_map {found} (in_specs "
            f"{spec_repr(spec) if spec else 'P()'}); expected what the task says: {wanted}.")


# --------------------------------------------------------------------------- for public checks
# The public checks (grader.check in the student's notebook) try the student's answer on the
# notebook's own inputs and read its method the way the hidden checks do; these helpers give
# them the hidden checks' words. Each raises AssertionError with a message for the student.
COLLECTIVES = {  # what the text calls a collective -> the primitives it traces to
    "psum": ("psum", "psum_invariant", "psum2"),
    "pmean": ("psum", "psum_invariant", "psum2"),  # pmean traces to psum and a division
    "all_gather": ("all_gather", "all_gather_invariant"),
    "psum_scatter": ("reduce_scatter",),
    "ppermute": ("ppermute",),
    "all_to_all": ("all_to_all",),
    "pmax": ("pmax",),
    "jax.pmap": ("xla_pmap",),
    "jax.shard_map": ("shard_map",),
}


def call(what, fn, *args):
    """``fn(*args)``, waited for; an exception of the student's code becomes a message naming
    ``what`` (the call as the student wrote it), the exception and its line."""
    import jax

    try:
        result = fn(*args)
        jax.block_until_ready(result)  # (Lab 3 Task 9 asks students for the one-line form)
    except Exception as exc:
        fail(f"`{what}` raised {student_error(exc)}; it should work on the notebook's own "
             "inputs, laid out as the task describes.")
    return result


def traced(name, fn, *args):
    """(primitive names, ``program_evidence``) of ``jax.make_jaxpr(fn)(*args)``, nested
    programs included; a function that cannot be traced gets a message naming ``name``."""
    import jax

    try:
        closed = jax.make_jaxpr(fn)(*args)
    except Exception as exc:
        fail(f"`{name}` could not be traced with jax.make_jaxpr: {student_error(exc)}")
    return set(re.findall(r"\b([a-z_][a-z0-9_]*)\[", str(closed))), program_evidence(closed)


def expect_collectives(name, primitives, required=(), forbidden=(), why="", shard_map=True):
    """The traced ``primitives`` of ``name`` go through ``jax.shard_map`` (unless not asked),
    use every collective of ``required`` and none of ``forbidden`` (names as in COLLECTIVES)."""
    if shard_map and "shard_map" not in primitives:
        fail(f"`{name}` does not go through jax.shard_map; this task asks you to write the "
             "per-device program with jax.shard_map.")
    for collective in forbidden:
        if primitives & set(COLLECTIVES[collective]):
            fail(f"`{name}` uses `{collective}`, which this task rules out{why}.")
    for collective in required:
        if not primitives & set(COLLECTIVES[collective]):
            fail(f"`{name}`'s traced program has no `jax.lax.{collective}`; this task asks you "
                 f"to use it{why}.")


def expect_shape(what, value, shape):
    """``value`` (the result of the call ``what``) is a jax.Array of ``shape``."""
    ev = evidence(value)
    if ev["kind"] != "array":
        fail(f"`{what}` returned {describe(ev)}; expected a jax.Array of shape {tuple(shape)}.")
    if tuple(ev["shape"]) != tuple(shape):
        fail(f"`{what}` returned an array of shape {tuple(ev['shape'])}; expected "
             f"{tuple(shape)}.")
    return ev


def expect_laid_out(what, value, spec, words, devices):
    """``value`` (the result of ``what``) is spread over ``devices`` devices of a mesh and laid
    out as ``spec`` (a PartitionSpec; ``is_equivalent_to``), ``words`` saying so in the task's
    terms."""
    ev = evidence(value)
    if ev["kind"] != "array":
        fail(f"`{what}` returned {describe(ev)}; expected a jax.Array {words}.")
    sev = ev["sharding"]
    if sev["kind"] != "NamedSharding" or len(sev["devices"]) != devices:
        fail(f"`{what}` returned an array {describe_sharding(sev)}; expected it spread over the "
             f"{devices} devices of the mesh, {words}.")
    if not is_laid_out_as(sev, len(ev["shape"]), spec):
        fail(f"`{what}` returned an array {describe_sharding(sev)}; expected {words} (check "
             "`out_specs`).")
    return ev


# --------------------------------------------------------------------------- for hidden checks
# Helpers every lab's hidden checks use (they know no answer): one copy, here, because the
# checks modules ship alone beside this one and cannot import each other.
CHECKS_FILE = re.compile(r"(jaxlab_)?(lab\d+|form)\.py")


def fail(message):
    raise AssertionError(message)


_SEEDED = None  # (seed, counter) while `seeded` runs


def fresh_rng():
    """A generator for fresh inputs: other draws on every check, so no answer can be memorised."""
    if _SEEDED is not None:
        seed, counter = _SEEDED
        return np.random.default_rng([seed, next(counter)])
    return np.random.default_rng(int.from_bytes(os.urandom(4), "little"))


@contextlib.contextmanager
def seeded(seed):
    """Inside the block, the fresh inputs are drawn from ``seed``: the n-th ``fresh_rng()`` of
    a probe then draws the same numbers for every answer, so ``jaxlab mutants`` can compare
    what a mutant of the solution does with what the solution does on the same inputs. (A
    student's code could as well fix NumPy's or the OS's randomness; the grader never seeds.)"""
    global _SEEDED
    _SEEDED = (int(seed), itertools.count())
    try:
        yield
    finally:
        _SEEDED = None


def check_devices(count):
    """``count`` devices to check on: the runtime's own, or its CPU devices where it has fewer
    (one GPU)."""
    import jax

    devices = jax.devices() if len(jax.devices()) >= count else jax.devices("cpu")
    return devices[:count]


def student_error(exc):
    """An exception raised by the student's code, in one line, with the line of their code."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "-packages" not in f.filename
              and not CHECKS_FILE.fullmatch(os.path.basename(f.filename))]
    where = f" (line {frames[-1].lineno} of your code)" if frames else ""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:400] + where


def label(text):
    """``text`` as a message names it: in backticks unless it already quotes a name."""
    return text if "`" in text else f"`{text}`"


def expect_close(name, actual, expected, what, *, rtol, atol):
    """``actual`` (the student's ``name``) equals ``expected`` within the lab's tolerances."""
    name = label(name)
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape:
        fail(f"{name} has shape {actual.shape}; expected {expected.shape} ({what}).")
    if not np.all(np.isfinite(actual)):
        fail(f"{name} contains NaN or infinite values; expected {what}.")
    if not np.allclose(actual, expected, rtol=rtol, atol=atol):
        worst = float(np.max(np.abs(actual - expected)))
        fail(f"{name} has the wrong values: expected {what}, but they differ by up to "
             f"{worst:.3g} (tolerance: rtol={rtol:g}, atol={atol:g}).")


def fresh_record(name, ev, call):
    """The probe's record of calling the student's function ``name`` on new data (``call`` in
    words); fails if it could not run."""
    expect_callable(name, ev[name])
    fresh = ev.get("fresh")
    if fresh is None:
        fail(f"`{name}` could not be tried on new data.")
    if "error" in fresh:
        fail(f"`{call}` on new data raised {fresh['error']}; it should work for any inputs "
             "of the layout the task describes.")
    return fresh


def expect_jitted(name, program):
    if not is_jit_wrapped(program):
        top = ", ".join(f"`{p}`" for p in program["top"]) or "nothing"
        fail(f"`{name}` is not wrapped in jax.jit: traced as you wrote it, its program runs "
             f"{top} at the top level instead of one `jit` call. The task says \"Wrap it in "
             "`jax.jit`\" (decorate it with @jax.jit, or assign jax.jit(...) to it).")
