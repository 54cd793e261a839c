"""Blind oracle for the lab3-parallelism answer corpus (tests/answers/lab3-parallelism/blind).

Written by an outside helper from the student notebook alone. It re-creates the notebook's
kernel (the notebook's own starter cells, copied below, and this helper's own reference
solutions for the tasks), then for every answer in the YAML files next to this script runs
the answer's code in a fresh copy of the namespace the answer cell would see and judges it
against independent references (NumPy formulas, explicit expected layouts, the traced
program of the function, spies on the calls it makes, and stand-in functions with a known
per-call time for the timing task). It prints one line per answer and a summary; every
label must agree with the verdict.

Run:  /work/main/.venv/bin/python oracle.py [q1 q5 ...]   (no argument: every question)
"""
import contextlib
import io
import math
import os
import re
import sys
import time
import traceback

os.environ.setdefault("PJRT_NPROC", "16")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOK = os.path.normpath(os.path.join(
    HERE, "..", "..", "..", "..", "student", "lab3-parallelism", "lab3-parallelism.ipynb"))
QUESTIONS = ["q1_device_put", "q2_inspect", "q3_partition_specs", "q4_propagation", "q5_dp_auto",
             "q6_dp_explicit", "q7_dp_manual", "q8_sharded_training", "q9_timing"]
KINDS = set("value method boundary size mesh axis spec keyword ring communication cast argument "
            "api timing other".split())
PJIT_TYPE = type(jax.jit(lambda a: a))

# ------------------------------------------------------------------ the notebook's own cells
# Copied verbatim from student/lab3-parallelism/lab3-parallelism.ipynb (code cells that define
# what later cells use; the grader.check cells, the plotting cell and the setup cell that
# writes the public checks are left out). Answer cells are the ("answer", question) slots.
NOTEBOOK_CELLS = [
    ("cell 3", r'''
import ctypes
import ctypes.util
import os

os.environ.setdefault("PJRT_NPROC", "16")
try:  # glibc (Linux) only; elsewhere there is nothing to do
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
except (OSError, AttributeError, TypeError):
    pass

import jax

N_DEVICES = 8
try:
    jax.config.update("jax_num_cpu_devices", N_DEVICES)
except RuntimeError:
    pass  # JAX already started; the check below says whether that is a problem

devices = jax.devices()
if len(devices) < N_DEVICES:
    devices = jax.devices("cpu")
    jax.config.update("jax_default_device", devices[0])
if len(devices) < N_DEVICES:
    raise RuntimeError(
        f"JAX is already running with {len(devices)} CPU device(s), and the number of devices "
        "can only be set before JAX starts. Restart the kernel (Kernel > Restart) and run the "
        "notebook from the top, starting with this cell.")
devices = devices[:N_DEVICES]
print(f"Using {len(devices)} {devices[0].platform.upper()} devices.")
'''),
    ("cell 5", r'''
def answered(*answers):
    """Whether every answer given is filled in; if one is still `...`, say so and return False."""
    if any(answer is ... for answer in answers):
        print("Skipped: this cell uses your answer to the task above. Fill that in first.")
        return False
    return True
'''),
    ("cell 7", r'''
import jax.numpy as jnp
import numpy as np

devices
'''),
    ("cell 9", r'''
A = jnp.arange(64.0).reshape(4, 16)
print(f"{A.device = }")
print(f"{A.sharding = }")
'''),
    ("cell 11", r'''
ones_on_1 = jnp.ones((4, 16), device=devices[1])
print(f"{ones_on_1.device = }")
print(f"{ones_on_1.sharding = }")
'''),
    ("cell 13", r'''
print("A:")
jax.debug.visualize_array_sharding(A, scale=0.5)
print("ones_on_1:")
jax.debug.visualize_array_sharding(ones_on_1, scale=0.5)
'''),
    ("cell 15", r'''
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Auto, AxisType.Auto),
                     devices=devices)
print(mesh)
'''),
    ("cell 17", r'''
sharding = NamedSharding(mesh, P("x", "y"))
print(sharding)
'''),
    ("answer", 'q1_device_put'),
    ("answer", 'q2_inspect'),
    ("answer", 'q3_partition_specs'),
    ("cell 30", r'''
@jax.jit
def f_elementwise(a):
    return 2 * jnp.sin(a) ** 2 + 1


if answered(A_sharded):
    Z = f_elementwise(A_sharded)
    jax.debug.visualize_array_sharding(Z, scale=0.3)
'''),
    ("cell 32", r'''
if answered(A_sharded):
    print(Z.sharding == A_sharded.sharding)
print(f_elementwise(A).sharding == A.sharding)
'''),
    ("cell 34", r'''
@jax.jit
def column_sums(a):
    return a.sum(axis=0)


if answered(A_sharded):
    Z = column_sums(A_sharded)
    print("input:")
    jax.debug.visualize_array_sharding(A_sharded, scale=0.5)
    print("output:")
    jax.debug.visualize_array_sharding(Z, scale=0.5)
    print(Z)
    print(Z.sharding)
'''),
    ("answer", 'q4_propagation'),
    ("cell 40", r'''
@jax.jit
def layer(x, W, b):
    return jax.nn.softmax(x @ W + b)


n_features = 10
n_data = 128
n_out = 2

key = jax.random.key(0)
key, *keys = jax.random.split(key, 4)
x = jax.random.normal(keys[0], shape=(n_data, n_features))
W = jax.random.normal(keys[1], shape=(n_features, n_out))
b = jax.random.normal(keys[2], shape=(n_out,))
'''),
    ("cell 42", r'''
out = layer(x, W, b)
print(out.shape)
jax.debug.visualize_array_sharding(out)
'''),
    ("answer", 'q5_dp_auto'),
    ("cell 47", r'''
np_array = np.arange(8)
print(f"JAX-level type of a NumPy array: {jax.typeof(np_array)}")
print(f"JAX-level type of a JAX array:   {jax.typeof(A)}")
print(f"JAX-level type of a Python float: {jax.typeof(4.2)}")
'''),
    ("cell 49", r'''
@jax.jit
def show_type(a):
    print(f"JAX-level type of the argument during tracing: {jax.typeof(a)}")
    return a


show_type(A);
'''),
    ("cell 51", r'''
if answered(A_sharded):
    show_type(A_sharded);
'''),
    ("cell 53", r'''
mesh_explicit = jax.make_mesh((2, 4), ("x", "y"),
                              axis_types=(AxisType.Explicit, AxisType.Explicit),
                              devices=devices)
print(mesh_explicit)
'''),
    ("cell 55", r'''
A_np = np.arange(32.0).reshape(8, 4)
A_explicit = jax.device_put(A_np, NamedSharding(mesh_explicit, P("x", None)))
print(f"type of A_np:       {jax.typeof(A_np)}")
print(f"type of A_explicit: {jax.typeof(A_explicit)}")
'''),
    ("cell 57", r'''
jax.debug.visualize_array_sharding(A_explicit)
'''),
    ("cell 59", r'''
col = jax.device_put(np.arange(4).reshape(4, 1), NamedSharding(mesh_explicit, P("x", None)))
row = jax.device_put(np.arange(8).reshape(1, 8), NamedSharding(mesh_explicit, P(None, "y")))
print("col:")
jax.debug.visualize_array_sharding(col)
print("row:")
jax.debug.visualize_array_sharding(row, scale=0.2)
'''),
    ("cell 61", r'''
@jax.jit
def multiply_arrays(a, c):
    product = a * c
    print(f"a:       {jax.typeof(a)}")
    print(f"c:       {jax.typeof(c)}")
    print(f"product: {jax.typeof(product)}")
    return product


product = multiply_arrays(col, row)
jax.debug.visualize_array_sharding(product, scale=0.4)
product
'''),
    ("answer", 'q6_dp_explicit'),
    ("cell 67", r'''
mesh_1d = jax.make_mesh((4,), ("x",), axis_types=(AxisType.Auto,), devices=devices[:4])

f_blockwise = jax.shard_map(f_elementwise, mesh=mesh_1d, in_specs=P("x"), out_specs=P("x"))

v = jnp.arange(32.0)
Z = f_blockwise(v)
print("sharding of f_blockwise(v):")
jax.debug.visualize_array_sharding(Z, scale=0.2)
'''),
    ("cell 69", r'''
def show_block(block):
    print(f"shape of the block on one device: {block.shape}")
    print(f"type of the block: {jax.typeof(block)}")
    return block * 2


doubled = jax.shard_map(show_block, mesh=mesh_1d, in_specs=P("x"), out_specs=P("x"))(v)
print(f"global shape: {doubled.shape}")
'''),
    ("cell 71", r'''
def block_sum(block):
    return jnp.sum(block, keepdims=True)


jax.shard_map(block_sum, mesh=mesh_1d, in_specs=P("x"), out_specs=P("x"))(v)
'''),
    ("cell 73", r'''
def total_sum(block):
    return jax.lax.psum(block.sum(), "x")


jax.shard_map(total_sum, mesh=mesh_1d, in_specs=P("x"), out_specs=P())(v)
'''),
    ("answer", 'q7_dp_manual'),
    ("cell 80", r'''
from tqdm import tqdm


def f(x):
    """The curve the data is drawn around."""
    return jnp.sin(6 * x) - 0.5 * x**2


def gen_data(key, f, n=100, sigma=0.1, xmin=0.0, xmax=2.0):
    keys = jax.random.split(key, 2)
    x = jax.random.uniform(keys[0], shape=(n, 1), minval=xmin, maxval=xmax)
    y = f(x) + sigma * jax.random.normal(keys[1], shape=(n, 1))
    return x, y


def random_layer_params(n_in, n_out, key, scale=1e-1):
    w_key, b_key = jax.random.split(key)
    return (scale * jax.random.normal(w_key, (n_in, n_out)),
            scale * jax.random.normal(b_key, (n_out,)))


def init_network_params(sizes, key):
    keys = jax.random.split(key, len(sizes) - 1)
    return [random_layer_params(m, n, k) for m, n, k in zip(sizes[:-1], sizes[1:], keys)]


def forward(params, x):
    for w, b in params[:-1]:
        x = jnp.tanh(jnp.dot(x, w) + b)
    final_w, final_b = params[-1]
    return jnp.dot(x, final_w) + final_b


def loss(params, x, y):
    return jnp.mean(jnp.square(forward(params, x) - y))


grad_loss = jax.jit(jax.grad(loss, argnums=0))


def train(params, x, y, epochs=100, step_size=1e-3):
    for _ in tqdm(range(epochs), desc="training"):
        grads = grad_loss(params, x, y)
        params = [(W - step_size * dW, b - step_size * db)
                  for (W, b), (dW, db) in zip(params, grads)]
        params = jax.block_until_ready(params)
    return params
'''),
    ("cell 81", r'''
global_key = jax.random.key(seed=0)
gen_key, *keys = jax.random.split(global_key, 3)

if devices[0].platform == "cpu":  # 8 simulated devices share a few cores: keep it small
    n = 1024
    layer_sizes = [1, 256, 256, 1]
else:
    n = 8192 * 2
    layer_sizes = [1, 8192, 8192, 8192, 1]

x_train, y_train = gen_data(keys[0], f, n=n)
params = init_network_params(layer_sizes, keys[1])

grad_loss(params, x_train, y_train);  # compile once before training
'''),
    ("cell 82", r'''
params_single = train(params, x_train, y_train)
'''),
    ("answer", 'q8_sharded_training'),
    ("answer", 'q9_timing'),
]

# ------------------------------------------------------------------ this helper's own solutions
# Run in the main namespace after a question's answers were judged, so that later answers
# see an earlier task solved (as the brief says: "with the reference solution's values").
REFERENCE = {
    "q1_device_put": '''
A_sharded = jax.device_put(A, sharding)
jax.debug.visualize_array_sharding(A_sharded)
''',
    "q2_inspect": '''
A_sharded_devices = A_sharded.devices()
A_shard_shape = A_sharded.sharding.shard_shape(A_sharded.shape)
''',
    "q3_partition_specs": '''
specs = [P("x", None), P(None, "y"), P(None, None), P(None, "x")]
shard_shapes = {}
replicas = {}
for spec in specs:
    placed = jax.device_put(A, NamedSharding(mesh, spec))
    jax.debug.visualize_array_sharding(placed)
    shard_shapes[spec] = placed.sharding.shard_shape(placed.shape)
    replicas[spec] = 1 + max(s.replica_id for s in placed.addressable_shards)
''',
    "q4_propagation": '''
B = jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(mesh, P("x", None)))
C = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P(None, "y")))
B_plus_C = B + C
BtC = B.T @ C
''',
    "q5_dp_auto": '''
mesh_dp_ref = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,), devices=devices)
x_auto = jax.device_put(x, NamedSharding(mesh_dp_ref, P("batch")))
W_auto = jax.device_put(W, NamedSharding(mesh_dp_ref, P()))
b_auto = jax.device_put(b, NamedSharding(mesh_dp_ref, P()))
out_auto = layer(x_auto, W_auto, b_auto)
''',
    "q6_dp_explicit": '''
mesh_dp_explicit_ref = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Explicit,),
                                     devices=devices)
x_explicit = jax.device_put(x, NamedSharding(mesh_dp_explicit_ref, P("batch")))
W_explicit = jax.device_put(W, NamedSharding(mesh_dp_explicit_ref, P()))
b_explicit = jax.device_put(b, NamedSharding(mesh_dp_explicit_ref, P()))


@jax.jit
def layer_explicit(x, W, b):
    out = layer(x, W, b)
    print(jax.typeof(x), jax.typeof(W), jax.typeof(b), jax.typeof(out))
    return out


out_explicit = layer_explicit(x_explicit, W_explicit, b_explicit)
''',
    "q7_dp_manual": '''
layer_manual = jax.shard_map(layer, mesh=mesh_1d, in_specs=(P("x"), P(), P()), out_specs=P("x"))
out_man = layer_manual(x, W, b)
''',
    "q8_sharded_training": '''
mesh_train_ref = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,), devices=devices)
x_train_sharded = jax.device_put(x_train, NamedSharding(mesh_train_ref, P("batch")))
y_train_sharded = jax.device_put(y_train, NamedSharding(mesh_train_ref, P("batch")))
params_replicated = jax.device_put(params, NamedSharding(mesh_train_ref, P()))
params_trained_sharded = train(params_replicated, x_train_sharded, y_train_sharded)
''',
    "q9_timing": '''
import time


def seconds_per_call(fn, *args, repeats=10):
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(fn(*args))
    return (time.perf_counter() - start) / repeats


time_unsharded = seconds_per_call(grad_loss, params, x_train, y_train)
time_sharded = seconds_per_call(grad_loss, params_replicated, x_train_sharded, y_train_sharded)
''',
}


# ------------------------------------------------------------------ helpers
class Wrong(AssertionError):
    pass


def need(cond, message):
    if not cond:
        raise Wrong(message)


def is_array(v):
    return isinstance(v, jax.Array) and type(v).__name__ == "ArrayImpl"


def axes_of(entry):
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return tuple(entry)


def spec_split(spec, ndim):
    """{dimension: mesh axes} for the dimensions a PartitionSpec splits."""
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return {d: axes_of(e) for d, e in enumerate(entries) if axes_of(e)}


def split_of(arr):
    need(isinstance(arr.sharding, NamedSharding),
         f"not on a mesh (its sharding is a {type(arr.sharding).__name__})")
    return spec_split(arr.sharding.spec, arr.ndim)


def softmax_np(z):
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def layer_np(x, W, b):
    return softmax_np(np.asarray(x, np.float64) @ np.asarray(W, np.float64) + np.asarray(b, np.float64))


def close(a, b, rtol=1e-5, atol=1e-6):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and bool(np.all(np.isfinite(a))) and np.allclose(a, b, rtol=rtol, atol=atol)


def fresh_rng(i):
    return np.random.default_rng(1000 + i)


class Ctx:
    """What one answer did while it ran: printed text and the calls the spies saw."""

    def __init__(self, base):
        self.base = base
        self.stdout = ""
        self.device_put_calls = []
        self.visualized = []
        self.calls = {}


@contextlib.contextmanager
def patched_jax(ctx):
    """Spy on jax.device_put and jax.debug.visualize_array_sharding (module attributes)."""
    real_put = jax.device_put
    real_vis = jax.debug.visualize_array_sharding

    def device_put(*args, **kwargs):
        out = real_put(*args, **kwargs)
        ctx.device_put_calls.append((args, kwargs, out))
        return out

    def visualize(arr, *args, **kwargs):
        ctx.visualized.append(arr)
        return real_vis(arr, *args, **kwargs)

    jax.device_put = device_put
    jax.debug.visualize_array_sharding = visualize
    try:
        yield
    finally:
        jax.device_put = real_put
        jax.debug.visualize_array_sharding = real_vis


def spy(name, fn, ctx):
    calls = ctx.calls.setdefault(name, [])

    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        calls.append((args, kwargs, out))
        return out

    wrapper.__name__ = getattr(fn, "__name__", name)
    return wrapper


def find_shard_maps(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            found.append(eqn)
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                if hasattr(sub, "eqns"):
                    found.extend(find_shard_maps(sub))
                elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    found.extend(find_shard_maps(sub.jaxpr))
    return found


# ------------------------------------------------------------------ verdicts, one per question
def check_q1_device_put(ns, ctx):
    A_ref = np.arange(64.0).reshape(4, 16)
    a = ns.get("A_sharded")
    need(is_array(a), f"A_sharded is {type(a).__name__}, not a jax.Array")
    need(a.shape == (4, 16) and a.dtype == jnp.float32, f"A_sharded is {a.dtype}{list(a.shape)}, not float32[4,16] like A")
    need(np.array_equal(np.asarray(a), A_ref), "A_sharded does not hold A's values")
    need(a.sharding == ctx.base["sharding"], f"sharding {a.sharding} is not `sharding` ({ctx.base['sharding']})")
    outs = [leaf for _, _, out in ctx.device_put_calls for leaf in jax.tree.leaves(out)]
    need(any(o is a for o in outs), "A_sharded is not what jax.device_put returned")
    need(any(v is a or (is_array(v) and v.sharding == a.sharding and np.array_equal(np.asarray(v), A_ref))
             for v in ctx.visualized), "the sharding of A_sharded was never drawn")


def check_q2_inspect(ns, ctx):
    mesh = ctx.base["mesh"]
    expected = set(mesh.devices.flat)  # P('x', 'y') on the 2 x 4 mesh uses every device
    devs = ns.get("A_sharded_devices")
    need(type(devs) in (set, frozenset), f"A_sharded_devices is a {type(devs).__name__}, not a set")
    need(all(isinstance(d, jax.Device) for d in devs), "A_sharded_devices holds things other than devices")
    need(set(devs) == expected, f"A_sharded_devices has {len(devs)} devices, expected the {len(expected)} of the mesh")
    shape = ns.get("A_shard_shape")
    need(type(shape) is tuple, f"A_shard_shape is a {type(shape).__name__}, not a tuple")
    need(all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) for n in shape),
         f"A_shard_shape {shape!r} is not a tuple of ints")
    need(tuple(int(n) for n in shape) == (4 // 2, 16 // 4), f"A_shard_shape is {shape}, expected (2, 4)")


Q3_SPECS = [P("x", None), P(None, "y"), P(None, None), P(None, "x")]


def check_q3_partition_specs(ns, ctx):
    mesh = ctx.base["mesh"]
    sizes = {"x": 2, "y": 4}
    shapes, reps = ns.get("shard_shapes"), ns.get("replicas")
    need(type(shapes) is dict and type(reps) is dict, "shard_shapes / replicas are not dicts")
    for name, d in (("shard_shapes", shapes), ("replicas", reps)):
        need(len(d) == 4 and set(d) == set(Q3_SPECS),
             f"{name} is keyed by {list(d)}, not by the four specs {Q3_SPECS}")
    for spec in Q3_SPECS:
        ways = [math.prod(sizes[a] for a in axes_of(e)) for e in spec]
        want_shape = tuple(n // k for n, k in zip((4, 16), ways))
        want_rep = 8 // math.prod(ways)
        got = shapes[spec]
        need(type(got) is tuple, f"shard_shapes[{spec}] is a {type(got).__name__}, not a tuple")
        need(tuple(got) == want_shape, f"shard_shapes[{spec}] = {got}, expected {want_shape}")
        r = reps[spec]
        need(isinstance(r, (int, np.integer)) and not isinstance(r, bool),
             f"replicas[{spec}] = {r!r} is not an int")
        need(r == want_rep, f"replicas[{spec}] = {r}, expected {want_rep}")
    placed = []
    for args, kwargs, _ in ctx.device_put_calls:
        where = args[1] if len(args) > 1 else kwargs.get("device")
        placed.extend(s for s in jax.tree.leaves(where, is_leaf=lambda s: isinstance(s, NamedSharding))
                      if isinstance(s, NamedSharding))
    for spec in Q3_SPECS:
        need(any(s.mesh == mesh and s.spec == spec for s in placed), f"A was never placed with {spec} on mesh")
    need(len(ctx.visualized) >= 4, f"only {len(ctx.visualized)} placements drawn, expected the four")


def check_q4_propagation(ns, ctx):
    mesh = ctx.base["mesh"]
    B, C = ns.get("B"), ns.get("C")
    for name, arr, axis in (("B", B, "x"), ("C", C, "y")):
        need(is_array(arr) and arr.shape == (4, 8), f"{name} is not a 4 x 8 jax.Array")
        need(isinstance(arr.sharding, NamedSharding) and arr.sharding.mesh == mesh,
             f"{name} is not on `mesh` ({arr.sharding})")
        split = split_of(arr)
        need(len(split) == 1 and list(split.values())[0] == (axis,),
             f"{name} has spec {arr.sharding.spec}: expected one dimension split over '{axis}' alone")
    Bn, Cn = np.asarray(B), np.asarray(C)
    ref_sum = jax.jit(lambda b, c: b + c)(B, C)
    ref_prod = jax.jit(lambda b, c: b.T @ c)(B, C)
    s = ns.get("B_plus_C")
    need(is_array(s) and s.shape == (4, 8), "B_plus_C is not a 4 x 8 jax.Array")
    need(close(s, Bn.astype(np.float64) + Cn), "B_plus_C != B + C")
    need(s.sharding.is_equivalent_to(ref_sum.sharding, 2),
         f"B_plus_C is laid out as {s.sharding}, not as jit propagates B + C ({ref_sum.sharding.spec})")
    m = ns.get("BtC")
    need(is_array(m) and m.shape == (8, 8), "BtC is not an 8 x 8 jax.Array")
    want = Bn.astype(np.float64).T @ Cn.astype(np.float64)
    need(close(m, want, rtol=1e-5, atol=1e-4 * (1 + np.abs(want).max())), "BtC != B.T @ C")
    need(m.sharding.is_equivalent_to(ref_prod.sharding, 2),
         f"BtC is laid out as {m.sharding}, not as jit propagates B.T @ C ({ref_prod.sharding.spec})")


def check_1d_mesh(arr, axis_type, name):
    need(is_array(arr), f"{name} is not a jax.Array")
    need(isinstance(arr.sharding, NamedSharding), f"{name} is not on a mesh")
    m = arr.sharding.mesh
    need(len(m.axis_names) == 1, f"{name} is on a {len(m.axis_names)}-D mesh {dict(m.shape)}, not a 1-D one")
    need(m.size in (4, 8), f"{name} is on a mesh of {m.size} devices, not 4 or 8")
    need(tuple(m.axis_types) == (axis_type,), f"{name}'s mesh axis is {m.axis_types}, not {axis_type}")
    need(split_of(arr) == {0: (m.axis_names[0],)},
         f"{name} has spec {arr.sharding.spec}: expected its rows split over the mesh axis")
    return m


def check_replicated_on(arr, ref, m, name):
    need(is_array(arr) and np.array_equal(np.asarray(arr), np.asarray(ref)), f"{name} does not hold the values")
    need(isinstance(arr.sharding, NamedSharding) and arr.sharding.mesh == m,
         f"{name} is not on the data's mesh ({arr.sharding})")
    need(arr.sharding.is_fully_replicated, f"{name} is not replicated ({arr.sharding.spec})")


def check_q5_dp_auto(ns, ctx):
    x, W, b = (ctx.base[k] for k in ("x", "W", "b"))
    xa = ns.get("x_auto")
    m = check_1d_mesh(xa, AxisType.Auto, "x_auto")
    need(np.array_equal(np.asarray(xa), np.asarray(x)), "x_auto does not hold x")
    check_replicated_on(ns.get("W_auto"), W, m, "W_auto")
    check_replicated_on(ns.get("b_auto"), b, m, "b_auto")
    out = ns.get("out_auto")
    need(is_array(out) and close(out, layer_np(x, W, b)), "out_auto has the wrong values")
    need(isinstance(out.sharding, NamedSharding)
         and out.sharding.is_equivalent_to(NamedSharding(m, P(m.axis_names[0])), 2),
         f"out_auto is not split like the data ({out.sharding})")
    need(any(len(a) == 3 and a[0] is xa and a[1] is ns["W_auto"] and a[2] is ns["b_auto"] and o is out
             for a, _, o in ctx.calls.get("layer", [])),
         "out_auto is not layer(x_auto, W_auto, b_auto)")


def check_q6_dp_explicit(ns, ctx):
    x, W, b = (ctx.base[k] for k in ("x", "W", "b"))
    xe = ns.get("x_explicit")
    m = check_1d_mesh(xe, AxisType.Explicit, "x_explicit")
    ax = m.axis_names[0]
    need(np.array_equal(np.asarray(xe), np.asarray(x)), "x_explicit does not hold x")
    check_replicated_on(ns.get("W_explicit"), W, m, "W_explicit")
    check_replicated_on(ns.get("b_explicit"), b, m, "b_explicit")
    f = ns.get("layer_explicit")
    need(type(f) is PJIT_TYPE, f"layer_explicit is a {type(f).__name__}, not a jax.jit-compiled function")
    out = ns.get("out_explicit")
    need(is_array(out) and close(out, layer_np(x, W, b)), "out_explicit has the wrong values")
    need(isinstance(out.sharding, NamedSharding) and out.sharding.mesh == m and split_of(out) == {0: (ax,)},
         f"out_explicit is not split like the data ({out.sharding})")
    types = [str(jax.typeof(v)) for v in (xe, ns["W_explicit"], ns["b_explicit"], out)]
    missing = [t for t in types if t not in ctx.stdout]
    need(not missing, f"while computing out_explicit nothing printed the types {missing}")
    for i, (n, nf, no) in enumerate(((16 * m.size, 7, 3), (4 * m.size, 10, 2))):
        rng = fresh_rng(i)
        x2 = jax.device_put(rng.standard_normal((n, nf)).astype(np.float32), NamedSharding(m, P(ax)))
        W2 = jax.device_put(rng.standard_normal((nf, no)).astype(np.float32), NamedSharding(m, P()))
        b2 = jax.device_put(rng.standard_normal((no,)).astype(np.float32), NamedSharding(m, P()))
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            o2 = f(x2, W2, b2)
        need(close(o2, layer_np(x2, W2, b2)), f"layer_explicit is wrong on new data {n}x{nf}->{no}")
        types = [str(jax.typeof(v)) for v in (x2, W2, b2, o2)]
        missing = [t for t in types if t not in buf.getvalue()]
        need(not missing, f"tracing layer_explicit on new data did not print {missing}")


def check_q7_dp_manual(ns, ctx):
    x, W, b = (ctx.base[k] for k in ("x", "W", "b"))
    f = ns.get("layer_manual")
    need(callable(f), "layer_manual is not a function")
    with contextlib.redirect_stdout(io.StringIO()):
        closed = jax.make_jaxpr(f)(x, W, b)
    sms = find_shard_maps(closed.jaxpr)
    need(sms, "layer_manual runs no jax.shard_map")
    for eqn in sms:
        mesh = eqn.params["mesh"]
        need(len(mesh.axis_names) == 1 and mesh.size in (4, 8),
             f"shard_map runs on mesh {dict(mesh.shape)}, not a 1-D mesh of 4 or 8 devices")
        shapes = [tuple(v.aval.shape) for v in eqn.invars]
        need(tuple(x.shape) in shapes, "x is not handed to shard_map")
        for shape, spec in zip(shapes, eqn.params["in_specs"]):
            split = spec_split(spec, len(shape))
            if shape == tuple(x.shape):
                need(split == {0: (mesh.axis_names[0],)}, f"x goes in with in_specs {spec}, not split by rows")
            elif shape in (tuple(W.shape), tuple(b.shape)):
                need(not split, f"an operand of shape {shape} goes in split ({spec}), not whole")
    out = ns.get("out_man")
    need(is_array(out) and close(out, layer_np(x, W, b)), "out_man has the wrong values")
    need(isinstance(out.sharding, NamedSharding), "out_man is not on a mesh")
    om = out.sharding.mesh
    need(len(om.axis_names) == 1 and om.size in (4, 8) and split_of(out) == {0: (om.axis_names[0],)},
         f"out_man is not split by rows over a 1-D mesh of 4 or 8 ({out.sharding})")
    for i, (n, nf, no) in enumerate(((64, 10, 2), (256, 7, 3))):
        rng = fresh_rng(10 + i)
        x2 = jnp.asarray(rng.standard_normal((n, nf)), dtype=jnp.float32)
        W2 = jnp.asarray(rng.standard_normal((nf, no)), dtype=jnp.float32)
        b2 = jnp.asarray(rng.standard_normal((no,)), dtype=jnp.float32)
        with contextlib.redirect_stdout(io.StringIO()):
            o2 = f(x2, W2, b2)
        need(close(o2, layer_np(x2, W2, b2)), f"layer_manual is wrong on new data {n}x{nf}->{no}")


def check_q8_sharded_training(ns, ctx):
    base = ctx.base
    all_devices = set(base["devices"])
    xs, ys = ns.get("x_train_sharded"), ns.get("y_train_sharded")
    for name, arr, ref in (("x_train_sharded", xs, base["x_train"]), ("y_train_sharded", ys, base["y_train"])):
        need(is_array(arr) and np.array_equal(np.asarray(arr), np.asarray(ref)), f"{name} does not hold the data")
        need(isinstance(arr.sharding, NamedSharding), f"{name} is not on a mesh")
        m = arr.sharding.mesh
        need(all(t == AxisType.Auto for t in m.axis_types), f"{name}'s mesh axes are {m.axis_types}, not Auto")
        need(set(arr.sharding.device_set) == all_devices, f"{name} is not spread over all 8 devices")
        need(tuple(arr.sharding.shard_shape(arr.shape)) == (ref.shape[0] // 8, ref.shape[1]),
             f"{name} blocks are {arr.sharding.shard_shape(arr.shape)}: not split 8 ways along the batch")
    m = xs.sharding.mesh
    need(ys.sharding.mesh == m, "x and y are on different meshes")
    pr = ns.get("params_replicated")
    need(type(pr) is list and len(pr) == len(base["params"]), "params_replicated is not a list of (W, b) pairs")
    for (Wr, br), (W0, b0) in zip(pr, base["params"]):
        check_replicated_on(Wr, W0, m, "a W of params_replicated")
        check_replicated_on(br, b0, m, "a b of params_replicated")
    calls = ctx.calls.get("train", [])
    need(len(calls) == 1, f"train was called {len(calls)} times")
    args, kwargs, out = calls[0]
    need(len(args) == 3 and args[0] is pr and args[1] is xs and args[2] is ys,
         "train was not called on (params_replicated, x_train_sharded, y_train_sharded)")
    need(kwargs.get("epochs", 100) == 100 and kwargs.get("step_size", 1e-3) == 1e-3,
         f"train was called with {kwargs}")
    pts = ns.get("params_trained_sharded")
    need(pts is out, "params_trained_sharded is not what train returned")
    need(type(pts) is list and len(pts) == len(base["params_single"]), "params_trained_sharded is not a list")
    for (Wt, bt), (Ws, bs) in zip(pts, base["params_single"]):
        for leaf, ref in ((Wt, Ws), (bt, bs)):
            need(close(leaf, ref, rtol=1e-4, atol=1e-6), "params_trained_sharded does not match params_single")
            need(leaf.sharding.is_fully_replicated and set(leaf.sharding.device_set) == all_devices,
                 f"a trained parameter is not replicated on all devices ({leaf.sharding})")


class _Pending:
    def __init__(self, ready_at):
        self.ready_at = ready_at

    def block_until_ready(self):
        while True:
            left = self.ready_at - time.perf_counter()
            if left <= 0:
                return self
            time.sleep(left)


class StandIn:
    """A function with a slow first call whose results are ready some time after each call
    returns; like a device, it runs the calls one after another (a call's work starts when the
    previous call's work is done)."""

    def __init__(self, first, durations):
        self.first, self.durations = first, durations
        self.calls, self.bad_args, self.busy_until, self.work = 0, 0, 0.0, []

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if args != (1, "two") or kwargs:
            self.bad_args += 1
        if self.calls == 1:
            time.sleep(self.first)  # "compiling"
        d = self.durations[self.calls % len(self.durations)]
        start = max(time.perf_counter(), self.busy_until)
        self.busy_until = start + d
        self.work.append(d)
        return _Pending(self.busy_until)


def check_q9_timing(ns, ctx):
    base = ctx.base
    spc = ns.get("seconds_per_call")
    need(callable(spc), "seconds_per_call is not a function")
    fast = StandIn(0.0, (0.0002,))
    spc(fast, 1, "two")
    need(fast.bad_args == 0, "seconds_per_call does not call fn(*args)")
    need(3 <= fast.calls <= 101, f"seconds_per_call called fn {fast.calls} times (warm-up + 2..100 timed calls expected)")
    slow = StandIn(0.5, (0.01, 0.05))
    got = spc(slow, 1, "two")
    need(isinstance(got, float) and math.isfinite(got), f"seconds_per_call returned {got!r}, not a float")
    want = float(np.mean(slow.work[1:]))  # the work of the timed calls
    need(0.8 * want <= got <= 1.3 * want + 0.005,
         f"seconds_per_call says {got:.4f} s for calls that take {want:.4f} s each")
    for name in ("time_unsharded", "time_sharded"):
        t = ns.get(name)
        need(isinstance(t, float) and math.isfinite(t) and 0 < t < 2, f"{name} = {t!r}")
    calls = ctx.calls.get("grad_loss", [])

    def called_with(*want_args):
        return any(len(a) == 3 and all(x is y for x, y in zip(a, want_args)) for a, _, _ in calls)

    need(called_with(base["params"], base["x_train"], base["y_train"]),
         "grad_loss was never timed on (params, x_train, y_train)")
    need(called_with(base["params_replicated"], base["x_train_sharded"], base["y_train_sharded"]),
         "grad_loss was never timed on (params_replicated, x_train_sharded, y_train_sharded)")


CHECKS = {q: globals()["check_" + q] for q in QUESTIONS}
SPIES = {"q5_dp_auto": ["layer"], "q8_sharded_training": ["train"], "q9_timing": ["grad_loss"]}


# ------------------------------------------------------------------ running
def quiet_exec(code, ns, label):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        exec(compile(code, label, "exec"), ns)
    return out.getvalue()


def notebook_text():
    import json
    with open(NOTEBOOK, encoding="utf-8") as fh:
        nb = json.load(fh)
    text = " ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    return re.sub(r"\s+", " ", text)


def judge(question, answer, base):
    ctx = Ctx(base)
    ns = dict(base)
    for name in SPIES.get(question, []):
        ns[name] = spy(name, base[name], ctx)
    t0 = time.perf_counter()
    try:
        with patched_jax(ctx):
            ctx.stdout = quiet_exec(answer["code"], ns, f"<{question}:{answer['name']}>")
    except Exception as exc:  # the answer cell itself fails
        return "wrong", f"the cell raises {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", time.perf_counter() - t0
    try:
        CHECKS[question](ns, ctx)
        return "correct", "", time.perf_counter() - t0
    except Wrong as exc:
        return "wrong", str(exc)[:160], time.perf_counter() - t0
    except Exception as exc:
        return "wrong", f"checking raised {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", time.perf_counter() - t0


def load_answers(question, problems):
    with open(os.path.join(HERE, question + ".yaml"), encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    names = [a["name"] for label in ("correct", "wrong") for a in data.get(label, [])]
    if len(names) != len(set(names)):
        problems.append(f"{question}: duplicate names")
    if len(data.get("correct", [])) < 3 or not 5 <= len(data.get("wrong", [])) <= 8:
        problems.append(f"{question}: {len(data.get('correct', []))} correct / {len(data.get('wrong', []))} wrong")
    for label in ("correct", "wrong"):
        for a in data.get(label, []):
            if not a["code"].startswith("### Your code here"):
                problems.append(f"{question}:{a['name']}: code does not start with '### Your code here'")
            if label == "wrong" and a.get("kind") not in KINDS:
                problems.append(f"{question}:{a['name']}: kind {a.get('kind')!r}")
            if not re.fullmatch(r"[A-Za-z0-9_]+", a["name"]):
                problems.append(f"{question}:{a['name']}: name is not snake_case")
    return data


def main(selected):
    text = notebook_text()
    problems = []
    ns = {"__name__": "__main__"}
    summary = {}
    mismatches = []
    t_start = time.perf_counter()
    for tag, payload in NOTEBOOK_CELLS:
        if tag != "answer":
            quiet_exec(payload, ns, f"<notebook {tag}>")
            continue
        question = payload
        if question in selected:
            data = load_answers(question, problems)
            counts = summary.setdefault(question, {"correct": 0, "wrong": 0, "agree": 0})
            for label in ("correct", "wrong"):
                for answer in data.get(label, []):
                    sentence = re.sub(r"\s+", " ", answer.get("sentence", "")).strip()
                    if not sentence or sentence not in text:
                        problems.append(f"{question}:{answer['name']}: sentence not found in the notebook")
                    verdict, reason, secs = judge(question, answer, ns)
                    agree = verdict == label
                    counts[label] += 1
                    counts["agree"] += agree
                    if not agree:
                        mismatches.append(f"{question}:{answer['name']}")
                    print(f"{question:20s} {answer['name']:42s} label={label:7s} oracle={verdict:7s} "
                          f"{'OK' if agree else 'MISMATCH'} [{secs:5.1f}s] {reason}", flush=True)
        quiet_exec(REFERENCE[question], ns, f"<reference {question}>")
    print()
    print("summary (labels: correct / wrong; answers where the oracle agrees):")
    for question, c in summary.items():
        print(f"  {question:20s} correct={c['correct']} wrong={c['wrong']} agree={c['agree']}/{c['correct'] + c['wrong']}")
    total = sum(c["correct"] + c["wrong"] for c in summary.values())
    agree = sum(c["agree"] for c in summary.values())
    print(f"  total: {total} answers, oracle agrees with {agree}, mismatches: {mismatches or 'none'}")
    print(f"  format problems: {problems or 'none'}")
    print(f"  run time: {time.perf_counter() - t_start:.0f} s")
    return 0 if not mismatches and not problems else 1


if __name__ == "__main__":
    args = sys.argv[1:]
    chosen = [q for q in QUESTIONS if not args or any(q.startswith(a) or q == a for a in args)]
    sys.exit(main(chosen))
