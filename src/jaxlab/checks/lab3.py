"""Hidden checks of Lab 3 (shipped only in the autograder zip, as ``jaxlab_lab3.py``).

Each question has a probe, which runs in the student's kernel and reduces the graded variables
to plain data (see ``form``), and a verdict, which judges that data and raises AssertionError
with a message in the student's terms. Every reference is recomputed here from the lab's own
recipe (the same keys, shapes and code as the notebook), never read from the notebook.
"""

import contextlib
import functools
import io
import math
import os
import time
import traceback

import numpy as np

try:
    from . import form
except ImportError:  # in the autograder the checks are flat modules beside the notebook
    import jaxlab_form as form

# Float32 results computed in another order (another device count, another mesh) differ from
# the float64 NumPy references by a few ulps; anything past these tolerances is a wrong answer.
RTOL = 1e-4
ATOL = 1e-5
# Sharded and single-device training agree to ~1e-7; the tolerance leaves room for other
# device counts while still catching a wrong learning rate or a missing step.
TRAIN_RTOL = 1e-3
TRAIN_ATOL = 1e-5
# A correct timing lies within this factor of the probe's own measurement on the same machine;
# forgetting block_until_ready is ~1000x off, timing the compile ~10-50x.
TIMING_FACTOR = 10
# `seconds_per_call` is judged on a stand-in for a jitted function whose every duration is known.
# Its first call blocks for TIMING_FIRST_CALL s (as compiling does); the work of call k then takes
# TIMING_WORK[k] steps of TIMING_STEP s, starts when the previous call's work ends (one device
# working in order) and its result is ready only then (asynchronous dispatch). The stand-in
# records when each call was made and when each wait for a result returned, so the average the
# task asks for (the time of the calls after the first, divided by their number) is known on this
# machine to within a fraction of a millisecond. Over 2..100 timed calls, the pattern keeps every
# usual slip (one call too many or too few in the count, the first call's work left running into
# the timed region, the fastest or the median call) at least one step away on the total, and the
# answer is accepted within TIMING_TOLERANCE steps of it (searched by brute force, 2026-11-27).
# Not waiting reads ~0; counting the first call adds TIMING_FIRST_CALL.
TIMING_FIRST_CALL = 0.25
TIMING_STEP = 0.03  # 15 ms of slack on the total: far above a wait's overshoot under load
TIMING_FIRST_WORK = 3  # steps: what a warm-up that is not waited for leaks into the timing
TIMING_PATTERN = (1, 2, 1)  # steps of the later calls' work, repeated
TIMING_TOLERANCE = 0.5  # steps, on the total time of the timed calls
TIMING_MAX_TIMED = 100  # the task's "at most 100"
# calls before the clock starts that are accepted ("once"; twice is harmless); the stand-in takes
# at most one warm-up and TIMING_MAX_TIMED timed calls, so more timed calls cannot pass as two
# warm-ups
TIMING_WARMUPS = (1, 2)
TIMING_MIN_TIMED = 2  # calls after the first: one timed call is not an average
MESH_SIZES = (4, 8)
# the notebook's training problem on a CPU: (n, layer_sizes); q9's probe times grad_loss on it
CPU_TRAINING = (1024, (1, 256, 256, 1))
FRESH_ROWS = 64


# --------------------------------------------------------------------------- probes
def _call(fn, *args):
    """Call a student's function, keeping what it prints and how it fails."""
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            result = fn(*args)
        return {"printed": out.getvalue(), "output": form.evidence(result)}
    except Exception as exc:
        last = traceback.extract_tb(exc.__traceback__)[-1]
        return {"printed": out.getvalue(),
                "error": f"{type(exc).__name__}: {exc}".strip()[:600],
                "where": f"line {last.lineno} of {os.path.basename(last.filename)}"}


def _fresh_layer_inputs(rows=FRESH_ROWS):
    rng = form.fresh_rng()
    return (rng.normal(size=(rows, 10)).astype(np.float32),
            rng.normal(size=(10, 2)).astype(np.float32),
            rng.normal(size=(2,)).astype(np.float32))


def _fresh_evidence(xf, Wf, bf):
    return {"x": xf, "W": Wf, "b": bf}


def _probe_explicit(values):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    ev = form.evidence_of(values)
    fn, xe = values.get("layer_explicit"), values.get("x_explicit")
    if callable(fn) and form._is_jax_array(xe) and isinstance(xe.sharding, NamedSharding) \
            and len(xe.sharding.mesh.axis_names) == 1:
        mesh = xe.sharding.mesh
        xf, Wf, bf = _fresh_layer_inputs()
        if hasattr(fn, "clear_cache"):
            # a trace cached from an earlier call with the same shapes would print nothing
            fn.clear_cache()
        args = (jax.device_put(xf, NamedSharding(mesh, P(mesh.axis_names[0]))),
                jax.device_put(Wf, NamedSharding(mesh, P())),
                jax.device_put(bf, NamedSharding(mesh, P())))
        ev["fresh"] = {**_fresh_evidence(xf, Wf, bf), **_call(fn, *args)}
    return ev


def _probe_manual(values):
    import jax

    ev = form.evidence_of(values)
    fn = values.get("layer_manual")
    if callable(fn):
        xf, Wf, bf = _fresh_layer_inputs()
        ev["fresh"] = {**_fresh_evidence(xf, Wf, bf), **_call(fn, xf, Wf, bf)}
        try:
            closed = jax.make_jaxpr(fn)(xf, Wf, bf)
            ev["jaxpr"] = str(closed)
            ev["program"] = form.program_evidence(closed)
        except Exception as exc:
            ev["jaxpr_error"] = f"{type(exc).__name__}: {exc}"[:600]
    return ev


def _seconds_per_call(fn, *args, repeats=3):  # the median of 3 is well inside TIMING_FACTOR
    import jax

    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - start)
    return float(np.median(runs))


class _AsyncResult:
    """A result that is ready at ``ready_at`` (perf_counter seconds), like a jax.Array that JAX
    returned before its computation finished; a wait for it is recorded by its workload."""

    def __init__(self, workload, index, ready_at):
        self._workload, self._index, self._ready_at = workload, index, ready_at

    def block_until_ready(self):
        delay = self._ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        self._workload.waits.append([self._index, time.perf_counter()])
        return self

    def __array__(self, dtype=None, copy=None):
        self.block_until_ready()
        return np.zeros((), dtype or np.float32)


class _TooManyCalls(RuntimeError):
    pass


def _work_steps(index):
    """Steps of work of call ``index`` (0 for the first call)."""
    return TIMING_FIRST_WORK if index == 0 else TIMING_PATTERN[(index - 1) % len(TIMING_PATTERN)]


class _Workload:
    """The stand-in for a jitted function (see TIMING_FIRST_CALL)."""

    def __init__(self):
        self.entered, self.ready, self.waits, self._busy_until = [], [], [], 0.0

    def __call__(self, *args, **kwargs):
        index = len(self.entered)
        if index >= 1 + TIMING_MAX_TIMED:
            raise _TooManyCalls(f"seconds_per_call called the function more than "
                                f"{1 + TIMING_MAX_TIMED} times")
        self.entered.append(time.perf_counter())
        if index == 0:
            time.sleep(TIMING_FIRST_CALL)  # compiling blocks the caller
        start = max(self._busy_until, time.perf_counter())
        self._busy_until = start + _work_steps(index) * TIMING_STEP
        self.ready.append(self._busy_until)
        return _AsyncResult(self, index, self._busy_until)


def _timing_run(fn):
    """Call the student's ``seconds_per_call`` on the stand-in; what it returned and what the
    stand-in recorded (times relative to the first call)."""
    workload = _Workload()
    run = {"first_call": TIMING_FIRST_CALL, "step": TIMING_STEP,
           **_call(fn, workload, np.float32(1.0))}
    t0 = workload.entered[0] if workload.entered else 0.0
    run.update(calls=len(workload.entered),
               entered=[t - t0 for t in workload.entered],
               ready=[t - t0 for t in workload.ready],
               waits=[[i, t - t0] for i, t in workload.waits])
    return run


def _probe_timing(values):
    """Judge the timing method on a stand-in workload; measure grad_loss here, in the same
    kernel and machine as the student's timings."""
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    ev = form.evidence_of(values)
    if callable(values.get("seconds_per_call")):
        ev["timing_runs"] = [_timing_run(values["seconds_per_call"])]
    devices = jax.devices() if len(jax.devices()) >= 8 else jax.devices("cpu")
    x, y, params = _training_setup(*CPU_TRAINING)
    mesh = jax.make_mesh((len(devices[:8]),), ("batch",), axis_types=(AxisType.Auto,),
                         devices=devices[:8])
    data, replicated = NamedSharding(mesh, P("batch")), NamedSharding(mesh, P())
    grad = jax.jit(jax.grad(_loss))
    ev["reference_unsharded"] = _seconds_per_call(grad, params, x, y)
    ev["reference_sharded"] = _seconds_per_call(
        grad, jax.device_put(params, replicated), jax.device_put(x, data),
        jax.device_put(y, data))
    return ev


# --------------------------------------------------------------------------- references
@functools.lru_cache(maxsize=None)
def _reference_mesh():
    import jax
    from jax.sharding import AxisType, Mesh

    return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("x", "y"),
                axis_types=(AxisType.Auto, AxisType.Auto))


@functools.lru_cache(maxsize=None)
def _layer_data():
    """x, W, b exactly as the notebook draws them."""
    import jax

    key = jax.random.key(0)
    key, *keys = jax.random.split(key, 4)
    return (np.asarray(jax.random.normal(keys[0], shape=(128, 10))),
            np.asarray(jax.random.normal(keys[1], shape=(10, 2))),
            np.asarray(jax.random.normal(keys[2], shape=(2,))))


def _softmax_layer(x, W, b):
    z = np.asarray(x, np.float64) @ np.asarray(W, np.float64) + np.asarray(b, np.float64)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def _curve(x):
    import jax.numpy as jnp

    return jnp.sin(6 * x) - 0.5 * x**2


def _forward(params, x):
    import jax.numpy as jnp

    for w, b in params[:-1]:
        x = jnp.tanh(jnp.dot(x, w) + b)
    return jnp.dot(x, params[-1][0]) + params[-1][1]


def _loss(params, x, y):
    import jax.numpy as jnp

    return jnp.mean(jnp.square(_forward(params, x) - y))


def _training_setup(n, sizes):
    """Data and initial parameters exactly as the notebook makes them."""
    import jax

    global_key = jax.random.key(seed=0)
    _, *keys = jax.random.split(global_key, 3)
    kx, ky = jax.random.split(keys[0], 2)
    x = jax.random.uniform(kx, shape=(n, 1), minval=0.0, maxval=2.0)
    y = _curve(x) + 0.1 * jax.random.normal(ky, shape=(n, 1))
    layer_keys = jax.random.split(keys[1], len(sizes) - 1)
    params = []
    for n_in, n_out, k in zip(sizes[:-1], sizes[1:], layer_keys):
        w_key, b_key = jax.random.split(k)
        params.append((0.1 * jax.random.normal(w_key, (n_in, n_out)),
                       0.1 * jax.random.normal(b_key, (n_out,))))
    return x, y, params


# `jaxlab grade`'s trusted worker sets this to a folder no kernel sees; there the reference
# training (~6 CPU-s, once per worker otherwise) is kept between workers and batches
REFERENCE_DIR = "JAXLAB_REFERENCE_DIR"


@functools.lru_cache(maxsize=4)
def _trained_reference(n, sizes, epochs=100, step_size=1e-3):
    folder = os.environ.get(REFERENCE_DIR)
    if not folder:
        return _train_reference(n, sizes, epochs, step_size)
    path = os.path.join(folder, f"lab3-trained-{n}-{'x'.join(map(str, sizes))}-{epochs}-"
                                f"{step_size:g}.npz")
    try:
        with np.load(path) as saved:
            return [(saved[f"W{i}"], saved[f"b{i}"]) for i in range(len(sizes) - 1)]
    except (OSError, KeyError, ValueError):
        pass
    params = _train_reference(n, sizes, epochs, step_size)
    try:
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp.npz"
        np.savez(tmp, **{f"{k}{i}": a for i, (W, b) in enumerate(params)
                         for k, a in (("W", W), ("b", b))})
        os.replace(tmp, path)  # whole or not at all, for a worker reading it meanwhile
    except OSError:
        pass
    return params


def _train_reference(n, sizes, epochs, step_size):
    import jax

    x, y, params = _training_setup(n, sizes)
    grad = jax.jit(jax.grad(_loss))
    for _ in range(epochs):
        grads = grad(params, x, y)
        params = [(W - step_size * dW, b - step_size * db)
                  for (W, b), (dW, db) in zip(params, grads)]
        params = jax.block_until_ready(params)
    return [(np.asarray(W), np.asarray(b)) for W, b in params]


# --------------------------------------------------------------------------- verdict helpers
_fail = form.fail


def _close(name, ev, expected, what, rtol=RTOL, atol=ATOL):
    form.expect_close(name, ev["value"], expected, what, rtol=rtol, atol=atol)


def _mesh_words(sev):
    axes = ", ".join(f"'{a}': {n}" for a, n in zip(sev["axis_names"], sev["mesh_shape"]))
    return f"a mesh with axes {{{axes}}}"


def _one_d_mesh(name, sev, axis_type, sizes=MESH_SIZES):
    """The array sits on a 1-D mesh of one of ``sizes`` devices with axes of ``axis_type``
    (any type when ``axis_type`` is None)."""
    if len(sev["mesh_shape"]) != 1 or sev["mesh_shape"][0] not in sizes:
        wanted = " or ".join(str(s) for s in sizes)
        _fail(f"`{name}` lives on {_mesh_words(sev)}; expected a 1-D mesh of {wanted} devices.")
    if axis_type is not None and sev["axis_types"][0] != axis_type:
        _fail(f"the mesh axis '{sev['axis_names'][0]}' of `{name}` is {sev['axis_types'][0]}; "
              f"expected an {axis_type} axis (pass axis_types=(AxisType.{axis_type},) "
              "to jax.make_mesh).")
    return sev["axis_names"][0]


def _laid_out(name, ev, spec, expected_words):
    from jax.sharding import PartitionSpec as P

    sev = ev["sharding"]
    if not form.is_laid_out_as(sev, len(ev["shape"]), P(*spec)):
        _fail(f"`{name}` is {form.describe_sharding(sev)}; expected {expected_words}.")


def _laid_out_any(name, ev, specs, expected_words):
    from jax.sharding import PartitionSpec as P

    sev = ev["sharding"]
    if not any(form.is_laid_out_as(sev, len(ev["shape"]), P(*spec)) for spec in specs):
        _fail(f"`{name}` is {form.describe_sharding(sev)}; expected {expected_words}.")


def _same_mesh(name, ev, ref_name, ref_ev):
    a, b = ev["sharding"], ref_ev["sharding"]
    if (a.get("device_ids"), a.get("axis_names")) != (b.get("device_ids"), b.get("axis_names")):
        _fail(f"`{name}` is on {_mesh_words(a)} (devices {a.get('device_ids')}), but "
              f"`{ref_name}` is on {_mesh_words(b)} (devices {b.get('device_ids')}); "
              "put them on the same mesh.")


def _result_on_mesh(name, ev, ref_name, how):
    """A computed result sits on a mesh; else say how to compute it from the placed arrays."""
    form.expect_array(name, ev)
    if ev["sharding"]["kind"] != "NamedSharding":
        _fail(f"`{name}` lives {form.describe_sharding(ev['sharding'])}; expected it on the "
              f"mesh of `{ref_name}`: {how}.")


def _replicated(name, ev, ref_name, ref_ev, how=None):
    if how:
        _result_on_mesh(name, ev, ref_name, how)
    form.expect_on_mesh(name, ev)
    _same_mesh(name, ev, ref_name, ref_ev)
    _laid_out(name, ev, (), "it replicated on every device of the mesh (spec P())")


def _batch_split(name, ev, axis):
    _laid_out(name, ev, (axis,),
              f"it split along the batch axis (dimension 0) across the mesh axis '{axis}' "
              f"(spec P('{axis}'))")


def _fresh_call(fn_name, fresh, check_output):
    """Judge the student's function on the probe's fresh inputs."""
    call = f"`{fn_name}` called on new data (x of shape ({FRESH_ROWS}, 10))"
    if "error" in fresh:
        _fail(f"{call} raised {fresh['error']} ({fresh['where']}); it should work for any "
              "batch that divides evenly over the mesh.")
    out = fresh["output"]
    if out["kind"] != "array":
        _fail(f"{call} returned {form.describe(out)}; expected a jax.Array.")
    _close(f"{fn_name}(x, W, b)", out, _softmax_layer(fresh["x"], fresh["W"], fresh["b"]),
           "softmax(x @ W + b) for those inputs")
    check_output(out)


def _int_tuple(ev):
    if ev["kind"] != "tuple" or not all(i["kind"] == "number" and i["is_int"] for i in ev["items"]):
        return None
    return tuple(int(i["value"]) for i in ev["items"])


# --------------------------------------------------------------------------- verdicts
def _lab_mesh(name, sev):
    """The array lives on the lab's `mesh`: 2 × 4, axes 'x' and 'y', both Auto."""
    if sorted(zip(sev["axis_names"], sev["mesh_shape"])) != [("x", 2), ("y", 4)]:
        _fail(f"`{name}` lives on {_mesh_words(sev)}; expected the lab's `mesh` "
              "(2 × 4, axes 'x' and 'y').")
    if any(t != "Auto" for t in sev["axis_types"]):
        types = ", ".join(f"'{a}': {t}" for a, t in zip(sev["axis_names"], sev["axis_types"]))
        _fail(f"`{name}` lives on a 2 × 4 mesh whose axes are {{{types}}}; expected the lab's "
              "`mesh`, whose axes are both Auto (a mesh made by jax.make_mesh without "
              "axis_types has Explicit axes since JAX 0.9): use `mesh` itself.")


NONE_FROM_DRAWING = ("`A_sharded` holds None; expected A placed with `sharding`. "
                     "jax.debug.visualize_array_sharding draws an array and returns None: "
                     "store what jax.device_put returns, then draw that.")


def _q1(ev):
    a = ev["A_sharded"]
    if a["kind"] == "none":  # a cell that raised before setting it is named by the grader
        exc = AssertionError(NONE_FROM_DRAWING)
        exc.undefined = "A_sharded"
        raise exc
    form.expect_on_mesh("A_sharded", a, shape=(4, 16))
    _close("A_sharded", a, np.arange(64.0).reshape(4, 16), "the values of A")
    if a["dtype"] != "float32":
        _fail(f"`A_sharded` holds {a['dtype']} values; expected the float32 array A itself "
              "placed on the devices (place A, not a new array).")
    sev = a["sharding"]
    if sev["axis_names"] != ["x", "y"] or sev["mesh_shape"] != [2, 4]:
        _fail(f"`A_sharded` lives on {_mesh_words(sev)}; expected the lab's `mesh` "
              "(2 × 4, axes 'x' and 'y').")
    _lab_mesh("A_sharded", sev)
    _laid_out("A_sharded", a, ("x", "y"),
              "rows split over 'x' and columns over 'y', as `sharding` = "
              "NamedSharding(mesh, P('x', 'y')) says")


def _q2(ev):
    from jax.sharding import NamedSharding, PartitionSpec as P

    devs, shape = ev["A_sharded_devices"], ev["A_shard_shape"]
    form.expect_kind("A_sharded_devices", devs, "set",
                     "a set of devices (for example what `A_sharded.devices()` returns)")
    if not all(d["kind"] == "device" for d in devs["items"]):
        _fail("`A_sharded_devices` should hold jax devices only; it holds "
              + ", ".join(form.describe(d) for d in devs["items"]) + ".")
    ids = {(d["platform"], d["id"]) for d in devs["items"]}
    if len(ids) != 8:
        _fail(f"`A_sharded_devices` holds {len(ids)} device(s); `A_sharded` is spread over all "
              "8 devices of `mesh`.")
    expected = NamedSharding(_reference_mesh(), P("x", "y")).shard_shape((4, 16))
    form.expect_kind("A_shard_shape", shape, "tuple", "a tuple such as (rows, columns)")
    found = _int_tuple(shape)
    if found != tuple(expected):
        _fail(f"`A_shard_shape` is {found if found is not None else form.describe(shape)}; "
              f"each device holds a block of shape {tuple(expected)} of the (4, 16) array A.")


SPECS = (("x", None), (None, "y"), (None, None), (None, "x"))


def _spec_key(entries):
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


def _by_spec(name, ev):
    """The dict's values by key. A dict keyed by P('x') cannot be read with the task's
    P('x', None) (the two specs lay A out alike but are not equal as keys), so keys must be
    the four specs as the task writes them."""
    if not ev["items"]:
        _fail(f"`{name}` is empty; fill it with one entry for each of the four specs.")
    table = {}
    for key, value in ev["items"]:
        if key["kind"] != "spec":
            _fail(f"`{name}` should be keyed by PartitionSpec objects such as P('x', None); "
                  f"one key is {form.describe(key)}.")
        table[_spec_key(key["entries"])] = value
    wanted = {_spec_key(list(s)): s for s in SPECS}
    def trimmed(key):
        return key[:max([i + 1 for i, e in enumerate(key) if e is not None], default=0)]

    for key, spec in wanted.items():
        if key not in table:
            found = ", ".join(form.spec_repr(list(k)) for k in table) or "none"
            alike = [k for k in table if trimmed(k) == trimmed(key)]
            hint = (f" {form.spec_repr(list(alike[0]))} lays A out as "
                    f"{form.spec_repr(list(spec))} does, but it is another key: "
                    f"`{name}[{form.spec_repr(list(spec))}]` raises KeyError. Key the dict by "
                    "the four specs as the task writes them." if alike else "")
            _fail(f"`{name}` has no entry for {form.spec_repr(list(spec))}; its keys are: "
                  f"{found}.{hint}")
    extra = [k for k in table if k not in wanted]
    if extra:
        _fail(f"`{name}` should hold the four specs of the task only; it also has "
              f"{form.spec_repr(list(extra[0]))}.")
    return {spec: table[_spec_key(list(spec))] for spec in SPECS}


def _q3(ev):
    from jax.sharding import NamedSharding, PartitionSpec as P

    for name in ("shard_shapes", "replicas"):
        form.expect_kind(name, ev[name], "dict", "a dict keyed by the four partition specs")
    shapes, counts = _by_spec("shard_shapes", ev["shard_shapes"]), _by_spec("replicas", ev["replicas"])
    for spec in SPECS:
        s = NamedSharding(_reference_mesh(), P(*spec))
        expected_shape = tuple(s.shard_shape((4, 16)))
        blocks = {str(idx) for idx in s.devices_indices_map((4, 16)).values()}
        expected_count = 8 // len(blocks)
        label = form.spec_repr(list(spec))
        found = _int_tuple(shapes[spec])
        if found != expected_shape:
            _fail(f"`shard_shapes[{label}]` is "
                  f"{found if found is not None else form.describe(shapes[spec])}; with {label} "
                  f"on the 2 × 4 `mesh` each device holds a block of shape {expected_shape} "
                  "of the (4, 16) array A.")
        c = counts[spec]
        if c["kind"] != "number" or not c["is_int"] or int(c["value"]) != expected_count:
            _fail(f"`replicas[{label}]` is {form.describe(c)}; with {label} each distinct "
                  f"block of A is held by {expected_count} device(s) (an int).")


def _q4(ev):
    import jax
    from jax.sharding import NamedSharding

    for name in ("B", "C"):
        form.expect_on_mesh(name, ev[name], shape=(4, 8))
        _lab_mesh(name, ev[name]["sharding"])
    # the task names the mesh axis, not the dimension: either dimension may be the split one
    for name, axis, other in (("B", "x", "y"), ("C", "y", "x")):
        _laid_out_any(name, ev[name], ((axis, None), (None, axis)),
                      f"one of its dimensions split along mesh axis '{axis}' and the array "
                      f"replicated along '{other}' (spec P('{axis}', None) or P(None, '{axis}'))")
    _same_mesh("C", ev["C"], "B", ev["B"])
    Bv, Cv = ev["B"]["value"], ev["C"]["value"]
    B = jax.device_put(Bv, form.rebuild_sharding(ev["B"]["sharding"]))
    C = jax.device_put(Cv, form.rebuild_sharding(ev["C"]["sharding"]))
    for name, op, ref, shape in (("B_plus_C", "B + C", Bv + Cv, (4, 8)),
                                 ("BtC", "B.T @ C", Bv.T.astype(np.float64) @ Cv, (8, 8))):
        form.expect_array(name, ev[name], shape=shape)
        _close(name, ev[name], ref, f"{op} of your B and C")
        propagated = (jax.jit(lambda b, c: b + c) if name == "B_plus_C"
                      else jax.jit(lambda b, c: b.T @ c))(B, C).sharding
        actual = form.rebuild_sharding(ev[name]["sharding"])
        if actual is None or not actual.is_equivalent_to(propagated, 2):
            _fail(f"`{name}` is {form.describe_sharding(ev[name]['sharding'])}, but {op} of the "
                  f"sharded B and C comes out as "
                  f"{form.describe_sharding(form.sharding_evidence(propagated))}; compute it "
                  f"directly as `{op}` from the sharded arrays.")


def _data_parallel_layer(ev, suffix, axis_type):
    """Shared verdict of q5 (Auto) and q6 (Explicit): data split, parameters replicated."""
    x, W, b = _layer_data()
    xn, Wn, bn, on = (f"x_{suffix}", f"W_{suffix}", f"b_{suffix}", f"out_{suffix}")
    form.expect_on_mesh(xn, ev[xn], shape=(128, 10))
    axis = _one_d_mesh(xn, ev[xn]["sharding"], axis_type)
    _close(xn, ev[xn], x, "the lab's data `x`")
    _batch_split(xn, ev[xn], axis)
    for name, value, shape in ((Wn, W, (10, 2)), (bn, b, (2,))):
        form.expect_on_mesh(name, ev[name], shape=shape)
        _close(name, ev[name], value, f"the lab's `{name[0]}`")
        _replicated(name, ev[name], xn, ev[xn])
    form.expect_array(on, ev[on], shape=(128, 2))
    _close(on, ev[on], _softmax_layer(x, W, b), f"layer({xn}, {Wn}, {bn})")
    _result_on_mesh(on, ev[on], xn, f"compute it as layer({xn}, {Wn}, {bn}) from the placed "
                    "arrays")
    _same_mesh(on, ev[on], xn, ev[xn])
    _batch_split(on, ev[on], axis)
    return axis


def _q5(ev):
    _data_parallel_layer(ev, "auto", "Auto")


def _q6(ev):
    axis = _data_parallel_layer(ev, "explicit", "Explicit")
    if ev["out_explicit"]["typeof"] != f"float32[128@{axis},2]":
        _fail(f"the type of `out_explicit` is {ev['out_explicit']['typeof']}; expected "
              f"float32[128@{axis},2].")
    form.expect_callable("layer_explicit", ev["layer_explicit"])
    if ev["layer_explicit"]["type"] != "PjitFunction":
        _fail("`layer_explicit` should be compiled with jax.jit (decorate it with @jax.jit); "
              f"it is {form.describe(ev['layer_explicit'])}.")
    fresh = ev.get("fresh")
    if fresh is None:
        _fail("`layer_explicit` could not be tried on new data because `x_explicit` is not on a "
              "1-D mesh.")
    _fresh_call("layer_explicit", fresh, lambda out: _batch_split(
        "layer_explicit(x, W, b)", out, axis))
    n = FRESH_ROWS
    wanted = {"x": f"float32[{n}@{axis},10]", "W": "float32[10,2]", "b": "float32[2]",
              "the output": f"float32[{n}@{axis},2]"}
    printed = fresh["printed"]
    missing = [f"{what} ({t})" for what, t in wanted.items() if t not in printed]
    if missing:
        shown = printed.strip().replace("\n", " | ")[:300] or "nothing"
        _fail(f"while tracing, `layer_explicit` should print the jax.typeof of x, W, b and of "
              f"the output. Called on new data of shape ({n}, 10) it printed: {shown}. Missing: "
              + ", ".join(missing) + ".")


def _q7(ev):
    form.expect_callable("layer_manual", ev["layer_manual"])
    om = ev["out_man"]
    form.expect_array("out_man", om, shape=(128, 2))
    _result_on_mesh("out_man", om, "layer_manual",
                    "compute it as layer_manual(x, W, b), whose shard_map puts the blocks "
                    "together on its mesh")
    # the task names no axis type: shard_map works on Auto and Explicit meshes alike
    axis = _one_d_mesh("out_man", om["sharding"], None)
    x, W, b = _layer_data()
    _close("out_man", om, _softmax_layer(x, W, b), "layer(x, W, b)")
    _batch_split("out_man", om, axis)
    if "jaxpr_error" in ev:
        _fail(f"`layer_manual` could not be traced on new data (x of shape ({FRESH_ROWS}, 10)): "
              f"{ev['jaxpr_error']}; it should work for any batch that divides evenly over "
              "the mesh.")
    if "shard_map" not in ev.get("jaxpr", ""):
        _fail("`layer_manual` gives the right numbers but does not go through jax.shard_map; "
              "this task asks you to write the per-device computation with jax.shard_map.")
    _fresh_call("layer_manual", ev["fresh"], lambda out: _batch_split(
        "layer_manual(x, W, b)", out, axis))
    for shape, what, dim, words in (
            ((FRESH_ROWS, 10), "x", 0, "each device handles its block of rows of x"),
            ((10, 2), "W", None, "each device uses the full W"),
            ((2,), "b", None, "each device uses the full b")):
        form.expect_operands_split("layer_manual", ev["program"], shape, what, dim,
                                   f"{words} (in_specs {'P(axis)' if dim == 0 else 'P()'} "
                                   f"for {what})")


def _params_pairs(name, ev):
    form.expect_kind(name, ev, "list", "a list of (W, b) pairs like `params`")
    pairs = []
    for i, item in enumerate(ev["items"]):
        if item["kind"] not in ("tuple", "list") or len(item["items"]) != 2:
            _fail(f"`{name}[{i}]` is {form.describe(item)}; expected a (W, b) pair.")
        for j, part in enumerate(item["items"]):
            form.expect_array(f"{name}[{i}][{j}]", part)
        pairs.append(item["items"])
    return pairs


def _check_params(name, ev, reference, what, ref_name, ref_ev, rtol=RTOL, atol=ATOL, how=None):
    pairs = _params_pairs(name, ev)
    if len(pairs) != len(reference):
        _fail(f"`{name}` has {len(pairs)} layers; expected {len(reference)} (W, b) pairs.")
    for i, (pair, ref) in enumerate(zip(pairs, reference)):
        for j, (part, expected) in enumerate(zip(pair, ref)):
            label = f"{name}[{i}][{j}]"
            _close(label, part, expected, what, rtol=rtol, atol=atol)
            _replicated(label, part, ref_name, ref_ev, how)


def _q8(ev):
    xs = ev["x_train_sharded"]
    for name in ("x_train_sharded", "y_train_sharded"):
        form.expect_on_mesh(name, ev[name])
    n = xs["shape"][0]
    params_ev = ev["params_replicated"]
    sizes = [1] + [int(pair[0]["shape"][1]) for pair in
                   _params_pairs("params_replicated", params_ev)]
    x, y, params = _training_setup(n, tuple(sizes))
    sev = xs["sharding"]
    if math.prod(sev["mesh_shape"]) != 8:
        _fail(f"`x_train_sharded` lives on {_mesh_words(sev)}, i.e. on "
              f"{math.prod(sev['mesh_shape'])} devices; expected it split over all 8 devices.")
    explicit = [a for a, t in zip(sev["axis_names"], sev["axis_types"]) if t != "Auto"]
    if explicit:
        _fail(f"the mesh of `x_train_sharded` has {'the' if len(explicit) == 1 else ''} "
              f"{', '.join(repr(a) for a in explicit)} "
              f"{'axis' if len(explicit) == 1 else 'axes'} of type "
              f"{sev['axis_types'][sev['axis_names'].index(explicit[0])]}; expected automatic "
              "parallelisation, as the task says: a mesh whose axes are Auto (pass "
              "axis_types=(AxisType.Auto,) to jax.make_mesh, as in Task 5).")
    all_axes = tuple(sev["axis_names"])
    for name, value, label in (("x_train_sharded", x, "x_train"), ("y_train_sharded", y, "y_train")):
        _close(name, ev[name], value, f"the training data `{label}`")
        _same_mesh(name, ev[name], "x_train_sharded", xs)
        _laid_out(name, ev[name], (all_axes,),
                  "it split along the batch axis (dimension 0) over all the devices of the mesh")
    _check_params("params_replicated", params_ev, params, "the initial `params`",
                  "x_train_sharded", xs)
    reference = _trained_reference(n, tuple(sizes))
    _check_params("params_trained_sharded", ev["params_trained_sharded"], reference,
                  "the parameters after `train(params, x_train, y_train)` (100 steps, "
                  "step_size 1e-3), as on one device", "x_train_sharded", xs,
                  rtol=TRAIN_RTOL, atol=TRAIN_ATOL,
                  how="train `params_replicated` on `x_train_sharded` and `y_train_sharded`, "
                      "and the result stays replicated on their mesh")


def _timed_totals(run):
    """[(calls before the clock, timed calls, their total time)] for each accepted number of
    calls before the clock (TIMING_WARMUPS): from the moment the last of those calls was done
    (its work finished, and waited for if it was before the next call) to the end of the last
    wait for a result."""
    entered, ready, waits, n = run["entered"], run["ready"], run["waits"], run["calls"]
    end = max((t for _, t in waits), default=None)
    totals = []
    for warm in TIMING_WARMUPS:
        if end is None or n - warm < 1:
            continue
        start = ready[warm - 1]
        waited = [t for i, t in waits if i == warm - 1 and t <= entered[warm]]
        totals.append((warm, n - warm, end - min(waited, default=start)))
    return totals


def _timing_slip(run, t):
    """The usual slip nearest to what ``seconds_per_call`` returned (one call before the
    clock), or None when none comes within 15%."""
    n, step, entered = run["calls"], run["step"], run["entered"]
    _, m, total = _timed_totals(run)[0]
    end = max(w for _, w in run["waits"])
    # each timed call as a student's clock around it reads it (overheads included), where its
    # result was waited for before the next call; else its work alone
    waited = {}
    for i, w in run["waits"]:
        waited.setdefault(i, w)
    work = sorted(waited[i] - entered[i]
                  if i in waited and (i + 1 == n or waited[i] <= entered[i + 1])
                  else _work_steps(i) * step for i in range(1, n))
    whole = end - entered[0]
    slips = {"counts the first (compiling) call": [whole / m, whole / n],
             "includes the work of the first call, whose result was not waited for before "
             "the clock started": [(end - entered[1]) / m],
             "is divided by one call more than were timed": [total / (m + 1)],
             "is divided by one call fewer than were timed": [total / (m - 1)] if m > 1 else [],
             "is divided by half the number of calls that were timed": [2 * total / m],
             "is not divided by the number of calls": [total],
             "is in milliseconds rather than seconds": [1000 * total / m],
             "counts the first call and is not divided by the number of calls": [whole]}
    fastest, median = work[0], (work[(m - 1) // 2] + work[m // 2]) / 2
    if fastest == median:
        slips["is that of the fastest (and the median) call, not the mean of the timed calls"] = [
            fastest]
    else:
        slips["is that of the fastest call, not the mean of the timed calls"] = [fastest]
        slips["is that of the median call, not the mean of the timed calls"] = [median]
    distance = {slip: min(abs(math.log(t / v)) for v in values)
                for slip, values in slips.items() if values}
    slip = min(distance, key=distance.get)
    return slip if distance[slip] < math.log(1.15) else None


def _timing_method(run):
    """Verdict on one run of ``seconds_per_call`` on the stand-in workload."""
    call = "seconds_per_call(f, x)"
    step, first, n = run["step"], run["first_call"], run["calls"]
    test = (f"`{call}` was tried on a function f whose first call takes {first:.2g} s (as "
            "compiling does) and whose every call returns at once with a result that is ready "
            f"only when its work is done, {step * 1e3:.0f} to "
            f"{max(TIMING_PATTERN) * step * 1e3:.0f} ms after the previous call's (as JAX's "
            "asynchronous dispatch does)")
    limit = 1 + TIMING_MAX_TIMED
    if run.get("error", "").startswith("_TooManyCalls"):
        _fail(f"{test}; it called f more than {limit} times. It should call f once before the "
              f"clock starts, then time several calls, at most {TIMING_MAX_TIMED} as the task "
              "says, and return their average.")
    if "error" in run:
        _fail(f"{test}; it raised {run['error']} ({run['where']}). It should call f(x) a few "
              f"times (at most {TIMING_MAX_TIMED} timed calls) and return the seconds per call.")
    out = run["output"]
    if out["kind"] in ("none", "ellipsis"):
        _fail(f"`seconds_per_call` is not defined yet (it returns {form.describe(out)}): write "
              "its body in the cell under '### Your code here' and run it.")
    if out["kind"] != "number" or not math.isfinite(out["value"]):
        _fail(f"{test}; it returned {form.describe(out)}; expected the seconds per call "
              "(a float).")
    timed = n - 1  # the first call compiles: the task says to leave it out of the timing
    if timed < TIMING_MIN_TIMED:
        _fail(f"{test}; it called f {n} time{'s' if n != 1 else ''}, so at most {timed} "
              f"call{'s' if timed != 1 else ''} after the first (compiling) one can have been "
              f"timed; expected an average over at least {TIMING_MIN_TIMED} timed calls (the "
              f"task says several, at most {TIMING_MAX_TIMED}). Call f once before starting "
              f"the clock, then time at least {TIMING_MIN_TIMED} calls and return their average.")
    t = out["value"]
    if not run["waits"] or t < step / 2:
        _fail(f"{test}. It returned {t:.3g} s per call; expected the mean time of the calls "
              f"after the first, each of which works {step:.3g} s or more: the clock stopped "
              "before the results were ready. Wait for them with jax.block_until_ready inside "
              "the timed region.")
    totals = _timed_totals(run)
    matched = [m for _, m, total in totals
               if m >= TIMING_MIN_TIMED and abs(t * m - total) <= TIMING_TOLERANCE * step]
    if any(m <= TIMING_MAX_TIMED for m in matched):
        return
    if matched:
        _fail(f"{test}; it averaged over {min(matched)} calls; expected several, at most "
              f"{TIMING_MAX_TIMED} as the task says.")
    _, m, total = totals[0]
    slip = _timing_slip(run, t)
    why = f": the time {slip}" if slip else ", which is not the mean time of the timed calls"
    _fail(f"{test}. It called f {n} times; the {m} calls after the first took {total:.4g} s "
          f"in all, so expected their mean, {total / m:.4g} s per call, but it returned "
          f"{t:.4g} s per call{why}. Call f once and wait for its result before starting the clock (so that "
          "neither compiling nor that call's work is counted), then time several calls, waiting "
          "for each result inside the timed region, and return their total time divided by "
          "their number.")


def _q9(ev):
    form.expect_callable("seconds_per_call", ev["seconds_per_call"])
    if "timing_runs" not in ev:
        _fail("`seconds_per_call` could not be tried.")
    _timing_method(ev["timing_runs"][-1])
    for name, ref_key, data in (("time_unsharded", "reference_unsharded", "unsharded"),
                                ("time_sharded", "reference_sharded", "sharded")):
        form.expect_number(name, ev[name])
        t, ref = ev[name]["value"], ev[ref_key]
        if t <= ref / TIMING_FACTOR:
            _fail(f"`{name}` is {t:.3g} s per call, but one call of grad_loss on the {data} "
                  f"data takes about {ref:.3g} s on this machine. A time this small usually "
                  "means the clock stopped before the computation finished: JAX dispatches "
                  "asynchronously, so wait with jax.block_until_ready inside the timed region.")
        if t >= ref * TIMING_FACTOR:
            _fail(f"`{name}` is {t:.3g} s per call, but one call of grad_loss on the {data} "
                  f"data takes about {ref:.3g} s on this machine. A time this large usually "
                  "includes compilation: call the function once before you start the clock, "
                  "and divide by the number of calls.")


# the notebook's own names that a question's public check reads besides its graded ones (its
# inputs and single-device references; no cell after the question reassigns them)
NOTEBOOK = {
    "q1": " A",
    "q2": " devices",
    "q5": " x W b layer",
    "q6": " x W b layer",
    "q7": " x W b layer",
    "q8": " x_train y_train params params_single devices",
    "q9": " grad_loss params x_train y_train params_replicated x_train_sharded y_train_sharded",
}
QUESTIONS = {
    "q1_device_put": form.question("A_sharded" + NOTEBOOK["q1"], _q1),
    "q2_inspect": form.question("A_sharded_devices A_shard_shape" + NOTEBOOK["q2"], _q2),
    "q3_partition_specs": form.question("shard_shapes replicas", _q3),
    "q4_propagation": form.question("B C B_plus_C BtC", _q4),
    "q5_dp_auto": form.question("x_auto W_auto b_auto out_auto" + NOTEBOOK["q5"], _q5),
    "q6_dp_explicit": form.question(
        "x_explicit W_explicit b_explicit layer_explicit out_explicit" + NOTEBOOK["q6"], _q6,
        _probe_explicit),
    "q7_dp_manual": form.question("layer_manual out_man" + NOTEBOOK["q7"], _q7, _probe_manual),
    "q8_sharded_training": form.question(
        "x_train_sharded y_train_sharded params_replicated params_trained_sharded"
        + NOTEBOOK["q8"], _q8),
    "q9_timing": form.question("seconds_per_call time_unsharded time_sharded" + NOTEBOOK["q9"],
                               _q9, _probe_timing),
}

# Verdicts that rest on timings: the kernel's own check (its claim) times again, at another
# moment, so a claim that passes where the verdict fails is load, not tampering (seen once under
# a load of ~30 on 2 cores). The verdict still decides the points.
MEASURED = ("q9_timing",)

probe, verdict, check = form.entry_points(QUESTIONS)
JAXLAB_CHECKS = 1  # declares the probe/verdict contract `jaxlab grade` relies on
