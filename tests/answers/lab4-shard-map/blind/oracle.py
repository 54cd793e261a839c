#!/usr/bin/env python
"""Blind oracle for the lab4-shard-map answer corpus in this folder.

Written by an outside helper from the student notebook's text alone (no hidden checks, no
solutions). For every answer in the <question>.yaml files beside this script it rebuilds the
notebook's kernel state up to the answer cell (starter code copied from the student notebook,
plus this script's OWN reference solutions for the earlier tasks), runs the answer's code in a
fresh copy of that namespace, and judges it against this script's own references on new random
inputs and on the method the task's text requires (read from jax.make_jaxpr).

Run:  /work/main/.venv/bin/python oracle.py [question ...]
"""
import os

os.environ.setdefault("PJRT_NPROC", "16")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import contextlib  # noqa: E402
import glob  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOK = os.path.normpath(os.path.join(
    HERE, "..", "..", "..", "..", "student", "lab4-shard-map", "lab4-shard-map.ipynb"))
QUESTIONS = ["q1_vmap_collective", "q2_global_sum", "q3_matmul_allgather", "q4_matmul_ring",
             "q5_matmul_reducescatter", "q6_matmul_ring_reducescatter", "q7_loss_dp",
             "q8_loss_fsdp", "q9_loss_tp", "q10_dp_training"]

# Starter code copied from the student notebook (cell index: source), with the
# jax.debug.visualize_array_sharding lines left out.
STARTER = {
    3: r'''
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
''',
    4: r'''
from functools import partial

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def one_d_mesh(axis_name):
    """A mesh of the 8 devices in a row, with one Auto axis called `axis_name`."""
    return jax.make_mesh((N_DEVICES,), (axis_name,), axis_types=(AxisType.Auto,),
                         devices=devices)
''',
    6: r'''
def answered(*answers):
    """Whether every answer given is filled in; if one is still `...`, say so and return False."""
    if any(answer is ... for answer in answers):
        print("Skipped: this cell uses your answer to the task above. Fill that in first.")
        return False
    return True
''',
    8: r'''
x = np.arange(5.0)
w = np.array([2.0, 3.0, 4.0])


def convolve(x, w):
    output = []
    for i in range(1, len(x) - 1):
        output.append(jnp.dot(x[i - 1:i + 2], w))
    return jnp.array(output)


convolve(x, w)
''',
    10: r'''
xs_conv = np.arange(5.0 * N_DEVICES).reshape(-1, 5)
jax.vmap(convolve, in_axes=(0, None))(xs_conv, w)
''',
    16: r'''
mesh_p = one_d_mesh("p")
if answered(normalized_convolution):
    on_devices = jax.shard_map(lambda x, w: normalized_convolution(x[0], w)[None], mesh=mesh_p,
                               in_specs=(P("p"), P()), out_specs=P("p"))

    conv_vmap = jax.vmap(normalized_convolution, in_axes=(0, None), axis_name="p")(xs_conv, w)
    conv_devices = on_devices(xs_conv, w)
    print(conv_vmap)
    print("same on 8 devices:", np.allclose(conv_vmap, conv_devices, rtol=1e-5))
    print("columns sum to 1:", np.allclose(conv_vmap.sum(axis=0), 1.0, rtol=1e-5))
''',
    18: r'''
mesh = one_d_mesh("i")


def device_put(x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


v = device_put(jnp.arange(32.0), P("i"))
''',
    24: r'''
lhs_values = jax.random.normal(jax.random.key(0), (32, 64))
rhs_values = jax.random.normal(jax.random.key(1), (64, 16))
expected_product = lhs_values @ rhs_values

lhs_spec = P("i", None)  # sharded by rows
rhs_spec = P("i", None)  # sharded by rows
lhs = device_put(lhs_values, lhs_spec)
rhs = device_put(rhs_values, rhs_spec)
''',
    36: r'''
lhs_cols_spec = P(None, "i")  # sharded by columns
lhs_by_cols = device_put(lhs_values, lhs_cols_spec)
''',
    47: r'''
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(lhs_spec, rhs_spec), out_specs=rhs_spec)
def matmul_allgather_overlapped_bidi(lhs_block, rhs_block):
    size = lax.axis_size("i")
    idx = lax.axis_index("i")
    shift_up = partial(lax.ppermute, axis_name="i",
                       perm=[(k, (k + 1) % size) for k in range(size)])
    shift_down = partial(lax.ppermute, axis_name="i",
                         perm=[(k, (k - 1) % size) for k in range(size)])
    B = lhs_block.shape[1] // size // 2  # half blocks

    def lhs_cols(k, half):
        return lax.dynamic_slice_in_dim(lhs_block, (2 * k + half) * B, B, 1)

    rhs_lo, rhs_hi = jnp.split(rhs_block, 2, axis=0)
    out_block = lhs_cols(idx, 0) @ rhs_lo + lhs_cols(idx, 1) @ rhs_hi
    for step in range(1, size):
        rhs_lo, rhs_hi = shift_up(rhs_lo), shift_down(rhs_hi)
        out_block += lhs_cols((idx - step) % size, 0) @ rhs_lo
        out_block += lhs_cols((idx + step) % size, 1) @ rhs_hi
    return out_block


print(jnp.allclose(matmul_allgather_overlapped_bidi(lhs, rhs), expected_product, atol=1e-4))
''',
    49: r'''
def predict(params, inputs):
    for W, b in params:
        outputs = jnp.dot(inputs, W) + b
        inputs = jax.nn.relu(outputs)
    return outputs


def loss(params, batch):
    inputs, targets = batch
    predictions = predict(params, inputs)
    return jnp.mean(jnp.sum((predictions - targets) ** 2, axis=-1))


def init_layer(key, n_in, n_out):
    k1, k2 = jax.random.split(key)
    W = jax.random.normal(k1, (n_in, n_out)) / jnp.sqrt(n_in)
    b = jax.random.normal(k2, (n_out,))
    return W, b


def init(key, layer_sizes, batch_size):
    key, *keys = jax.random.split(key, len(layer_sizes))
    params = list(map(init_layer, keys, layer_sizes[:-1], layer_sizes[1:]))
    key, *keys = jax.random.split(key, 3)
    inputs = jax.random.normal(keys[0], (batch_size, layer_sizes[0]))
    targets = jax.random.normal(keys[1], (batch_size, layer_sizes[-1]))
    return params, (inputs, targets)


layer_sizes = [784, 128, 128, 128, 128, 128, 8]
batch_size = 32
params, batch = init(jax.random.key(0), layer_sizes, batch_size)

loss_single = jax.jit(loss)(params, batch)
grad_single = jax.jit(jax.grad(loss))(params, batch)
print(f"single-device loss: {float(loss_single):.4f}")


def allclose(a, b):
    """Whether two pytrees (for example two gradients) agree leaf by leaf."""
    return jax.tree.all(jax.tree.map(partial(jnp.allclose, rtol=1e-3, atol=1e-4), a, b))
''',
    51: r'''
mesh_batch = one_d_mesh("batch")
batch_dp = jax.device_put(batch, NamedSharding(mesh_batch, P("batch")))
params_dp = jax.device_put(params, NamedSharding(mesh_batch, P()))
''',
    57: r'''
batch_fsdp = jax.device_put(batch, NamedSharding(mesh_batch, P("batch")))
params_fsdp = jax.device_put(params, NamedSharding(mesh_batch, P("batch")))
print("a weight matrix, sharded by rows:", params_fsdp[0][0].sharding.shard_shape((784, 128)))
''',
    63: r'''
mesh_feats = one_d_mesh("feats")
batch_tp = jax.device_put(batch, NamedSharding(mesh_feats, P(None, "feats")))
params_tp = jax.device_put(params, NamedSharding(mesh_feats, P("feats")))
''',
    69: r'''
from typing import NamedTuple


class Params(NamedTuple):
    weight: jnp.ndarray
    bias: jnp.ndarray


def init_regression(rng):
    """The initial model parameters."""
    weights_key, bias_key = jax.random.split(rng)
    weight = jax.random.normal(weights_key, ())
    bias = jax.random.normal(bias_key, ())
    return Params(weight, bias)


def loss_fn(params, xs, ys):
    """Mean squared error of the model's predictions on xs against ys."""
    pred = params.weight * xs + params.bias
    return jnp.mean((pred - ys) ** 2)


LEARNING_RATE = 0.005


@jax.jit
def update_single(params, xs, ys):
    """One SGD step on one device; returns the new params and the loss before the step."""
    loss, grads = jax.value_and_grad(loss_fn)(params, xs, ys)
    new_params = jax.tree.map(lambda p, g: p - LEARNING_RATE * g, params, grads)
    return new_params, loss


def train(update, params, xs, ys, steps=1000):
    for step in range(steps):
        params, loss = update(params, xs, ys)
        params = jax.block_until_ready(params)  # one step at a time (see the setup cell)
        if step % 200 == 0:
            print(f"step {step:4d}, loss {float(loss):.3f}")
    return params


# data drawn around y = 2 x - 1
rng = np.random.default_rng(0)
xs = rng.normal(size=(128, 1)).astype(np.float32)
noise = 0.5 * rng.normal(size=(128, 1)).astype(np.float32)
ys = (xs * 2 - 1 + noise).astype(np.float32)

params_init = init_regression(jax.random.PRNGKey(123))
params_single = train(update_single, params_init, xs, ys)
print(params_single)
''',
    71: r'''
mesh_dp = one_d_mesh("batch")
xs_sharded = jax.device_put(xs, NamedSharding(mesh_dp, P("batch")))
ys_sharded = jax.device_put(ys, NamedSharding(mesh_dp, P("batch")))
params_replicated = jax.device_put(params_init, NamedSharding(mesh_dp, P()))
''',
}

# --------------------------------------------------------------------------- own references
# This helper's own reference solutions of the tasks, used only to build the kernel state that
# later answer cells see (the checks below compare with NumPy / the notebook's single-device
# functions, not with these).
REF = {
    "q1_vmap_collective": r'''
def normalized_convolution(x, w):
    out = jnp.stack([jnp.dot(x[i - 1:i + 2], w) for i in range(1, len(x) - 1)])
    return out / jax.lax.psum(out, "p")
''',
    "q2_global_sum": r'''
global_sum = jax.shard_map(lambda b: lax.psum(jnp.sum(b), "i"), mesh=mesh,
                           in_specs=P("i"), out_specs=P())
''',
    "q3_matmul_allgather": r'''
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(P("i", None), P("i", None)), out_specs=P("i", None))
def matmul_allgather(l, r):
    return l @ lax.all_gather(r, "i", tiled=True)
''',
    "q4_matmul_ring": r'''
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(P("i", None), P("i", None)), out_specs=P("i", None))
def matmul_allgather_overlapped(l, r):
    n = lax.axis_size("i"); idx = lax.axis_index("i"); k = r.shape[0]
    perm = [(j, (j + 1) % n) for j in range(n)]
    out = lax.dynamic_slice_in_dim(l, idx * k, k, 1) @ r
    for s in range(1, n):
        r = lax.ppermute(r, "i", perm)
        out = out + lax.dynamic_slice_in_dim(l, ((idx - s) % n) * k, k, 1) @ r
    return out
''',
    "q5_matmul_reducescatter": r'''
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(P(None, "i"), P("i", None)), out_specs=P("i", None))
def matmul_psumscatter(l, r):
    return lax.psum_scatter(l @ r, "i", tiled=True)
''',
    "q6_matmul_ring_reducescatter": r'''
@jax.jit
@partial(jax.shard_map, mesh=mesh, in_specs=(P(None, "i"), P("i", None)), out_specs=P("i", None))
def matmul_psumscatter_overlapped(l, r):
    n = lax.axis_size("i"); idx = lax.axis_index("i"); R = l.shape[0] // n
    perm = [(j, (j + 1) % n) for j in range(n)]
    part = lambda j: lax.dynamic_slice_in_dim(l, j * R, R, 0) @ r
    acc = part((idx - 1) % n)
    for s in range(1, n):
        acc = lax.ppermute(acc, "i", perm) + part((idx - s - 1) % n)
    return acc
''',
    "q7_loss_dp": r'''
loss_dp = jax.shard_map(lambda p, b: lax.pmean(loss(p, b), "batch"), mesh=mesh_batch,
                        in_specs=(P(), P("batch")), out_specs=P())
''',
    "q8_loss_fsdp": r'''
def _ref_fsdp(params, batch):
    inputs, targets = batch
    for W, b in params:
        outputs = inputs @ lax.all_gather(W, "batch", tiled=True) + lax.all_gather(b, "batch", tiled=True)
        inputs = jax.nn.relu(outputs)
    return lax.pmean(jnp.mean(jnp.sum((outputs - targets) ** 2, axis=-1)), "batch")
loss_fsdp = jax.shard_map(_ref_fsdp, mesh=mesh_batch, in_specs=(P("batch"), P("batch")), out_specs=P())
''',
    "q9_loss_tp": r'''
@partial(jax.shard_map, mesh=mesh_feats, in_specs=(P("feats"), P(None, "feats")), out_specs=P(None, "feats"))
def _ref_predict_tp(params, inputs):
    for W, b in params:
        outputs = lax.psum_scatter(inputs @ W, "feats", scatter_dimension=1, tiled=True) + b
        inputs = jax.nn.relu(outputs)
    return outputs
def loss_tp(params, batch):
    return jnp.mean(jnp.sum((_ref_predict_tp(params, batch[0]) - batch[1]) ** 2, axis=-1))
''',
}

# (cells before the task's answer cell) for each question, in notebook order
STAGES = {
    "q1_vmap_collective": [3, 4, 6, 8, 10],
    "q2_global_sum": ["q1_vmap_collective", 16, 18],
    "q3_matmul_allgather": ["q2_global_sum", 24],
    "q4_matmul_ring": ["q3_matmul_allgather"],
    "q5_matmul_reducescatter": ["q4_matmul_ring", 36],
    "q6_matmul_ring_reducescatter": ["q5_matmul_reducescatter"],
    "q7_loss_dp": ["q6_matmul_ring_reducescatter", 47, 49, 51],
    "q8_loss_fsdp": ["q7_loss_dp", 57],
    "q9_loss_tp": ["q8_loss_fsdp", 63],
    "q10_dp_training": ["q9_loss_tp", 69, 71],
}


def build_namespaces(upto):
    """{question: namespace at its answer cell} for the questions up to `upto`."""
    ns = {"__name__": "__lab__"}
    snapshots = {}
    for q in QUESTIONS:
        for step in STAGES[q]:
            src = STARTER[step] if isinstance(step, int) else REF[step]
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(src, f"<cell {step}>", "exec"), ns)
        snapshots[q] = dict(ns)
        if q == upto:
            break
    return snapshots

# --------------------------------------------------------------------------- program reading
COLLECTIVE_PREFIXES = ("psum", "pmax", "pmin", "all_gather", "all_to_all", "ragged_all_to_all",
                       "ppermute", "reduce_scatter", "pbroadcast", "pgather")


def is_collective(name):
    return name.startswith(COLLECTIVE_PREFIXES)


def sub_jaxprs(params):
    for value in params.values():
        for sub in value if isinstance(value, (list, tuple)) else (value,):
            if hasattr(sub, "eqns"):
                yield sub
            elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                yield sub.jaxpr


def flatten(jaxpr):
    """Every equation under `jaxpr`, nested bodies inlined where they occur."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for sub in sub_jaxprs(eqn.params):
            out.extend(flatten(sub))
    return out


def find_shard_maps(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "shard_map":
            found.append(eqn)
        else:
            for sub in sub_jaxprs(eqn.params):
                found.extend(find_shard_maps(sub))
    return found


def shape_of(var):
    return tuple(int(n) for n in getattr(var.aval, "shape", ()))


def norm_spec(spec, ndim):
    """A PartitionSpec as a tuple (one entry per dimension) of tuples of mesh axis names."""
    entries = list(spec) + [None] * (ndim - len(spec))
    out = []
    for e in entries:
        out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
    return tuple(out)


def program(fn, *args):
    """(top-level primitive names, [shard_map info]) of jax.make_jaxpr(fn)(*args)."""
    closed = jax.make_jaxpr(fn)(*args)
    infos = []
    for eqn in find_shard_maps(closed.jaxpr):
        mesh = eqn.params["mesh"]
        infos.append({
            "axes": tuple(str(a) for a in mesh.axis_names),
            "sizes": tuple(int(mesh.shape[a]) for a in mesh.axis_names),
            "ins": [(shape_of(v), norm_spec(s, len(shape_of(v))))
                    for v, s in zip(eqn.invars, eqn.params["in_specs"])],
            "outs": [(shape_of(v), norm_spec(s, len(shape_of(v))))
                     for v, s in zip(eqn.outvars, eqn.params["out_specs"])],
            "body": flatten(eqn.params["jaxpr"]),
        })
    return [e.primitive.name for e in closed.jaxpr.eqns], infos


def collectives(body):
    return [e for e in body if is_collective(e.primitive.name)]


def jitted(top):
    return len(top) == 1 and top[0] in ("jit", "pjit")


def one_shard_map(infos, axis, fails):
    if len(infos) != 1:
        fails.append(f"expected one shard_map, found {len(infos)}")
        return None
    sm = infos[0]
    if sm["axes"] != (axis,) or sm["sizes"] != (8,):
        fails.append(f"shard_map over mesh axes {sm['axes']} {sm['sizes']}, expected ('{axis}',) of 8")
    return sm


def is_full_cycle(perm, n=8):
    perm = [tuple(int(x) for x in p) for p in perm]
    if len(perm) != n:
        return False
    src = [a for a, _ in perm]
    dst = [b for _, b in perm]
    if sorted(src) != list(range(n)) or sorted(dst) != list(range(n)):
        return False
    nxt = dict(perm)
    seen, k = set(), 0
    while k not in seen:
        seen.add(k)
        k = nxt[k]
    return len(seen) == n


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def replicated_on(arr, axis):
    s = getattr(arr, "sharding", None)
    return (isinstance(s, NamedSharding) and tuple(s.mesh.axis_names) == (axis,)
            and s.is_fully_replicated)


def laid_out(arr, axis, spec):
    s = getattr(arr, "sharding", None)
    return (isinstance(s, NamedSharding) and tuple(s.mesh.axis_names) == (axis,)
            and s.is_equivalent_to(NamedSharding(s.mesh, spec), arr.ndim))


def close(a, b, rtol, atol):
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and bool(np.all(np.isfinite(a))) and np.allclose(a, b, rtol=rtol, atol=atol)


def rng_for(*seed):
    return np.random.default_rng([20240611, *seed])


# --------------------------------------------------------------------------- the checks
# Each check gets the namespace after the answer cell ran and returns a list of failures
# (empty: the answer is correct).

def check_q1(ns):
    fails = []
    f = ns["normalized_convolution"]
    mesh_p = ns["one_d_mesh"]("p")
    on_devices = jax.shard_map(lambda x, w: f(x[0], w)[None], mesh=mesh_p,
                               in_specs=(P("p"), P()), out_specs=P("p"))
    vmapped = jax.jit(jax.vmap(f, in_axes=(0, None), axis_name="p"))
    for t, length in enumerate((5, 3, 9)):
        rng = rng_for(1, t)
        while True:  # positions whose total over the batch is far from 0, signed outputs
            xs = rng.normal(0.5, 1.0, size=(8, length)).astype(np.float32)
            w = rng.normal(0.0, 1.0, size=3).astype(np.float32)
            conv = np.stack([[np.dot(x[i:i + 3].astype(np.float64), w) for i in range(length - 2)]
                             for x in xs])
            if np.all(np.abs(conv.sum(0)) > 1.0) and np.any(conv < 0):
                break
        ref = conv / conv.sum(0)
        try:
            got_v = vmapped(xs, w)
            if not close(got_v, ref, 1e-4, 1e-5):
                fails.append(f"length {length}: vmap values differ from the normalised convolution")
        except Exception as exc:
            fails.append(f"length {length}: vmap raised {type(exc).__name__}: {str(exc)[:120]}")
        try:
            got_d = jax.jit(on_devices)(xs, w)
            if not close(got_d, ref, 1e-4, 1e-5):
                fails.append(f"length {length}: shard_map values differ")
        except Exception as exc:
            fails.append(f"length {length}: shard_map raised {type(exc).__name__}: {str(exc)[:120]}")
    try:
        _, infos = program(on_devices, np.ones((8, 5), np.float32), np.ones(3, np.float32))
        body = infos[0]["body"]
        if not any(e.primitive.name.startswith("psum") and tuple(e.params.get("axes", e.params.get("axis_name", ()))) == ("p",)
                   for e in body):
            fails.append("no psum over 'p' in the program under shard_map")
    except Exception as exc:
        fails.append(f"program could not be traced: {type(exc).__name__}")
    return fails


def check_q2(ns):
    fails = []
    f = ns["global_sum"]
    mesh = ns["mesh"]
    for t, n in enumerate((32, 8, 64, 1000)):
        x = rng_for(2, t).normal(size=n).astype(np.float32)
        xd = put(x, mesh, P("i"))
        try:
            out = f(xd)
        except Exception as exc:
            fails.append(f"length {n}: raised {type(exc).__name__}: {str(exc)[:120]}")
            continue
        if np.shape(out) != ():
            fails.append(f"length {n}: result has shape {np.shape(out)}, not a scalar")
        elif not close(out, x.astype(np.float64).sum(), 1e-5, 1e-4):
            fails.append(f"length {n}: {float(out)} != {x.astype(np.float64).sum()}")
        if not getattr(getattr(out, "sharding", None), "is_fully_replicated", False):
            fails.append(f"length {n}: result not replicated")
    try:
        _, infos = program(f, put(np.ones(64, np.float32), mesh, P("i")))
        sm = one_shard_map(infos, "i", fails)
        if sm:
            if [s for _, s in sm["ins"]] != [(("i",),)]:
                fails.append(f"in_specs {sm['ins']}, expected P('i')")
            if [s for _, s in sm["outs"]] != [()]:
                fails.append(f"out_specs {sm['outs']}, expected P() of a scalar")
            colls = collectives(sm["body"])
            if len(colls) != 1 or not colls[0].primitive.name.startswith("psum"):
                fails.append(f"collectives {[e.primitive.name for e in colls]}, expected one psum")
            elif any(int(np.prod(shape_of(v))) != 1 for v in colls[0].invars):
                fails.append("the psum does not add up one partial sum per device")
    except Exception as exc:
        fails.append(f"program could not be traced: {type(exc).__name__}: {str(exc)[:100]}")
    return fails


MATMUL_SHAPES = ((32, 64, 16), (16, 128, 24), (64, 32, 8))


def check_matmul(ns, name, lhs_spec, allowed, required, moving):
    """Values on several shapes, output by rows, jitted, specs, and the collectives used.
    `moving`: which block a ppermute must carry ('rhs' or 'out'), or None."""
    fails = []
    f = ns[name]
    mesh = ns["mesh"]
    for t, (m, k, n) in enumerate(MATMUL_SHAPES):
        rng = rng_for(3, t)
        a = rng.normal(size=(m, k)).astype(np.float32)
        b = rng.normal(size=(k, n)).astype(np.float32)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        try:
            # jitted here only to keep the oracle fast; whether the answer itself is
            # wrapped in jax.jit is read from its program below
            out = jax.jit(f)(put(a, mesh, lhs_spec), put(b, mesh, P("i", None)))
        except Exception as exc:
            fails.append(f"{m}x{k}x{n}: raised {type(exc).__name__}: {str(exc)[:120]}")
            continue
        if not close(out, ref, 1e-4, 1e-3):
            fails.append(f"{m}x{k}x{n}: wrong product")
        if not laid_out(out, "i", P("i", None)):
            fails.append(f"{m}x{k}x{n}: result not sharded by rows on mesh ('i',): {getattr(out, 'sharding', None)}")
    m, k, n = MATMUL_SHAPES[0]
    try:
        top, infos = program(f, put(np.ones((m, k), np.float32), mesh, lhs_spec),
                             put(np.ones((k, n), np.float32), mesh, P("i", None)))
    except Exception as exc:
        return fails + [f"program could not be traced: {type(exc).__name__}"]
    if not jitted(top):
        fails.append(f"not wrapped in jax.jit (top level: {top})")
    sm = one_shard_map(infos, "i", fails)
    if sm is None:
        return fails
    want_in = [((m, k), norm_spec(lhs_spec, 2)), ((k, n), (("i",), ()))]
    if sm["ins"] != want_in:
        fails.append(f"in_specs {sm['ins']}, expected {want_in}")
    if sm["outs"] != [((m, n), (("i",), ()))]:
        fails.append(f"out_specs {sm['outs']}, expected P('i', None)")
    colls = collectives(sm["body"])
    names = sorted({e.primitive.name for e in colls})
    if not set(names) <= set(allowed) or not any(x in names for x in required):
        fails.append(f"collectives {names}; allowed {allowed}, one of {required} required")
    for e in colls:
        if e.primitive.name == "all_gather" and shape_of(e.invars[0]) != (k // 8, n):
            fails.append(f"all_gather of a block of shape {shape_of(e.invars[0])}, not of rhs")
        if e.primitive.name == "ppermute":
            if not is_full_cycle(e.params["perm"]):
                fails.append(f"ppermute perm {e.params['perm']} is not a ring over all 8 devices")
            want = (k // 8, n) if moving == "rhs" else (m // 8, n)
            if shape_of(e.invars[0]) != want:
                fails.append(f"ppermute moves a block of shape {shape_of(e.invars[0])}, expected {want} ({moving})")
    return fails


def check_q3(ns):
    return check_matmul(ns, "matmul_allgather", P("i", None), ["all_gather"], ["all_gather"], None)


def check_q4(ns):
    return check_matmul(ns, "matmul_allgather_overlapped", P("i", None), ["ppermute"],
                        ["ppermute"], "rhs")


def check_q5(ns):
    return check_matmul(ns, "matmul_psumscatter", P(None, "i"), ["reduce_scatter"],
                        ["reduce_scatter"], None)


def check_q6(ns):
    return check_matmul(ns, "matmul_psumscatter_overlapped", P(None, "i"), ["ppermute"],
                        ["ppermute"], "out")


LAYER_SIZES = [784, 128, 128, 128, 128, 128, 8]


def param_shapes():
    ws = {(a, b) for a, b in zip(LAYER_SIZES[:-1], LAYER_SIZES[1:])}
    bs = {(b,) for b in LAYER_SIZES[1:]}
    return ws, bs


def check_loss_values(ns, fn, mesh, pspec, bspec, batch_sizes, seed):
    fails = []
    allclose = ns["allclose"]
    for t, bs in enumerate(batch_sizes):
        params, batch = ns["init"](jax.random.key(1000 * seed + t), LAYER_SIZES, bs)
        pd = jax.device_put(params, NamedSharding(mesh, pspec))
        bd = jax.device_put(batch, NamedSharding(mesh, bspec))
        ref_l = jax.jit(ns["loss"])(params, batch)
        ref_g = jax.jit(jax.grad(ns["loss"]))(params, batch)
        try:
            got_l = jax.jit(fn)(pd, bd)
            if np.shape(got_l) != () or not close(got_l, ref_l, 1e-3, 1e-4):
                fails.append(f"batch {bs}: loss {np.asarray(got_l)} != {float(ref_l):.5f}")
        except Exception as exc:
            fails.append(f"batch {bs}: loss raised {type(exc).__name__}: {str(exc)[:120]}")
            continue
        try:
            got_g = jax.jit(jax.grad(fn))(pd, bd)
            if jax.tree.structure(got_g) != jax.tree.structure(ref_g) or not bool(allclose(got_g, ref_g)):
                fails.append(f"batch {bs}: gradient differs from jax.grad(loss)")
        except Exception as exc:
            fails.append(f"batch {bs}: grad raised {type(exc).__name__}: {str(exc)[:120]}")
    return fails


def trace_loss(ns, fn, mesh, pspec, bspec, bs, fails):
    params, batch = ns["init"](jax.random.key(7), LAYER_SIZES, bs)
    pd = jax.device_put(params, NamedSharding(mesh, pspec))
    bd = jax.device_put(batch, NamedSharding(mesh, bspec))
    try:
        return program(fn, pd, bd)
    except Exception as exc:
        fails.append(f"program could not be traced: {type(exc).__name__}: {str(exc)[:100]}")
        return None, None


def check_q7(ns):
    fn, mb = ns["loss_dp"], ns["mesh_batch"]
    fails = check_loss_values(ns, fn, mb, P(), P("batch"), (40, 8), 7)
    bs = 32
    _, infos = trace_loss(ns, fn, mb, P(), P("batch"), bs, fails)
    if infos is None:
        return fails
    sm = one_shard_map(infos, "batch", fails)
    if sm is None:
        return fails
    ws, bsh = param_shapes()
    for shape, spec in sm["ins"]:
        if shape in ws or shape in bsh:
            if any(spec):
                fails.append(f"parameter of shape {shape} not replicated: {spec}")
        elif shape in ((bs, 784), (bs, 8)):
            if spec != (("batch",), ()):
                fails.append(f"batch leaf {shape} not split along its first axis: {spec}")
    if not any(shape in ((bs, 784), (bs, 8)) for shape, _ in sm["ins"]):
        fails.append("the batch is not an operand of shard_map")
    if [s for _, s in sm["outs"]] != [()]:
        fails.append(f"out_specs {sm['outs']}, expected one replicated scalar")
    colls = collectives(sm["body"])
    if len(colls) != 1 or any(int(np.prod(shape_of(v))) != 1 for v in colls[0].invars):
        fails.append(f"collectives {[(e.primitive.name, [shape_of(v) for v in e.invars]) for e in colls]}: expected one scalar collective")
    return fails


def check_q8(ns):
    fn, mb = ns["loss_fsdp"], ns["mesh_batch"]
    fails = check_loss_values(ns, fn, mb, P("batch"), P("batch"), (40, 8), 8)
    bs = 32
    _, infos = trace_loss(ns, fn, mb, P("batch"), P("batch"), bs, fails)
    if infos is None:
        return fails
    sm = one_shard_map(infos, "batch", fails)
    if sm is None:
        return fails
    for shape, spec in sm["ins"]:
        want = (("batch",),) + ((),) * (len(shape) - 1)
        if spec != want:
            fails.append(f"operand of shape {shape} has spec {spec}, expected split along its first axis")
    if [s for _, s in sm["outs"]] != [()]:
        fails.append(f"out_specs {sm['outs']}, expected one replicated scalar")
    body = sm["body"]
    gathers = [e for e in body if e.primitive.name.startswith("all_gather")]
    n_layers = len(LAYER_SIZES) - 1
    if len(gathers) != 2 * n_layers:
        fails.append(f"{len(gathers)} all_gathers, expected one per W and b ({2 * n_layers})")
    if any(not e.params.get("tiled") or e.params.get("all_gather_dimension") != 0 for e in gathers):
        fails.append("an all_gather is not tiled=True along axis 0")
    first_dot = next((i for i, e in enumerate(body) if e.primitive.name == "dot_general"), None)
    before = sum(1 for i, e in enumerate(body) if e.primitive.name.startswith("all_gather")
                 and (first_dot is None or i < first_dot))
    if before > 2:
        fails.append(f"{before} all_gathers before the first layer's product: not gathered just before use")
    others = [e for e in collectives(body) if not e.primitive.name.startswith("all_gather")]
    if len(others) != 1 or any(int(np.prod(shape_of(v))) != 1 for v in others[0].invars):
        fails.append(f"loss combined by {[e.primitive.name for e in others]}: expected one scalar collective")
    return fails


def check_q9(ns):
    fn, mf = ns["loss_tp"], ns["mesh_feats"]
    fails = check_loss_values(ns, fn, mf, P("feats"), P(None, "feats"), (40,), 9)
    bs = 40
    _, infos = trace_loss(ns, fn, mf, P("feats"), P(None, "feats"), bs, fails)
    if infos is None:
        return fails
    sm = one_shard_map(infos, "feats", fails)
    if sm is None:
        return fails
    ws, bsh = param_shapes()
    for shape, spec in sm["ins"]:
        if shape in ws and spec != (("feats",), ()):
            fails.append(f"W of shape {shape} has spec {spec}, expected P('feats', None)")
        elif shape in bsh and spec != (("feats",),):
            fails.append(f"b of shape {shape} has spec {spec}, expected P('feats')")
        elif shape == (bs, 784) and spec != ((), ("feats",)):
            fails.append(f"inputs have spec {spec}, expected P(None, 'feats')")
    body = sm["body"]
    scatters = [i for i, e in enumerate(body) if e.primitive.name == "reduce_scatter"]
    n_layers = len(LAYER_SIZES) - 1
    if len(scatters) != n_layers:
        fails.append(f"{len(scatters)} psum_scatters, expected one per layer ({n_layers})")
    if any(body[i].params["scatter_dimension"] != 1 or not body[i].params["tiled"] for i in scatters):
        fails.append("a psum_scatter is not scatter_dimension=1, tiled=True")
    for i, e in enumerate(body):
        name = e.primitive.name
        if not is_collective(name) or name == "reduce_scatter":
            continue
        if name.startswith("psum") and scatters and i > scatters[-1]:
            continue  # combining the loss after the last layer
        fails.append(f"collective {name} in the layers (only psum_scatter allowed)")
    return fails


def check_q10(ns):
    fails = []
    update, update_single = ns["update"], ns["update_single"]
    Params, mesh_dp = ns["Params"], ns["mesh_dp"]
    for t, n in enumerate((128, 64, 256)):
        rng = rng_for(10, t)
        params = Params(jnp.float32(rng.normal()), jnp.float32(rng.normal()))
        xs = rng.normal(size=(n, 1)).astype(np.float32)
        ys = (3 * xs + 0.5 + rng.normal(size=(n, 1))).astype(np.float32)
        ref_p, ref_l = update_single(params, xs, ys)
        try:
            out = update(put(params, mesh_dp, P()), put(xs, mesh_dp, P("batch")),
                         put(ys, mesh_dp, P("batch")))
        except Exception as exc:
            fails.append(f"n={n}: update raised {type(exc).__name__}: {str(exc)[:120]}")
            continue
        if not (isinstance(out, tuple) and len(out) == 2):
            fails.append(f"n={n}: update did not return (new_params, loss)")
            continue
        new_p, l = out
        if type(new_p) is not Params or not all(close(a, b, 1e-4, 1e-6) for a, b in zip(new_p, ref_p)):
            fails.append(f"n={n}: new params {new_p} != update_single's {ref_p}")
        if np.shape(l) != () or not close(l, ref_l, 1e-4, 1e-6):
            fails.append(f"n={n}: loss {np.asarray(l)} != update_single's {float(ref_l)}")
        if not all(replicated_on(a, "batch") for a in jax.tree.leaves(out)):
            fails.append(f"n={n}: outputs not replicated on mesh_dp")
    try:
        top, infos = program(update, ns["params_replicated"], ns["xs_sharded"], ns["ys_sharded"])
        if not jitted(top):
            fails.append(f"update not wrapped in jax.jit (top level: {top})")
        sm = one_shard_map(infos, "batch", fails)
        if sm:
            for shape, spec in sm["ins"]:
                want = () if shape == () else (("batch",), ())
                if spec != want:
                    fails.append(f"operand of shape {shape} has spec {spec}, expected {want}")
            if any(any(spec) for _, spec in sm["outs"]):
                fails.append(f"out_specs {sm['outs']}, expected (P(), P())")
    except Exception as exc:
        fails.append(f"program could not be traced: {type(exc).__name__}: {str(exc)[:100]}")
    trained = ns.get("params_trained")
    single = ns["params_single"]
    if type(trained) is not Params:
        fails.append(f"params_trained is {type(trained).__name__}, not Params")
    else:
        if not np.allclose(np.array(trained), np.array(single), rtol=1e-3, atol=1e-4):
            fails.append(f"params_trained {trained} does not match params_single {single}")
        if not all(replicated_on(a, "batch") for a in trained):
            fails.append("params_trained is not the replicated output of training with `update`")
    return fails


CHECKS = {"q1_vmap_collective": check_q1, "q2_global_sum": check_q2,
          "q3_matmul_allgather": check_q3, "q4_matmul_ring": check_q4,
          "q5_matmul_reducescatter": check_q5, "q6_matmul_ring_reducescatter": check_q6,
          "q7_loss_dp": check_q7, "q8_loss_fsdp": check_q8, "q9_loss_tp": check_q9,
          "q10_dp_training": check_q10}

# --------------------------------------------------------------------------- runner
KINDS = {"value", "method", "boundary", "size", "mesh", "axis", "spec", "keyword", "ring",
         "communication", "cast", "argument", "api", "timing", "other"}


def notebook_text():
    with open(NOTEBOOK, encoding="utf-8") as f:
        nb = json.load(f)
    text = " ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    return re.sub(r"\s+", " ", text)


def lint(question, answers, text):
    problems = []
    names = [a["name"] for group in ("correct", "wrong") for a in answers.get(group, [])]
    if len(names) != len(set(names)):
        problems.append("duplicate answer names")
    if len(answers.get("correct", [])) < 3 or not 5 <= len(answers.get("wrong", [])) <= 8:
        problems.append("needs >= 3 correct and 5..8 wrong answers")
    for group in ("correct", "wrong"):
        for a in answers.get(group, []):
            if not a["code"].startswith("### Your code here"):
                problems.append(f"{a['name']}: code does not start with '### Your code here'")
            if re.sub(r"\s+", " ", a["sentence"]) not in text:
                problems.append(f"{a['name']}: sentence not found in the notebook")
            if group == "wrong" and a.get("kind") not in KINDS:
                problems.append(f"{a['name']}: kind {a.get('kind')!r}")
    return problems


def judge(question, base, code):
    ns = dict(base)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"<{question} answer>", "exec"), ns)
    except Exception as exc:
        return [f"the answer cell raised {type(exc).__name__}: {str(exc)[:150]}"]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return CHECKS[question](ns)
    except Exception as exc:
        traceback.print_exc()
        return [f"oracle check raised {type(exc).__name__}: {exc}"]


def main(selected):
    text = notebook_text()
    last = max(selected, key=QUESTIONS.index)
    t0 = time.time()
    namespaces = build_namespaces(last)
    print(f"kernel state rebuilt in {time.time() - t0:.1f}s")
    summary, disagreements, lint_problems = {}, [], []
    for q in selected:
        with open(os.path.join(HERE, f"{q}.yaml"), encoding="utf-8") as f:
            answers = yaml.safe_load(f)
        for p in lint(q, answers, text):
            lint_problems.append(f"{q}: {p}")
        counts = {"correct": [0, 0], "wrong": [0, 0]}
        for label in ("correct", "wrong"):
            for a in answers.get(label, []):
                t = time.time()
                fails = judge(q, namespaces[q], a["code"])
                verdict = "wrong" if fails else "correct"
                agree = verdict == label
                counts[label][0] += 1
                counts[label][1] += agree
                why = "" if not fails else " | " + "; ".join(fails)[:300]
                print(f"{q:30s} {a['name']:42s} label={label:7s} oracle={verdict:7s} "
                      f"{'OK ' if agree else 'DISAGREE'} ({time.time() - t:.1f}s){why}", flush=True)
                if not agree:
                    disagreements.append(f"{q}/{a['name']}")
        summary[q] = counts
        jax.clear_caches()
    print("\nSUMMARY (answers, labels the oracle agrees with)")
    for q, c in summary.items():
        print(f"  {q:30s} correct {c['correct'][1]}/{c['correct'][0]}   wrong {c['wrong'][1]}/{c['wrong'][0]}")
    total = sum(c[l][0] for c in summary.values() for l in c)
    agreed = sum(c[l][1] for c in summary.values() for l in c)
    print(f"  TOTAL {agreed}/{total} labels confirmed; {len(disagreements)} disagreements"
          f"{': ' + ', '.join(disagreements) if disagreements else ''}")
    print(f"  lint: {'; '.join(lint_problems) if lint_problems else 'ok'}")
    print(f"  elapsed {time.time() - t0:.0f}s")
    return 1 if disagreements or lint_problems else 0


if __name__ == "__main__":
    chosen = sys.argv[1:] or QUESTIONS
    sys.exit(main([q for q in QUESTIONS if q in chosen]))
