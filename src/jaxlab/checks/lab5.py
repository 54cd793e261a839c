"""Hidden checks of Lab 5 (shipped only in the autograder zip, as ``jaxlab_lab5.py``).

Same design as Labs 3 and 4: a probe runs in the student's kernel, calls the student's functions
on fresh random inputs laid out as the task says (other sizes too) and records the results and
the traced program (``jax.make_jaxpr``) as plain data; a verdict judges that data only,
recomputing every reference in float64 NumPy from the lab's recipe, and raises AssertionError in
the student's terms.

The traced program is read with ``_program`` (richer than ``form.program_evidence``): every
equation in program order with its operand and result shapes, the mesh axes a collective runs
over, the ``perm`` of a ``ppermute``, the types (``f32[48@data,64@model]``) of every matrix
product, and how many times it runs (a ``scan`` body runs ``length`` times; a ``while`` body an
unknown number of times). Collectives are recognised by the primitive names JAX 0.10 writes:
``psum``/``pmean`` trace to ``psum_invariant`` inside ``shard_map``, ``all_gather`` to
``all_gather``, ``ppermute`` and ``all_to_all`` to themselves.

Parts: A (q1, q2: 2-D mesh), B (q3-q6: pipeline), C (q7, q8: experts), D (q9: a training
script run as two processes; its section says how it is checked).
"""

import contextlib
import functools
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import typing

import numpy as np

try:
    from . import form
except ImportError:  # in the autograder the checks are flat modules beside the notebook
    import jaxlab_form as form

# Float32 results computed in another order (blocks, stages, other devices) differ from the
# float64 references by a few ulps; anything past these tolerances is a wrong answer.
RTOL = 1e-4
ATOL = 1e-5
# Losses and gradients: sums over a batch and 16 tanh layers in float32 differ by ~1e-6.
GRAD_RTOL = 1e-3
GRAD_ATOL = 1e-5
N_DEVICES = 8

COLLECTIVES = {
    "psum": ("psum", "psum_invariant", "psum2"),
    "all_gather": ("all_gather", "all_gather_invariant"),
    "psum_scatter": ("reduce_scatter",),
    "ppermute": ("ppermute",),
    "all_to_all": ("all_to_all",),
    "pmax": ("pmax",),
    "pmin": ("pmin",),
}
# primitives that move data between devices (pvary, which check_vma inserts, moves nothing)
COMMUNICATION = {p for prims in COLLECTIVES.values() for p in prims}


# =========================================================================== shared: probes
_rng = form.fresh_rng


def _devices():
    return form.check_devices(N_DEVICES)


_error = form.student_error


def _is_mesh(value):
    cls = type(value)
    return cls.__name__ == "Mesh" and cls.__module__.startswith("jax")


def _mesh_evidence(value):
    """A jax Mesh as plain data; anything else as ``form.evidence`` describes it."""
    if not _is_mesh(value):
        return form.evidence(value)
    return {"kind": "mesh", "axis_names": [str(a) for a in value.axis_names],
            "shape": [int(value.shape[a]) for a in value.axis_names],
            "axis_types": [str(t).rsplit(".", 1)[-1] for t in value.axis_types],
            "device_ids": np.asarray(value.device_ids).tolist()}


def _mesh_for(value, axes, shape, axis_types):
    """The student's mesh when it has the task's axes and shape, else the lab's own one."""
    import jax
    from jax.sharding import AxisType

    if _is_mesh(value) and tuple(map(str, value.axis_names)) == axes and \
            tuple(int(value.shape[a]) for a in value.axis_names) == shape:
        return value
    return jax.make_mesh(shape, axes, axis_types=tuple(getattr(AxisType, t) for t in axis_types),
                         devices=_devices())


def _put(value, mesh, *spec):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.device_put(value, NamedSharding(mesh, P(*spec)))


def _tree_evidence(value):
    if type(value) in (list, tuple):
        return {"kind": type(value).__name__, "items": [_tree_evidence(v) for v in value]}
    return form.evidence(value)


def _call(fn, *args, jit=False, grad=False):
    """Call ``fn`` (compiled with ``jit``) and, with ``grad``, its gradient in the first
    argument; the results as evidence, or the error in the student's terms."""
    import jax

    ev = {}
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            run = jax.jit(fn) if jit else fn
            ev["output"] = _tree_evidence(jax.block_until_ready(run(*args)))
            if grad:
                ev["grad"] = _tree_evidence(
                    jax.block_until_ready(jax.jit(jax.grad(fn))(*args)))
    except Exception as exc:
        ev["error"] = _error(exc)
    return ev


def _aval_shape(var):
    return [int(n) for n in getattr(var.aval, "shape", ())]


def _aval_type(var):
    aval = getattr(var, "aval", None)
    return aval.str_short() if hasattr(aval, "str_short") else str(aval)


def _axes(params):
    axes = params.get("axes", params.get("axis_name", ()))
    return [str(a) for a in (axes if isinstance(axes, (tuple, list)) else (axes,))]


def _walk(jaxpr, times, inside, steps, shard_maps):
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        step = {"prim": name, "in": [_aval_shape(v) for v in eqn.invars],
                "out": [_aval_shape(v) for v in eqn.outvars], "times": times, "inside": inside}
        if name in COMMUNICATION:
            step["axes"] = _axes(eqn.params)
            if "perm" in eqn.params:
                step["perm"] = [[int(a), int(b)] for a, b in eqn.params["perm"]]
        if name == "dot_general":
            step["types"] = [_aval_type(v) for v in (*eqn.invars, *eqn.outvars)]
        steps.append(step)
        if name == "shard_map":
            mesh = eqn.params["mesh"]
            shard_maps.append({
                "axis_names": [str(a) for a in mesh.axis_names],
                "mesh_shape": [int(mesh.shape[a]) for a in mesh.axis_names],
                "in": [[_aval_shape(v), [form._spec_entry(e) for e in spec]]
                       for v, spec in zip(eqn.invars, eqn.params["in_specs"])]})
            _walk(eqn.params["jaxpr"], times, True, steps, shard_maps)
        elif name == "scan":
            inner = None if times is None else times * int(eqn.params["length"])
            _walk(eqn.params["jaxpr"].jaxpr, inner, inside, steps, shard_maps)
        elif name == "while":
            for sub in form._sub_jaxprs(eqn.params):
                _walk(sub, None, inside, steps, shard_maps)
        else:
            for sub in form._sub_jaxprs(eqn.params):
                _walk(sub, times, inside, steps, shard_maps)


def _program(closed):
    """Plain data on ``closed = jax.make_jaxpr(fn)(*args)``: the top-level primitives, every
    shard_map (mesh, operand shapes and specs) and every equation (see the module docstring)."""
    steps, shard_maps = [], []
    _walk(closed.jaxpr, 1, False, steps, shard_maps)
    return {"top": [eqn.primitive.name for eqn in closed.jaxpr.eqns], "steps": steps,
            "shard_maps": shard_maps}


def _trace(fn, *args):
    import jax

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return {"program": _program(jax.make_jaxpr(fn)(*args))}
    except Exception as exc:
        return {"jaxpr_error": _error(exc)}


# =========================================================================== shared: verdicts
_fail = form.fail


_label = form.label


_close = functools.partial(form.expect_close, rtol=RTOL, atol=ATOL)


def _is_factor(k):
    """Whether ``k`` (a ratio of a wrong result to the right one) is a whole number >= 2 or one
    over such a number: the signature of a sum taken for a mean, or the reverse."""
    if k is None or k <= 0:
        return False
    big = k if k >= 1 else 1 / k
    return round(big) >= 2 and math.isclose(big, round(big), rel_tol=GRAD_RTOL)


def _ratio(actual, expected):
    """actual / expected when the two are proportional (within GRAD_RTOL), else None."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if actual.shape != expected.shape or not np.any(expected):
        return None
    k = float(np.sum(actual * expected) / np.sum(expected * expected))
    if k != 0 and np.allclose(actual, k * expected, rtol=GRAD_RTOL, atol=GRAD_ATOL):
        return k
    return None


def _loss_value(call, out, ref_loss, factor_words, what):
    """A scalar loss equal to ``ref_loss``; a whole factor off (a sum taken for a mean, or the
    reverse) is named with ``factor_words``."""
    _array_out(call, out, ())
    value = float(out["value"])
    k = _ratio(value, ref_loss)
    if _is_factor(k):
        _fail(f"`{call}` is {value:.6g}, {k:.3g} times the loss {ref_loss:.6g}; expected "
              f"{factor_words}.")
    _close(call, value, ref_loss, what, rtol=GRAD_RTOL, atol=GRAD_ATOL)


_fresh = form.fresh_record


def _fresh_each(name, ev, calls):
    """The probe's records of calling ``name`` on several fresh inputs (``calls``: each in
    words); fails at the first that could not run."""
    form.expect_callable(name, ev[name])
    cases = ev.get("fresh")
    if not cases:
        _fail(f"`{name}` could not be tried on new data.")
    for case, call in zip(cases, calls):
        _fresh(name, {name: ev[name], "fresh": case}, call)
    return cases


def _program_of(name, fresh):
    if "jaxpr_error" in fresh:
        _fail(f"`{name}` could not be traced with jax.make_jaxpr: {fresh['jaxpr_error']}")
    return fresh["program"]


def _array_out(call, out, shape):
    call = _label(call)
    if out["kind"] != "array":
        _fail(f"{call} returned {form.describe(out)}; expected a jax.Array of shape {shape}.")
    if tuple(out["shape"]) != tuple(shape):
        _fail(f"{call} returned an array of shape {tuple(out['shape'])}; expected {shape}.")


def _arrays(name, ev, count, what):
    """The arrays of a tuple (or list) of ``count`` arrays."""
    if "`" not in name:
        form.expect_defined(name, ev)
    if ev["kind"] not in ("tuple", "list") or len(ev["items"]) != count:
        _fail(f"{_label(name)} is {form.describe(ev)}; expected {what}.")
    for i, item in enumerate(ev["items"]):
        if item["kind"] != "array":
            _fail(f"item {i} of {_label(name)} is {form.describe(item)}; expected a jax.Array "
                  f"({what}).")
    return ev["items"]


def _uses_shard_map(name, program, what):
    if not program["shard_maps"]:
        _fail(f"`{name}` gives the right numbers but does not go through jax.shard_map; "
              f"expected what the task asks for: {what}.")


_jitted = form.expect_jitted


def _communication(program):
    """The collectives inside shard_map, in program order."""
    return [s for s in program["steps"] if s["inside"] and s["prim"] in COMMUNICATION]


def _collective_name(prim):
    return next((k for k, v in COLLECTIVES.items() if prim in v), prim)


def _describe_moves(moves):
    return ", ".join(f"`{_collective_name(s['prim'])}` over {tuple(s['axes'])} of an array of "
                     f"shape {tuple(s['in'][0]) if s['in'] else ()}" for s in moves) or "none"


def _spec_entries(spec):
    """A spec's entries as tuples of mesh axes, trailing unsplit dimensions dropped."""
    out = [tuple(form._axes(e)) for e in spec]
    while out and not out[-1]:
        out.pop()
    return out


def _spec_words(spec):
    return form.spec_repr(spec) if spec else "P()"


def _operand_spec(name, program, shape, what, wanted, words):
    """Every shard_map operand of global ``shape`` has in_specs ``wanted`` (a tuple of entries,
    each a mesh axis name or None)."""
    expected = _spec_entries([list(w) if isinstance(w, tuple) else w for w in wanted])
    for sm in program["shard_maps"]:
        for s, spec in sm["in"]:
            if tuple(s) == tuple(shape) and _spec_entries(spec) != expected:
                _fail(f"`{name}` hands {what} (shape {tuple(shape)}) to jax.shard_map with "
                      f"in_specs {_spec_words(spec)}; expected what the task says: {words}.")


def _on_mesh_as(name, ev, spec, words, devices=N_DEVICES):
    from jax.sharding import PartitionSpec as P

    name, sev = _label(name), ev["sharding"]
    if sev["kind"] != "NamedSharding" or len(sev["devices"]) != devices:
        _fail(f"{name} lives {form.describe_sharding(sev)}; expected it spread over the "
              f"{devices} devices of a mesh, {words}.")
    if not form.is_laid_out_as(sev, len(ev["shape"]), P(*spec)):
        _fail(f"{name} is {form.describe_sharding(sev)}; expected {words}.")


def _mesh_words(mev):
    axes = ", ".join(f"'{a}': {n}" for a, n in zip(mev["axis_names"], mev["shape"]))
    return f"a mesh with axes {{{axes}}}"


def _same_mesh(name, sev, mesh_name, mev):
    if sev.get("kind") != "NamedSharding" or (sev["axis_names"], sev["device_ids"]) != (
            mev["axis_names"], mev["device_ids"]):
        where = form.describe_sharding(sev)
        _fail(f"`{name}` lives {where}, not on `{mesh_name}`; expected it placed on "
              f"`{mesh_name}` ({_mesh_words(mev)}).")


def _type_dims(text):
    """``f32[48@data,64@model]`` -> [(48, ('data',)), (64, ('model',))]."""
    match = re.search(r"\[([^\]]*)\]", text)
    dims = []
    for part in (match.group(1).split(",") if match and match.group(1) else []):
        size, _, axes = part.partition("@")
        dims.append((int(re.sub(r"\D", "", size) or 0),
                     tuple(a for a in re.split(r"[(), ]+", axes) if a)))
    return dims


# =========================================================================== Part A: 2-D mesh
MLP_SIZES = (16, 64, 8)  # inputs, hidden, outputs
MLP_BATCH = 32
# batch sizes of the fresh calls in Part A ("any batch size divisible by 4"): the first is
# the one whose traced program is read; 4 is one example per row of the mesh
MLP_FRESH_BATCHES = (48, 4)
MESH_2D = (("data", "model"), (4, 2))
MEGATRON = ((None, "model"), ("model",), ("model", None), ())  # W1, b1, W2, b2


@functools.lru_cache(maxsize=None)
def _lab_mlp():
    """``init_mlp(jax.random.key(0))`` of the notebook: (W1, b1, W2, b2), (x, y) in NumPy."""
    import jax
    import jax.numpy as jnp

    n_in, n_hidden, n_out = MLP_SIZES
    k = jax.random.split(jax.random.key(0), 6)
    W1 = jax.random.normal(k[0], (n_in, n_hidden)) / jnp.sqrt(n_in)
    b1 = 0.1 * jax.random.normal(k[1], (n_hidden,))
    W2 = jax.random.normal(k[2], (n_hidden, n_out)) / jnp.sqrt(n_hidden)
    b2 = 0.1 * jax.random.normal(k[3], (n_out,))
    x = jax.random.normal(k[4], (MLP_BATCH, n_in))
    y = jax.random.normal(k[5], (MLP_BATCH, n_out))
    return tuple(np.asarray(a) for a in (W1, b1, W2, b2)), (np.asarray(x), np.asarray(y))


def _fresh_mlp(rng, batch):
    n_in, n_hidden, n_out = MLP_SIZES
    params = (rng.normal(size=(n_in, n_hidden)) / np.sqrt(n_in), 0.1 * rng.normal(size=n_hidden),
              rng.normal(size=(n_hidden, n_out)) / np.sqrt(n_hidden), 0.1 * rng.normal(size=n_out))
    x, y = rng.normal(size=(batch, n_in)), rng.normal(size=(batch, n_out))
    return tuple(a.astype(np.float32) for a in params), (x.astype(np.float32),
                                                         y.astype(np.float32))


def _mlp_forward(params, x):
    W1, b1, W2, b2 = (np.asarray(a, np.float64) for a in params)
    h = np.tanh(np.asarray(x, np.float64) @ W1 + b1)
    return h, h @ W2 + b2


def _mlp_loss_and_grad(params, batch):
    """``mlp_loss`` and its gradient, in float64."""
    x, y = (np.asarray(a, np.float64) for a in batch)
    W1, b1, W2, b2 = (np.asarray(a, np.float64) for a in params)
    h, pred = _mlp_forward(params, x)
    loss = float(np.mean(np.sum((pred - y) ** 2, axis=-1)))
    d_pred = 2 * (pred - y) / len(x)
    d_z = (d_pred @ W2.T) * (1 - h ** 2)
    return loss, (x.T @ d_z, d_z.sum(0), h.T @ d_pred, d_pred.sum(0))


def _placed_mlp(mesh, params, batch):
    x, y = batch
    return (tuple(_put(p, mesh, *s) for p, s in zip(params, MEGATRON)),
            (_put(x, mesh, "data", None), _put(y, mesh, "data", None)))


def _probe_mesh_2d(values):
    ev = form.evidence_of({k: values.get(k) for k in ("x_2d", "params_2d", "forward_2d",
                                                      "out_2d")})
    ev["mesh_2d"] = _mesh_evidence(values.get("mesh_2d"))
    ev["params_2d"] = _tree_evidence(values.get("params_2d"))
    fn = values.get("forward_2d")
    if callable(fn):
        rng, ev["fresh"] = _rng(), []
        mesh = _mesh_for(values.get("mesh_2d"), *MESH_2D, ("Explicit", "Explicit"))
        for i, batch in enumerate(MLP_FRESH_BATCHES):
            params, (x, _) = _fresh_mlp(rng, batch)
            placed = tuple(_put(p, mesh, *s) for p, s in zip(params, MEGATRON))
            xp = _put(x, mesh, "data", None)
            ev["fresh"].append({"params": list(params), "x": x, **_call(fn, placed, xp),
                                **(_trace(fn, placed, xp) if i == 0 else {})})
    return ev


def _probe_loss_2d(values):
    ev = form.evidence_of({"loss_2d": values.get("loss_2d")})
    fn = values.get("loss_2d")
    if callable(fn):
        rng, ev["fresh"] = _rng(), []
        mesh = _mesh_for(values.get("mesh_2d"), *MESH_2D, ("Explicit", "Explicit"))
        for i, size in enumerate(MLP_FRESH_BATCHES):
            params, batch = _fresh_mlp(rng, size)
            placed, placed_batch = _placed_mlp(mesh, params, batch)
            ev["fresh"].append({"params": list(params), "batch": list(batch),
                                **_call(fn, placed, placed_batch, jit=True, grad=True),
                                **(_trace(fn, placed, placed_batch) if i == 0 else {})})
    return ev


def _check_mesh_2d(mev):
    name = "mesh_2d"
    form.expect_defined(name, mev)
    if mev["kind"] != "mesh":
        _fail(f"`{name}` is {form.describe(mev)}; expected a jax Mesh (jax.make_mesh).")
    axes, shape = MESH_2D
    if tuple(mev["axis_names"]) != axes or tuple(mev["shape"]) != shape:
        _fail(f"`{name}` is {_mesh_words(mev)}; expected a 4 × 2 mesh with axes "
              "('data', 'model').")
    if any(t != "Explicit" for t in mev["axis_types"]):
        _fail(f"the axes of `{name}` are {tuple(mev['axis_types'])}; expected both Explicit "
              "(pass axis_types=(AxisType.Explicit, AxisType.Explicit) to jax.make_mesh).")
    if len(set(np.ravel(mev["device_ids"]).tolist())) != N_DEVICES:
        _fail(f"`{name}` uses devices {mev['device_ids']}; expected the 8 devices of `devices`.")


def _check_first_layer(name, program, batch):
    """The hidden activations stay split over `model`: W1 is never gathered."""
    n_in, n_hidden, n_out = MLP_SIZES
    wanted = f"float32[{batch}@data,{n_hidden}@model]"
    first = [s for s in program["steps"] if s["prim"] == "dot_general" and not s["inside"]
             and s["out"] == [[batch, n_hidden]]]
    for step in first:
        if _type_dims(step["types"][-1]) != [(batch, ("data",)), (n_hidden, ("model",))]:
            _fail(f"in `{name}` the first layer's product x @ W1 has type {step['types'][-1]}; "
                  f"expected {wanted}: the hidden activations stay split over 'model' (W1 is "
                  "never gathered) and the examples over 'data'.")
    second = [s for s in program["steps"] if s["prim"] == "dot_general" and not s["inside"]
              and s["out"] == [[batch, n_out]]]
    for step in second:
        lhs, rhs = (_type_dims(t) for t in step["types"][:2])
        if lhs[-1][1] != ("model",) or rhs[0][1] != ("model",):
            _fail(f"in `{name}` the second layer's product h @ W2 multiplies {step['types'][0]} "
                  f"by {step['types'][1]}; expected h split over 'model' by columns and W2 by "
                  "rows, so that each device multiplies its own blocks and the summands are "
                  "added over 'model' (out_sharding).")
    if not first and not program["shard_maps"]:
        _fail(f"`{name}` computes no product of shape ({batch}, {n_hidden}) (x @ W1); expected "
              "the MLP's forward pass tanh(x @ W1 + b1) @ W2 + b2.")
    if program["shard_maps"]:  # a forward written with shard_map inside jit
        _operand_spec(name, program, (n_in, n_hidden), "W1", MEGATRON[0],
                      "W1 split by columns over 'model'")
        if any(s["prim"] in COLLECTIVES["all_gather"] for s in _communication(program)):
            _fail(f"`{name}` uses `all_gather`; expected the hidden activations to stay split "
                  "over 'model' (no weight is gathered).")


def _q1(ev):
    _check_mesh_2d(ev["mesh_2d"])
    mev = ev["mesh_2d"]
    (W1, b1, W2, b2), (x, _) = _lab_mlp()
    form.expect_on_mesh("x_2d", ev["x_2d"], shape=x.shape)
    _close("x_2d", ev["x_2d"]["value"], x, "the values of `x_mlp`")
    _same_mesh("x_2d", ev["x_2d"]["sharding"], "mesh_2d", mev)
    _on_mesh_as("x_2d", ev["x_2d"], ("data", None),
                "its rows split over 'data' and copies over 'model' (spec P('data', None))")
    names = ("W1", "b1", "W2", "b2")
    words = ("W1 split by columns over 'model' (spec P(None, 'model'))",
             "b1 split over 'model' (spec P('model'))",
             "W2 split by rows over 'model' (spec P('model', None))",
             "b2 replicated (spec P())")
    items = _arrays("params_2d", ev["params_2d"], 4, "the tuple (W1, b1, W2, b2) of `mlp_params`")
    for i, (item, ref, nm, spec, w) in enumerate(zip(items, (W1, b1, W2, b2), names, MEGATRON,
                                                     words)):
        _close(f"params_2d[{i}]", item["value"], ref, f"{nm} of `mlp_params`")
        _same_mesh(f"params_2d[{i}]", item["sharding"], "mesh_2d", mev)
        _on_mesh_as(f"params_2d[{i}]", item, spec, f"the Megatron layout: {w}")
    out = ev["out_2d"]
    form.expect_on_mesh("out_2d", out, shape=(MLP_BATCH, MLP_SIZES[2]))
    _close("out_2d", out["value"], _mlp_forward((W1, b1, W2, b2), x)[1],
           "forward(mlp_params, x_mlp)")
    wanted = f"float32[{MLP_BATCH}@data,{MLP_SIZES[2]}]"
    if out["typeof"] != wanted:
        _fail(f"`out_2d` has type {out['typeof']}; expected {wanted}: split over 'data', "
              "replicated over 'model'.")
    cases = _fresh_each("forward_2d", ev, [
        f"forward_2d(params, x) on new data ({batch} examples)" for batch in MLP_FRESH_BATCHES])
    for fresh, batch in zip(cases, MLP_FRESH_BATCHES):
        call = f"forward_2d(params, x) on new data ({batch} examples)"
        _array_out(call, fresh["output"], (batch, MLP_SIZES[2]))
        _close(call, fresh["output"]["value"], _mlp_forward(fresh["params"], fresh["x"])[1],
               "tanh(x @ W1 + b1) @ W2 + b2 for those inputs")
        wanted = f"float32[{batch}@data,{MLP_SIZES[2]}]"
        if fresh["output"]["typeof"] != wanted:
            _fail(f"`{call}` returned an array of type {fresh['output']['typeof']}; expected "
                  f"{wanted}: the output split over 'data' and replicated over 'model'.")
    program = _program_of("forward_2d", cases[0])
    _jitted("forward_2d", program)
    _check_first_layer("forward_2d", program, MLP_FRESH_BATCHES[0])


def _q2(ev):
    calls = [f"loss_2d(params, batch) on new data ({size} examples)"
             for size in MLP_FRESH_BATCHES]
    cases = _fresh_each("loss_2d", ev, calls)
    for fresh, call in zip(cases, calls):
        _loss_2d_values(fresh, call)
    _loss_2d_method(cases[0])


def _loss_2d_values(fresh, call):
    ref_loss, ref_grads = _mlp_loss_and_grad(fresh["params"], fresh["batch"])
    _loss_value(call, fresh["output"], ref_loss,
                "the mean over 'data' of the devices' mean losses (jax.lax.pmean, or psum "
                "divided by the size of 'data'), after one psum over 'model' of the output "
                "block", "mlp_loss(params, batch) for new params and batch")
    grad_call = "the gradient of `loss_2d` (jax.grad)"
    leaves = _arrays(grad_call, fresh["grad"], 4, "a tuple of four gradients like `params`")
    ratios = [_ratio(a["value"], e) for a, e in zip(leaves, ref_grads)]
    if all(_is_factor(k) and math.isclose(k, ratios[0], rel_tol=GRAD_RTOL) for k in ratios):
        _fail(f"{grad_call} is {ratios[0]:.3g} times the gradient of `mlp_loss`. "
              "Inside jax.shard_map, jax.grad already adds up the contributions of a "
              "parameter's copies; take the gradient of the averaged loss and do not average "
              "or sum the gradients yourself.")
    for name, leaf, exp in zip(("W1", "b1", "W2", "b2"), leaves, ref_grads):
        _close(f"{grad_call} for {name}", leaf["value"], exp,
               "the gradient of `mlp_loss` for new params and batch", rtol=GRAD_RTOL,
               atol=GRAD_ATOL)


def _loss_2d_method(fresh):
    program = _program_of("loss_2d", fresh)
    _uses_shard_map("loss_2d", program, "the per-device program written with jax.shard_map "
                    "on mesh_2d")
    for sm in program["shard_maps"]:
        if tuple(sm["axis_names"]) != MESH_2D[0] or tuple(sm["mesh_shape"]) != MESH_2D[1]:
            _fail(f"`loss_2d` runs jax.shard_map on a mesh with axes {tuple(sm['axis_names'])} "
                  f"and shape {tuple(sm['mesh_shape'])}; expected mesh_2d (4 × 2, axes "
                  "('data', 'model')).")
    n_in, n_hidden, n_out = MLP_SIZES
    B = MLP_FRESH_BATCHES[0]
    for shape, what, spec, words in (
            ((B, n_in), "x", ("data",), "x split by rows over 'data' (P('data', None))"),
            ((B, n_out), "y", ("data",), "y split by rows over 'data' (P('data', None))"),
            ((n_in, n_hidden), "W1", MEGATRON[0], "W1 split by columns over 'model'"),
            ((n_hidden,), "b1", MEGATRON[1], "b1 split over 'model'"),
            ((n_hidden, n_out), "W2", MEGATRON[2], "W2 split by rows over 'model'"),
            ((n_out,), "b2", MEGATRON[3], "b2 replicated (P())")):
        _operand_spec("loss_2d", program, shape, what, spec, words)
    moves = _communication(program)
    block = [B // MESH_2D[1][0], n_out]
    words = ("one psum over 'model' of the output block (shape "
             f"{tuple(block)}), then one mean over 'data' of the devices' losses (a scalar)")
    ok = (len(moves) == 2 and moves[0]["prim"] in COLLECTIVES["psum"]
          and moves[0]["axes"] == ["model"] and moves[0]["in"][0] == block
          and moves[1]["prim"] in COLLECTIVES["psum"] and "data" in moves[1]["axes"]
          and moves[1]["in"][0] == [] and all(m["times"] == 1 for m in moves))
    if not ok:
        _fail(f"inside its shard_map `loss_2d` communicates {len(moves)} time(s) "
              f"({_describe_moves(moves)}); expected what the task says: {words}.")


# =========================================================================== Part B: pipeline
N_STAGES = 8
LAYERS_PER_STAGE = 2
N_LAYERS = N_STAGES * LAYERS_PER_STAGE
WIDTH = 24


class MicroCase(typing.NamedTuple):
    M: int  # microbatches
    size: int  # examples per microbatch


# "for any number M of microbatches and any microbatch size" (the notebook has 8 of 4): fewer
# microbatches than stages, one microbatch of one example, more microbatches than stages. The
# first is the one whose gradient's program is read; every case's ppermute count is checked.
# Sizes differ from LAYERS_PER_STAGE: activations are told from parameter blocks by shape.
PIPELINE_CASES = (MicroCase(6, 3), MicroCase(1, 1), MicroCase(11, 5))
# Task 5's loss and gradient through the pipeline: another size than the notebook's and the
# smallest (the gradient of a long unrolled schedule is the costliest compile of the lab)
GRAD_PIPELINE_CASES = PIPELINE_CASES[:2]
STAGE_MESH = (("stage",), (N_STAGES,))


@functools.lru_cache(maxsize=None)
def _lab_layers():
    """``init_layers(jax.random.key(1))`` of the notebook, stacked: (W (16, 24, 24), b (16, 24))."""
    import jax
    import jax.numpy as jnp

    Ws, bs = [], []
    for k in jax.random.split(jax.random.key(1), N_LAYERS):
        kW, kb = jax.random.split(k)
        Ws.append(np.asarray(jax.random.normal(kW, (WIDTH, WIDTH)) / jnp.sqrt(WIDTH)))
        bs.append(np.asarray(0.1 * jax.random.normal(kb, (WIDTH,))))
    return np.stack(Ws), np.stack(bs)


def _fresh_pipeline(rng, case):
    W = (rng.normal(size=(N_LAYERS, WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
    b = (0.1 * rng.normal(size=(N_LAYERS, WIDTH))).astype(np.float32)
    x = rng.normal(size=(*case, WIDTH)).astype(np.float32)
    y = rng.normal(size=(*case, WIDTH)).astype(np.float32)
    return (W, b), x, y


def _sequential(params, x):
    """Every layer's output (the last is the network's), float64."""
    W, b = (np.asarray(a, np.float64) for a in params)
    hs = [np.asarray(x, np.float64)]
    for Wl, bl in zip(W, b):
        hs.append(np.tanh(hs[-1] @ Wl + bl))
    return hs


def _pipeline_loss_and_grad(params, x, y):
    W, _ = (np.asarray(a, np.float64) for a in params)
    hs = _sequential(params, x)
    y = np.asarray(y, np.float64)
    n = y.shape[0] * y.shape[1]
    loss = float(np.sum((hs[-1] - y) ** 2) / n)
    d_h = 2 * (hs[-1] - y) / n
    gW, gb = np.zeros_like(W), np.zeros((N_LAYERS, WIDTH))
    for layer in reversed(range(N_LAYERS)):
        d_z = d_h * (1 - hs[layer + 1] ** 2)
        gW[layer] = np.einsum("mbi,mbo->io", hs[layer], d_z)
        gb[layer] = d_z.sum((0, 1))
        d_h = d_z @ W[layer].T
    return loss, (gW, gb)


def _placed_pipeline(mesh, params, *arrays):
    return (tuple(_put(p, mesh, "stage") for p in params), *(_put(a, mesh) for a in arrays))


def _probe_stage_params(values):
    return {"mesh_stage": _mesh_evidence(values.get("mesh_stage")),
            "stage_params": _tree_evidence(values.get("stage_params"))}


def _probe_pipeline(name, grad):
    def probe_fn(values):
        import jax

        ev = form.evidence_of({name: values.get(name)})
        fn = values.get(name)
        if callable(fn):
            rng, ev["fresh"] = _rng(), []
            mesh = _mesh_for(values.get("mesh_stage"), *STAGE_MESH, ("Auto",))
            for i, case in enumerate(GRAD_PIPELINE_CASES if grad else PIPELINE_CASES):
                params, x, y = _fresh_pipeline(rng, case)
                args = _placed_pipeline(mesh, params, x, y) if grad else \
                    _placed_pipeline(mesh, params, x)
                # the forward's schedule is counted in every case, the gradient's read once
                traced = _trace(jax.grad(fn) if grad else fn, *args) if i == 0 or not grad \
                    else {}
                ev["fresh"].append({"params": list(params), "x": x, "y": y,
                                    **_call(fn, *args, jit=grad, grad=grad), **traced})
        return ev
    return probe_fn


def _q3(ev):
    mev = ev["mesh_stage"]
    form.expect_defined("mesh_stage", mev)
    if mev["kind"] != "mesh":
        _fail(f"`mesh_stage` is {form.describe(mev)}; expected a jax Mesh (jax.make_mesh).")
    if tuple(mev["axis_names"]) != STAGE_MESH[0] or tuple(mev["shape"]) != STAGE_MESH[1]:
        _fail(f"`mesh_stage` is {_mesh_words(mev)}; expected a 1-D mesh of the 8 devices with "
              "one axis named 'stage'.")
    ids = np.ravel(mev["device_ids"]).tolist()
    if ids != sorted(ids):  # `devices` lists the runtime's devices in the order of their ids
        _fail(f"`mesh_stage` holds the devices {ids} in that order; expected the 8 `devices` in "
              f"their order {sorted(ids)}, so that device k holds layers 2k and 2k + 1.")
    W, b = _lab_layers()
    items = _arrays("stage_params", ev["stage_params"], 2,
                    "the tuple (W_stack, b_stack) of the stacked weights and biases")
    for i, (item, ref, what) in enumerate(zip(items, (W, b), ("weights", "biases"))):
        name = f"stage_params[{i}]"
        if tuple(item["shape"]) != ref.shape:
            _fail(f"`{name}` has shape {tuple(item['shape'])}; expected {ref.shape}: the "
                  f"{what} of the 16 layers stacked along a new leading dimension.")
        value = np.asarray(item["value"], np.float64)
        if not np.allclose(value, ref, rtol=RTOL, atol=ATOL) and np.allclose(
                value, ref[::-1], rtol=RTOL, atol=ATOL):
            _fail(f"`{name}` holds the {what} of `layers` in reverse order; expected layer 0 "
                  "first, so that stage 0 holds the first layers.")
        _close(name, value, ref, f"the {what} of `layers` stacked in layer order")
        _same_mesh(name, item["sharding"], "mesh_stage", mev)
        _on_mesh_as(name, item, ("stage",),
                    "the leading (layer) dimension split over 'stage' (spec P('stage')), so "
                    "that device k holds layers 2k and 2k + 1")


def _param_moves(program):
    """Collectives of a parameter block: anything shaped like a weight matrix or a bias stack."""
    def is_param(shape):
        return (len(shape) >= 2 and tuple(shape[-2:]) == (WIDTH, WIDTH)) or \
            tuple(shape) in ((LAYERS_PER_STAGE, WIDTH), (N_LAYERS, WIDTH))

    return [s for s in _communication(program)
            if any(is_param(sh) for sh in s["in"] + s["out"])]


def _pipeline_layout(name, program, n_micro, micro_size):
    _uses_shard_map(name, program, "a pipeline written with jax.shard_map on mesh_stage")
    _operand_spec(name, program, (N_LAYERS, WIDTH, WIDTH), "W_stack", ("stage",),
                  "stage_params split over 'stage' (P('stage'))")
    _operand_spec(name, program, (N_LAYERS, WIDTH), "b_stack", ("stage",),
                  "stage_params split over 'stage' (P('stage'))")
    _operand_spec(name, program, (n_micro, micro_size, WIDTH), "the microbatches", (),
                  "the microbatches replicated (P())")
    moved = _param_moves(program)
    if moved:
        _fail(f"`{name}` moves parameters between devices ({_describe_moves(moved[:3])}); "
              "expected what the task says: in a pipeline the parameters stay on their stage "
              "and only activations travel (no parameter is gathered).")


def _pipeline_call(name, case):
    args = "stage_params, microbatches" + (", targets" if name == "pipeline_loss" else "")
    return (f"{name}({args}) for {case.M} new microbatch{'es' if case.M > 1 else ''} of "
            f"{case.size}")


def _q4(ev):
    name = "pipeline_forward"
    cases = _fresh_each(name, ev, [_pipeline_call(name, c) for c in PIPELINE_CASES])
    for fresh, case in zip(cases, PIPELINE_CASES):
        call = _pipeline_call(name, case)
        _array_out(call, fresh["output"], (*case, WIDTH))
        _close(call, fresh["output"]["value"], _sequential(fresh["params"], fresh["x"])[-1],
               "sequential_forward of the 16 layers applied to each microbatch")
        _on_mesh_as(call, fresh["output"], (), "the outputs replicated on every device "
                    "(out_specs=P())")
    for fresh, (M, mb) in zip(cases, PIPELINE_CASES):
        program = _program_of(name, fresh)
        _pipeline_layout(name, program, M, mb)
        shifts = [s for s in _communication(program) if s["prim"] in COLLECTIVES["ppermute"]
                  and s["in"] and math.prod(s["in"][0]) == mb * WIDTH]
        if any(s["times"] is None for s in shifts):
            _fail("`pipeline_forward` moves its activations inside a while loop, whose number "
                  "of steps cannot be read from the traced program; expected a loop of a fixed "
                  f"number of steps (a Python for loop, lax.fori_loop with fixed bounds, or "
                  f"lax.scan) of M + {N_STAGES} - 1 steps.")
        count = sum(s["times"] for s in shifts)
        steps = M + N_STAGES - 1
        if not any(s["axes"] == ["stage"] for s in shifts) or count not in (steps - 1, steps):
            _fail(f"`pipeline_forward` moves a microbatch's activations (shape ({mb}, {WIDTH})) "
                  f"with ppermute over 'stage' {count} time(s) for {M} microbatch"
                  f"{'es' if M > 1 else ''}; expected the GPipe schedule: M + L - 1 = {steps} "
                  "steps, each moving the activations one stage on (the last move may be left "
                  f"out: {steps - 1} or {steps}).")
    _jitted(name, _program_of(name, cases[0]))


def _q5(ev):
    name = "pipeline_loss"
    cases = _fresh_each(name, ev, [_pipeline_call(name, c) for c in GRAD_PIPELINE_CASES])
    grad_call = "the gradient of `pipeline_loss` (jax.grad)"
    for fresh, case in zip(cases, GRAD_PIPELINE_CASES):
        call = _pipeline_call(name, case)
        ref_loss, ref_grads = _pipeline_loss_and_grad(fresh["params"], fresh["x"], fresh["y"])
        _loss_value(call, fresh["output"], ref_loss,
                    "the mean over all examples of all microbatches of the squared error "
                    "summed over the 24 outputs", "the sequential model's loss")
        leaves = _arrays(grad_call, fresh["grad"], 2,
                         "a tuple of two gradients like `stage_params`")
        for leaf, exp, what in zip(leaves, ref_grads, ("W_stack", "b_stack")):
            _close(f"{grad_call} for {what}", leaf["value"], exp,
                   "the gradient of the sequential model's loss", rtol=GRAD_RTOL,
                   atol=GRAD_ATOL)
    fresh = cases[0]
    program = _program_of(name, fresh)
    _uses_shard_map(name, program, "a pipeline written with jax.shard_map on mesh_stage")
    for leaf, what in zip(_arrays(grad_call, fresh["grad"], 2, ""), ("W_stack", "b_stack")):
        _on_mesh_as(f"{grad_call} for {what}", leaf, ("stage",),
                    "the gradient split over 'stage' like stage_params (each device holding "
                    "only its stage's gradient)")
    _pipeline_layout(name, program, *GRAD_PIPELINE_CASES[0])
    if not any(s["prim"] in COLLECTIVES["ppermute"] for s in _communication(program)):
        _fail("the gradient of `pipeline_loss` moves no activation with ppermute; expected the "
              "loss of the pipeline of Task 4, whose gradient flows back through the stages.")


class BubbleCase(typing.NamedTuple):
    stages: int
    micro: int


class NeededCase(typing.NamedTuple):
    stages: int
    max_bubble: float

    @property
    def tie(self):
        """Whether max_bubble is exactly the idle fraction of some number of microbatches."""
        return self.stages > 1 and _bubble(self.stages, _needed(*self) - 1) == self.max_bubble


# Every grading asks these, then BUBBLE_DRAWS random pairs (stages 2..64, microbatches 1..256).
BUBBLE_CASES = (
    BubbleCase(8, 8),  # the notebook's schedule
    BubbleCase(2, 2),  # 1/3, which no float32 holds exactly
    BubbleCase(8, 1),  # one microbatch: 7 of 8 slots idle
    BubbleCase(1, 5), BubbleCase(1, 1),  # one stage: no bubble at all
)
BUBBLE_DRAWS = 12
# Every grading asks these, then NEEDED_TIE_DRAWS random ties (max_bubble exactly the fraction
# of some M, stages 2..64, M 1..400) and NEEDED_DRAWS bounds off every tie (stages 2..64, bound
# 0.01..0.95). A formula solved for M lands on either side of a tie after rounding: floor + 1
# of (L - 1)(1 - b) / b says 63 for the first case, floor((L - 1) / b) - L + 2 says 18 for the
# second, and each tie says so for about 1 in 5 (floor + 1) to 1 in 27 of the draws.
NEEDED_CASES = (
    NeededCase(8, 0.1),  # the notebook's example: bubble_fraction(8, 63) is 0.1, so 64
    NeededCase(8, 0.28),  # bubble_fraction(8, 18) is 0.28, so 19
    NeededCase(5, 0.8),  # the fraction of one microbatch (4 / 5), so 2
    NeededCase(1, 0.5),  # one stage: no bubble, and still at least one microbatch
    NeededCase(4, 0.9),  # one microbatch already does (3 / 4)
)
NEEDED_TIE_DRAWS = 4
NEEDED_DRAWS = 12
# a random bound this close to a tie could land on either side after rounding: the tie cases
# above test ties on purpose, draws keep away from them
NEEDED_TIE_GAP = 1e-6


def _bubble(stages, micro):
    """The idle fraction as the task defines it, in Python floats."""
    return (stages - 1) / (micro + stages - 1)


def _needed(stages, max_bubble):
    """The smallest M >= 1 with _bubble(stages, M) < max_bubble, compared in Python floats (so a
    bound that is exactly some M's fraction needs M + 1)."""
    m = max(1, math.floor((stages - 1) * (1 - max_bubble) / max_bubble))
    while m > 1 and _bubble(stages, m - 1) < max_bubble:
        m -= 1
    while _bubble(stages, m) >= max_bubble:
        m += 1
    return m


def _bubble_draws(rng):
    return [BubbleCase(int(L), int(M)) for L, M in zip(rng.integers(2, 65, BUBBLE_DRAWS),
                                                       rng.integers(1, 257, BUBBLE_DRAWS))]


def _needed_draws(rng):
    ties = [NeededCase(int(L), _bubble(int(L), int(M)))
            for L, M in zip(rng.integers(2, 65, NEEDED_TIE_DRAWS),
                            rng.integers(1, 401, NEEDED_TIE_DRAWS))]
    off = []
    while len(off) < NEEDED_DRAWS:
        L, bound = int(rng.integers(2, 65)), float(rng.uniform(0.01, 0.95))
        exact = (L - 1) * (1 - bound) / bound
        if abs(exact - round(exact)) > NEEDED_TIE_GAP:
            off.append(NeededCase(L, bound))
    return ties + off


def _probe_bubble(values):
    ev = form.evidence_of({k: values.get(k) for k in ("bubble_fraction", "microbatches_needed")})
    bubble, needed = values.get("bubble_fraction"), values.get("microbatches_needed")
    rng = _rng()
    fresh = {}
    if callable(bubble):
        fresh["bubble"] = _values_of(bubble, [*BUBBLE_CASES, *_bubble_draws(rng)])
    if callable(needed):
        fresh["needed"] = _values_of(needed, [*NEEDED_CASES, *_needed_draws(rng)])
    ev["fresh"] = fresh
    return ev


# A call of bubble_fraction or microbatches_needed takes microseconds (the slowest correct
# answer of the corpus, a count of the schedule's slots in a loop, well under a second); one
# that has not returned after CALL_SECONDS is a loop that never ends, and the calls after it
# are not made (the verdict stops at the first wrong case anyway)
CALL_SECONDS = 10


class _NoReturn(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds):
    """Raise _NoReturn in the block after ``seconds`` (main thread with SIGALRM only)."""
    import threading

    if not hasattr(signal, "setitimer") or threading.current_thread() is not \
            threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise _NoReturn

    previous = signal.signal(signal.SIGALRM, stop)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _values_of(fn, cases):
    found = []
    for args in cases:
        value = _value_of(fn, *args)
        found.append([*args, value])
        if value.get("kind") == "no return":
            break
    return found


def _value_of(fn, *args):
    try:
        with contextlib.redirect_stdout(io.StringIO()), _time_limit(CALL_SECONDS):
            return form.evidence(fn(*args))
    except _NoReturn:
        return {"kind": "no return", "seconds": CALL_SECONDS}
    except Exception as exc:
        return {"kind": "error", "error": _error(exc)}


# what a plain Python number may also be: NumPy's 64-bit floats are Python floats, and its
# integers hold counts exactly; a 32-bit float keeps about 7 digits of a fraction
EXACT_NUMBER_TYPES = ("int", "float", "float64", "int8", "int16", "int32", "int64", "uint8",
                      "uint16", "uint32", "uint64")


def _number(name, ev, integer=False):
    """(value, what is wrong with its type or None) of what a function returned: a plain Python
    number (or a NumPy scalar of the same precision) has no type problem; fails where there is
    no number at all. The type problem is named only once the value is right (``_typed``)."""
    wanted = "an int" if integer else "a float"
    if ev["kind"] == "error":
        _fail(f"`{name}` raised {ev['error']}; it should return {wanted}.")
    if ev["kind"] == "no return":
        _fail(f"`{name}` did not return within {ev['seconds']:g} s: a loop that never ends (a "
              "count that never moves, or a fraction that never falls below the bound); "
              f"expected {wanted} at once.")
    if ev["kind"] == "number" and ev["type"] in EXACT_NUMBER_TYPES and (ev["is_int"]
                                                                        or not integer):
        return ev["value"], None
    if ev["kind"] in ("array", "ndarray") and ev["shape"] == [] and "value" in ev:
        what = "a jax.Array" if ev["kind"] == "array" else "a NumPy array"
        return float(ev["value"]), (
            f"`{name}` returned {what} of shape () and dtype {ev['dtype']} (value "
            f"{float(ev['value']):.9g}), not a plain Python number; expected {wanted}, as the "
            "task asks: both functions take and return plain Python numbers (convert with "
            f"{'int' if integer else 'float'}(...), or compute with Python numbers: "
            "float32 keeps only about 7 digits of a fraction).")
    if ev["kind"] == "number" and not integer:
        return ev["value"], (
            f"`{name}` returned a NumPy {ev['type']} ({ev['value']:.9g}), not a plain Python "
            f"number; expected {wanted}, as the task asks (convert with float(...): "
            f"{ev['type']} keeps too few digits of a fraction).")
    if ev["kind"] == "number":
        return ev["value"], f"`{name}` returned {form.describe(ev)} (a {ev['type']}); expected {wanted}."
    _fail(f"`{name}` returned {form.describe(ev)}; expected {wanted}.")


def _typed(value, problem, expected, rel_tol):
    """Whether ``value`` is ``expected``; a right value of the wrong type fails with its type
    problem (a 32-bit float is right when it holds ``expected`` to its own precision)."""
    if problem is None:
        return math.isclose(value, expected, rel_tol=rel_tol, abs_tol=1e-12)
    if math.isclose(value, expected, rel_tol=max(rel_tol, FLOAT32_RTOL), abs_tol=1e-12):
        _fail(problem)
    return False


# a float32 holds about 7 significant digits
FLOAT32_RTOL = 1e-6


def _q6(ev):
    form.expect_callable("bubble_fraction", ev["bubble_fraction"])
    for L, M, out in ev["fresh"]["bubble"]:
        call = f"bubble_fraction({L}, {M})"
        value, problem = _number(call, out)
        expected = _bubble(L, M)
        if not _typed(value, problem, expected, 1e-9):
            # (at one microbatch, L - 1 over 1 says nothing about how it was computed)
            extra = (" That is the idle time over the busy time; the task asks for the idle "
                     "slots over all slots of the schedule." if M > 1 and math.isclose(
                         value, (L - 1) / M, rel_tol=1e-9) else "")
            _fail(f"`{call}` is {value:.9g}; expected {expected:.9g}, the idle fraction of "
                  f"{M} microbatch{'es' if M > 1 else ''} through {L} stage"
                  f"{'s' if L > 1 else ''}: (L - 1) / (M + L - 1).{extra}")
    form.expect_callable("microbatches_needed", ev["microbatches_needed"])
    for L, bound, out in ev["fresh"]["needed"]:
        call = f"microbatches_needed({L}, {bound!r})"
        value, problem = _number(call, out, integer=True)
        expected = _needed(L, bound)
        if _typed(value, problem, expected, 0.0):
            continue
        if value < 1:
            _fail(f"`{call}` is {value:g}; expected {expected}: at least one microbatch, even "
                  f"where {'one stage leaves no bubble at all' if L == 1 else 'the bound is met'}"
                  ".")
        at = _bubble(L, value)
        if at == bound:
            why = (f"bubble_fraction({L}, {value:g}) is exactly {bound!r}, which is not "
                   f"strictly less than {bound!r}, so {value:g} microbatches are not enough")
        elif at < bound:
            why = (f"{expected} microbatches already give {_bubble(L, expected):.9g}, strictly "
                   f"less than {bound!r}")
        else:
            why = (f"{value:g} microbatches give {at:.9g}, which is not strictly less than "
                   f"{bound!r}")
        _fail(f"`{call}` is {value:g}; expected {expected}, the smallest number of microbatches "
              f"M whose idle fraction (L - 1) / (M + L - 1) is strictly less than {bound!r}: "
              f"{why}.")


# =========================================================================== Part C: experts
N_EXPERTS = 8
D_MODEL, D_HIDDEN = 16, 32
EXPERT_CAPACITY = 2


class RouteCase(typing.NamedTuple):
    T: int  # tokens
    D: int  # features
    E: int  # experts
    capacity: int


# "for any T, D and E": more experts than the lab's 8 (and not a power of two), fewer, one;
# one token; a capacity of 0 (every token dropped) and one no expert reaches. Each draw makes
# the case show what it is for (_route_draw): a token dropped wherever the capacity allows one,
# and the last expert chosen by two tokens or more wherever there are two tokens, so that an
# answer written for 8 experts (one_hot(..., 8), range(8)) miscounts whenever E > 8.
ROUTE_CASES = (
    RouteCase(T=20, D=16, E=8, capacity=2),
    RouteCase(T=13, D=7, E=5, capacity=3),
    RouteCase(T=40, D=6, E=11, capacity=2),
    RouteCase(T=1, D=3, E=1, capacity=0),
    RouteCase(T=9, D=1, E=3, capacity=9),
)
# tokens per device in moe_layer: the Part C notebook has 4; one token per device is the least
MOE_TOKENS_PER_DEVICE = (12, 1)
# A token whose two best experts score within this margin could go either way in float32.
ROUTER_MARGIN = 1e-3


def _softmax(logits):
    z = np.exp(logits - logits.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def _route(tokens, router_weights, capacity):
    """Top-1 routing with capacity, float64: (expert, gate, slot)."""
    probs = _softmax(np.asarray(tokens, np.float64) @ np.asarray(router_weights, np.float64))
    expert = probs.argmax(-1)
    slot = np.zeros(len(expert), int)
    seen = {}
    for t, e in enumerate(expert):
        slot[t] = seen.get(e, 0)
        seen[e] = slot[t] + 1
    gate = np.where(slot < capacity, probs[np.arange(len(expert)), expert], 0.0)
    return expert, gate, slot


def _clear_draw(rng, tokens_shape, n_experts):
    """Tokens and router weights whose every token's best expert leads by ROUTER_MARGIN."""
    while True:
        tokens = rng.normal(size=tokens_shape).astype(np.float32)
        router = rng.normal(size=(tokens_shape[1], n_experts)).astype(np.float32)
        logits = np.sort(tokens.astype(np.float64) @ router, axis=-1)
        if n_experts < 2 or np.all(logits[:, -1] - logits[:, -2] > ROUTER_MARGIN):
            return tokens, router


def _route_draw(rng, case):
    """A clear draw (_clear_draw) for ``case`` that drops a token wherever its capacity lets
    one be dropped, and gives the last expert two tokens or more wherever there are two."""
    while True:
        tokens, router = _clear_draw(rng, (case.T, case.D), case.E)
        expert, _, slot = _route(tokens, router, case.capacity)
        if (case.capacity >= case.T or np.any(slot >= case.capacity)) and \
                (case.T < 2 or np.sum(expert == case.E - 1) >= 2):
            return tokens, router


def _probe_route(values):
    import jax

    ev = form.evidence_of({"route": values.get("route")})
    fn = values.get("route")
    if callable(fn):
        rng, cases = _rng(), []
        for case in ROUTE_CASES:
            tokens, router = _route_draw(rng, case)
            found = {"tokens": tokens, "router": router, "capacity": case.capacity,
                     **_call(jax.jit(fn, static_argnums=2), tokens, router, case.capacity)}
            if "error" in found:
                found["eager"] = _call(fn, tokens, router, case.capacity)
            cases.append(found)
        ev["fresh"] = cases
    return ev


def _q7(ev):
    form.expect_callable("route", ev["route"])
    for case in ev["fresh"]:
        tokens, capacity = case["tokens"], case["capacity"]
        T, E = len(tokens), case["router"].shape[1]
        call = (f"route(tokens, router_weights, {capacity}) for {T} new tokens and {E} experts "
                "under jax.jit")
        if "error" in case:
            eager = case.get("eager", {})
            how = ("It works without jax.jit, so some step needs concrete values: use jnp "
                   "operations on the arrays" if "error" not in eager else
                   "It fails without jax.jit too")
            _fail(f"`{call}` raised {case['error']}. {how}; expected it to work under jax.jit "
                  "with capacity a static int.")
        out = _arrays(call, case["output"], 3, "a tuple (expert, gate, slot) of three arrays")
        expert, gate, slot = _route(tokens, case["router"], capacity)
        for what, item in (("expert", out[0]), ("slot", out[2])):
            if tuple(item["shape"]) != (T,) or "int" not in item["dtype"]:
                _fail(f"`{call}` returned {what} as an array of shape {tuple(item['shape'])} and "
                      f"dtype {item['dtype']}; expected integers of shape ({T},).")
        if not np.array_equal(out[0]["value"], expert):
            _fail(f"`{call}` returned the wrong expert for some tokens: expected the index of "
                  "the largest score tokens @ router_weights.")
        found_slot = np.asarray(out[2]["value"])
        if not np.array_equal(found_slot, slot):
            lab = expert < N_EXPERTS
            extra = (" (they start at 1; the first token of an expert has slot 0)"
                     if np.array_equal(found_slot, slot + 1) else
                     f" (right for the tokens of experts 0 to {N_EXPERTS - 1}, wrong for those "
                     f"of experts {N_EXPERTS} to {E - 1}: count over all E = {E} experts, "
                     "router_weights.shape[1], not the lab's 8)"
                     if E > N_EXPERTS and np.array_equal(found_slot[lab], slot[lab]) else "")
            _fail(f"`{call}` returned the wrong slots{extra}: expected, for each token, how "
                  "many tokens before it chose the same expert.")
        probs = _softmax(tokens.astype(np.float64) @ case["router"])[np.arange(T), expert]
        found_gate = np.asarray(out[1]["value"], np.float64)
        if found_gate.shape == gate.shape and np.allclose(found_gate, probs, rtol=RTOL,
                                                          atol=ATOL) and np.any(gate != probs):
            _fail(f"`{call}` keeps the gate of tokens whose slot is {capacity} or more; "
                  "expected 0 for those dropped tokens.")
        _close(f"the gate that `{call}` returned", found_gate, gate,
               "the softmax probability of the chosen expert, 0 for a dropped token")


def _probe_moe(values):
    ev = form.evidence_of({"moe_layer": values.get("moe_layer")})
    fn = values.get("moe_layer")
    if callable(fn):
        import jax

        rng = _rng()
        mesh = jax.make_mesh((N_EXPERTS,), ("expert",),
                             axis_types=(jax.sharding.AxisType.Auto,), devices=_devices())
        ev["fresh"] = []
        for i, per_device in enumerate(MOE_TOKENS_PER_DEVICE):
            T = N_EXPERTS * per_device
            while True:
                tokens, router = _clear_draw(rng, (T, D_MODEL), N_EXPERTS)
                gates = _moe_reference_gates(tokens, router)
                # a token dropped wherever a device has more tokens than the capacity
                if per_device <= EXPERT_CAPACITY or np.any(gates == 0):
                    break
            W_in = (rng.normal(size=(N_EXPERTS, D_MODEL, D_HIDDEN)) / 4).astype(np.float32)
            W_out = (rng.normal(size=(N_EXPERTS, D_HIDDEN, D_MODEL)) / 6).astype(np.float32)
            args = (_put(tokens, mesh, "expert"), _put(router, mesh),
                    _put(W_in, mesh, "expert"), _put(W_out, mesh, "expert"))
            # the program is read from the first case; the others check the numbers
            ev["fresh"].append({"tokens": tokens, "router": router, "W_in": W_in,
                                "W_out": W_out, **_call(fn, *args),
                                **(_trace(fn, *args) if i == 0 else {})})
    return ev


def _moe_reference_gates(tokens, router):
    groups = np.split(np.asarray(tokens), N_EXPERTS)
    return np.concatenate([_route(g, router, EXPERT_CAPACITY)[1] for g in groups])


def _moe_reference(tokens, router, W_in, W_out):
    """The dense layer, float64: each device's tokens routed with its own capacity."""
    out = []
    for group in np.split(np.asarray(tokens, np.float64), N_EXPERTS):
        expert, gate, _ = _route(group, router, EXPERT_CAPACITY)
        W1 = np.asarray(W_in, np.float64)[expert]
        W2 = np.asarray(W_out, np.float64)[expert]
        hidden = np.maximum(np.einsum("td,tdh->th", group, W1), 0.0)
        out.append(gate[:, None] * np.einsum("th,thd->td", hidden, W2))
    return np.concatenate(out)


def _expert_weight(shape):
    return tuple(shape[-2:]) in ((D_MODEL, D_HIDDEN), (D_HIDDEN, D_MODEL)) and \
        math.prod(shape[:-2]) == 1


def _q8(ev):
    cases = _fresh_each("moe_layer", ev, [
        f"moe_layer(tokens, router_weights, W_in, W_out) for {n} new token{'s' if n > 1 else ''} "
        "per device" for n in MOE_TOKENS_PER_DEVICE])
    for fresh in cases:
        T = len(fresh["tokens"])
        call = (f"moe_layer(tokens, router_weights, W_in, W_out) for {T // N_EXPERTS} new "
                f"token{'s' if T > N_EXPERTS else ''} per device")
        out = fresh["output"]
        _array_out(call, out, (T, D_MODEL))
        expected = _moe_reference(fresh["tokens"], fresh["router"], fresh["W_in"],
                                  fresh["W_out"])
        _close(call, out["value"], expected,
               "each token's gate times its expert's expert_mlp output (0 for tokens over "
               f"EXPERT_CAPACITY = {EXPERT_CAPACITY} of an expert on their device)")
        sev = out["sharding"]
        axis = (sev.get("axis_names") or ["expert"])[0]
        _on_mesh_as(call, out, (axis,), "split by rows like tokens (out_specs=P('expert'))")
    fresh = cases[0]
    T = len(fresh["tokens"])
    program = _program_of("moe_layer", fresh)
    _uses_shard_map("moe_layer", program, "the per-device program written with jax.shard_map "
                    "on mesh_expert")
    for shape, what, spec, words in (
            ((T, D_MODEL), "tokens", ("expert",), "tokens split by rows over 'expert'"),
            ((D_MODEL, N_EXPERTS), "router_weights", (), "router_weights replicated (P())"),
            ((N_EXPERTS, D_MODEL, D_HIDDEN), "W_in", ("expert",),
             "W_in split over its leading (expert) dimension"),
            ((N_EXPERTS, D_HIDDEN, D_MODEL), "W_out", ("expert",),
             "W_out split over its leading (expert) dimension")):
        _operand_spec("moe_layer", program, shape, what, spec, words)
    moves = _communication(program)
    words = ("two jax.lax.all_to_all over 'expert' (the tokens out to their experts, the "
             "results back) and no other collective")
    if len(moves) != 2 or any(m["prim"] != "all_to_all" or m["axes"] != ["expert"]
                              or m["times"] != 1 for m in moves):
        _fail(f"inside its shard_map `moe_layer` communicates {len(moves)} time(s) "
              f"({_describe_moves(moves)}); expected what the task says: {words}.")
    slots = N_EXPERTS * EXPERT_CAPACITY * D_MODEL  # one device's (E, capacity, D) buffer
    for move, what in zip(moves, ("tokens out to the experts", "results back")):
        shape = tuple(move["in"][0]) if move["in"] else ()
        if math.prod(shape) != slots:
            _fail(f"`moe_layer` sends the {what} with an all_to_all of an array of shape {shape} "
                  f"on each device ({math.prod(shape)} numbers); expected what the task says: "
                  f"buffers of E × EXPERT_CAPACITY slots, shape ({N_EXPERTS}, {EXPERT_CAPACITY}, "
                  f"{D_MODEL}) ({slots} numbers), whatever the number of tokens: the capacity "
                  "bounds what each device sends to each expert.")
    body = [s for s in program["steps"] if s["inside"]]
    sent, returned = (i for i, s in enumerate(body) if s["prim"] in COMMUNICATION)
    experts = [i for i, s in enumerate(body) if s["prim"] == "dot_general"
               and any(_expert_weight(sh) for sh in s["in"])]
    if not experts or not all(sent < i < returned for i in experts):
        _fail("`moe_layer` does not apply the experts between its two all_to_all; expected "
              "what the task says: the first all_to_all sends the tokens to their experts' "
              "devices, each device applies its expert (W_in, W_out) to what it received, "
              "and the second all_to_all sends the results back.")


# ---- Part D: one program, several processes (q9_multi_process)
#
# The answer is a program, not a function: `train_script` holds the source of a training
# script that two processes run together. The probe writes it to a fresh folder beside the
# lab's model module (PD_MODEL_SOURCE, the text the notebook writes to pd_model.py) and runs it
# again, as two processes joined by jax.distributed, on new data: N rows (N divisible by 8,
# another N than the notebook's) and new initial parameters. Each process runs under a small
# boot script (PD_BOOT_SOURCE) that records, as plain data, what the checks cannot read from
# the result alone: the jax.distributed.initialize calls, every jax.make_array_from_process_local
# _data call (its local rows and the array it made: global shape, devices, processes), and every
# file the process opened for writing at the output path. The verdict recomputes the training in
# float64 NumPy on one process and compares.

PD_PROCESSES = 2
PD_LOCAL_DEVICES = 4  # CPU devices per process: one mesh of 8 across both
PD_LAYER_SIZES = (1, 64, 64, 1)
PD_STEPS = 20
PD_STEP_SIZE = 0.02
# another batch size than the notebook's 256 rows: a script that hard-codes 256 (or 128 per
# process) fails; 320 rows are 160 per process and 40 per device
PD_FRESH_ROWS = 320
# trained parameters, float32 on 8 devices in 2 processes against float64 on one: measured
# 1.2e-7 apart at most; the nearest wrong training (one process's half of the data, 8x the
# step, over 300 draws) lies 2.7e-2 away
PD_TRAIN_RTOL = 1e-4
PD_TRAIN_ATOL = 1e-5
# the re-run takes ~5 s on one core, ~12 s at half a core; a script that waits for a process that
# never comes (jax.distributed.initialize waits 300 s by default) is stopped at PD_TIMEOUT
PD_TIMEOUT = 120
PD_GRACE = 5  # seconds the other process gets to finish once one process failed
# Two processes that wait for each other (a collective one of them never reaches, arrays of
# other global shapes in the two, one process gone while the other waits) use no CPU: measured,
# a pair stuck in a mismatched all-reduce used 0.005 CPU-s a second each, until XLA gave up
# after ~30 s (a process that never connects: PD_TIMEOUT). A training pair uses a core, and at
# Gradescope's half a core beside the kernel still ~0.15 CPU-s a second each. So the pair is
# stopped once its running processes together used less than PD_STUCK_CPU seconds of CPU in
# PD_STUCK_SECONDS: the student hears why in seconds, not minutes (where /proc cannot be read,
# only PD_TIMEOUT stops them)
PD_STUCK_SECONDS = 10
PD_STUCK_CPU = 0.1
PD_LOG_TAIL = 4000  # characters of each process's output kept as evidence
PD_SCRIPT = "pd_train.py"
PD_MODEL = "pd_model.py"
PD_BOOT = "pd_boot.py"
# gloo's report of every connection it makes, written a piece at a time by several threads at
# once (so one message can be cut by another's pieces or by newlines): not the student's output;
# any run of its phrases and the numbers between them goes
PD_GLOO_WORDS = (r"\[Gloo\]\s+Rank|is\s+connected\s+to|peer\s+ranks\."
                 r"|Expected\s+number\s+of\s+connected\s+peer\s+ranks\s+is\s*:")
PD_GLOO_NOISE = re.compile(
    rf"[ \t]*(?:{PD_GLOO_WORDS})"
    rf"(?:\s*(?:{PD_GLOO_WORDS})|\s*\d+(?=\s*(?:{PD_GLOO_WORDS})|[ \t]*(?:\n|\Z))"
    r"|[ \t]*\d+)*(?:[ \t]*\n(?=[ \t]*\n))*[ \t]*")

# pd_model.py exactly as the notebook writes it (a test compares the two)
PD_MODEL_SOURCE = '''\
"""Lab 3's regression network, for the training script of Part D."""
import jax.numpy as jnp
import numpy as np

LAYER_SIZES = [1, 64, 64, 1]
STEPS = 20
STEP_SIZE = 0.02


def forward(params, x):
    for w, b in params[:-1]:
        x = jnp.tanh(jnp.dot(x, w) + b)
    final_w, final_b = params[-1]
    return jnp.dot(x, final_w) + final_b


def loss(params, x, y):
    return jnp.mean(jnp.square(forward(params, x) - y))


def load_params(path):
    """The list of (W, b) pairs stored in the .npz file `path`, as NumPy arrays."""
    with np.load(path) as stored:
        return [(stored[f"W{i}"], stored[f"b{i}"]) for i in range(len(LAYER_SIZES) - 1)]


def save_params(path, params):
    """Store a list of (W, b) pairs in the .npz file `path`.

    Every W and b must be readable in this process with np.asarray: a jax.Array replicated on
    every device is, one split across the devices of several processes is not."""
    arrays = {}
    for i, (W, b) in enumerate(params):
        arrays[f"W{i}"], arrays[f"b{i}"] = np.asarray(W), np.asarray(b)
    np.savez(path, **arrays)
'''

# Runs in each process of the re-run: `python pd_boot.py RECORD SCRIPT ARGS...`. It records
# what the script does with JAX (see above) into RECORD when the process exits, then runs the
# script as __main__ with sys.argv = [SCRIPT, *ARGS]. The last of ARGS is the output file.
PD_BOOT_SOURCE = r'''
import atexit
import json
import os
import runpy
import sys

record_path, script, *args = sys.argv[1:]
out_path = os.path.realpath(args[-1])
record = {"initialize": [], "local_data": [], "writes": [], "notes": [], "config": [],
          "placed": [], "printed": ""}


def _writing(mode, flags):
    if isinstance(mode, str):
        return any(c in mode for c in "waxX+")
    return isinstance(flags, int) and bool(flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))


def _audit(event, details):
    try:
        if event == "open" and isinstance(details[0], (str, bytes)) \
                and _writing(details[1], details[2]):
            path = os.path.realpath(os.fsdecode(details[0]))
        elif event in ("os.rename", "os.replace", "os.link", "os.symlink", "shutil.move",
                       "shutil.copyfile"):
            path = os.path.realpath(os.fsdecode(details[1]))
        else:
            return
        if path.startswith(out_path) and path not in record["writes"]:
            record["writes"].append(path)
    except Exception:
        pass


sys.addaudithook(_audit)

import jax
import numpy as np

_initialize = jax.distributed.initialize
_make = jax.make_array_from_process_local_data


_update = jax.config.update
_device_put = jax.device_put


def initialize(*a, **k):
    record["initialize"].append({"args": [repr(v) for v in a],
                                 "kwargs": {n: repr(v) for n, v in k.items()}})
    return _initialize(*a, **k)


def update(*a, **k):
    name = a[0] if a else k.get("name")
    value = a[1] if len(a) > 1 else k.get("val")
    record["config"].append({"name": str(name), "value": repr(value),
                             "after_initialize": bool(record["initialize"])})
    return _update(*a, **k)


def device_put(*a, **k):
    placed = _device_put(*a, **k)
    try:
        found = []
        for x in jax.tree.leaves(placed):
            if isinstance(x, jax.Array):
                found.append({"shape": [int(n) for n in x.shape],
                              "replicated": bool(x.sharding.is_fully_replicated),
                              "devices": len(x.sharding.device_set),
                              "processes": sorted({int(d.process_index)
                                                   for d in x.sharding.device_set})})
        record["placed"].append(found)
    except Exception as exc:
        record["notes"].append(f"recording device_put: {exc!r}")
    return placed


class _Printed:
    """sys.stdout, keeping the start of what the script prints."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        if len(record["printed"]) < 2000:
            record["printed"] += str(text)
        return self.stream.write(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _facts():
    return {"process_index": jax.process_index(), "process_count": jax.process_count(),
            "device_count": jax.device_count(), "local_device_count": jax.local_device_count()}


def make_array_from_process_local_data(sharding, local_data, *a, **k):
    made = _make(sharding, local_data, *a, **k)
    try:
        local = np.asarray(local_data)
        shape = tuple(int(n) for n in made.shape)
        record["local_data"].append({
            "shape": list(local.shape), "dtype": str(local.dtype),
            "values": local.ravel().tolist() if local.size <= 100_000 else None,
            "global_shape": list(shape),
            "shard_shape": [int(n) for n in made.sharding.shard_shape(shape)],
            "devices": len(made.sharding.device_set),
            "processes": sorted({int(d.process_index) for d in made.sharding.device_set}),
            **_facts()})
    except Exception as exc:
        record["notes"].append(f"recording make_array_from_process_local_data: {exc!r}")
    return made


jax.distributed.initialize = initialize
jax.make_array_from_process_local_data = make_array_from_process_local_data
jax.config.update = update
jax.device_put = device_put
sys.stdout = _Printed(sys.stdout)


def _write_record():
    try:
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            record["at_exit"] = _facts()
    except Exception as exc:
        record["notes"].append(f"at exit: {exc!r}")
    with open(record_path, "w") as f:
        json.dump(record, f)


atexit.register(_write_record)  # after jax's own atexit hooks: it runs before them
sys.argv = [script, *args]
runpy.run_path(script, run_name="__main__")
'''


def _pd_reference(init, x, y, step_size=PD_STEP_SIZE, steps=PD_STEPS):
    """Single-process training of Lab 3's network in float64: ``steps`` steps of gradient
    descent on the mean squared error over all of ``x``, ``y`` (backpropagation by hand)."""
    params = [(np.asarray(W, np.float64), np.asarray(b, np.float64))
              for W, b in init]
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    for _ in range(steps):
        acts = [x]
        for W, b in params[:-1]:
            acts.append(np.tanh(acts[-1] @ W + b))
        delta = 2 * (acts[-1] @ params[-1][0] + params[-1][1] - y) / y.size
        grads = []
        for i in reversed(range(len(params))):
            grads.append((acts[i].T @ delta, delta.sum(axis=0)))
            if i:
                delta = (delta @ params[i][0].T) * (1 - acts[i] ** 2)
        params = [(W - step_size * dW, b - step_size * db)
                  for (W, b), (dW, db) in zip(params, reversed(grads))]
    return params


# --------------------------------------------------------------------------- Part D probe
def _pd_fresh_data(rng, rows=PD_FRESH_ROWS):
    """New data around Lab 3's curve, sorted by x: each process's share covers another part of
    the curve, so training on one share alone ends far from training on all rows."""
    while True:  # every value once in its column: the rows a process passes are read back
        x = np.sort(rng.uniform(0.0, 2.0, size=(rows, 1)), axis=0).astype(np.float32)
        y = (np.sin(6 * x) - 0.5 * x ** 2 + 0.1 * rng.normal(size=x.shape)).astype(np.float32)
        if len(np.unique(x)) == rows and len(np.unique(y)) == rows:
            break
    init = {}
    for i, (n_in, n_out) in enumerate(zip(PD_LAYER_SIZES[:-1], PD_LAYER_SIZES[1:])):
        init[f"W{i}"] = (0.1 * rng.normal(size=(n_in, n_out))).astype(np.float32)
        init[f"b{i}"] = (0.1 * rng.normal(size=(n_out,))).astype(np.float32)
    return x, y, init


def _pd_free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pd_env():
    """The kernel's environment for the processes: CPU devices only, no device count forced
    from outside (the script sets its own), output unbuffered."""
    # and no persistent compilation cache: its key leaves out the CPU collectives, so a script
    # without gloo loaded an executable compiled with gloo (the warm-up's, the solution's) and
    # both processes aborted (signal 6, no message) where they raise "Multiprocess computations
    # aren't implemented" without the cache (measured 2026-11-26, JAX 0.10.2)
    env = {k: v for k, v in os.environ.items() if k not in (
        "XLA_FLAGS", "FORCE_COLOR", "JAX_COMPILATION_CACHE_DIR", "JAX_ENABLE_COMPILATION_CACHE")
        and not k.startswith("JAX_PERSISTENT_CACHE_")}
    # plain tracebacks: Python 3.13 colours them where a kernel's environment asks for colour
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PYTHON_COLORS="0", NO_COLOR="1")
    # XLA's CPU collective threads starve without it on a core or two: 300 unblocked steps of a
    # correct script hung in 3 of 3 runs on one core, and finished in 3 of 3 with it
    env.setdefault("PJRT_NPROC", "16")
    return env


def _pd_cpu_seconds(pids):
    """CPU seconds (user and system, every thread) the processes ``pids`` have used, read from
    /proc; None where it cannot be read."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return None
    return total


def _pd_run_processes(argvs, cwd, logs, timeout=PD_TIMEOUT):
    """Start one process per argv, all at once; wait until all exit, one fails (the others get
    PD_GRACE seconds more), those still running are stuck waiting for each other (PD_STUCK_*)
    or ``timeout`` passes; kill what is left. Returns plain data."""
    procs = []
    try:
        for argv, log in zip(argvs, logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen(
                    argv, cwd=cwd, env=_pd_env(), stdout=out, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True))
        start = time.monotonic()
        deadline, first_failed, stuck = start + timeout, None, None
        progress = None  # (the running processes, when they last used the CPU, its total then)
        # poll every process each round (any() would stop at the first one still running)
        while None in [p.poll() for p in procs] and time.monotonic() < deadline:
            if first_failed is None:
                failed = [i for i, p in enumerate(procs) if p.returncode]
                if failed:
                    first_failed = failed[0]
                    deadline = min(deadline, time.monotonic() + PD_GRACE)
            now = time.monotonic()
            running = tuple(p.pid for p in procs if p.returncode is None)
            cpu = _pd_cpu_seconds(running)
            if cpu is not None and first_failed is None:
                if progress is None or progress[0] != running or cpu - progress[2] >= PD_STUCK_CPU:
                    progress = (running, now, cpu)
                elif now - progress[1] >= PD_STUCK_SECONDS:
                    stuck = round(now - progress[1], 1)
                    break
            time.sleep(0.05)
        if first_failed is None:
            failed = [i for i, p in enumerate(procs) if p.poll()]
            first_failed = failed[0] if failed else None
        running = [i for i, p in enumerate(procs) if p.poll() is None]
        seconds = time.monotonic() - start
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    p.kill()
                p.wait()
    return {"returncodes": [p.returncode for p in procs], "still_running": running,
            "timed_out": bool(running) and first_failed is None and stuck is None,
            "stuck": stuck if running and first_failed is None else None,
            "first_failed": first_failed, "seconds": round(seconds, 2)}


def _pd_read_log(path):
    try:
        text = open(path, errors="replace").read()
    except OSError:
        return ""
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)
    # a message may span lines (another thread's newline inside it): match the whole text,
    # then drop the lines that held nothing else
    marked = PD_GLOO_NOISE.sub("\0", text)
    lines = [(line.replace("\0", ""), line) for line in marked.splitlines(True)]
    return _pd_tail("".join(kept for kept, line in lines if kept.strip() or "\0" not in line))


def _pd_tail(text):
    """The end of a log; when more output came after its last Python exception than the tail
    holds, that exception instead (the traceback's header, its frames in the student's script,
    the exception line): under load the runtime can abort a process after it raised (signal 6
    and a native stack dump, which says nothing to a student), and the verdict saw only the dump."""
    start = text.rfind("Traceback (most recent call last)")
    if start == -1 or start >= len(text) - PD_LOG_TAIL:
        return text[-PD_LOG_TAIL:]
    lines = text[start:].splitlines(True)
    end = next((k for k in range(1, len(lines))
                if lines[k].strip() and not lines[k][0].isspace()), None)
    if end is None:
        return text[-PD_LOG_TAIL:]
    return (lines[0] + "".join(ln for ln in lines[1:end] if PD_SCRIPT in ln)
            + lines[end])[-PD_LOG_TAIL:]


def _pd_free_kernel_memory():
    """Free the kernel before two more JAX processes start beside it: measured on the lab's
    solution, the kernel went from 393 to 143 MiB (malloc_trim alone: 364), which is what lets
    the kernel, the grader and the two processes fit a 768 MB container."""
    form.free_kernel_memory()


def _pd_rerun(script):
    """Run ``script`` as the task says, on new data, under the recording boot script."""
    _pd_free_kernel_memory()
    rng = _rng()
    x, y, init = _pd_fresh_data(rng)
    folder = tempfile.mkdtemp(prefix="jaxlab-q9-")
    try:
        paths = {name: os.path.join(folder, name) for name in
                 (PD_SCRIPT, PD_MODEL, PD_BOOT, "data.npz", "params.npz")}
        for name, text in ((PD_SCRIPT, script), (PD_MODEL, PD_MODEL_SOURCE),
                           (PD_BOOT, PD_BOOT_SOURCE)):
            with open(paths[name], "w") as f:
                f.write(text)
        np.savez(paths["data.npz"], x=x, y=y, **init)
        coordinator = f"127.0.0.1:{_pd_free_port()}"
        records = [os.path.join(folder, f"record-{i}.json") for i in range(PD_PROCESSES)]
        logs = [os.path.join(folder, f"log-{i}.txt") for i in range(PD_PROCESSES)]
        argvs = [[sys.executable, paths[PD_BOOT], records[i], paths[PD_SCRIPT], coordinator,
                  str(PD_PROCESSES), str(i), paths["data.npz"], paths["params.npz"]]
                 for i in range(PD_PROCESSES)]
        fresh = {"x": x, "y": y, "init": init, "folder": folder,
                 "timeout": PD_TIMEOUT, **_pd_run_processes(argvs, folder, logs, PD_TIMEOUT),
                 "logs": [_pd_read_log(log) for log in logs], "records": []}
        for path in records:
            try:
                with open(path) as f:
                    fresh["records"].append(json.load(f))
            except (OSError, ValueError):
                fresh["records"].append(None)
        fresh["saved"] = None
        if os.path.exists(paths["params.npz"]):
            try:
                with np.load(paths["params.npz"], allow_pickle=False) as saved:
                    fresh["saved"] = {k: np.array(saved[k]) for k in saved.files}
            except Exception as exc:
                fresh["saved_error"] = f"{type(exc).__name__}: {exc}"[:300]
        return fresh
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _pd_probe(values):
    ev = form.evidence_of({"train_script": values.get("train_script")})
    script = values.get("train_script")
    if type(script) is str and script.strip():
        ev["fresh"] = _pd_rerun(script)
    return ev


# --------------------------------------------------------------------------- Part D verdict
def _pd_fail(message):
    raise AssertionError(message)


PD_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(?::\s|$)")
# what a failure means where its words alone would not say it (error text -> hint)
PD_HINTS = (
    ("Multiprocess computations aren't implemented",
     " JAX's CPU backend needs the gloo collectives to compute across processes: "
     "jax.config.update('jax_cpu_collectives_implementation', 'gloo') before "
     "jax.distributed.initialize."),
)


def _pd_error_of(log, folder):
    """The exception a process's output ends with, and the line of the script it came from."""
    lines = log.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        last = [ln.strip() for ln in lines if ln.strip()]
        return (f"`{last[-1][:300]}`" if last else "no message"), None
    block = [ln for ln in lines[starts[-1]:] if ln and not ln[0].isspace() and not ln.startswith(
        ("Traceback", "The above exception", "During handling", "---"))]
    # JAX prints a note after the exception ("For simplicity, JAX has removed ..."): the
    # exception is the last line that reads `Name: message` (or a bare name)
    exception = next((ln for ln in reversed(block) if PD_EXCEPTION_LINE.match(ln)),
                     block[-1] if block else "an exception")
    where = None
    script = re.escape(os.path.join(folder, PD_SCRIPT)) if folder else PD_SCRIPT
    for line in lines:
        match = re.search(rf'"{script}", line (\d+)', line)
        if match:
            where = int(match.group(1))
    return f"`{exception.strip()[:300]}`", where


def _pd_ran(fresh):
    rows = len(fresh["x"])
    last = [next((ln.strip() for ln in reversed(log.splitlines()) if ln.strip()), None)
            for log in fresh["logs"]]
    printed = "; ".join(f"process {i} last printed {text[:160]!r}" if text
                        else f"process {i} printed nothing" for i, text in enumerate(last))
    if fresh.get("stuck"):
        waiting = fresh["still_running"]
        both = len(waiting) == len(fresh["returncodes"])
        who = "both processes" if both else f"process {waiting[0]} (the other had exited)"
        _pd_fail(f"`train_script` got stuck on new data ({rows} rows): after "
                 f"{fresh['seconds']:g} s, {who} had used no CPU for {fresh['stuck']:g} s, "
                 f"waiting, and {'were' if both else 'was'} stopped ({printed}); expected both "
                 f"processes to train "
                 f"{PD_STEPS} steps side by side and exit. Processes wait like that for each "
                 "other when one of them never reaches a computation the other is in (every "
                 "jitted step over the global arrays runs in both processes, each on its own "
                 "rows), or when their arrays' global shapes differ.")
    if fresh["timed_out"]:
        _pd_fail(f"`train_script` was still running after {fresh['timeout']:g} s on new data "
                 f"({rows} rows) and was stopped ({printed}); expected it to train {PD_STEPS} "
                 "steps and exit within seconds. A process that waits for ever is usually "
                 "waiting for the other one: both must call jax.distributed.initialize with the "
                 "same coordinator address and num_processes=2, each with its own process_id.")
    i = fresh["first_failed"]
    # which process exits first is a race (under load, a process aborted by the runtime when
    # its peer failed can exit before the peer has printed why): name one that stopped with a
    # Python exception of its own when there is one
    raised = [j for j, code in enumerate(fresh["returncodes"]) if code is not None and code > 0]
    if i is not None and fresh["returncodes"][i] < 0 and raised:
        i = raised[0]
    if i is not None:
        code = fresh["returncodes"][i]
        error, line = _pd_error_of(fresh["logs"][i], fresh.get("folder"))
        how = (f"was killed by signal {-code}, last printing {error}" if code < 0 else
               f"stopped with {error}")
        where = f" (line {line} of your script)" if line else ""
        hint = "".join(words for text, words in PD_HINTS if text in error)
        _pd_fail(f"`train_script` failed on new data ({rows} rows): process {i} (started as "
                 f"`python {PD_SCRIPT} COORDINATOR 2 {i} DATA_FILE OUT_FILE`) {how}{where}; "
                 "expected both processes to run to the end, for any number of rows divisible "
                 f"by 8.{hint}")


def _pd_joined(records):
    for i, record in enumerate(records):
        if record is None:
            _pd_fail(f"`train_script`: process {i} ended without exiting normally (the checks "
                     "saw no normal exit of Python, e.g. os._exit or a crash); expected it to "
                     "run to the end.")
        if not record["initialize"]:
            _pd_fail(f"`train_script` never called jax.distributed.initialize in process {i}, so "
                     "each process ran alone with only its own devices; expected both to join "
                     "one program: jax.distributed.initialize(COORDINATOR, num_processes=2, "
                     "process_id=PROCESS_ID), with the script's first three arguments, before "
                     "any other JAX call.")
    facts = [r.get("at_exit") or next(iter(r["local_data"]), None) for r in records]
    for i, seen in enumerate(facts):
        if seen is None:
            _pd_fail(f"`train_script` did not use the devices of the joined processes in process "
                     f"{i} (it made no jax.Array there); expected it to train on the global mesh.")
        if seen["process_count"] != PD_PROCESSES:
            _pd_fail(f"`train_script`: process {i} saw jax.process_count() == "
                     f"{seen['process_count']}; expected the {PD_PROCESSES} processes to join "
                     "one program (jax.distributed.initialize with num_processes=2).")
        if seen["local_device_count"] != PD_LOCAL_DEVICES or \
                seen["device_count"] != PD_PROCESSES * PD_LOCAL_DEVICES:
            _pd_fail(f"`train_script`: process {i} had {seen['local_device_count']} CPU "
                     f"device(s) of its own and saw {seen['device_count']} in all; expected "
                     f"{PD_LOCAL_DEVICES} per process, {PD_PROCESSES * PD_LOCAL_DEVICES} in all "
                     "(jax.config.update('jax_num_cpu_devices', 4) before "
                     "jax.distributed.initialize).")
    indices = sorted(f["process_index"] for f in facts)
    if indices != list(range(PD_PROCESSES)):
        _pd_fail(f"`train_script`: the processes saw jax.process_index() values {indices}; "
                 "expected 0 and 1: pass each process its own PROCESS_ID as process_id.")


def _pd_rows_of(call, column):
    """Which rows of ``column`` (N×1) a recorded make_array call's local data holds, or None."""
    if not call["values"]:
        return None
    where = {float(v): r for r, v in enumerate(column[:, 0])}
    rows = [where.get(float(v)) for v in call["values"]]
    return None if any(r is None for r in rows) else rows


def _pd_global_data(records, fresh):
    n = len(fresh["x"])
    share = n // PD_PROCESSES
    for label, column in (("x", fresh["x"]), ("y", fresh["y"])):
        rows_by_process = {}
        for i, record in enumerate(records):
            calls = [(c, _pd_rows_of(c, column)) for c in record["local_data"]]
            calls = [(c, rows) for c, rows in calls if rows is not None]
            if not calls:
                _pd_fail(f"`train_script`: process {i} made no array from its rows of `{label}` "
                         "with jax.make_array_from_process_local_data; expected each process to "
                         f"read its own {share} rows of {label} from the data file and pass them "
                         "to it, to make the global array of all rows.")
            call, rows = calls[-1]
            if call["processes"] != list(range(PD_PROCESSES)) or \
                    call["devices"] != PD_PROCESSES * PD_LOCAL_DEVICES:
                _pd_fail(f"`train_script`: the global `{label}` of process {i} lies on "
                         f"{call['devices']} device(s) of process(es) {call['processes']}; "
                         "expected one mesh of all 8 devices of both processes (jax.devices(), "
                         "not jax.local_devices()).")
            if len(rows) != share:
                _pd_fail(f"`train_script`: process {i} passed {len(rows)} rows of `{label}` to "
                         f"jax.make_array_from_process_local_data; expected only its own share: "
                         f"{share} of the {n} rows (rows {i * share} to {(i + 1) * share - 1} "
                         "for this process). Each process reads only its slice of the data; the "
                         "global array is made of the slices of both.")
            if call["global_shape"] != [n, 1]:
                _pd_fail(f"`train_script`: the global `{label}` that process {i} made has shape "
                         f"{tuple(call['global_shape'])}; expected ({n}, 1), all rows of both "
                         "processes.")
            if call["shard_shape"] != [n // (PD_PROCESSES * PD_LOCAL_DEVICES), 1]:
                _pd_fail(f"`train_script`: the global `{label}` is split into blocks of shape "
                         f"{tuple(call['shard_shape'])}; expected its rows split over the 8 "
                         f"devices ({n // 8} rows each, a PartitionSpec naming the mesh axis for "
                         "dimension 0): data parallelism.")
            rows_by_process[i] = rows
        every = sorted(r for rows in rows_by_process.values() for r in rows)
        if every != list(range(n)):
            _pd_fail(f"`train_script`: processes 0 and 1 passed overlapping rows of `{label}` "
                     "to jax.make_array_from_process_local_data (some rows twice, others never); "
                     "expected each process to pass its own share, so that together they pass "
                     f"every row once: process p the {share} rows from row p*{share} on.")
        for i, rows in rows_by_process.items():
            if rows != list(range(i * share, (i + 1) * share)):
                _pd_fail(f"`train_script`: process {i} passed {_pd_rows_words(rows, share)} of "
                         f"`{label}` to jax.make_array_from_process_local_data; expected what "
                         f"the task says: process p takes the {share} rows from row p*{share} "
                         f"on, in order, so process {i} rows {i * share} to "
                         f"{(i + 1) * share - 1}. The global array's rows are the processes' "
                         "rows in process order, so any other split puts the data file's rows "
                         "in another order.")


def _pd_rows_words(rows, share):
    """Which rows a process passed, in words: a run, a stride, or the first few."""
    step = rows[1] - rows[0] if len(rows) > 1 else 1
    if rows == list(range(rows[0], rows[0] + step * len(rows), step)):
        if step == 1:
            return f"rows {rows[0]} to {rows[-1]}"
        if step > 0:
            return f"every {_ordinal(step)} row from row {rows[0]} ({rows[0]}, {rows[1]}, ...)"
        return f"rows {rows[0]} down to {rows[-1]} (in reverse order)"
    return f"rows {', '.join(map(str, rows[:4]))}, ... (not rows in order)"


def _ordinal(n):
    return {2: "second", 3: "third", 4: "fourth"}.get(n, f"{n}th")


def _pd_writes(records):
    for record in records:
        index = (record.get("at_exit") or record["local_data"][-1])["process_index"]
        if index != 0 and record["writes"]:
            _pd_fail(f"`train_script`: process {index} (jax.process_index() == {index}) also "
                     "wrote the output file; expected only process 0 to save. Every process "
                     "holds the same replicated parameters, and processes writing one file at "
                     "once can leave it half written.")
        if index != 0 and record.get("printed", "").strip():
            _pd_fail(f"`train_script`: process {index} (jax.process_index() == {index}) printed "
                     f"{record['printed'].strip()[:80]!r}; expected what the task says: print "
                     "from process 0 only (the other process prints nothing).")


# step 1 of the task: both settings with jax.config.update, before jax.distributed.initialize
PD_SETTINGS = (("jax_num_cpu_devices", repr(PD_LOCAL_DEVICES)),
               ("jax_cpu_collectives_implementation", repr("gloo")))


def _pd_settings(records):
    for i, record in enumerate(records):
        for name, value in PD_SETTINGS:
            calls = [c for c in record.get("config", []) if c["name"] == name
                     and c["value"] == value]
            if calls and not all(c["after_initialize"] for c in calls):
                continue
            how = (f"set {name} to {value} only after jax.distributed.initialize" if calls
                   else f"never set {name} to {value} with jax.config.update")
            _pd_fail(f"`train_script`: process {i} {how}; expected what step 1 says: "
                     f"jax.config.update('{name}', {value}) before jax.distributed.initialize, "
                     "as pd_hello.py does (JAX picks gloo by itself since 0.5.1, but the script "
                     "says what it needs).")


def _pd_params_placed(records):
    shapes = {(a, b) for a, b in zip(PD_LAYER_SIZES[:-1], PD_LAYER_SIZES[1:])} | \
        {(b,) for b in PD_LAYER_SIZES[1:]}
    for i, record in enumerate(records):
        placed = {tuple(x["shape"]) for call in record.get("placed", []) for x in call
                  if x["replicated"] and x["devices"] == PD_PROCESSES * PD_LOCAL_DEVICES
                  and x["processes"] == list(range(PD_PROCESSES))}
        if not shapes <= placed:
            _pd_fail(f"`train_script`: process {i} did not place the parameters replicated on "
                     "the 8 devices with jax.device_put; expected what step 4 says: "
                     "jax.device_put(params, NamedSharding(mesh, P())) of the parameters that "
                     "pd_model.load_params(DATA_FILE) returns.")


def _pd_saved(fresh):
    names = [f"{k}{i}" for i in range(len(PD_LAYER_SIZES) - 1) for k in ("W", "b")]
    saved = fresh["saved"]
    if saved is None:
        problem = (f"could not be read ({fresh['saved_error']})" if fresh.get("saved_error")
                   else "was not written")
        _pd_fail(f"`train_script` ran without error, but the output file (the last argument, "
                 f"OUT_FILE) {problem}; expected process 0 to save the trained parameters there "
                 "with pd_model.save_params(OUT_FILE, params).")
    if sorted(saved) != sorted(names):
        _pd_fail(f"`train_script` saved arrays named {sorted(saved)}; expected "
                 f"{sorted(names)}, as pd_model.save_params writes the list of (W, b) pairs.")
    shapes = dict(zip(names, [s for a, b in zip(PD_LAYER_SIZES[:-1], PD_LAYER_SIZES[1:])
                              for s in ((a, b), (b,))]))
    for name in names:
        if tuple(saved[name].shape) != shapes[name]:
            _pd_fail(f"`train_script` saved {name} with shape {tuple(saved[name].shape)}; "
                     f"expected {shapes[name]}.")
        if not np.issubdtype(saved[name].dtype, np.floating):
            _pd_fail(f"`train_script` saved {name} with dtype {str(saved[name].dtype).lstrip('|<>=')}"
                     f"{_pd_raw_dtype_words(saved[name].dtype)}; expected float32, the dtype of "
                     "the parameters pd_model.load_params returns and training keeps.")
    return [(saved[f"W{i}"], saved[f"b{i}"]) for i in range(len(PD_LAYER_SIZES) - 1)]


def _pd_raw_dtype_words(dtype):
    # np.savez stores a bfloat16 array as raw 2-byte records: it loads back as V2, which no
    # NumPy arithmetic accepts (measured: np.allclose raises UFuncTypeError on it)
    if dtype.kind == "V" and dtype.itemsize == 2:
        return (" (raw 2-byte records: what a bfloat16 array saved with np.savez reads back as; "
                "the parameters were cast to bfloat16 somewhere)")
    return ""


def _pd_close_to(found, expected):
    return all(np.allclose(f, e, rtol=PD_TRAIN_RTOL, atol=PD_TRAIN_ATOL)
               for pair, ref in zip(found, expected) for f, e in zip(pair, ref))


# How a script that takes 8 times the gradient got there, read from its source: the words of
# the two ways the task's methods lead to it (matched on the text; only the message uses it)
PD_SUMMED_WAYS = (
    (re.compile(r"check_vma\s*=\s*False"),
     "with check_vma=False, jax.grad inside jax.shard_map gives each device the gradient of "
     "its own mean loss, and a psum of those adds 8 of them up: their mean (pmean, or psum "
     "divided by 8) is the gradient of the loss over all rows"),
    (re.compile(r"\bpmean\b"),
     "with check_vma on (the default), jax.grad inside jax.shard_map with respect to "
     "replicated parameters already adds up the 8 devices' gradients, and a pmean of that sum "
     "is still the sum: take the gradient of the pmean of the loss instead, or divide the "
     "summed gradient by 8"),
)


def _pd_summed_words(script):
    found = [words for pattern, words in PD_SUMMED_WAYS if pattern.search(script or "")]
    if not found:
        found = [words for _, words in PD_SUMMED_WAYS]
        return "Two ways lead there: " + "; or ".join(found)
    return found[0][0].upper() + found[0][1:]


def _pd_trained(found, fresh, script=None):
    init = [(fresh["init"][f"W{i}"], fresh["init"][f"b{i}"])
            for i in range(len(PD_LAYER_SIZES) - 1)]
    x, y = fresh["x"], fresh["y"]
    expected = _pd_reference(init, x, y)
    if _pd_close_to(found, expected):
        return
    what = (f"the parameters after {PD_STEPS} steps of gradient descent with step size "
            f"pd_model.STEP_SIZE = {PD_STEP_SIZE:g} on all {len(x)} rows, from the initial "
            "parameters in the data file, as training on one process gives")
    if not all(np.all(np.isfinite(a)) for pair in found for a in pair):
        _pd_fail(f"`train_script` saved parameters with NaN or infinite values; expected {what}.")
    if _pd_close_to(found, _pd_reference(init, x, y, step_size=8 * PD_STEP_SIZE)):
        _pd_fail("`train_script` trains with gradients 8 times too large: its parameters are "
                 f"those of training with step size {8 * PD_STEP_SIZE:g}, so each step used the "
                 "sum of the 8 devices' gradients where the gradient of the loss over all rows "
                 f"is their mean. {_pd_summed_words(script)}. Expected {what}.")
    worst = max(float(np.max(np.abs(np.asarray(f, np.float64) - e)))
                for pair, ref in zip(found, expected) for f, e in zip(pair, ref))
    _pd_fail(f"`train_script` saved the wrong parameters: expected {what}, but they differ "
             f"by up to {worst:.3g} (tolerance: rtol={PD_TRAIN_RTOL:g}, atol={PD_TRAIN_ATOL:g}).")


def _pd_q9(ev):
    form.expect_kind("train_script", ev["train_script"], "str",
                     "a string holding the source of your training script")
    if not ev["train_script"]["value"].strip():
        _pd_fail("`train_script` is an empty string; expected the source of your training "
                 "script.")
    fresh = ev.get("fresh")
    if fresh is None:
        _pd_fail("`train_script` could not be run on new data.")
    _pd_ran(fresh)
    records = fresh["records"]
    _pd_joined(records)
    _pd_settings(records)
    _pd_global_data(records, fresh)
    _pd_params_placed(records)
    _pd_writes(records)
    _pd_trained(_pd_saved(fresh), fresh, ev["train_script"]["value"])


# =========================================================================== questions
# What each question's public checks (grader.check in the notebook) read besides the answer:
# the notebook's own inputs and references, which no later cell reassigns. The hidden probes
# read only the answers.
NOTEBOOK = {
    "q1": " mlp_params x_mlp forward",
    "q2": " mlp_params x_mlp y_mlp mlp_loss",
    "q3": " layers devices",
    "q4": " layers micro_x expected_outputs",
    "q5": " layers micro_x micro_y sequential_loss",
    "q7": " moe_tokens moe_router EXPERT_CAPACITY TOKENS_PER_DEVICE",
    "q8": " mesh_expert moe_dense moe_tokens moe_router moe_W_in moe_W_out EXPERT_CAPACITY",
    "q9": " launch pd_params_single",
}
QUESTIONS = {
    # Part A
    "q1_mesh_2d": form.question("mesh_2d x_2d params_2d forward_2d out_2d" + NOTEBOOK["q1"],
                                _q1, _probe_mesh_2d),
    "q2_dp_tp_shard_map": form.question("loss_2d mesh_2d" + NOTEBOOK["q2"], _q2,
                                        _probe_loss_2d),
    # Part B
    "q3_stage_params": form.question("mesh_stage stage_params" + NOTEBOOK["q3"], _q3,
                                     _probe_stage_params),
    "q4_pipeline_forward": form.question("pipeline_forward mesh_stage" + NOTEBOOK["q4"], _q4,
                                         _probe_pipeline("pipeline_forward", grad=False)),
    "q5_pipeline_grad": form.question("pipeline_loss mesh_stage" + NOTEBOOK["q5"], _q5,
                                      _probe_pipeline("pipeline_loss", grad=True)),
    "q6_bubble": form.question("bubble_fraction microbatches_needed", _q6, _probe_bubble),
    # Part C
    "q7_router": form.question("route" + NOTEBOOK["q7"], _q7, _probe_route),
    "q8_moe_all_to_all": form.question("moe_layer" + NOTEBOOK["q8"], _q8, _probe_moe),
    # Part D
    # probed first: it gives back the kernel's compiled programs before its processes start
    # (_pd_free_kernel_memory), which the other probes' compiling would otherwise pay for again
    # in otter's own tests after them
    "q9_multi_process": form.question("train_script" + NOTEBOOK["q9"], _pd_q9, _pd_probe,
                                      probe_first=True),
}
probe, verdict, check = form.entry_points(QUESTIONS)
JAXLAB_CHECKS = 1  # declares the probe/verdict contract `jaxlab grade` relies on
