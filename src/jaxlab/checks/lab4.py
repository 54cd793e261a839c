"""Hidden checks of Lab 4 (shipped only in the autograder zip, as ``jaxlab_lab4.py``).

Same design as Lab 3: a probe runs in the student's kernel, calls the student's functions on
fresh random inputs laid out as the question says, and records the results and the traced
program (``jax.make_jaxpr``) as plain data; a verdict judges that data only, recomputing every
reference from the lab's own recipe, and raises AssertionError in the student's terms.

Collectives are recognised by the primitive names JAX 0.10 writes in a jaxpr: inside
``shard_map`` ``psum``/``pmean`` trace to ``psum_invariant`` (``psum`` under ``vmap``),
``psum_scatter`` to ``reduce_scatter``, ``all_gather`` to ``all_gather``, ``ppermute`` to
``ppermute``; ``jax.pmap`` shows up as ``xla_pmap`` in older JAX (in 0.10 it is itself lowered
to a ``shard_map``, so a pmap answer that is numerically right cannot be told apart).
"""

import collections
import contextlib
import functools
import io
import re

import numpy as np

try:
    from . import form
except ImportError:  # in the autograder the checks are flat modules beside the notebook
    import jaxlab_form as form

# Float32 results computed in another order (blocks, rings, other devices) differ from the
# float64 references by a few ulps; anything past these tolerances is a wrong answer.
RTOL = 1e-4
ATOL = 1e-5
# Losses and gradients of the MLP: sums over 784 features in another order differ by ~1e-6.
GRAD_RTOL = 1e-3
GRAD_ATOL = 1e-4
# 1000 SGD steps of the regression, float32 (student) against float64 (reference).
TRAIN_RTOL = 1e-3
TRAIN_ATOL = 1e-4
N_DEVICES = 8
LAYER_SIZES = (784, 128, 128, 128, 128, 128, 8)
FRESH_BATCH = 64
# Sizes the tasks let vary, each tried in every grading (the first is the one whose traced
# program is read). Task 1, "examples of any length of 3 or more": the notebook's are 5 long.
CONV_LENGTHS = (7, 3, 12)
# Task 1's examples are drawn with signs, so that some convolutions are negative (a psum of their
# absolute values then differs, found blind) while every position's total over the examples stays
# at least CONV_TOTAL_MARGIN away from zero (the division stays well conditioned).
CONV_TOTAL_MARGIN = 1.0
# Task 2, "any length divisible by 8": 8 is one entry per device.
SUM_LENGTHS = (96, 8)
# Task 7, "any batch size divisible by 8": 8 is one example per device.
DP_BATCHES = (FRESH_BATCH, 8)
# Task 8, the same: 16 rows are 2 per device. At 64 a device holds 8 rows of 8 outputs, a square
# block on which a loss summed over the examples and averaged over the outputs (axis=0 for
# axis=-1, found by mutation) equals the right one
FSDP_BATCHES = (FRESH_BATCH, 16)
# Tasks 3-6: lhs and rhs of other shapes than the notebook's (every dimension divisible by 8)
MATMUL_SHAPES = ((48, 64), (64, 24))
# Task 10: one step of `update` on a new batch of this many rows
TRAIN_FRESH_ROWS = 256
LEARNING_RATE = 0.005
TRAIN_STEPS = 1000
# The MLP's gradient jumps where a ReLU's input crosses zero: one unit switching on or off for
# one example moves the gradient by ~1e-2, far past GRAD_RTOL, and two float32 computations of
# an input sitting within ~3e-6 (of its layer's spread) of zero may disagree on its sign. Fresh
# inputs are drawn so that every ReLU input is at least KINK_MARGIN of its layer's spread away
# from zero (about 1 draw in 25 qualifies; each draw costs ~4 ms).
KINK_MARGIN = 1e-4
KINK_DRAWS = 1000
# A loss that returns one device's mean instead of the batch's must never pass by chance: fresh
# draws also keep every device's share of the batch (FRESH_BATCH / N_DEVICES rows) at least
# SHARD_LOSS_GAP (relative) away from the whole batch's mean loss, ten times GRAD_RTOL.
SHARD_LOSS_GAP = 1e-2

COLLECTIVES = {
    "psum": ("psum", "psum_invariant", "psum2"),
    "all_gather": ("all_gather", "all_gather_invariant"),
    "psum_scatter": ("reduce_scatter",),
    "ppermute": ("ppermute",),
    "jax.pmap": ("xla_pmap",),
    "jax.shard_map": ("shard_map",),
}

Params = collections.namedtuple("Params", "weight bias")


# --------------------------------------------------------------------------- probes
_rng = form.fresh_rng


def _devices():
    return form.check_devices(N_DEVICES)


def _mesh(axis):
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh((N_DEVICES,), (axis,), axis_types=(AxisType.Auto,), devices=_devices())


def _put(value, mesh, *spec):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.device_put(value, NamedSharding(mesh, P(*spec)))


_error = form.student_error


def _params_evidence(value):
    """A pytree of results as evidence; namedtuples (the regression's Params) become dicts."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {"kind": "params", "items": {f: form.evidence(getattr(value, f))
                                           for f in value._fields}}
    if type(value) in (list, tuple):
        return {"kind": type(value).__name__, "items": [_params_evidence(v) for v in value]}
    return form.evidence(value)


def _trace(fn, *args):
    import jax

    try:
        closed = jax.make_jaxpr(fn)(*args)
        return {"jaxpr": str(closed), "program": form.program_evidence(closed)}
    except Exception as exc:
        return {"jaxpr_error": _error(exc)}


def _run(fn, *args, grad=False):
    """Call ``fn`` (compiled) and, with ``grad``, its gradient in the first argument."""
    import jax

    out = io.StringIO()
    ev = {}
    try:
        with contextlib.redirect_stdout(out):
            ev["output"] = _params_evidence(jax.block_until_ready(jax.jit(fn)(*args)))
            if grad:
                ev["grad"] = _params_evidence(
                    jax.block_until_ready(jax.jit(jax.grad(fn))(*args)))
    except Exception as exc:
        ev["error"] = _error(exc)
    return ev


def _probe_conv(values):
    import jax
    from jax.sharding import PartitionSpec as P

    ev = form.evidence_of(values)
    fn = values.get("normalized_convolution")
    if not callable(fn):
        return ev
    rng = _rng()
    w = rng.uniform(0.5, 2.0, size=(3,)).astype(np.float32)
    vmapped = jax.vmap(fn, in_axes=(0, None), axis_name="p")
    sharded = jax.shard_map(lambda x, w: fn(x[0], w)[None], mesh=_mesh("p"),
                            in_specs=(P("p"), P()), out_specs=P("p"))
    runs = []
    for length in CONV_LENGTHS:
        xv = _signed_examples(rng, 5, length, w)
        xs = _signed_examples(rng, N_DEVICES, length, w)
        runs.append({"x_vmap": xv, "x_shard": xs, "vmap": _run(vmapped, xv, w),
                     "shard_map": _run(sharded, xs, w)})
    ev["fresh"] = {"w": w, "runs": runs, **_trace(vmapped, runs[0]["x_vmap"], w)}
    return ev


def _signed_examples(rng, count, length, w):
    """``count`` examples of ``length`` with some negative convolutions and every position's total
    at least CONV_TOTAL_MARGIN from zero."""
    while True:
        x = rng.uniform(-1.0, 2.0, size=(count, length)).astype(np.float32)
        conv = np.stack([_convolve(row, w) for row in x])
        if (conv < 0).any() and np.abs(conv.sum(axis=0)).min() >= CONV_TOTAL_MARGIN:
            return x


def _probe_global_sum(values):
    ev = form.evidence_of(values)
    fn = values.get("global_sum")
    if callable(fn):
        rng, ev["fresh"] = _rng(), []
        for i, length in enumerate(SUM_LENGTHS):
            x = rng.uniform(-1.0, 1.0, size=(length,)).astype(np.float32)
            xp = _put(x, _mesh("i"), "i")
            ev["fresh"].append({"x": x, **_run(fn, xp), **(_trace(fn, xp) if i == 0 else {})})
    return ev


def _probe_matmul(name, lhs_spec):
    def probe_fn(values):
        ev = form.evidence_of(values)
        fn = values.get(name)
        if callable(fn):
            rng = _rng()
            lhs_shape, rhs_shape = MATMUL_SHAPES
            lhs = rng.normal(size=lhs_shape).astype(np.float32)
            rhs = rng.normal(size=rhs_shape).astype(np.float32)
            mesh = _mesh("i")
            args = (_put(lhs, mesh, *lhs_spec), _put(rhs, mesh, "i", None))
            ev["fresh"] = {"lhs": lhs, "rhs": rhs, **_run(fn, *args), **_trace(fn, *args)}
        return ev
    return probe_fn


LOSS_BATCHES = {"loss_dp": DP_BATCHES, "loss_fsdp": FSDP_BATCHES, "loss_tp": (FRESH_BATCH,)}
LOSS_LAYOUTS = {  # question: (mesh axis, params spec, inputs spec, targets spec)
    "loss_dp": ("batch", (), ("batch",), ("batch",)),
    "loss_fsdp": ("batch", ("batch",), ("batch",), ("batch",)),
    "loss_tp": ("feats", ("feats",), (None, "feats"), (None, "feats")),
}


def _probe_loss(name):
    def probe_fn(values):
        import jax

        ev = form.evidence_of(values)
        fn = values.get(name)
        if callable(fn):
            rng = _rng()
            records = []
            for size in LOSS_BATCHES[name]:
                seed = _kink_free_seed(rng, size)
                params, (inputs, targets) = _fresh_init(seed, size)
                axis, pspec, ispec, tspec = LOSS_LAYOUTS[name]
                mesh = _mesh(axis)
                params = [(_put(W, mesh, *pspec), _put(b, mesh, *pspec)) for W, b in params]
                batch = (_put(inputs, mesh, *ispec), _put(targets, mesh, *tspec))
                records.append({"seed": seed, "batch": size,
                                **_run(fn, params, batch, grad=True),
                                **(_trace(fn, params, batch) if not records else {})})
            # the first batch size's record, whose program is read; the others' values
            ev["fresh"] = {**records[0], "more": records[1:]}
        return ev
    return probe_fn


def _probe_training(values):
    import jax

    ev = {"update": form.evidence(values.get("update")),
          "params_trained": _params_evidence(values.get("params_trained"))}
    fn = values.get("update")
    if callable(fn):
        rng = _rng()
        xs = rng.normal(size=(TRAIN_FRESH_ROWS, 1)).astype(np.float32)
        ys = (3 * xs + 0.5 + 0.3 * rng.normal(size=(256, 1))).astype(np.float32)
        w, b = rng.normal(size=(2,)).astype(np.float32)
        mesh = _mesh("batch")
        args = (Params(_put(np.float32(w), mesh), _put(np.float32(b), mesh)),
                _put(xs, mesh, "batch"), _put(ys, mesh, "batch"))
        ev["fresh"] = {"xs": xs, "ys": ys, "w": float(w), "b": float(b), **_run(fn, *args),
                       **_trace(fn, *args)}
        try:
            ev["fresh"]["loss_origin"] = _output_origin(jax.make_jaxpr(fn)(*args))
        except Exception as exc:
            ev["fresh"]["loss_origin"] = {"from": "untraceable", "error": _error(exc)}
    return ev


def _output_origin(closed, index=-1):
    """Where the traced program computes its output ``index`` (the last: `update`'s loss), seen
    through jit wrappers: the primitive of the equation that makes it, and for a shard_map the
    out_specs entry of that output. A gradient's residuals leave a shard_map split over the
    devices too, so the loss's own origin is what tells a loss averaged outside (found blind)."""
    jaxpr = closed.jaxpr
    var = jaxpr.outvars[index]
    while True:
        found = [(eqn, i) for eqn in jaxpr.eqns for i, v in enumerate(eqn.outvars) if v is var]
        if not found:
            return {"from": "an input or a constant"}
        eqn, i = found[0]
        if eqn.primitive.name in ("jit", "pjit") and hasattr(eqn.params.get("jaxpr"), "jaxpr"):
            jaxpr = eqn.params["jaxpr"].jaxpr
            var = jaxpr.outvars[i]
            continue
        origin = {"from": eqn.primitive.name}
        if eqn.primitive.name == "shard_map":
            origin["spec"] = [form._spec_entry(e) for e in eqn.params["out_specs"][i]]
        return origin


# --------------------------------------------------------------------------- references
def _convolve(x, w):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    return np.array([x[i - 1:i + 2] @ w for i in range(1, len(x) - 1)])


def _normalized_convolutions(xs, w):
    out = np.stack([_convolve(x, w) for x in xs])
    return out / out.sum(axis=0, keepdims=True)


def _predict(params, inputs):
    import jax
    import jax.numpy as jnp

    for W, b in params:
        outputs = jnp.dot(inputs, W) + b
        inputs = jax.nn.relu(outputs)
    return outputs


def _loss(params, batch):
    import jax.numpy as jnp

    inputs, targets = batch
    predictions = _predict(params, inputs)
    return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))


def _init_layer(key, n_in, n_out):
    import jax
    import jax.numpy as jnp

    k1, k2 = jax.random.split(key)
    W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
    b = jax.random.normal(k2, (n_out,))
    return W, b


def _init(key, layer_sizes, batch_size):
    """The lab's `init` (seed 003): parameters and one batch of inputs and targets."""
    import jax

    key, *keys = jax.random.split(key, len(layer_sizes))
    params = list(map(_init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))
    key, *keys = jax.random.split(key, 3)
    inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
    targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))
    return params, (inputs, targets)


@functools.lru_cache(maxsize=None)
def _jitted_init(batch=FRESH_BATCH):
    import jax

    return jax.jit(lambda key: _init(key, LAYER_SIZES, batch))


def _fresh_init(seed, batch=FRESH_BATCH):
    """The params and batch that a probe draws for ``seed`` (same bits in kernel and worker)."""
    import jax

    return _jitted_init(batch)(jax.random.key(seed))


def _kink_margin(params, inputs):
    """How close the nearest ReLU input comes to zero, in units of its layer's spread."""
    h, margin = np.asarray(inputs, np.float64), np.inf
    for W, b in params[:-1]:
        z = h @ np.asarray(W, np.float64) + np.asarray(b, np.float64)
        margin = min(margin, float(np.abs(z).min() / z.std()))
        h = np.maximum(z, 0.0)
    return margin


def _shard_loss_gap(params, batch, shards=N_DEVICES):
    """How far the nearest device's mean loss over its rows lies from the batch's, relatively."""
    inputs, targets = batch
    h = np.asarray(inputs, np.float64)
    for i, (W, b) in enumerate(params):
        h = h @ np.asarray(W, np.float64) + np.asarray(b, np.float64)
        if i < len(params) - 1:
            h = np.maximum(h, 0.0)
    per_example = ((h - np.asarray(targets, np.float64)) ** 2).sum(axis=-1)
    whole = per_example.mean()
    return float(np.abs(per_example.reshape(shards, -1).mean(axis=1) - whole).min() / whole)


def _kink_free_seed(rng, batch=FRESH_BATCH, draws=KINK_DRAWS):
    """A seed whose fresh draw keeps clear of ReLU kinks (KINK_MARGIN) and whose devices' mean
    losses each differ from the batch's (SHARD_LOSS_GAP); else the draw closest to both."""
    best = (-1.0, None)
    for _ in range(draws):
        seed = int(rng.integers(1, 2**31))
        params, data = _fresh_init(seed, batch)
        margin, gap = _kink_margin(params, data[0]), _shard_loss_gap(params, data)
        if margin >= KINK_MARGIN and gap >= SHARD_LOSS_GAP:
            return seed
        best = max(best, (min(margin / KINK_MARGIN, gap / SHARD_LOSS_GAP), seed))
    return best[1]


@functools.lru_cache(maxsize=None)
def _jitted_value_and_grad():
    import jax

    return jax.jit(jax.value_and_grad(_loss))


def _reference_loss_and_grad(seed, batch=FRESH_BATCH):
    params, batch = _fresh_init(seed, batch)
    loss, grads = _jitted_value_and_grad()(params, batch)
    return float(loss), [(np.asarray(W), np.asarray(b)) for W, b in grads]


def _regression_step(w, b, xs, ys, lr=LEARNING_RATE):
    """One single-device SGD step of the seed's linear regression, in float64."""
    xs, ys = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
    err = w * xs + b - ys
    return (w - lr * 2 * np.mean(err * xs), b - lr * 2 * np.mean(err), float(np.mean(err ** 2)))


@functools.lru_cache(maxsize=None)
def _regression_data():
    """xs, ys and the initial Params exactly as the notebook makes them."""
    import jax

    rng = np.random.default_rng(0)
    xs = rng.normal(size=(128, 1)).astype(np.float32)
    noise = 0.5 * rng.normal(size=(128, 1)).astype(np.float32)
    ys = (xs * 2 - 1 + noise).astype(np.float32)
    weights_key, bias_key = jax.random.split(jax.random.PRNGKey(123))
    w = float(jax.random.normal(weights_key, ()))
    b = float(jax.random.normal(bias_key, ()))
    return xs, ys, w, b


@functools.lru_cache(maxsize=None)
def _trained_reference():
    xs, ys, w, b = _regression_data()
    for _ in range(TRAIN_STEPS):
        w, b, _ = _regression_step(w, b, xs, ys)
    return w, b


# --------------------------------------------------------------------------- verdict helpers
_fail = form.fail


_close = functools.partial(form.expect_close, rtol=RTOL, atol=ATOL)


def _is_multiple(actual, expected, factor, rtol=GRAD_RTOL, atol=GRAD_ATOL):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return actual.shape == expected.shape and np.allclose(actual, factor * expected, rtol=rtol,
                                                          atol=atol)


def _primitives(jaxpr):
    return set(re.findall(r"\b([a-z_][a-z0-9_]*)\[", jaxpr))


def _uses(jaxpr, collective):
    return bool(_primitives(jaxpr) & set(COLLECTIVES[collective]))


_fresh = form.fresh_record


def _method(name, fresh, required=(), forbidden=(), shard_map=True, why=""):
    if "jaxpr_error" in fresh:
        _fail(f"`{name}` could not be traced with jax.make_jaxpr: {fresh['jaxpr_error']}")
    jaxpr = fresh["jaxpr"]
    if shard_map and not _uses(jaxpr, "jax.shard_map"):
        _fail(f"`{name}` gives the right numbers but does not go through jax.shard_map; this "
              "task asks you to write the per-device program with jax.shard_map.")
    for collective in forbidden:
        if _uses(jaxpr, collective):
            _fail(f"`{name}` uses `{collective}`, which this task rules out{why}.")
    for collective in required:
        if not _uses(jaxpr, collective):
            _fail(f"`{name}` gives the right numbers but its traced program has no "
                  f"`jax.lax.{collective}`; this task asks you to use it{why}.")


# the jax.lax function a student wrote, for the primitive it traces to (messages name the former)
LAX_NAMES = {"psum_invariant": "psum", "psum2": "psum", "all_gather_invariant": "all_gather",
             "reduce_scatter": "psum_scatter"}
# primitives that move data between devices (pvary, which check_vma inserts, moves nothing)
COMMUNICATION = ("psum", "psum_invariant", "psum2", "all_gather", "all_gather_invariant",
                 "reduce_scatter", "ppermute", "all_to_all", "pmax", "pmin")


def _body(fresh):
    """The equations of every shard_map body of the traced program, in program order."""
    return [step for sm in fresh["program"]["shard_maps"] for step in sm["body"]]


def _one_scalar_collective(name, fresh, words):
    """One collective in the shard_map, of one number per device (a 0-d array, or a 1-element
    one such as a sum taken with keepdims=True, found blind)."""
    moves = [(prim, shapes) for prim, shapes in _body(fresh) if prim in COMMUNICATION]
    if len(moves) != 1 or len(moves[0][1]) != 1 or int(np.prod(moves[0][1][0])) != 1:
        found = ", ".join(f"`{LAX_NAMES.get(p, p)}` of an array of shape "
                          f"{tuple(s[0]) if s else ()}" for p, s in moves) or "none"
        _fail(f"`{name}` communicates {len(moves)} time(s) inside its shard_map ({found}); "
              f"expected what the task says: {words}.")


def _on_mesh_axis(name, fresh, axis, mesh_name):
    """Every shard_map of the program runs on a 1-D mesh whose axis is ``axis`` (the task names
    the mesh ``mesh_name``): the notebook's other meshes hold the same 8 devices, and on Auto
    axes the inputs are laid out again silently, so only the program shows it (found blind)."""
    for sm in fresh["program"]["shard_maps"]:
        if sm["axis_names"] != [axis]:
            axes = ", ".join(repr(a) for a in sm["axis_names"])
            _fail(f"`{name}` runs jax.shard_map on a mesh whose axis is {axes}; expected what "
                  f"the task says: jax.shard_map on `{mesh_name}`, whose axis is '{axis}'.")


def _jitted(name, fresh):
    form.expect_jitted(name, fresh["program"])


_operand_layout = form.expect_operands_split


def _order(name, fresh, first, then, words):
    """Every ``then`` equation of the shard_map body comes after some ``first`` equation."""
    steps = _body(fresh)
    seen = False
    for prim, _ in steps:
        if prim in first:
            seen = True
        elif prim in then and not seen:
            _fail(f"`{name}` runs {_in_words(prim, 'a ')} before any {_in_words(first[0])} in "
                  f"its shard_map; expected what the task says: {words}.")


def _in_words(prim, article=""):
    return f"{article}matrix product" if prim == "dot_general" else \
        f"`{LAX_NAMES.get(prim, prim)}`"


def _array_out(call, out, shape):
    if out["kind"] != "array":
        _fail(f"`{call}` returned {form.describe(out)}; expected a jax.Array of shape {shape}.")
    if tuple(out["shape"]) != tuple(shape):
        _fail(f"`{call}` returned an array of shape {tuple(out['shape'])}; expected {shape}.")


def _on_8_devices(call, out, spec, words):
    from jax.sharding import PartitionSpec as P

    sev = out["sharding"]
    if sev["kind"] != "NamedSharding" or len(sev["devices"]) != N_DEVICES:
        _fail(f"`{call}` returned an array {form.describe_sharding(sev)}; expected it spread "
              f"over the {N_DEVICES} devices of the mesh, {words}.")
    if len(sev["axis_names"]) == 1:
        spec = tuple(sev["axis_names"][0] if s == "axis" else s for s in spec)
    if not form.is_laid_out_as(sev, len(out["shape"]), P(*spec)):
        _fail(f"`{call}` returned an array {form.describe_sharding(sev)}; expected {words} "
              "(check `out_specs`).")


# --------------------------------------------------------------------------- verdicts
def _q1(ev):
    fresh = _fresh("normalized_convolution", ev, "normalized_convolution(x, w)")
    for runs in fresh["runs"]:
        for key, xs, how in (("vmap", runs["x_vmap"], "jax.vmap(normalized_convolution, "
                              "in_axes=(0, None), axis_name='p')"),
                             ("shard_map", runs["x_shard"], "jax.shard_map over a mesh axis "
                              "'p' (one example per device)")):
            run = runs[key]
            call = f"normalized_convolution under {how}"
            if "error" in run:
                _fail(f"`{call}` on {len(xs)} new examples of length {xs.shape[1]} raised "
                      f"{run['error']}; it should divide each example's convolution by "
                      "jax.lax.psum of the convolutions over the axis named 'p', for examples "
                      "of any length of 3 or more.")
            expected = _normalized_convolutions(xs, fresh["w"])
            call = f"{call} on examples of length {xs.shape[1]}"
            _array_out(call, run["output"], expected.shape)
            _close(call, run["output"]["value"], expected,
                   "each example's convolution divided by the sum of the convolutions over "
                   "all examples (a psum over the axis 'p')")
    _method("normalized_convolution", fresh, required=("psum",), shard_map=False)


def _q2(ev):
    form.expect_callable("global_sum", ev["global_sum"])
    cases = ev.get("fresh") or _fail("`global_sum` could not be tried on new data.")
    for fresh in cases:
        n = len(fresh["x"])
        call = f"global_sum(x) for x of length {n}"
        _fresh("global_sum", {"global_sum": ev["global_sum"], "fresh": fresh}, call)
        out = fresh["output"]
        if out["kind"] == "array" and out["shape"] == [N_DEVICES] and n != N_DEVICES:
            _fail(f"`{call}` returned {N_DEVICES} numbers, one per device; add them up with "
                  "a collective inside the shard_map and return a scalar replicated on every "
                  "device (out_specs=P()).")
        _array_out(call, out, ())
        _close(call, out["value"], np.sum(fresh["x"], dtype=np.float64),
               f"the sum of all {n} entries of x, for any length divisible by 8")
    fresh = cases[0]
    out = fresh["output"]
    _method("global_sum", fresh, required=("psum",), forbidden=("all_gather",),
            why=": each device sums its own block, then one psum adds the partial sums")
    _on_mesh_axis("global_sum", fresh, "i", "mesh")
    _on_8_devices("global_sum(x)", out, (), "replicated")
    _operand_layout("global_sum", fresh["program"], fresh["x"].shape, "x", 0,
                    "x is sharded over `mesh` (spec P('i'))")
    _one_scalar_collective("global_sum", fresh, "each device sums its own block, and one "
                           "collective adds up the eight partial sums (one number per device)")


MATMUL_LAYOUTS = {  # lhs layout in words: (dimension of lhs split, spec)
    "rows": (0, "P('i', None)"),
    "columns": (1, "P(None, 'i')"),
}
MATMUL_ORDER = {  # question: (first, then, the task's words)
    "q3_matmul_allgather": (("all_gather", "all_gather_invariant"), ("dot_general",),
                            "to gather rhs with all_gather, then multiply locally"),
    "q5_matmul_reducescatter": (("dot_general",), ("reduce_scatter",),
                                "to multiply locally, then combine the partial products with "
                                "psum_scatter"),
}

MATMULS = {  # question: (function, lhs layout in words, required, forbidden, why)
    "q3_matmul_allgather": ("matmul_allgather", "rows", ("all_gather",), (),
                            ": gather the blocks of rhs, then multiply locally"),
    "q4_matmul_ring": ("matmul_allgather_overlapped", "rows", ("ppermute",),
                       ("all_gather", "psum"),
                       ": blocks of rhs must travel around a ppermute ring instead"),
    "q5_matmul_reducescatter": ("matmul_psumscatter", "columns", ("psum_scatter",), (),
                                ": multiply locally, then psum_scatter the partial products"),
    "q6_matmul_ring_reducescatter": ("matmul_psumscatter_overlapped", "columns", ("ppermute",),
                                     ("psum_scatter", "psum", "all_gather"),
                                     ": partial sums must travel around a ppermute ring "
                                     "instead"),
}


def _matmul_verdict(question):
    name, lhs_words, required, forbidden, why = MATMULS[question]

    def verdict_fn(ev):
        call = f"{name}(lhs, rhs)"
        fresh = _fresh(name, ev, call)
        lhs, rhs = fresh["lhs"], fresh["rhs"]
        expected = lhs.astype(np.float64) @ rhs
        what = (f"lhs @ rhs for new lhs {lhs.shape} sharded by {lhs_words} and rhs "
                f"{rhs.shape} sharded by rows")
        _array_out(call, fresh["output"], expected.shape)
        _close(call, fresh["output"]["value"], expected, what)
        _method(name, fresh, required=required, forbidden=forbidden, why=why)
        _on_mesh_axis(name, fresh, "i", "mesh")
        _on_8_devices(call, fresh["output"], ("axis", None),
                      "the result sharded by rows (out_specs=P('i', None))")
        dim, spec = MATMUL_LAYOUTS[lhs_words]
        _operand_layout(name, fresh["program"], lhs.shape, "lhs", dim,
                        f"lhs is sharded by {lhs_words} ({spec})")
        _operand_layout(name, fresh["program"], rhs.shape, "rhs", 0, "rhs is sharded by rows (P('i', None))")
        if question in MATMUL_ORDER:
            _order(name, fresh, *MATMUL_ORDER[question])
        if question == "q3_matmul_allgather":
            for prim, shapes in _body(fresh):
                if prim in COLLECTIVES["all_gather"] and np.prod(shapes[0]) != rhs.size:
                    _fail(f"`{name}` gathers an array of shape {tuple(shapes[0])} with "
                          f"all_gather; expected what the task says: gather rhs (shape "
                          f"{rhs.shape}), then multiply locally.")
        _jitted(name, fresh)
    return verdict_fn


LOSS_MESHES = {"q7_loss_dp": ("batch", "mesh_batch"), "q8_loss_fsdp": ("batch", "mesh_batch"),
               "q9_loss_tp": ("feats", "mesh_feats")}
LOSSES = {  # question: (function, required, forbidden, why)
    "q7_loss_dp": ("loss_dp", ("psum",), ("all_gather",),
                   ": each device computes the loss of its part of the batch with the full "
                   "(replicated) parameters, and one pmean/psum combines the scalars"),
    "q8_loss_fsdp": ("loss_fsdp", ("all_gather", "psum"), (),
                     ": each device gathers every weight with all_gather just before using it, "
                     "and one pmean/psum combines the losses"),
    "q9_loss_tp": ("loss_tp", ("psum_scatter",), ("all_gather",),
                   ": weights stay sharded over features; each layer multiplies locally and "
                   "psum_scatter sums and re-shards the result"),
}


def _leaves(name, ev):
    """The (W, b) arrays of a params-shaped result, flattened."""
    if ev["kind"] not in ("list", "tuple") or len(ev["items"]) != len(LAYER_SIZES) - 1:
        _fail(f"`{name}` is {form.describe(ev)}; expected a list of "
              f"{len(LAYER_SIZES) - 1} (W, b) pairs like `params`.")
    leaves = []
    for pair in ev["items"]:
        if pair["kind"] not in ("list", "tuple") or len(pair["items"]) != 2 or any(
                p["kind"] != "array" for p in pair["items"]):
            _fail(f"`{name}` should hold (W, b) pairs of arrays; one item is "
                  f"{form.describe(pair)}.")
        leaves.extend(pair["items"])
    return leaves


def _loss_values(name, fresh):
    """The loss and its gradient on one fresh batch, against the single-device ones."""
    size = fresh.get("batch", FRESH_BATCH)
    call = f"{name}(params, batch)" + (f" for a batch of {size}" if size != FRESH_BATCH else "")
    if "error" in fresh:
        _fail(f"`{call}` on new data raised {fresh['error']}; it should work for any inputs of "
              "the layout the task describes.")
    ref_loss, ref_grads = _reference_loss_and_grad(fresh["seed"], size)
    out = fresh["output"]
    _array_out(call, out, ())
    value = float(out["value"])
    if _is_multiple(value, ref_loss, N_DEVICES):
        _fail(f"`{call}` is {value:.6g}, {N_DEVICES} times the loss {ref_loss:.6g}: psum "
              "adds up the per-device mean losses. Average them with jax.lax.pmean "
              f"(or divide the psum by {N_DEVICES}).")
    _close(call, value, ref_loss, "the single-device `loss(params, batch)` for new "
           "params and batch", rtol=GRAD_RTOL, atol=GRAD_ATOL)
    grad_call = f"jax.grad({name})(params, batch)"
    leaves = _leaves(grad_call, fresh["grad"])
    expected = [g for pair in ref_grads for g in pair]
    if all(_is_multiple(a["value"], e, N_DEVICES) for a, e in zip(leaves, expected)):
        _fail(f"`{grad_call}` is {N_DEVICES} times the gradient of the single-device loss. "
              "Inside jax.shard_map, jax.grad with respect to replicated parameters "
              "already sums the gradient over the devices; check which collective you "
              "apply and to what.")
    for i, (leaf, exp) in enumerate(zip(leaves, expected)):
        _close(f"{grad_call}[{i // 2}][{i % 2}]", leaf["value"], exp,
               "the gradient of the single-device `loss` for new params and batch",
               rtol=GRAD_RTOL, atol=GRAD_ATOL)


def _loss_verdict(question):
    name, required, forbidden, why = LOSSES[question]

    def verdict_fn(ev):
        fresh = _fresh(name, ev, f"{name}(params, batch)")
        for record in [fresh, *fresh.get("more", ())]:
            _loss_values(name, record)
        _method(name, fresh, required=required, forbidden=forbidden, why=why)
        _on_mesh_axis(name, fresh, *LOSS_MESHES[question])
        LOSS_METHODS[question](name, fresh)
    return verdict_fn


BATCH = ((FRESH_BATCH, LAYER_SIZES[0]), (FRESH_BATCH, LAYER_SIZES[-1]))
WEIGHTS = tuple(zip(LAYER_SIZES[:-1], LAYER_SIZES[1:]))
BIASES = tuple(sorted({(n,) for n in LAYER_SIZES[1:]}))


def _dp_method(name, fresh):
    for shape, what in zip(BATCH, ("the inputs of the batch", "the targets of the batch")):
        _operand_layout(name, fresh["program"], shape, what, 0,
                        "the batch is sharded along its first axis (P('batch'))")
    for shape in WEIGHTS + BIASES:
        _operand_layout(name, fresh["program"], shape, "a parameter", None,
                        "the parameters are replicated (P())")
    _one_scalar_collective(name, fresh, "the losses of the devices are combined with one "
                           "scalar collective (one pmean or psum of the local loss)")


def _fsdp_method(name, fresh):
    for shape, what in zip(BATCH, ("the inputs of the batch", "the targets of the batch")):
        _operand_layout(name, fresh["program"], shape, what, 0,
                        "the batch is sharded along its first axis (P('batch'))")
    for shape in WEIGHTS + BIASES:
        _operand_layout(name, fresh["program"], shape, "a parameter", 0,
                        "every W and b is sharded along its first axis (P('batch'))")
    if re.search(r"\ball_gather(?:_invariant)?\[[^\]]*?\btiled=False", fresh["jaxpr"]):
        _fail(f"`{name}` gathers with jax.lax.all_gather(..., tiled=False), which stacks the "
              "devices' blocks along a new axis; expected what the task says: gather each W and "
              "b with jax.lax.all_gather(..., tiled=True), which concatenates them.")
    gathered = products = 0
    for prim, _ in _body(fresh):
        if prim in COLLECTIVES["all_gather"]:
            gathered += 1
        elif prim == "dot_general":
            products += 1
            if gathered > 2 * products:
                _fail(f"`{name}` has gathered {gathered} arrays with all_gather before its "
                      f"matrix product number {products}; expected what the task says: gather "
                      "each W and b just before it is used (layer by layer), not all "
                      "parameters up front.")


def _tp_method(name, fresh):
    for shape, what in ((BATCH[0], "the inputs"),
                        *(((FRESH_BATCH, n), "activations") for n in LAYER_SIZES[1:-1])):
        _operand_layout(name, fresh["program"], shape, what, 1,
                        "inputs and activations are sharded over features (P(None, 'feats'))")
    for shape in WEIGHTS:
        _operand_layout(name, fresh["program"], shape, "a weight matrix", 0,
                        "each W is sharded by rows (P('feats', None))")
    for shape in BIASES:
        _operand_layout(name, fresh["program"], shape, "a bias", 0,
                        "each b is sharded over its features (P('feats'))")
    pending = False
    for prim, _ in _body(fresh):
        if prim == "dot_general":
            if pending:
                break
            pending = True
        elif prim in COLLECTIVES["psum_scatter"]:
            pending = False
    if pending:
        _fail(f"`{name}` has a matrix product inside jax.shard_map that is not followed by "
              "psum_scatter before the next one; expected what the task says: every layer is a "
              "local matrix product followed by jax.lax.psum_scatter.")


LOSS_METHODS = {"q7_loss_dp": _dp_method, "q8_loss_fsdp": _fsdp_method, "q9_loss_tp": _tp_method}


def _scalar_pair(name, ev):
    """(weight, bias) evidence from a Params namedtuple or a 2-tuple."""
    if ev["kind"] == "params" and set(ev["items"]) == {"weight", "bias"}:
        items = [ev["items"]["weight"], ev["items"]["bias"]]
    elif ev["kind"] in ("tuple", "list") and len(ev["items"]) == 2:
        items = ev["items"]
    else:
        _fail(f"`{name}` is {form.describe(ev)}; expected Params(weight, bias).")
    for field, item in zip(("weight", "bias"), items):
        if item["kind"] not in ("array", "number") or item.get("shape", []) != []:
            _fail(f"`{name}.{field}` is {form.describe(item)}; expected a scalar.")
    return items


SUM_OF_COPIES = (
    "all-reduces a value that every device already holds, such as jax.lax.pmean of the "
    "gradient of the averaged loss (inside jax.shard_map, jax.grad with respect to replicated "
    "params already all-reduces the gradient). The step is right, but that all-reduce is one "
    "too many; expected what the task says: the gradient averaged over the devices and "
    "all-reduced once. Average the loss with jax.lax.pmean and use its gradient as it is.")


def _no_sum_of_copies(name, program):
    if any(sm.get("sums_of_copies", 0) for sm in program["shard_maps"]):
        _fail(f"`{name}` {SUM_OF_COPIES}")


def _q10(ev):
    from jax.sharding import PartitionSpec as P

    fresh = _fresh("update", ev, "update(params, xs, ys)")
    call = "update(params, xs, ys)"
    out = fresh["output"]
    if out["kind"] not in ("tuple", "list") or len(out["items"]) != 2:
        _fail(f"`{call}` returned {form.describe(out)}; expected (new_params, loss) as the "
              "seed's update does.")
    new_ev, loss_ev = out["items"]
    new = _scalar_pair(f"{call}[0]", new_ev)
    w, b = fresh["w"], fresh["b"]
    ref_w, ref_b, ref_loss = _regression_step(w, b, fresh["xs"], fresh["ys"])
    found = np.array([float(np.asarray(i["value"])) for i in new])
    step = found - [w, b]
    ref_step = np.array([ref_w - w, ref_b - b])
    if np.allclose(step, N_DEVICES * ref_step, rtol=GRAD_RTOL, atol=1e-7):
        _fail(f"`{call}` takes a step {N_DEVICES} times too large: its gradient is "
              f"{N_DEVICES}x the true one. Inside jax.shard_map (with its default "
              "check_vma=True), jax.grad with respect to replicated params already sums the "
              "per-device gradients, so the pmap recipe 'pmean the grads' multiplies them by "
              "the number of devices. Take the gradient of jax.lax.pmean(loss, axis) instead, "
              "or do not average the gradients again.")
    _close(f"{call}[0]", step, ref_step, f"a step of -{LEARNING_RATE} × the gradient of the "
           "mean squared error over the whole (new) batch, as on one device",
           rtol=GRAD_RTOL, atol=1e-7)
    if loss_ev["kind"] not in ("array", "number") or loss_ev.get("shape", []) != []:
        _fail(f"`{call}[1]` (the loss) is {form.describe(loss_ev)}; expected a scalar.")
    _close(f"{call}[1]", float(np.asarray(loss_ev["value"])), ref_loss,
           "the mean squared error over the whole batch before the step (a pmean over devices)",
           rtol=GRAD_RTOL)
    for field, item in zip(("weight", "bias"), new):
        if item["kind"] == "array":
            _on_8_devices(f"{call}[0].{field}", item, (), "replicated (out_specs=P())")
    if loss_ev["kind"] == "array":
        _on_8_devices(f"{call}[1]", loss_ev, (), "replicated (out_specs=P())")
    _method("update", fresh, required=("psum",), forbidden=("jax.pmap",),
            why=": average over the devices inside jax.shard_map, not with jax.pmap")
    _on_mesh_axis("update", fresh, "batch", "mesh_dp")
    origin = fresh.get("loss_origin", {})
    if origin.get("from") != "shard_map" or form.split_dims(origin.get("spec", [])):
        where = (f"jax.shard_map returns it split over the devices (out_specs "
                 f"{form.spec_repr(origin['spec'])})" if origin.get("from") == "shard_map" else
                 f"it is computed outside jax.shard_map (by `{origin.get('from')}`)")
        _fail(f"`update` returns a loss that no jax.shard_map returns replicated: {where}; "
              "expected what the task says: (new_params, loss) both replicated "
              "(out_specs=(P(), P())), the loss averaged over the devices inside the shard_map "
              "(jax.lax.pmean).")
    _operand_layout("update", fresh["program"], fresh["xs"].shape, "xs or ys", 0,
                    "xs and ys are sharded along the batch axis (P('batch'))")
    _no_sum_of_copies("update", fresh["program"])
    _jitted("update", fresh)
    form.expect_defined("params_trained", ev["params_trained"])
    trained = _scalar_pair("params_trained", ev["params_trained"])
    ref = _trained_reference()
    for field, item, expected in zip(("weight", "bias"), trained, ref):
        _close(f"params_trained.{field}", float(np.asarray(item["value"])), expected,
               f"the {field} after {TRAIN_STEPS} steps of single-device SGD from the lab's "
               "`params` on `xs`, `ys`", rtol=TRAIN_RTOL, atol=TRAIN_ATOL)
        sev = item.get("sharding", {})
        if item["kind"] != "array" or sev.get("kind") != "NamedSharding" \
                or len(sev["devices"]) != N_DEVICES \
                or not form.is_laid_out_as(sev, len(item["shape"]), P()):
            where = (f"lives {form.describe_sharding(sev)}" if item["kind"] == "array"
                     else f"is {form.describe(item)}, not a jax.Array")
            _fail(f"`params_trained.{field}` {where}; expected it replicated on the "
                  f"{N_DEVICES} devices of mesh_dp, as the task defines `params_trained`: what "
                  "train(update, params_replicated, xs_sharded, ys_sharded) returns. A copy of "
                  "the single-device result is not the output of the sharded run.")


# the notebook's own names that a question's public check reads besides its graded ones (its
# inputs and single-device references; no cell after the question reassigns them)
NOTEBOOK = {
    "q1": " convolve one_d_mesh w xs_conv",
    "q2": " v",
    "q3": " lhs rhs expected_product",
    "q4": " lhs rhs expected_product",
    "q5": " lhs_by_cols rhs expected_product",
    "q6": " lhs_by_cols rhs expected_product",
    "q7": " params_dp batch_dp loss_single grad_single",
    "q8": " params_fsdp batch_fsdp loss_single grad_single",
    "q9": " params_tp batch_tp loss_single grad_single",
    "q10": " update_single params_init xs ys xs_sharded ys_sharded params_replicated "
           "params_single",
}
QUESTIONS = {
    "q1_vmap_collective": form.question("normalized_convolution" + NOTEBOOK["q1"], _q1,
                                        _probe_conv),
    "q2_global_sum": form.question("global_sum" + NOTEBOOK["q2"], _q2, _probe_global_sum),
    **{q: form.question(name + NOTEBOOK[q.split("_")[0]], _matmul_verdict(q),
                        _probe_matmul(name, spec))
       for q, spec in (("q3_matmul_allgather", ("i", None)), ("q4_matmul_ring", ("i", None)),
                       ("q5_matmul_reducescatter", (None, "i")),
                       ("q6_matmul_ring_reducescatter", (None, "i")))
       for name in [MATMULS[q][0]]},
    **{q: form.question(LOSSES[q][0] + NOTEBOOK[q.split("_")[0]], _loss_verdict(q),
                        _probe_loss(LOSSES[q][0])) for q in LOSSES},
    "q10_dp_training": form.question("update params_trained" + NOTEBOOK["q10"], _q10,
                                     _probe_training),
}

probe, verdict, check = form.entry_points(QUESTIONS)
JAXLAB_CHECKS = 1  # declares the probe/verdict contract `jaxlab grade` relies on
