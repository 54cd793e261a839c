"""Hidden checks of Lab 6 (shipped only in the autograder zip, as ``jaxlab_lab6.py``).

Same design as Labs 3-5: a probe runs in the student's kernel, calls the student's functions on
fresh random inputs (other sizes too, where the task lets them vary) and records, as plain data,
the results, the traced program (``jax.make_jaxpr``), what ``print_saved_residuals`` lists and
what the compiled program (``.lower(...).compile()``) says about its memory; a verdict judges
that data only, recomputing every reference in float64 NumPy from the lab's recipe.

Memory is compared as a ratio to a reference the probe compiles in the same kernel, with the
same backend and JAX version (the lab's own plain scan, replicated step and one-device
attention), never to a fixed byte count: the figures differ between backends and versions.
Part D's verdict compiles the lab's own sharded products for the student's sizes and reads the
FLOPs from ``cost_analysis()`` and the collective from the HLO text.

The traced program is read by ``_program``: every equation in program order with its operand
and result shapes and dtypes, the primitive that produced each operand, how many times it runs
(a ``scan`` body runs ``length`` times; a ``while`` body an unknown number), whether it runs
inside ``shard_map``, the equations nested under it (a remat's or a scan's body), and for a
collective its mesh axes. ``jax.checkpoint`` traces to ``remat2`` (JAX 0.8-0.12),
``checkpoint_name`` to ``name``.

Parts: A (q1, q2: rematerialization), B (q3, q4: Adam and ZeRO), C (q5-q7: attention), D (q8,
q9: the cost model).
"""

import contextlib
import functools
import inspect
import io
import math
import re
from typing import NamedTuple

import numpy as np

try:
    from . import form
except ImportError:  # in the autograder the checks are flat modules beside the notebook
    import jaxlab_form as form

# Float32 results computed in another order than the float64 references differ by a few ulps;
# anything past these tolerances is a wrong answer.
RTOL = 1e-4
ATOL = 1e-5
# Losses and gradients through a dozen tanh layers in float32.
GRAD_RTOL = 1e-3
GRAD_ATOL = 1e-5
N_DEVICES = 8

REMAT = ("remat2", "checkpoint", "remat")  # what jax.checkpoint traces to
COLLECTIVES = {
    "psum": ("psum", "psum_invariant", "psum2"),
    "all_gather": ("all_gather", "all_gather_invariant"),
    "psum_scatter": ("reduce_scatter",),
    "ppermute": ("ppermute",),
    "all_to_all": ("all_to_all",),
}
COMMUNICATION = {p for prims in COLLECTIVES.values() for p in prims}

_rng = form.fresh_rng
_error = form.student_error
_fail = form.fail
_label = form.label
_close = functools.partial(form.expect_close, rtol=RTOL, atol=ATOL)
_grad_close = functools.partial(form.expect_close, rtol=GRAD_RTOL, atol=GRAD_ATOL)


def _devices(count=N_DEVICES):
    return form.check_devices(count)


# =========================================================================== shared: probes
def _quiet(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with what it prints thrown away."""
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args, **kwargs)


def _call(fn, *args, **kwargs):
    """The result of ``fn(*args)`` as evidence, or the error in the student's terms."""
    import jax

    try:
        return {"output": form.evidence(_quiet(lambda: jax.block_until_ready(
            fn(*args, **kwargs))))}
    except Exception as exc:
        return {"error": _error(exc)}


def _value_and_grad(fn, *args):
    """The loss and its gradient in the first argument, compiled, as evidence."""
    import jax

    try:
        loss, grad = _quiet(lambda: jax.block_until_ready(
            jax.jit(jax.value_and_grad(fn))(*args)))
        return {"output": form.evidence(loss), "grad": form.evidence(grad)}
    except Exception as exc:
        return {"error": _error(exc)}


def _aval(var):
    aval = getattr(var, "aval", None)
    return [int(n) for n in getattr(aval, "shape", ())], str(getattr(aval, "dtype", ""))


def _axes(params):
    axes = params.get("axes", params.get("axis_name", ()))
    return [str(a) for a in (axes if isinstance(axes, (tuple, list)) else (axes,))]


CALLS = ("jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call")


def _walk(jaxpr, times, inside, steps):
    """Append the equations of ``jaxpr`` (nested ones after their parent) to ``steps``;
    return, for each output of ``jaxpr``, the primitive that made it (seen through calls)."""
    made_by = {}  # id of a variable -> the primitive that made it
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        ins, outs = [_aval(v) for v in eqn.invars], [_aval(v) for v in eqn.outvars]
        step = {"prim": name, "in": [s for s, _ in ins], "out": [s for s, _ in outs],
                "out_dtypes": [d for _, d in outs], "times": times, "inside": inside,
                "made_by": [made_by.get(id(v)) for v in eqn.invars]}
        if name in COMMUNICATION:
            step["axes"] = _axes(eqn.params)
            if "perm" in eqn.params:
                step["perm"] = [[int(a), int(b)] for a, b in eqn.params["perm"]]
        if name == "name":
            step["name"] = str(eqn.params.get("name"))
        if name in REMAT:
            step["policy"] = repr(eqn.params.get("policy"))
        if name == "scan":
            step["length"] = int(eqn.params["length"])
        steps.append(step)
        first, inner = len(steps), None
        if name == "shard_map":
            _walk(eqn.params["jaxpr"], times, True, steps)
        elif name == "scan":
            length = int(eqn.params["length"])
            _walk(eqn.params["jaxpr"].jaxpr, None if times is None else times * length, inside,
                  steps)
        else:
            for sub in form._sub_jaxprs(eqn.params):
                made = _walk(sub, None if name == "while" else times, inside, steps)
                inner = made if name in CALLS else None
        step["nested"] = [first, len(steps)]
        for i, v in enumerate(eqn.outvars):
            made_by[id(v)] = inner[i] if inner and i < len(inner) and inner[i] else name
    return [made_by.get(id(v)) for v in jaxpr.outvars]


def _program(closed):
    """Plain data on ``closed = jax.make_jaxpr(fn)(*args)`` (see the module docstring)."""
    steps = []
    _walk(closed.jaxpr, 1, False, steps)
    return {"steps": steps, "shard_maps": sum(s["prim"] == "shard_map" for s in steps)}


def _trace(fn, *args):
    import jax

    try:
        return {"program": _program(_quiet(jax.make_jaxpr(fn), *args))}
    except Exception as exc:
        return {"jaxpr_error": _error(exc)}


RESIDUAL_LINE = re.compile(r"^\s*(\w+)\[([\d, ]*)\]\s+(.*)$")


def _residuals(fn, *args):
    """What ``jax.ad_checkpoint.print_saved_residuals`` lists: [{dtype, shape, source}]."""
    from jax.ad_checkpoint import print_saved_residuals

    text = io.StringIO()
    try:
        with contextlib.redirect_stdout(text):
            print_saved_residuals(fn, *args)
    except Exception as exc:
        return {"residuals_error": _error(exc)}
    rows = []
    for line in text.getvalue().splitlines():
        match = RESIDUAL_LINE.match(line)
        if match:
            rows.append({"dtype": match.group(1), "source": match.group(3).strip(),
                         "shape": [int(n) for n in match.group(2).split(",") if n.strip()]})
    return {"residuals": rows}


def _compiled(fn, *args, grad=False):
    """The compiled program of ``fn`` (or of its gradient) for these arguments, not run."""
    import jax

    run = jax.grad(fn) if grad else fn
    return _quiet(lambda: jax.jit(run).lower(*args).compile())


def _memory(fn, *args, grad=False):
    """Bytes of the compiled program's arguments and temporaries, or the error."""
    try:
        memory = _compiled(fn, *args, grad=grad).memory_analysis()
        return {"temp": int(memory.temp_size_in_bytes),
                "arguments": int(memory.argument_size_in_bytes),
                "outputs": int(memory.output_size_in_bytes)}
    except Exception as exc:
        return {"error": _error(exc)}


def _spec(*shape, sharding=None):
    import jax
    import jax.numpy as jnp

    return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)


def _put(value, mesh, *spec):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.device_put(value, NamedSharding(mesh, P(*spec)))


def _mesh(axis, count=N_DEVICES, axis_type="Auto"):
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh((count,), (axis,), axis_types=(getattr(AxisType, axis_type),),
                         devices=_devices(count))


def _count(n, thing):
    return f"{n} {thing}" + ("" if n == 1 else "s")


def _value_of(fn, *args):
    """Evidence of what ``fn(*args)`` returns, or ``{"kind": "error"}``."""
    record = _call(fn, *args)
    return record["output"] if "output" in record else {"kind": "error", "error": record["error"]}


def _number(call, ev, integer=False):
    """The number (an int with ``integer``) that a Python or NumPy scalar, or an array of shape
    (), holds; fail with the student's call otherwise."""
    if ev["kind"] == "error":
        _fail(f"`{call}` raised {ev['error']}; it should return a number.")
    scalar = ev["kind"] == "number" or (ev["kind"] in ("array", "ndarray") and ev["shape"] == [])
    whole = ev.get("is_int", False) or "int" in ev.get("dtype", "")
    if not scalar or (integer and not whole):
        _fail(f"`{call}` returned {form.describe(ev)}; expected "
              f"{'an int' if integer else 'a number'}.")
    return float(ev["value"])


# =========================================================================== shared: verdicts
def _program_of(name, fresh):
    if "jaxpr_error" in fresh:
        _fail(f"`{name}` could not be traced with jax.make_jaxpr: {fresh['jaxpr_error']}")
    return fresh["program"]


def _array_out(call, out, shape):
    call = _label(call)
    if out["kind"] not in ("array", "ndarray"):
        _fail(f"{call} returned {form.describe(out)}; expected an array of shape {shape}.")
    if tuple(out["shape"]) != tuple(shape):
        _fail(f"{call} returned an array of shape {tuple(out['shape'])}; expected {shape}.")


def _arrays(name, ev, count, what):
    """The arrays of a tuple (or list) of ``count`` arrays (jax or NumPy)."""
    if ev["kind"] not in ("tuple", "list") or len(ev["items"]) != count:
        _fail(f"{_label(name)} is {form.describe(ev)}; expected {what}.")
    for i, item in enumerate(ev["items"]):
        if item["kind"] not in ("array", "ndarray"):
            _fail(f"item {i} of {_label(name)} is {form.describe(item)}; expected an array "
                  f"({what}).")
    return ev["items"]


def _scalar(call, out):
    if out["kind"] not in ("array", "ndarray", "number") or out.get("shape", []) != []:
        _fail(f"{_label(call)} returned {form.describe(out)}; expected a scalar loss.")
    return float(out["value"])


def _loss_and_grads(name, case, ref_loss, ref_grads, leaf_names, words):
    """A loss and its gradient equal to the float64 references."""
    call = f"{name}(params, x, y) {case['words']}"
    if "error" in case:
        _fail(f"`{call}` raised {case['error']}; it should work for any sizes the task allows.")
    _close(call, _scalar(call, case["output"]), ref_loss, words, rtol=GRAD_RTOL, atol=GRAD_ATOL)
    grads = _arrays(f"the gradient of `{name}` (jax.grad)", case["grad"], len(leaf_names),
                    f"a tuple of {len(leaf_names)} gradients like `params`")
    for leaf, expected, what in zip(grads, ref_grads, leaf_names):
        _grad_close(f"the gradient of `{call}` for {what}", leaf["value"], expected,
                    f"the gradient of {words}")


def _remat_scan(name, program, n_layers, unit="layer"):
    """The loop over the layers (the ``unit``s) is a lax.scan of length L with jax.checkpoint
    on its body."""
    units = f"{unit}s"
    steps = program["steps"]
    scans = [i for i, s in enumerate(steps) if s["prim"] == "scan" and s["length"] == n_layers]
    remats = [i for i, s in enumerate(steps) if s["prim"] in REMAT]
    if not scans:
        what = (f"{sum(s['prim'] in ('dot_general',) for s in steps)} matrix products one after "
                "the other" if not any(s["prim"] in ("scan", "while") for s in steps) else
                "a loop of another length")
        _fail(f"`{name}` does not loop over its {n_layers} {units} with lax.scan (traced for "
              f"{n_layers} {units}, it runs {what}); expected a lax.scan over the stacked "
              f"{units}, whose body is one {unit}.")
    inside = [i for i in remats for j in scans if steps[j]["nested"][0] <= i
              < steps[j]["nested"][1]]
    if inside:
        return [steps[i] for i in inside]
    around = [i for i in remats for j in scans if steps[i]["nested"][0] <= j
              < steps[i]["nested"][1]]
    if around:
        _fail(f"`{name}` puts jax.checkpoint around the whole lax.scan; expected it on the "
              f"scan's body (one {unit}), so that each {unit}'s input is kept and the backward "
              f"pass recomputes one {unit} at a time, not all the {units} at once.")
    _fail(f"`{name}` runs no jax.checkpoint inside its lax.scan; expected the scan's body (one "
          f"{unit}) wrapped in jax.checkpoint.")


def _stacked_residuals(name, rec, n_layers):
    """The residuals that are not arguments and grow with L (a leading dimension of L)."""
    if "residuals_error" in rec:
        _fail(f"jax.ad_checkpoint.print_saved_residuals could not run `{name}`: "
              f"{rec['residuals_error']}")
    return sorted(tuple(r["shape"]) for r in rec["residuals"]
                  if not r["source"].startswith("from the argument")
                  and len(r["shape"]) == 3 and r["shape"][0] == n_layers)


def _without(shapes, taken):
    """``shapes`` less one of each shape in ``taken``."""
    left = list(shapes)
    for shape in taken:
        if shape in left:
            left.remove(shape)
    return left


def _weights_hint(extra, weights):
    """A remark when residuals that should not be there have the shapes of the weight stacks."""
    if any(tuple(shape) in weights for shape in extra):
        return (" (some have the shape of the weight stacks: slices of the weights taken "
                "outside the checkpointed function are saved; let the scan hand them to it, or "
                "slice them inside it)")
    return ""


def _shapes_words(shapes):
    return ", ".join(f"f32{list(s)}".replace(" ", "") for s in shapes) or "none"


# =========================================================================== Part A: remat
class Deep(NamedTuple):
    layers: int
    width: int
    batch: int


# The notebook's deep network: 16 tanh layers of width 128, batch 64. The fresh cases vary the
# depth (one layer is the smallest network), the width and the batch; the residuals are read at
# the last, whose three sizes differ so that a residual's shape says which it is.
REMAT_CASES = (Deep(layers=1, width=7, batch=5), Deep(layers=5, width=12, batch=9))
# The compiled gradient's temporary memory, checkpointed over plain, on CPU over the fresh sizes
# (10-13 layers, width 80-128, batch 32-64): 0.40-0.46 with JAX 0.10.2, 0.57-0.63 with 0.12
# (whose plain program is leaner); checkpointing the whole scan gives 1.0-1.04 on both, a
# Python loop of checkpointed layers 0.89-1.9.
REMAT_MEMORY_RATIO = 0.8
REMAT_MEMORY_CASE = Deep(layers=12, width=96, batch=48)  # the ratio needs some depth


def _fresh_deep(rng, n_layers, width, batch):
    W = (rng.normal(size=(n_layers, width, width)) / np.sqrt(width)).astype(np.float32)
    b = (0.1 * rng.normal(size=(n_layers, width))).astype(np.float32)
    x = rng.normal(size=(batch, width)).astype(np.float32)
    y = rng.normal(size=(batch, width)).astype(np.float32)
    return (W, b), x, y


def _deep_loss_and_grad(params, x, y):
    """``deep_loss`` and its gradient in (W, b), float64, backpropagation by hand."""
    W, b = (np.asarray(a, np.float64) for a in params)
    hs = [np.asarray(x, np.float64)]
    for Wl, bl in zip(W, b):
        hs.append(np.tanh(hs[-1] @ Wl + bl))
    y = np.asarray(y, np.float64)
    loss = float(np.mean(np.sum((hs[-1] - y) ** 2, axis=-1)))
    d_h = 2 * (hs[-1] - y) / len(y)
    gW, gb = np.zeros_like(W), np.zeros_like(b)
    for layer in reversed(range(len(W))):
        d_z = d_h * (1 - hs[layer + 1] ** 2)
        gW[layer], gb[layer] = hs[layer].T @ d_z, d_z.sum(0)
        d_h = d_z @ W[layer].T
    return loss, (gW, gb)


def _plain_deep_loss(params, x, y):
    """The notebook's ``deep_loss``: the reference the memory is compared with."""
    import jax.numpy as jnp
    from jax import lax

    def body(h, layer_params):
        W, b = layer_params
        return jnp.tanh(h @ W + b), None

    h, _ = lax.scan(body, x, params)
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


@functools.lru_cache(maxsize=1)
def _plain_memory():
    """The notebook's deep_loss at REMAT_MEMORY_CASE, compiled once per kernel."""
    L, D, B = REMAT_MEMORY_CASE
    return _memory(_plain_deep_loss, (_spec(L, D, D), _spec(L, D)), _spec(B, D), _spec(B, D),
                   grad=True)


def _probe_remat(values):
    fn = values.get("remat_loss")
    ev = form.evidence_of({"remat_loss": fn})
    if not callable(fn):
        return ev
    rng = _rng()
    cases = []
    for n_layers, width, batch in REMAT_CASES:
        params, x, y = _fresh_deep(rng, n_layers, width, batch)
        cases.append({"params": list(params), "x": x, "y": y,
                      "words": f"for {_count(n_layers, 'new layer')} of width {width}, batch "
                               f"{batch}",
                      **_value_and_grad(fn, params, x, y)})
    ev["fresh"] = cases
    params, x, y = cases[-1]["params"], cases[-1]["x"], cases[-1]["y"]
    ev["trace"] = {**_trace(fn, tuple(params), x, y), **_residuals(fn, tuple(params), x, y)}
    L, D, B = REMAT_MEMORY_CASE
    shapes = ((_spec(L, D, D), _spec(L, D)), _spec(B, D), _spec(B, D))
    ev["memory"] = {"layers": L, "width": D, "batch": B,
                    "student": _memory(fn, *shapes, grad=True), "plain": _plain_memory()}
    return ev


def _memory_ratio(name, memory, what, limit, reference_words):
    if "error" in memory["student"]:
        _fail(f"`{name}` could not be compiled for {what}: {memory['student']['error']}")
    student, reference = memory["student"]["temp"], memory["plain"]["temp"]
    ratio = student / max(reference, 1)
    if ratio >= limit:
        _fail(f"compiled for {what}, `{name}` needs {student / 2**20:.2f} MiB of temporary "
              f"memory, {ratio:.0%} of the {reference / 2**20:.2f} MiB of {reference_words}; "
              f"expected clearly less (under {limit:.0%} of it).")


def _q1(ev):
    form.expect_callable("remat_loss", ev["remat_loss"])
    for case in ev["fresh"]:
        ref_loss, ref_grads = _deep_loss_and_grad(case["params"], case["x"], case["y"])
        _loss_and_grads("remat_loss", case, ref_loss, ref_grads, ("W", "b"),
                        "deep_loss for those inputs")
    last = ev["fresh"][-1]
    L, B, D = len(last["params"][0]), *last["x"].shape
    program = _program_of("remat_loss", ev["trace"])
    _remat_scan("remat_loss", program, L)
    stacked = _stacked_residuals("remat_loss", ev["trace"], L)
    wanted = [(L, B, D)]
    if stacked != wanted:
        extra = _without(stacked, wanted)
        how = (f"besides each layer's input, it keeps {_shapes_words(extra)}"
               if wanted[0] in stacked else
               f"it keeps {_shapes_words(stacked)}, not each layer's input")
        how += _weights_hint(extra, {(L, D, D)})
        _fail(f"traced for {L} layers of width {D} and batch {B}, `remat_loss` saves "
              f"{len(stacked)} array(s) that grow with the depth ({_shapes_words(stacked)}): "
              f"{how}; expected only each layer's input, f32[{L},{B},{D}] (jax.checkpoint "
              "with no policy on the scan's body).")
    mem = ev["memory"]
    _memory_ratio("remat_loss", mem, f"{mem['layers']} layers of width {mem['width']}, batch "
                  f"{mem['batch']}", REMAT_MEMORY_RATIO, "deep_loss's gradient")


# ---- q2: a policy
POLICY_NAME = "hidden"


class Blocks(NamedTuple):
    layers: int
    d_model: int
    d_ff: int
    batch: int


# sizes all different in the last case, where the residuals are read
POLICY_CASES = (Blocks(layers=1, d_model=6, d_ff=19, batch=4),
                Blocks(layers=4, d_model=9, d_ff=26, batch=11))


def _fresh_blocks(rng, n_layers, d_model, d_ff, batch):
    W_in = (rng.normal(size=(n_layers, d_model, d_ff)) / np.sqrt(d_model)).astype(np.float32)
    W_out = (rng.normal(size=(n_layers, d_ff, d_model)) / np.sqrt(4 * d_ff)).astype(np.float32)
    x = rng.normal(size=(batch, d_model)).astype(np.float32)
    y = rng.normal(size=(batch, d_model)).astype(np.float32)
    return (W_in, W_out), x, y


def _blocks_loss_and_grad(params, x, y):
    """``blocks_loss`` and its gradient in (W_in, W_out), float64."""
    W_in, W_out = (np.asarray(a, np.float64) for a in params)
    hs, acts = [np.asarray(x, np.float64)], []
    for Wi, Wo in zip(W_in, W_out):
        acts.append(np.tanh(hs[-1] @ Wi))
        hs.append(hs[-1] + acts[-1] @ Wo)
    y = np.asarray(y, np.float64)
    loss = float(np.mean(np.sum((hs[-1] - y) ** 2, axis=-1)))
    d_h = 2 * (hs[-1] - y) / len(y)
    g_in, g_out = np.zeros_like(W_in), np.zeros_like(W_out)
    for layer in reversed(range(len(W_in))):
        a = acts[layer]
        g_out[layer] = a.T @ d_h
        d_z = (d_h @ W_out[layer].T) * (1 - a ** 2)
        g_in[layer] = hs[layer].T @ d_z
        d_h = d_h + d_z @ W_in[layer].T
    return loss, (g_in, g_out)


def _policies(closed):
    """The policy object of every jax.checkpoint in a traced program (None: no policy given)."""
    found = []
    for eqn in closed.eqns:
        if eqn.primitive.name in REMAT:
            found.append(eqn.params.get("policy"))
        for sub in form._sub_jaxprs(eqn.params):
            found += _policies(sub)
    return found


# What a policy saves, read from its effect on another function than the student's block: one
# value named POLICY_NAME (shape (3, 5)), one named "other" (3, 7), an unnamed matrix product
# whose result the backward pass needs (3, 11). A policy that saves exactly the values named
# POLICY_NAME saves the first alone; dots_saveable, which happens to save the same residuals in
# the lab's block, saves all three products here, save_any_names_but_these(...) the "other" too.
POLICY_TRIAL_SHAPES = ((3, 4), (4, 5), (5, 7), (7, 11))


def _policy_trial(policy):
    """The non-argument residuals (shape, source) of the trial function under ``policy``."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    def trial(x, W1, W2, W3):
        a = checkpoint_name(x @ W1, POLICY_NAME)
        b = checkpoint_name(jnp.sin(a) @ W2, "other")
        return jnp.sum(jnp.sin(jnp.sin(b @ W3)))

    try:
        checkpointed = jax.checkpoint(trial, policy=policy)
    except Exception as exc:
        return {"residuals_error": _error(exc)}
    args = [jnp.ones(shape, jnp.float32) for shape in POLICY_TRIAL_SHAPES]
    rec = _residuals(checkpointed, *args)
    if "residuals" in rec:
        rec["residuals"] = [r for r in rec["residuals"]
                            if not r["source"].startswith("from the argument")]
        # JAX 0.10 prints the value kept by its name as "named 'hidden' from <file>:<line>"; JAX
        # 0.8.2 as "output of reduce_precision from <file>:<line>" (measured): the named value is
        # the one made on the line of ``a`` above
        # (the checkpoint_name call's line and column: x @ W1 on that line has another column)
        lines, first = inspect.getsourcelines(trial)
        where = f":{first + 1}:{lines[1].index('checkpoint_name(')} "
        for r in rec["residuals"]:
            r["named"] = r["source"].startswith(f"named {POLICY_NAME!r}") or (
                tuple(r["shape"]) == (3, 5) and where in r["source"])
    return {"policy": repr(policy), **rec}


def _probe_policy(values):
    fn = values.get("policy_loss")
    ev = form.evidence_of({"policy_loss": fn})
    if not callable(fn):
        return ev
    rng = _rng()
    cases = []
    for n_layers, d_model, d_ff, batch in POLICY_CASES:
        params, x, y = _fresh_blocks(rng, n_layers, d_model, d_ff, batch)
        cases.append({"params": list(params), "x": x, "y": y,
                      "words": f"for {_count(n_layers, 'new block')} (D {d_model}, F {d_ff}), "
                               f"batch {batch}", **_value_and_grad(fn, params, x, y)})
    ev["fresh"] = cases
    params, x, y = cases[-1]["params"], cases[-1]["x"], cases[-1]["y"]
    ev["trace"] = {**_trace(fn, tuple(params), x, y), **_residuals(fn, tuple(params), x, y)}
    try:
        import jax

        closed = _quiet(jax.make_jaxpr(fn), tuple(params), x, y)
        ev["policies"] = [_policy_trial(policy) for policy in _policies(closed.jaxpr)]
    except Exception as exc:
        ev["policies_error"] = _error(exc)
    return ev


def _q2(ev):
    form.expect_callable("policy_loss", ev["policy_loss"])
    for case in ev["fresh"]:
        ref_loss, ref_grads = _blocks_loss_and_grad(case["params"], case["x"], case["y"])
        _loss_and_grads("policy_loss", case, ref_loss, ref_grads, ("W_in", "W_out"),
                        "blocks_loss for those inputs")
    last = ev["fresh"][-1]
    L, (B, D), F = len(last["params"][0]), last["x"].shape, last["params"][0].shape[-1]
    program = _program_of("policy_loss", ev["trace"])
    _remat_scan("policy_loss", program, L, "block")
    named = [s for s in program["steps"] if s["prim"] == "name" and s["name"] == POLICY_NAME]
    if not named:
        names = sorted({s["name"] for s in program["steps"] if s["prim"] == "name"})
        found = f"only {', '.join(repr(n) for n in names)}" if names else "no value"
        _fail(f"`policy_loss` names {found}; expected the product h @ W_in named "
              f"{POLICY_NAME!r} with jax.ad_checkpoint.checkpoint_name.")
    for step in named:
        if step["made_by"][0] != "dot_general" or step["out"][0] != [B, F]:
            what = step["made_by"][0] or "an input of the block"
            shape = f" (shape {tuple(step['out'][0])})" if step["out"][0] != [B, F] else ""
            _fail(f"`policy_loss` gives the name {POLICY_NAME!r} to the result of `{what}`{shape}; "
                  f"expected it on the product h @ W_in itself (shape ({B}, {F})), before tanh.")
    stacked = _stacked_residuals("policy_loss", ev["trace"], L)
    wanted = sorted([(L, B, D), (L, B, F)])
    if stacked != wanted:
        missing, extra = _without(wanted, stacked), _without(stacked, wanted)
        how = "; ".join(filter(None, (
            f"it does not keep {_shapes_words(missing)}" if missing else "",
            f"it also keeps {_shapes_words(extra)}" if extra else "")))
        how += _weights_hint(extra, {(L, D, F), (L, F, D)})
        _fail(f"traced for {L} blocks (D {D}, F {F}) and batch {B}, `policy_loss` saves "
              f"{_shapes_words(stacked)} that grow with the depth: {how}; expected exactly "
              f"each block's input f32[{L},{B},{D}] and its {POLICY_NAME!r} product "
              f"f32[{L},{B},{F}] (a policy that saves only the values named {POLICY_NAME!r}, "
              "jax.checkpoint_policies.save_only_these_names).")
    # the same residuals in this block can come from another policy: read the policy itself
    if "policies_error" in ev:
        _fail(f"`policy_loss` could not be traced to read its policy: {ev['policies_error']}")
    for trial in ev.get("policies", ()):
        if "residuals_error" in trial:
            _fail(f"the policy of `policy_loss`'s jax.checkpoint ({trial['policy']}) could not "
                  f"be tried on another function: {trial['residuals_error']}")
        saved = trial["residuals"]
        kept_by_name = [r for r in saved if r.get("named")]
        if len(saved) != 1 or len(kept_by_name) != 1:
            found = "; ".join(f"{_shapes_words([r['shape']])} ({r['source'].split(' from ')[0]})"
                              for r in saved) or "nothing"
            _fail(f"the policy of `policy_loss`'s jax.checkpoint ({trial['policy']}), tried on "
                  f"another function with a value named {POLICY_NAME!r}, one named 'other' and "
                  f"an unnamed matrix product, saves: {found}; expected exactly the value "
                  f"named {POLICY_NAME!r}. The task asks for a policy that saves exactly the "
                  f"values named {POLICY_NAME!r} (jax.checkpoint_policies.save_only_these_names), "
                  "not one that happens to save the same values in this block.")


# =========================================================================== Part B: Adam
LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8  # the notebook's defaults
ADAM_STEPS = 4


class AdamChain(NamedTuple):
    """ADAM_STEPS steps from zero moments, each fed the student's own previous result."""
    shape: tuple
    large_eps: bool  # eps of 1e-2 to 1e-1, where its place (inside the root or not) shows

    @property
    def ndim(self):
        return len(self.shape)


class AdamStep(NamedTuple):
    """One step from given moments."""
    words: str
    shape: tuple
    t: int
    settings: bool  # False: called with the default settings
    how: str  # "eager", "jit" (t traced) or "numpy" (NumPy arguments that must not change)

    @property
    def ndim(self):
        return len(self.shape)


ADAM_CHAINS = (AdamChain(shape=(3, 4), large_eps=False), AdamChain(shape=(5,), large_eps=True))
ADAM_STEPS_ALONE = (
    AdamStep("at step t = 7 with moments already built up", (2, 3), 7, True, "eager"),
    AdamStep("on a scalar parameter with the default settings", (), 1, False, "eager"),
    AdamStep("under jax.jit with t a traced integer", (4,), 3, True, "jit"),
    AdamStep("on NumPy arrays", (3,), 2, True, "numpy"))
# Fresh updates are compared on parameters of size ~0.1: float32 against float64 differ by
# ~1e-8 there; eps inside the square root (with the large eps drawn here) differs by >= 1e-4,
# a missing bias correction by ~1e-2. The moments are compared relatively (v can be 1e-6).
ADAM_RTOL = 1e-4
ADAM_ATOL = 1e-6
ADAM_MOMENT_ATOL = 1e-7


def _adam(param, grad, m, v, t, lr=LR, b1=B1, b2=B2, eps=EPS, correct=True, eps_inside=False):
    """One Adam step in float64; ``correct``/``eps_inside`` give the common wrong variants."""
    param, grad, m, v = (np.asarray(a, np.float64) for a in (param, grad, m, v))
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad ** 2
    m_hat, v_hat = (m / (1 - b1 ** t), v / (1 - b2 ** t)) if correct else (m, v)
    denominator = np.sqrt(v_hat + eps) if eps_inside else np.sqrt(v_hat) + eps
    return param - lr * m_hat / denominator, m, v


ADAM_VARIANTS = (
    ({"correct": False}, "without the bias correction (divide m and v by 1 - b1**t and "
                         "1 - b2**t)"),
    ({"eps_inside": True}, "with eps inside the square root (it goes outside: sqrt(v_hat) + "
                           "eps)"),
)


def _gradient_draw(rng, shape):
    """Gradients of size 0.1 to 1, either sign: no update rests on a near-zero gradient."""
    return (rng.uniform(0.1, 1.0, shape) * rng.choice([-1.0, 1.0], shape)).astype(np.float32)


def _hyper(rng, large_eps=False):
    return {"lr": float(rng.uniform(1e-3, 1e-1)), "b1": float(rng.uniform(0.5, 0.95)),
            "b2": float(rng.uniform(0.9, 0.9999)),
            "eps": float(rng.uniform(1e-2, 1e-1) if large_eps else rng.uniform(1e-9, 1e-7))}


def _probe_adam(values):
    import jax
    import jax.numpy as jnp

    fn = values.get("adam_update")
    ev = form.evidence_of({"adam_update": fn})
    if not callable(fn):
        return ev
    rng = _rng()
    f32 = np.float32
    chains = []
    # from zero moments, ADAM_STEPS steps, each step fed the student's own previous result
    for shape, large_eps in ADAM_CHAINS:
        hyper = _hyper(rng, large_eps=large_eps)
        state = [rng.uniform(-0.1, 0.1, shape).astype(f32), np.zeros(shape, f32),
                 np.zeros(shape, f32)]
        steps = []
        for t in range(1, ADAM_STEPS + 1):
            grad = _gradient_draw(rng, shape)
            step = {"inputs": [state[0], grad, state[1], state[2]], "t": t,
                    **_call(fn, jnp.asarray(state[0]),
                    jnp.asarray(grad), jnp.asarray(state[1]), jnp.asarray(state[2]), t,
                    **hyper)}
            steps.append(step)
            if "error" in step or step["output"]["kind"] not in ("tuple", "list") or \
                    len(step["output"]["items"]) != 3:
                break
            state = [np.asarray(item.get("value"), f32) for item in step["output"]["items"]]
        chains.append({"hyper": hyper, "steps": steps,
                       "words": f"on parameters of shape {shape}, from zero moments"})
    ev["chains"] = chains
    # single steps: mid-training (t = 7), the defaults on a scalar, t traced under jax.jit,
    # and NumPy inputs that must come back unchanged
    singles = []
    for words, shape, t, settings, how in ADAM_STEPS_ALONE:
        hyper = _hyper(rng) if settings else None
        param = rng.uniform(-0.1, 0.1, shape).astype(f32)
        m = (0.3 * _gradient_draw(rng, shape)).astype(f32) if t > 1 else np.zeros(shape, f32)
        v = (rng.uniform(0.05, 0.5, shape)).astype(f32) if t > 1 else np.zeros(shape, f32)
        grad = _gradient_draw(rng, shape)
        inputs = [param, grad, m, v]
        kwargs = hyper or {}
        if how == "jit":
            run = jax.jit(lambda p, g, m_, v_, t_: fn(p, g, m_, v_, t_, **kwargs))
            record = _call(run, *map(jnp.asarray, inputs), jnp.int32(t))
        elif how == "numpy":
            copies = [a.copy() for a in inputs]
            record = _call(fn, *copies, t, **kwargs)
            record["changed"] = [not np.array_equal(a, c) for a, c in zip(inputs, copies)]
        else:
            record = _call(fn, *map(jnp.asarray, inputs), t, **kwargs)
        singles.append({"inputs": inputs, "t": t, "hyper": hyper, "words": words, **record})
    ev["singles"] = singles
    return ev


def _adam_result(call, record, inputs, t, hyper, words):
    """The student's (param, m, v) after one step equal to the float64 step."""
    if "error" in record:
        traced = (" Under jax.jit, t is a traced integer: compute with it through jnp (for "
                  "example b1 ** t), never through Python's float(), int() or if."
                  if "jit" in words else "")
        _fail(f"`{call}` {words} raised {record['error']}; expected one Adam step, as the task "
              f"describes.{traced}")
    out = _arrays(call, record["output"], 3, "the tuple (new_param, new_m, new_v)")
    param, grad, m, v = inputs
    shape = tuple(np.shape(param))
    for item, what in zip(out, ("new_param", "new_m", "new_v")):
        _array_out(f"the {what} of `{call}`", item, shape)
    expected = _adam(param, grad, m, v, t, **(hyper or {}))
    found = np.asarray(out[0]["value"], np.float64)
    for variant, why in ADAM_VARIANTS:
        wrong = _adam(param, grad, m, v, t, **(hyper or {}), **variant)[0]
        if not np.allclose(found, expected[0], rtol=ADAM_RTOL, atol=ADAM_ATOL) and \
                np.allclose(found, wrong, rtol=ADAM_RTOL, atol=ADAM_ATOL):
            _fail(f"`{call}` {words} returns new parameters that match Adam {why}; expected "
                  "Adam's update as the task writes it.")
    for item, ref, what, atol in zip(out, expected, ("new_param", "new_m", "new_v"),
                                     (ADAM_ATOL, ADAM_MOMENT_ATOL, ADAM_MOMENT_ATOL)):
        form.expect_close(f"the {what} of `{call}`", item["value"], ref,
                          f"Adam's {what} {words} (float64 reference)", rtol=ADAM_RTOL, atol=atol)


def _settings(hyper):
    if hyper is None:
        return "the defaults"
    return ", ".join(f"{k}={v:.3g}" for k, v in hyper.items())


def _q3(ev):
    form.expect_callable("adam_update", ev["adam_update"])
    for chain in ev["chains"]:
        for step in chain["steps"]:
            t = step["t"]
            call = f"adam_update(param, grad, m, v, {t}, {_settings(chain['hyper'])})"
            _adam_result(call, step, step["inputs"], t, chain["hyper"],
                         f"{chain['words']}, at step {t}")
    for single in ev["singles"]:
        call = f"adam_update(param, grad, m, v, {single['t']}" + (
            f", {_settings(single['hyper'])})" if single["hyper"] else ")")
        _adam_result(call, single, single["inputs"], single["t"], single["hyper"],
                     single["words"])
        changed = [n for n, c in zip(("param", "grad", "m", "v"), single.get("changed", ()))
                   if c]
        if changed:
            _fail(f"`{call}` {single['words']} changes its argument(s) "
                  f"{', '.join(changed)} in place; expected a pure function that returns new "
                  "arrays and leaves its arguments as they were.")


# ---- q4: ZeRO
ZERO_STEPS = 3
ZERO_AXIS = "data"
# The state after ZERO_STEPS steps is compared with the student's own adam_update trained on one
# device (float32, the mean gradient of each whole batch): Task 4 grades the sharding, Task 3
# the formulas, and a wrong Adam costs only Task 3. Adam divides by sqrt(v), so a gradient entry
# near zero makes its update sensitive to rounding; fresh draws whose float64 gradients have an
# entry below ZERO_GRAD_MARGIN (relative to their mean size) are drawn again. A float32
# simulation of the sharded step (8 partial gradients summed) over 2,000 draws of both fresh
# shapes stayed within 1.3% of these tolerances for W (against float64), 3% for m and v. Adam's
# update does not change when every gradient is scaled alike (a sum taken for the mean, 8x), but
# m and v do: they are compared too.
ZERO_GRAD_MARGIN = 1e-3
ZERO_RTOL = 1e-4
ZERO_ATOL = 2e-5
ZERO_MOMENT_ATOL = 1e-6
# Per-device argument bytes of the compiled step over the ideal fully split state and batch.
ZERO_BYTES_FACTOR = 1.25


class Zero(NamedTuple):
    d_in: int
    d_out: int
    batch: int
    steps: int


# one row of W and one example per device for one step, then more of each for ZERO_STEPS
ZERO_CASES = (Zero(d_in=8, d_out=3, batch=8, steps=1),
              Zero(d_in=40, d_out=11, batch=24, steps=ZERO_STEPS))
ZERO_MEMORY_CASE = Zero(d_in=256, d_out=64, batch=32, steps=1)


def _regression_grad(W, x, y):
    """The gradient of ``regression_loss`` in W, float64."""
    W, x, y = (np.asarray(a, np.float64) for a in (W, x, y))
    pred = np.tanh(x @ W)
    d_z = 2 * (pred - y) / len(x) * (1 - pred ** 2)
    return x.T @ d_z


def _zero_reference(W, batches):
    """Adam on one device, every step on the mean gradient of the whole batch; also the
    gradients' smallest entry relative to their mean size."""
    W = np.asarray(W, np.float64)
    m, v, smallest = np.zeros_like(W), np.zeros_like(W), np.inf
    for t, (x, y) in enumerate(batches, start=1):
        g = _regression_grad(W, x, y)
        smallest = min(smallest, float(np.min(np.abs(g)) / np.mean(np.abs(g))))
        W, m, v = _adam(W, g, m, v, t)
    return (W, m, v), smallest


def _fresh_zero(rng, d_in, d_out, batch, steps=ZERO_STEPS):
    while True:
        W = (rng.normal(size=(d_in, d_out)) / np.sqrt(d_in)).astype(np.float32)
        batches = [(rng.normal(size=(batch, d_in)).astype(np.float32),
                    rng.normal(size=(batch, d_out)).astype(np.float32))
                   for _ in range(steps)]
        if _zero_reference(W, batches)[1] > ZERO_GRAD_MARGIN:
            return W, batches


def _replicated_adam_step(state, x, y, t):
    import jax
    import jax.numpy as jnp

    W, m, v = state
    g = jax.grad(_regression_loss)(W, x, y)
    m = B1 * m + (1 - B1) * g
    v = B2 * v + (1 - B2) * g ** 2
    return W - LR * m / (1 - B1 ** t) / (jnp.sqrt(v / (1 - B2 ** t)) + EPS), m, v


@functools.lru_cache(maxsize=4)
def _replicated_memory(state, x, y):
    """A step with the state replicated, compiled once per kernel for each layout."""
    return _memory(_replicated_adam_step, state, x, y, 1)


def _mesh_data():
    """The notebook's ``mesh_data``: axis 'data', Explicit, over the lab's 8 devices in order."""
    return _mesh(ZERO_AXIS, axis_type="Explicit")


def _on_mesh_data(state):
    """For each array of ``state``: whether its sharding's mesh is the notebook's mesh_data."""
    mesh = _mesh_data()
    return [getattr(getattr(a, "sharding", None), "mesh", None) == mesh for a in state]


def _state_mesh(state):
    """The mesh the student's state lives on, when it is one with the axis 'data'."""
    try:
        mesh = state[0].sharding.mesh
        if ZERO_AXIS in mesh.axis_names and mesh.devices.size == N_DEVICES:
            return mesh
    except Exception:
        pass
    return None


def _probe_zero(values):
    import jax

    init, step = values.get("zero_init"), values.get("zero_step")
    ev = form.evidence_of({"zero_init": init, "zero_step": step})
    adam = values.get("adam_update")
    if not (callable(init) and callable(step)):
        return ev
    rng = _rng()
    cases = []
    for d_in, d_out, batch, steps in ZERO_CASES:
        W, batches = _fresh_zero(rng, d_in, d_out, batch, steps)
        case = {"W": W, "batches": [list(b) for b in batches],
                "words": f"for W of shape ({d_in}, {d_out}) and batches of {batch}",
                "one_device": _one_device_adam(adam, W, batches)}
        cases.append(case)
        try:
            state = _quiet(init, W)
        except Exception as exc:
            case["init_error"] = _error(exc)
            break
        case["init"] = form.evidence(state)
        if type(state) in (tuple, list):
            case["init_on_mesh_data"] = _on_mesh_data(state)
        mesh = _state_mesh(state) if type(state) in (tuple, list) and len(state) == 3 else None
        if mesh is None:
            break
        placed = [(_put(x, mesh, ZERO_AXIS), _put(y, mesh, ZERO_AXIS)) for x, y in batches]
        case["trace"] = _trace(step, state, *placed[0], 1)
        try:
            for t, (x, y) in enumerate(placed, start=1):
                state = _quiet(lambda: jax.block_until_ready(step(state, x, y, t)))
            case["final"] = form.evidence(state)
            if type(state) in (tuple, list):
                case["final_on_mesh_data"] = _on_mesh_data(state)
        except Exception as exc:
            case["step_error"] = _error(exc)
            break
    ev["fresh"] = cases
    if all("final" in case for case in cases):
        from jax.sharding import NamedSharding, PartitionSpec as P

        d_in, d_out, batch, _ = ZERO_MEMORY_CASE
        state = _quiet(init, np.zeros((d_in, d_out), np.float32))
        mesh = _state_mesh(state)
        rows, copies = NamedSharding(mesh, P(ZERO_AXIS)), NamedSharding(mesh, P())
        x, y = _spec(batch, d_in, sharding=rows), _spec(batch, d_out, sharding=rows)
        replicated = tuple(_spec(d_in, d_out, sharding=copies) for _ in range(3))
        ev["memory"] = {"shape": [d_in, d_out, batch],
                        "student": _memory(step, state, x, y, 1),
                        "plain": _replicated_memory(replicated, x, y)}
    return ev


def _regression_loss(W, x, y):
    import jax.numpy as jnp

    return jnp.mean(jnp.sum((jnp.tanh(x @ W) - y) ** 2, axis=-1))


def _one_device_adam(adam, W, batches):
    """The state after the student's adam_update (default settings) trains W on one device with
    each whole batch's mean gradient: what ZeRO must reproduce, whatever that Adam's merits."""
    import jax

    if not callable(adam):
        return {"error": "`adam_update` (Task 3) is not defined"}
    @jax.jit
    def step(state, x, y, t):
        W, m, v = state
        return tuple(adam(W, jax.grad(_regression_loss)(W, x, y), m, v, t))

    try:
        state = (W, np.zeros_like(W), np.zeros_like(W))
        for t, (x, y) in enumerate(batches, start=1):
            state = _quiet(step, state, x, y, t)
        return {"output": form.evidence(tuple(jax.device_get(a) for a in state))}
    except Exception as exc:
        return {"error": _error(exc)}


def _split_rows(name, item, words):
    """``item`` (array evidence) lies on 8 devices of a mesh, split by rows over 'data'."""
    from jax.sharding import PartitionSpec as P

    sev = item.get("sharding", {})
    if item["kind"] != "array" or sev.get("kind") != "NamedSharding" or \
            len(sev["devices"]) != N_DEVICES:
        where = form.describe_sharding(sev) if sev else f"is {form.describe(item)}"
        _fail(f"{_label(name)} {'lives ' if sev else ''}{where}; expected {words}: a jax.Array "
              f"on the 8 devices of `mesh_data`, split by rows over {ZERO_AXIS!r}.")
    if ZERO_AXIS not in sev["axis_names"] or not form.is_laid_out_as(
            sev, len(item["shape"]), P(ZERO_AXIS)):
        _fail(f"{_label(name)} is {form.describe_sharding(sev)}; expected {words} split by rows "
              f"over {ZERO_AXIS!r} (spec P({ZERO_AXIS!r})), each device holding 1/8 of it.")


def _expect_mesh_data(name, items, on_mesh_data, words):
    """Each array of a state (split by rows over 'data', already checked) is on mesh_data."""
    for item, what, ok in zip(items, "Wmv", on_mesh_data):
        if not ok:
            sev = item["sharding"]
            types = ", ".join(f"{a!r} {t}" for a, t in zip(sev["axis_names"],
                                                            sev["axis_types"]))
            _fail(f"{name} ({what}) {words} lives on a mesh of its own (axes: {types}), not on "
                  "`mesh_data` (axis 'data' Explicit, over the notebook's 8 devices in order); "
                  "expected the state on mesh_data, as the task says.")


def _zero_communication(program, d_in, d_out):
    moves = [s for s in program["steps"] if s["inside"] and s["prim"] in COMMUNICATION]
    gathers = [s for s in moves if s["prim"] in COLLECTIVES["all_gather"]]
    scatters = [s for s in moves if s["prim"] in COLLECTIVES["psum_scatter"]]
    sums = [s for s in moves if s["prim"] in COLLECTIVES["psum"] and s["in"]
            and math.prod(s["in"][0]) >= d_in * d_out]
    return gathers, scatters, sums


def _q4(ev):
    form.expect_callable("zero_init", ev["zero_init"])
    form.expect_callable("zero_step", ev["zero_step"])
    for case in ev["fresh"]:
        W, batches, words = case["W"], case["batches"], case["words"]
        d_in, d_out = W.shape
        if "init_error" in case:
            _fail(f"`zero_init(W)` {words} raised {case['init_error']}.")
        items = _arrays(f"zero_init(W) {words}", case["init"], 3, "the state (W, m, v)")
        for item, ref, what in zip(items, (W, np.zeros_like(W), np.zeros_like(W)),
                                   ("W", "m", "v")):
            call = f"`zero_init(W)` ({what}) {words}"
            _close(call, item["value"], ref, f"{what}: " + ("W itself" if what == "W" else
                                                             "zeros"))
            _split_rows(call, item, f"the {what} of the state")
        _expect_mesh_data("`zero_init(W)`", items, case.get("init_on_mesh_data", ()), words)
        program = _program_of("zero_step", case.get("trace", {"jaxpr_error": "not traced"}))
        if "step_error" in case:
            _fail(f"`zero_step(state, x, y, t)` {words} raised {case['step_error']}.")
        if not program["shard_maps"]:
            _fail("`zero_step` does not go through jax.shard_map; expected the per-device step "
                  "written with jax.shard_map on mesh_data, as the task says.")
        single = case["one_device"]
        if "error" in single:
            _fail(f"training on one device with your `adam_update` {words}, the reference for "
                  f"`zero_step`, failed: {single['error']}")
        refs = [np.asarray(item["value"], np.float64) for item in _arrays(
            "`adam_update`'s (W, m, v) on one device", single["output"], 3, "(W, m, v)")]
        final = _arrays(f"zero_step(...) {words}", case["final"], 3, "the new state (W, m, v)")
        for item, ref, what, atol in zip(final, refs, "Wmv",
                                         (ZERO_ATOL, ZERO_MOMENT_ATOL, ZERO_MOMENT_ATOL)):
            call = f"the state's {what} after {_count(len(batches), 'step')} of `zero_step` " \
                f"{words}"
            _array_out(call, item, ref.shape)
            found = np.asarray(item["value"], np.float64)
            if what == "m" and not np.allclose(found, ref, rtol=ZERO_RTOL, atol=atol):
                for factor in (N_DEVICES, 1 / N_DEVICES):
                    if np.allclose(found, factor * ref, rtol=ZERO_RTOL, atol=atol):
                        _fail(f"{call} is {factor:g} times m for the mean gradient: the "
                              "gradient each device updates with must be its slice of the mean "
                              "over the whole batch (what psum_scatter adds up, divided by the "
                              "number of devices, of each device's own mean-loss gradient).")
            form.expect_close(call, found, ref, "your adam_update on one device with the mean "
                              "gradient of each whole batch", rtol=ZERO_RTOL, atol=atol)
            _split_rows(call, item, f"the new {what}")
        _expect_mesh_data("`zero_step`'s new state", final, case.get("final_on_mesh_data", ()),
                          f"after {_count(len(batches), 'step')} {words}")
        gathers, scatters, sums = _zero_communication(program, d_in, d_out)
        block = [d_in // N_DEVICES, d_out]
        if sums:
            _fail(f"`zero_step` adds up an array of shape {tuple(sums[0]['in'][0])} over the "
                  "devices with psum (an all-reduce, as in data parallelism); expected one "
                  "psum_scatter of the gradient, so that each device receives only its rows.")
        # the gradient's d_in x d_out numbers, scattered once: tiled, or untiled on the
        # gradient reshaped to (8, d_in / 8, d_out), which moves the same bytes
        if len(scatters) != 1 or math.prod(scatters[0]["in"][0]) != d_in * d_out or \
                scatters[0]["times"] != 1:
            _fail(f"`zero_step` runs {len(scatters)} psum_scatter(s) "
                  f"({', '.join(str(tuple(s['in'][0])) for s in scatters) or 'none'}) {words}; "
                  f"expected one psum_scatter of the gradient (shape ({d_in}, {d_out})) over "
                  f"{ZERO_AXIS!r}.")
        if [g["in"][0] for g in gathers] != [block]:
            found = ", ".join(str(tuple(g["in"][0])) for g in gathers) or "none"
            _fail(f"`zero_step` all-gathers {len(gathers)} array(s) of shape(s) {found} {words}; "
                  f"expected exactly one all_gather: of this device's rows of W, shape "
                  f"{tuple(block)} (m and v stay split).")
    memory = ev.get("memory")
    if memory:
        d_in, d_out, batch = memory["shape"]
        if "error" in memory["student"]:
            _fail(f"`zero_step` could not be compiled for W of shape ({d_in}, {d_out}): "
                  f"{memory['student']['error']}")
        ideal = 4 * (3 * d_in * d_out + batch * (d_in + d_out)) / N_DEVICES + 4
        found = memory["student"]["arguments"]
        if found > ZERO_BYTES_FACTOR * ideal:
            _fail(f"compiled for W of shape ({d_in}, {d_out}), `zero_step` takes {found} bytes "
                  f"of arguments per device, against {memory['plain']['arguments']} for a "
                  f"step with the state replicated; expected about 1/8 of the state and batch "
                  f"per device ({ideal:.0f} bytes).")


# =========================================================================== Part C: attention
# Scores of the "large" fresh inputs reach ATTENTION_LARGE: exp overflows float32 past 88.7, so
# a softmax that does not subtract the maximum returns inf/nan there. Scores that large carry
# float32 rounding of ~1e-5 that exp turns into relative errors of the weights: a correct float32
# attention was measured up to 2.7e-4 from the float64 reference over 400 draws (2.5 times
# RTOL/ATOL), so these cases are compared at LARGE_RTOL/LARGE_ATOL, still far below what a wrong
# softmax (clipped scores, no mask) is off by there.
ATTENTION_LARGE = 200.0
LARGE_RTOL = 1e-2
LARGE_ATOL = 1e-3
# "Rising" fresh inputs: every query points the same way and later keys score higher, up to
# RISING_TOP (~RISING_TOP / S more per key), so the keys a query may not see score far above
# those it sees. A maximum taken over those masked keys, before the mask, is then more than 103
# above every score the first queries see, exp underflows to 0 for all of them, and their
# weights are 0/0; with scores up to ATTENTION_LARGE alone that happened only on some draws.
# Float32 rounding of scores of 1e3 is ~6e-5, well inside LARGE_RTOL.
RISING_TOP = 1000.0
RISING = "rising"
OVERFLOW = 88.7  # exp of more overflows float32
# exp of less than -UNDERFLOW is below float32's smallest normal number (1.2e-38), which XLA's CPU
# backend flushes to zero: a row whose visible scores all lie that far below the maximum it
# subtracts gets weights 0/0 (measured: with 88.7 here, 3.5% of the large draws of a maximum
# taken before the mask were misread as overflow)
UNDERFLOW = 87.3


class Attention(NamedTuple):
    S: int
    d: int
    large: object  # False, True (scores up to ATTENTION_LARGE) or RISING


ATTENTION_CASES = (Attention(S=29, d=13, large=False), Attention(S=1, d=6, large=False),
                   Attention(S=13, d=29, large=True), Attention(S=24, d=8, large=RISING))


def _attention_reference(q, k, v):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    S, d = q.shape
    scores = q @ k.T / np.sqrt(d)
    scores = np.where(np.tril(np.ones((S, S), bool)), scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    return (w / w.sum(-1, keepdims=True)) @ v


def _attention_draw(rng, S, d, large=False):
    q, k, v = (rng.normal(size=(S, d)).astype(np.float32) for _ in range(3))
    if large == RISING:  # queries along one direction u, keys along u more and more
        u = rng.normal(size=d)
        u /= np.linalg.norm(u)
        q = (u + 0.05 * rng.normal(size=(S, d))).astype(np.float32)
        k = (np.arange(1, S + 1)[:, None] / S * u + 0.05 * rng.normal(size=(S, d))).astype(
            np.float32)
    if large:  # scale q so that the largest score is ATTENTION_LARGE (or RISING_TOP)
        top = np.max(np.abs(q.astype(np.float64) @ k.T)) / np.sqrt(d)
        q = (q * ((RISING_TOP if large == RISING else ATTENTION_LARGE) / top)).astype(
            np.float32)
    return q, k, v


def _attention_words(S, d, large, block=None):
    return f"for S = {S}, d = {d}" + (f", block_size = {block}" if block else "") + (
        f", scores rising along the sequence up to {RISING_TOP:g}" if large == RISING else
        f", scores up to {ATTENTION_LARGE:g}" if large else "")


def _attention_case(fn, q, k, v, words, *args):
    return {"q": q, "k": k, "v": v, "words": words, **_call(fn, q, k, v, *args)}


def _visible_max(q, k):
    """Each query's largest score over the keys it may see (float64)."""
    q, k = (np.asarray(a, np.float64) for a in (q, k))
    S, d = q.shape
    scores = np.where(np.tril(np.ones((S, S), bool)), q @ k.T / np.sqrt(d), -np.inf)
    return scores.max(axis=-1)


def _non_finite(call, case, bad):
    """Fail with what makes rows ``bad`` (not finite): exp overflowing past OVERFLOW (some
    score of the row is above it), or a maximum taken over keys the query may not see (the
    row's visible scores lie more than UNDERFLOW below its largest score: exp underflows for
    all)."""
    q, k = (np.asarray(a, np.float64) for a in (case["q"], case["k"]))
    scores = q @ k.T / np.sqrt(q.shape[1])
    visible = _visible_max(q, k)
    overflow = scores.max(axis=-1) > OVERFLOW
    underflow = visible < scores.max(axis=-1) - UNDERFLOW
    first = int(np.argmax(bad))
    if np.all(overflow[bad]) and not np.all(underflow[bad]):
        _fail(f"`{call}` {case['words']} returns inf or nan: exp of a score above 88 "
              "overflows float32; expected a numerically safe softmax that subtracts each "
              "query's maximum score before exp.")
    if np.all(underflow[bad]) and not np.all(overflow[bad]):
        _fail(f"`{call}` {case['words']} returns nan for query {first}, whose largest visible "
              f"score is {visible[first]:.3g}: the maximum it subtracts before exp is taken over "
              "keys that query may not see (they score far higher here), so exp underflows to 0 "
              "for every key it does see and its weights are 0/0. Expected the maximum over the "
              "keys each query may see: apply the causal mask before taking it.")
    _fail(f"`{call}` {case['words']} returns inf or nan (first at query {first}); expected a "
          "numerically safe softmax: subtract from each query's scores their maximum over the "
          "keys it may see (apply the causal mask before taking it), so that exp neither "
          "overflows (above 88) nor underflows to 0 for every key the query sees.")


def _attention_result(call, case, block=None):
    S, d = case["q"].shape
    if "error" in case:
        _fail(f"`{call}` {case['words']} raised {case['error']}; it should work for any "
              "sizes the task allows.")
    out = case["output"]
    _array_out(f"{call} {case['words']}", out, (S, d))
    found = np.asarray(out["value"], np.float64)
    if case.get("large") and not np.all(np.isfinite(found)):
        _non_finite(call, case, ~np.all(np.isfinite(found), axis=-1))
    expected = _attention_reference(case["q"], case["k"], case["v"])
    if not case.get("large") and not np.allclose(found, expected, rtol=RTOL, atol=ATOL):
        for wrong, why in _attention_variants(case["q"], case["k"], case["v"], block):
            if np.allclose(found, wrong, rtol=RTOL, atol=ATOL):
                _fail(f"`{call}` {case['words']} computes attention {why}.")
    rtol, atol = (LARGE_RTOL, LARGE_ATOL) if case.get("large") else (RTOL, ATOL)
    form.expect_close(f"{call} {case['words']}", found, expected,
                      "causal softmax attention (float64 reference)", rtol=rtol, atol=atol)


def _diagnostic_order(cases):
    """Fresh attention cases in the order whose first failure explains best: ordinary scores
    first (they name a wrong scale or mask), then the rising scores (a maximum taken before the
    mask returns nan there on every draw, and the message names it), the large random scores
    last. On those, that mistake fails on some draws only, and then sometimes only by lost
    precision (measured on q5's large draws with JAX on CPU: 0.5% of 1,000 failed as not close
    to the reference, a message that cannot name it; replayed in NumPy, whose float32 keeps
    subnormals, 3-6% of q5-q7's)."""
    rank = {False: 0, RISING: 1, True: 2}
    return sorted(cases, key=lambda case: rank[case["large"]])


def _attention_variants(q, k, v, block=None):
    """(output, what it does) of the common wrong attentions; with ``block``, also the masks
    made with positions counted within a block of ``block`` keys (or queries)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    S, d = q.shape

    def softmax_out(scores, mask):
        scores = np.where(mask, scores, -np.inf)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        return (w / w.sum(-1, keepdims=True)) @ v

    scaled, position = q @ k.T / np.sqrt(d), np.arange(S)
    variants = [
        (softmax_out(q @ k.T, position[:, None] >= position[None, :]),
         "without scaling the scores: they should be divided by sqrt(d) before the softmax"),
        (softmax_out(scaled, np.ones((S, S), bool)),
         "without the causal mask: query i should see only keys j <= i"),
        (softmax_out(scaled, position[:, None] <= position[None, :]),
         "with the mask the wrong way round: query i sees keys j >= i; expected j <= i")]
    if block and block < S:
        local = position % block
        variants += [
            (softmax_out(scaled, position[:, None] >= local[None, :]),
             f"with a causal mask that counts each key's position within its block of {block} "
             f"(key j as position j mod {block}); expected the mask to compare positions in "
             "the whole sequence: query i sees keys j <= i"),
            (softmax_out(scaled, local[:, None] >= local[None, :]),
             f"with a causal mask that counts positions within each block of {block} (query i "
             f"as i mod {block}, key j as j mod {block}); expected the mask to compare "
             "positions in the whole sequence: query i sees keys j <= i")]
    return variants


def _probe_attention(values):
    fn = values.get("attention")
    ev = form.evidence_of({"attention": fn})
    if callable(fn):
        rng = _rng()
        ev["fresh"] = [{**_attention_case(fn, *_attention_draw(rng, S, d, large),
                                          _attention_words(S, d, large)), "large": large}
                       for S, d, large in ATTENTION_CASES]
    return ev


def _q5(ev):
    form.expect_callable("attention", ev["attention"])
    for case in _diagnostic_order(ev["fresh"]):
        _attention_result("attention(q, k, v)", case)


# ---- q6: online softmax
class Online(NamedTuple):
    S: int
    d: int
    block: int
    large: object  # as Attention.large


# block sizes from 1 to S, a block of 4 first: there a mask that counts key positions within
# each block differs from no mask at all (with blocks of 1 they are the same), and the message
# can say which it is; the programs are read at ONLINE_TRACES, whose d (odd) is no block size,
# so that a block's scores (S, block) and its output (S, d) are told apart
ONLINE_CASES = (Online(S=20, d=3, block=4, large=False), Online(S=36, d=7, block=1, large=False),
                Online(S=36, d=7, block=9, large=True), Online(S=36, d=7, block=36, large=False),
                Online(S=36, d=7, block=9, large=RISING))
ONLINE_TRACES = (Online(S=36, d=7, block=9, large=False), Online(S=36, d=7, block=1, large=False))


def _probe_blocked(values):
    fn = values.get("blocked_attention")
    ev = form.evidence_of({"blocked_attention": fn})
    if callable(fn):
        rng = _rng()
        ev["fresh"] = [{**_attention_case(fn, *_attention_draw(rng, S, d, large),
                                          _attention_words(S, d, large, block), block),
                        "block": block, "large": large} for S, d, block, large in ONLINE_CASES]
        ev["traces"] = [{"S": S, "d": d, "block": block, **_trace(
            lambda q, k, v: fn(q, k, v, block), *_attention_draw(rng, S, d))}
            for S, d, block, _ in ONLINE_TRACES]
    return ev


def _q6(ev):
    form.expect_callable("blocked_attention", ev["blocked_attention"])
    for case in _diagnostic_order(ev["fresh"]):
        _attention_result("blocked_attention(q, k, v, block_size)", case, case["block"])
    for trace in ev["traces"]:
        _one_pass(trace)


def _one_pass(trace):
    """The traced program folds each block of keys once and builds nothing of S × S."""
    S, block = trace["S"], trace["block"]
    program = _program_of("blocked_attention", trace)
    big = sorted({tuple(shape) for s in program["steps"] for shape, dtype in
                  zip(s["out"], s["out_dtypes"]) if "float" in dtype and len(shape) >= 2
                  and math.prod(shape) >= S * S})
    if big:
        _fail(f"traced for S = {S} and block_size = {block}, `blocked_attention` builds an array "
              f"of shape {big[0]} ({math.prod(big[0])} entries, at least S × S = {S * S}); "
              f"expected each block's scores of shape ({S}, {block}) and nothing of S × S "
              "entries.")
    scores = [s for s in program["steps"] if s["prim"] == "dot_general"
              and s["out"] == [[S, block]]]
    if any(s["times"] is None for s in scores):
        _fail("`blocked_attention` computes its scores inside a while loop, whose number of "
              "steps cannot be read from the traced program; expected a loop of a fixed number "
              "of steps over the blocks (a Python for loop, lax.fori_loop with fixed bounds, or "
              "lax.scan).")
    count = sum(s["times"] for s in scores)
    if count != S // block:
        _fail(f"traced for S = {S} and block_size = {block}, `blocked_attention` computes "
              f"{count} score block(s) of shape ({S}, {block}); expected one per block of keys, "
              f"{S // block}: a single pass over the blocks with a running maximum and sum.")


# ---- q7: ring attention
RING_AXIS = "seq"


class Ring(NamedTuple):
    S: int
    d: int
    large: object  # as Attention.large


# blocks of 6 positions per device (first: see ONLINE_CASES), one position per device, blocks
# of 10 (longer than the notebook's 8: positions computed with its block length keep their order
# up to 8 and collide past it), scores large and rising; the program is read at RING_TRACES,
# whose S, its block S / 8 and d all differ
RING_CASES = (Ring(S=48, d=7, large=False), Ring(S=8, d=5, large=False),
              Ring(S=80, d=6, large=False), Ring(S=48, d=7, large=True),
              Ring(S=48, d=7, large=RISING))
RING_TRACES = (Ring(S=40, d=3, large=False),)
RING_MEMORY = (1024, 16)  # S, d of the memory comparison
# Compiled temporary memory per device over that of one-device attention, both compiled here:
# the lab's ring measured 0.006 (S = 1024) on CPU with JAX 0.10.2; the whole S x S scores on
# one device is 0.5 of it.
RING_MEMORY_RATIO = 0.1


def _probe_ring(values):
    import jax

    fn = values.get("ring_attention")
    ev = form.evidence_of({"ring_attention": fn})
    if not callable(fn):
        return ev
    rng = _rng()
    mesh = _mesh(RING_AXIS)
    cases = []
    for S, d, large in RING_CASES:
        q, k, v = _attention_draw(rng, S, d, large=large)
        placed = [_put(a, mesh, RING_AXIS) for a in (q, k, v)]
        cases.append({"q": q, "k": k, "v": v, "words": _attention_words(S, d, large),
                      "large": large, **_call(jax.jit(fn), *placed)})
    ev["fresh"] = cases
    (S, d, _), = RING_TRACES
    q, k, v = (_put(a, mesh, RING_AXIS) for a in _attention_draw(rng, S, d))
    ev["trace"] = {"S": S, "d": d, **_trace(fn, q, k, v)}
    from jax.sharding import NamedSharding, PartitionSpec as P

    S, d = RING_MEMORY
    rows = NamedSharding(mesh, P(RING_AXIS))
    ev["memory"] = {"S": S, "d": d,
                    "student": _memory(fn, *[_spec(S, d, sharding=rows)] * 3),
                    "plain": _attention_memory()}
    return ev


@functools.lru_cache(maxsize=1)
def _attention_memory():
    """One-device attention at RING_MEMORY, compiled once per kernel."""
    S, d = RING_MEMORY
    return _memory(_attention_one_device, *[_spec(S, d)] * 3)


def _attention_one_device(q, k, v):
    import jax.numpy as jnp

    S, d = q.shape
    scores = q @ k.T / jnp.sqrt(d)
    scores = jnp.where(jnp.arange(S)[:, None] >= jnp.arange(S)[None, :], scores, -jnp.inf)
    w = jnp.exp(scores - scores.max(axis=-1, keepdims=True))
    return (w / w.sum(axis=-1, keepdims=True)) @ v


def _is_ring(perm):
    """Whether ``perm`` sends every device j to j + 1 (the last to 0): the text's ring."""
    return len(perm) == N_DEVICES and {(b - a) % N_DEVICES for a, b in perm} == {1}


def _q7(ev):
    form.expect_callable("ring_attention", ev["ring_attention"])
    for case in _diagnostic_order(ev["fresh"]):
        _attention_result("ring_attention(q, k, v)", case, len(case["q"]) // N_DEVICES)
        _split_over_seq(case)
    trace = ev["trace"]
    S, d = trace["S"], trace["d"]
    b = S // N_DEVICES
    program = _program_of("ring_attention", trace)
    if not program["shard_maps"]:
        _fail("`ring_attention` does not go through jax.shard_map; expected the per-device "
              "program written with jax.shard_map on mesh_seq.")
    moves = [s for s in program["steps"] if s["inside"] and s["prim"] in COMMUNICATION]
    if any(s["prim"] in COLLECTIVES["all_gather"] for s in moves):
        _fail("`ring_attention` uses all_gather; expected the key and value blocks to travel "
              "around the ring with ppermute, one block at a time.")
    whole = sorted({tuple(shape) for s in program["steps"] if s["inside"]
                    for shape, dtype in zip(s["out"], s["out_dtypes"])
                    if "float" in dtype and len(shape) >= 2 and S in shape})
    if whole:
        _fail(f"traced for S = {S}, `ring_attention` builds an array of shape {whole[0]} on each "
              f"device, holding all {S} positions; expected each device to hold one block of "
              f"{b} keys and values at a time.")
    shifts = [s for s in moves if s["prim"] in COLLECTIVES["ppermute"]
              and s["in"] and math.prod(s["in"][0]) >= b * d]
    if any(s["times"] is None for s in shifts):
        _fail("`ring_attention` moves its blocks inside a while loop, whose number of steps "
              "cannot be read from the traced program; expected a loop of a fixed number of "
              "steps (a Python for loop, lax.fori_loop with fixed bounds, or lax.scan).")
    for s in shifts:
        if s["axes"] != [RING_AXIS] or not _is_ring(s.get("perm", [])):
            _fail(f"`ring_attention` runs a ppermute over {tuple(s['axes'])} with perm "
                  f"{s.get('perm')}; expected the text's ring over {RING_AXIS!r}: every device j "
                  "sending to j + 1, the last to device 0, at every step.")
    moved = sum(math.prod(s["in"][0]) * s["times"] for s in shifts)
    wanted = 2 * (N_DEVICES - 1) * b * d
    if moved != wanted:
        _fail(f"traced for S = {S} and d = {d}, `ring_attention` moves {moved} numbers per "
              f"device with ppermute ({moved / (b * d):g} blocks of {b} × {d}); expected the "
              f"key block and the value block {N_DEVICES - 1} times each (n - 1 moves: the "
              f"last block needs none), {wanted} numbers.")
    memory = ev["memory"]
    if "error" in memory["student"]:
        _fail(f"`ring_attention` could not be compiled for S = {memory['S']}: "
              f"{memory['student']['error']}")
    _memory_ratio("ring_attention", memory, f"S = {memory['S']}, d = {memory['d']}",
                  RING_MEMORY_RATIO, "attention on one device (whose S × S scores alone take "
                  f"{memory['S'] ** 2 * 4 / 2**20:.0f} MiB)")


def _split_over_seq(case):
    from jax.sharding import PartitionSpec as P

    out = case["output"]
    sev = out.get("sharding", {})
    call = f"ring_attention(q, k, v) {case['words']}"
    if sev.get("kind") != "NamedSharding" or not form.is_laid_out_as(
            sev, len(out["shape"]), P(RING_AXIS)):
        where = form.describe_sharding(sev) if sev else "not on any device"
        _fail(f"`{call}` returns an array {where}; expected it split by rows over "
              f"{RING_AXIS!r} like q (out_specs=P({RING_AXIS!r})).")


# =========================================================================== Part D: costs
KINDS = ("none", "all-gather", "reduce-scatter", "all-reduce")
# cost_analysis also counts the additions of an all-reduce, one per element of its result (I·K):
# the product's own FLOPs are its figure less those, exactly (measured at every COST_CASES size
# and the notebook's, on 2 to 8 devices). "The FLOPs of the matrix product" are compared within
# rounding, so an answer that returns cost_analysis()'s figure loses case 3.
FLOPS_RTOL = 1e-9


class Cost(NamedTuple):
    I: int
    J: int
    K: int
    n: int


# every case of the table at each size; I and K differ (whose bytes are counted shows), J is
# at least 64 n, and the dimensions split are divisible by n
COST_CASES = (Cost(I=96, J=640, K=40, n=8), Cost(I=20, J=256, K=12, n=4),
              Cost(I=6, J=130, K=14, n=2))
HLO_COLLECTIVE = re.compile(r"= (\w+)\[([\d,]*)\]\S* (all-gather|all-reduce|reduce-scatter|"
                            r"collective-permute|all-to-all)(?:-start)?\(")


def _case_programs(mesh):
    """The notebook's ``case_programs``: the shard_map program of each case of the table."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    smap = functools.partial(jax.shard_map, mesh=mesh)
    return {
        1: (smap(lambda a, b: a @ b, in_specs=(P("x", None), P()), out_specs=P("x", None)),
            P("x", None), P()),
        2: (smap(lambda a, b: a @ lax.all_gather(b, "x", axis=1, tiled=True),
                 in_specs=(P("x", None), P(None, "x")), out_specs=P("x", None)),
            P("x", None), P(None, "x")),
        3: (smap(lambda a, b: lax.psum(a @ b, "x"), in_specs=(P(None, "x"), P("x", None)),
                 out_specs=P()),
            P(None, "x"), P("x", None)),
        4: (smap(lambda a, b: lax.psum_scatter(a @ b, "x", scatter_dimension=0, tiled=True),
                 in_specs=(P(None, "x"), P("x", None)), out_specs=P("x", None)),
            P(None, "x"), P("x", None)),
    }


@functools.lru_cache(maxsize=64)
def _compiled_case(case, I, J, K, n):
    """(FLOPs of one device, [(collective, result shape)]) of the case's compiled program."""
    import jax
    from jax.sharding import NamedSharding

    mesh = _mesh("x", n)
    program, a_spec, b_spec = _case_programs(mesh)[case]
    a = _spec(I, J, sharding=NamedSharding(mesh, a_spec))
    b = _spec(J, K, sharding=NamedSharding(mesh, b_spec))
    compiled = _quiet(lambda: jax.jit(program).lower(a, b).compile())
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    found = [(kind, [int(n) for n in dims.split(",") if n])
             for _, dims, kind in HLO_COLLECTIVE.findall(compiled.as_text())]
    return float(cost["flops"]), found


def _collective_bytes(kind, shape, n):
    """Bytes one device sends in a ring collective whose HLO result has ``shape`` (float32)."""
    size = 4 * math.prod(shape)
    if kind == "all-gather":
        return (n - 1) / n * size
    if kind == "reduce-scatter":  # the result is one device's block
        return (n - 1) * size
    if kind == "all-reduce":
        return 2 * (n - 1) / n * size
    return 0.0


def _probe_costs(values):
    fn = values.get("matmul_costs")
    ev = form.evidence_of({"matmul_costs": fn})
    if callable(fn):
        ev["fresh"] = [{"case": case, "I": I, "J": J, "K": K, "n": n,
                        "result": _value_of(fn, case, I, J, K, n)}
                       for I, J, K, n in COST_CASES for case in (1, 2, 3, 4)]
    return ev


def _q8(ev):
    form.expect_callable("matmul_costs", ev["matmul_costs"])
    for row in ev["fresh"]:
        case, I, J, K, n = (row[k] for k in ("case", "I", "J", "K", "n"))
        call = f"matmul_costs({case}, {I}, {J}, {K}, {n})"
        result = row["result"]
        if result["kind"] == "error":
            _fail(f"`{call}` raised {result['error']}.")
        if result["kind"] not in ("tuple", "list") or len(result["items"]) != 3:
            _fail(f"`{call}` returned {form.describe(result)}; expected a tuple (flops, "
                  "comm_bytes, collective).")
        flops_ev, bytes_ev, kind_ev = result["items"]
        flops, collectives = _compiled_case(case, I, J, K, n)
        kind, shape = collectives[0] if collectives else ("none", [])
        found_kind = kind_ev.get("value") if kind_ev["kind"] == "str" else None
        if found_kind != kind:
            names = ", ".join(f'"{k}"' for k in KINDS)
            said = repr(found_kind) if found_kind is not None else form.describe(kind_ev)
            _fail(f"`{call}` names the collective {said}; expected {kind!r}, the one the "
                  f"compiled program of case {case} runs (the names are {names}).")
        found = _number(f"{call}[0]", flops_ev)
        additions = math.prod(shape) if kind == "all-reduce" else 0
        if not math.isclose(found, flops - additions, rel_tol=FLOPS_RTOL):
            also = (f", of which {additions} are the all-reduce's additions (I·K), not the "
                    "product's" if additions else "")
            _fail(f"`{call}` says one device does {found:.6g} FLOPs; the compiled program's "
                  f"cost_analysis() says {flops:.6g}{also}; expected the FLOPs of the product "
                  f"one device computes, {flops - additions:.6g}.")
        expected = _collective_bytes(kind, shape, n)
        found = _number(f"{call}[1]", bytes_ev)
        if not math.isclose(found, expected, rel_tol=1e-9, abs_tol=1e-9):
            what = (f"the compiled program's {kind} has result {_shapes_words([shape])}"
                    if kind != "none" else "the compiled program runs no collective")
            _fail(f"`{call}` says one device sends {found:.6g} bytes; expected "
                  f"{expected:.6g}: {what}, and the table's rule for it gives that many bytes "
                  "per device.")


# ---- q9: rooflines
BOUNDS = ("compute", "memory", "communication")


class Roofline(NamedTuple):
    bound: str  # the resource whose time is drawn longest; the others 1% to 90% of it
    links: bool  # False: no communication at all (one chip)


ROOFLINE_CASES = tuple(Roofline(bound, True) for bound in BOUNDS * 2) + (
    Roofline("memory", False), Roofline("compute", False))
# the kinds of critical_batch's answer: some batch size (drawn D, F, chip), exactly 1 (memory at
# least as fast as the arithmetic), None (D, F below 64: never compute-bound on these chips)
BATCH_KINDS = ("some",) * 6 + ("one", "never")
# draws whose two largest times (or whose critical batch) lie this close to a tie are drawn
# again: float rounding could decide them either way
TIE_MARGIN = 1e-6
# ... and the boundaries the text states, reached exactly, with every number a power of two so
# that any way of writing the comparison (closed form, intensities, the two times, a search)
# computes the tie without rounding: for a critical intensity c = flop_per_s / hbm_bytes_per_s,
# the product with D = F = 4c is compute-bound from exactly B = 2c on (D = 2c, F = 4c: from 4c),
# where its compute time equals its memory time ("at least": a strict comparison answers one
# more); with D = F = 2c the intensity only tends to c, and no batch size is compute-bound
# (None: the closed form's denominator is exactly 0); and on a chip of 1/32 FLOP/s and 1/8 B/s
# of memory, D = F = 1 is compute-bound from B = 1 although the denominator is only 1/16.
EXACT_KINDS = ("knee", "knee", "zero", "small")


def _exact_case(rng, kind):
    """(D, F, chip) of an EXACT_KINDS case."""
    if kind == "small":
        return 1, 1, {"flop_per_s": 2.0 ** -5, "hbm_bytes_per_s": 2.0 ** -3,
                      "link_bytes_per_s": 2.0 ** -6}
    c = 2 ** int(rng.integers(4, 10))
    peak = float(2 ** int(rng.integers(44, 51)))
    D, F = (2 * c, 2 * c) if kind == "zero" else [(4 * c, 4 * c), (2 * c, 4 * c),
                                                    (4 * c, 2 * c)][int(rng.integers(3))]
    return D, F, {"flop_per_s": peak, "hbm_bytes_per_s": peak / c,
                  "link_bytes_per_s": peak / (16 * c)}


def _chip(rng):
    peak = float(10 ** rng.uniform(13.5, 15.5))
    return {"flop_per_s": peak, "hbm_bytes_per_s": float(peak / 10 ** rng.uniform(1.5, 3)),
            "link_bytes_per_s": float(peak / 10 ** rng.uniform(2.5, 4))}


def _roofline(flops, hbm, comm, chip):
    times = {"compute": flops / chip["flop_per_s"], "memory": hbm / chip["hbm_bytes_per_s"],
             "communication": comm / chip["link_bytes_per_s"]}
    bound = max(times, key=times.get)
    return times[bound], bound, sorted(times.values())


def _critical(D, F, chip):
    """(smallest batch, exact bound) or (None, None)."""
    peak, bandwidth = chip["flop_per_s"], chip["hbm_bytes_per_s"]
    slope = D * F * bandwidth - peak * (D + F)
    if slope <= 0:
        return None, None
    exact = peak * D * F / slope
    return max(1, math.ceil(exact)), exact


def _probe_roofline(values):
    ev = form.evidence_of({name: values.get(name) for name in ("roofline_time", "critical_batch")})
    rng = _rng()
    time_fn, batch_fn = values.get("roofline_time"), values.get("critical_batch")
    fresh = {}
    if callable(time_fn):
        cases = []
        for bound, links in ROOFLINE_CASES:
            chip = _chip(rng)
            longest = float(10 ** rng.uniform(-6, -1))
            times = {b: longest * float(rng.uniform(0.01, 0.9)) for b in BOUNDS}
            times[bound] = longest
            if not links:
                times["communication"] = 0.0
            cases.append((times["compute"] * chip["flop_per_s"],
                          times["memory"] * chip["hbm_bytes_per_s"],
                          times["communication"] * chip["link_bytes_per_s"], chip))
        fresh["time"] = [[*case, _value_of(time_fn, *case)] for case in cases]
    if callable(batch_fn):
        cases = []
        for kind in BATCH_KINDS:
            while True:
                chip = _chip(rng)
                D, F = (int(2 ** rng.uniform(5, 14)) for _ in range(2))
                if kind == "one":  # memory as fast as the arithmetic, or faster
                    chip["hbm_bytes_per_s"] = chip["flop_per_s"] * float(rng.uniform(1.5, 4))
                    D, F = int(rng.integers(64, 4096)), int(rng.integers(64, 4096))
                if kind == "never":
                    D, F = int(rng.integers(8, 64)), int(rng.integers(8, 64))
                batch, exact = _critical(D, F, chip)
                found = "never" if batch is None else "one" if batch == 1 else "some"
                if found == kind and (exact is None or
                                      abs(exact - round(exact)) >= TIE_MARGIN * exact):
                    break
            cases.append((D, F, chip))
        cases += [_exact_case(rng, kind) for kind in EXACT_KINDS]
        fresh["batch"] = [[*case, _value_of(batch_fn, *case)] for case in cases]
    ev["fresh"] = fresh
    return ev


def _plain_number(call, ev, types, what):
    """The number a function that takes and returns plain Python numbers returned: a Python
    ``int`` or ``float`` (a NumPy scalar or a 0-d array is not one). Call it once the value is
    known to be right: a message about the type is for a right value only."""
    value = _number(call, ev)
    if ev["kind"] != "number" or ev.get("type") not in types:
        found = ev.get("type") if ev["kind"] == "number" else form.describe(ev)
        _fail(f"`{call}` returned a {found} ({value:g}); expected {what}, a plain Python "
              "number: the task says both functions take and return plain Python numbers "
              "(convert with float() or int(); a NumPy scalar is not one).")
    return value


def _q9(ev):
    form.expect_callable("roofline_time", ev["roofline_time"])
    for flops, hbm, comm, chip, out in ev["fresh"]["time"]:
        call = f"roofline_time({flops:.4g}, {hbm:.4g}, {comm:.4g}, chip)"
        seconds, bound, times = _roofline(flops, hbm, comm, chip)
        if out["kind"] == "error":
            _fail(f"`{call}` raised {out['error']}.")
        if out["kind"] not in ("tuple", "list") or len(out["items"]) != 2:
            _fail(f"`{call}` returned {form.describe(out)}; expected a tuple (seconds, bound).")
        found = _number(f"{call}[0]", out["items"][0])
        if not math.isclose(found, seconds, rel_tol=1e-9):
            extra = (" That is the sum of the three times; with perfect overlap the step takes "
                     "the largest." if math.isclose(found, sum(times), rel_tol=1e-9) else "")
            _fail(f"`{call}` is {found:.6g} s for a chip of {chip['flop_per_s']:.4g} FLOP/s, "
                  f"{chip['hbm_bytes_per_s']:.4g} B/s of memory and "
                  f"{chip['link_bytes_per_s']:.4g} B/s of links; expected {seconds:.6g} s, the "
                  f"largest of the compute, memory and communication times.{extra}")
        _plain_number(f"{call}[0]", out["items"][0], ("float", "int"), "a float")
        kind = out["items"][1]
        if kind["kind"] != "str" or kind["value"] != bound:
            said = repr(kind["value"]) if kind["kind"] == "str" else form.describe(kind)
            _fail(f"`{call}` names the bound {said}; expected {bound!r}, the resource whose "
                  "time is largest.")
    form.expect_callable("critical_batch", ev["critical_batch"])
    for D, F, chip, out in ev["fresh"]["batch"]:
        call = f"critical_batch({D}, {F}, chip)"
        batch, exact = _critical(D, F, chip)
        words = (f"on a chip of {chip['flop_per_s']:.4g} FLOP/s and {chip['hbm_bytes_per_s']:.4g} "
                 "B/s of memory")
        if batch is None:
            if out["kind"] == "error":
                _fail(f"`{call}` raised {out['error']} {words}; expected None: there, even a "
                      "very large batch's intensity never exceeds the chip's critical intensity "
                      "(it only approaches it).")
            if out["kind"] != "none":
                _fail(f"`{call}` returned {form.describe(out)} {words}; expected None: even for "
                      "a very large batch the product's intensity stays below the chip's "
                      "critical intensity.")
            continue
        found = _number(call, out)
        if found != batch:
            tie = (f" At B = {batch} the two times are exactly equal, and \"at least\" takes "
                   "that batch size." if exact == batch and found == batch + 1 else "")
            _fail(f"`{call}` is {found:g} {words}; expected {batch}, the smallest batch size "
                  f"(at least 1) whose compute time 2·B·D·F / flop_per_s is at least its memory "
                  f"time 2·(B·D + D·F + B·F) / hbm_bytes_per_s (the bound is B = "
                  f"{exact:.6g}).{tie}")
        _plain_number(call, out, ("int",), "an int")


# =========================================================================== questions
def _freed(probe):
    """``probe``, run after the kernel gives back what it compiled so far: each probe compiles
    a few dozen programs, and kept they piled up from 431 to 673 MiB in the solution's kernel,
    which at Gradescope's 768 MB left the container thrashing until the grader's deadline."""

    @functools.wraps(probe)
    def run(values):
        form.free_kernel_memory()
        return probe(values)

    return run


# Each question's names: those it grades, then the notebook's own names its public check reads
# (its example inputs and references), which no later cell reassigns.
QUESTIONS = {
    # Part A
    "q1_remat_scan": form.question(
        "remat_loss deep_loss deep_params deep_x deep_y compiled_grad", _q1,
        _freed(_probe_remat)),
    "q2_remat_policy": form.question(
        "policy_loss blocks_loss block_params block_x block_y", _q2, _freed(_probe_policy)),
    # Part B
    "q3_adam_reference": form.question(
        "adam_update reg_W reg_batches regression_loss LR B1 B2 EPS", _q3, _freed(_probe_adam)),
    "q4_zero_sharded_adam": form.question(
        "zero_init zero_step adam_update reg_W reg_batches mesh_data W_single m_single v_single",
        _q4, _freed(_probe_zero)),
    # Part C
    "q5_attention_reference": form.question("attention att_q att_k att_v", _q5,
                                            _freed(_probe_attention)),
    "q6_online_softmax": form.question("blocked_attention att_q att_k att_v", _q6,
                                       _freed(_probe_blocked)),
    "q7_ring_attention": form.question("ring_attention attention mesh_seq att_q att_k att_v",
                                       _q7, _freed(_probe_ring)),
    # Part D
    "q8_matmul_costs": form.question(
        "matmul_costs compile_case hlo_collectives I_DEMO J_DEMO K_DEMO N_DEVICES", _q8,
        _freed(_probe_costs)),
    "q9_roofline": form.question("roofline_time critical_batch CHIPS matmul_intensity", _q9,
                                 _freed(_probe_roofline)),
}
probe, verdict, check = form.entry_points(QUESTIONS)
JAXLAB_CHECKS = 1  # declares the probe/verdict contract `jaxlab grade` relies on
