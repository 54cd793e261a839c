"""Blind oracle for lab6-memory: runs every answer of the YAML files beside it and checks its
label against my own reference implementations. Run: /work/main/.venv/bin/python oracle.py [q...]"""
import collections
import contextlib
import io
import math
import os
import pathlib
import re
import sys
import time
import traceback

os.environ.setdefault("PJRT_NPROC", "16")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
import numpy as np  # noqa: E402
import yaml  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
NOTEBOOK = pathlib.Path("/work/main/student/lab6-memory/lab6-memory.ipynb")

NOTEBOOK_CODE = r'''
# ---- notebook starter code (copied from the student notebook) + my own reference solutions ----
import ctypes, ctypes.util, os
os.environ.setdefault("PJRT_NPROC", "16")
import jax
N_DEVICES = 8
try:
    jax.config.update("jax_num_cpu_devices", N_DEVICES)
except RuntimeError:
    pass
devices = jax.devices()
if len(devices) < N_DEVICES:
    devices = jax.devices("cpu")
    jax.config.update("jax_default_device", devices[0])
devices = devices[:N_DEVICES]

import math
import re
from functools import partial

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name, print_saved_residuals
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

MiB = 2**20


def answered(*answers):
    if any(answer is ... for answer in answers):
        print("Skipped: this cell uses your answer to the task above. Fill that in first.")
        return False
    return True


def layer(h, W, b):
    return jnp.tanh(h @ W + b)


demo_W, demo_b = jnp.ones((4, 4)) / 4, jnp.zeros(4)
demo_x = jnp.ones((2, 4))

N_LAYERS, WIDTH, BATCH = 16, 128, 64


def init_deep(key, n_layers=N_LAYERS, width=WIDTH, batch=BATCH):
    kW, kb, kx, ky = jax.random.split(key, 4)
    W = jax.random.normal(kW, (n_layers, width, width)) / jnp.sqrt(width)
    b = 0.1 * jax.random.normal(kb, (n_layers, width))
    x = jax.random.normal(kx, (batch, width))
    y = jax.random.normal(ky, (batch, width))
    return (W, b), x, y


def deep_loss(params, x, y):
    """Mean over the examples of the squared error summed over the outputs, after L layers."""
    def body(h, layer_params):
        W, b = layer_params
        return layer(h, W, b), None

    h, _ = lax.scan(body, x, params)
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


deep_params, deep_x, deep_y = init_deep(jax.random.key(0))


def compiled_grad(loss_fn, *args):
    """The compiled program of jax.grad(loss_fn) for these arguments (not run)."""
    return jax.jit(jax.grad(loss_fn)).lower(*args).compile()


DEPTHS = [4, 8, 16, 32]


def deep_shapes(n_layers, width=WIDTH, batch=BATCH):
    spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    return ((spec(n_layers, width, width), spec(n_layers, width)), spec(batch, width),
            spec(batch, width))


def temp_by_depth(loss_fn):
    return [compiled_grad(loss_fn, *deep_shapes(n)).memory_analysis().temp_size_in_bytes / MiB
            for n in DEPTHS]


# ---- my reference for Task 1 ----
def remat_loss(params, x, y):
    def body(h, layer_params):
        W, b = layer_params
        return layer(h, W, b), None

    h, _ = lax.scan(jax.checkpoint(body), x, params)
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


N_BLOCKS, D_MODEL, D_FF, BLOCK_BATCH = 12, 64, 256, 32


def mlp_block(h, W_in, W_out):
    return h + jnp.tanh(h @ W_in) @ W_out


def init_blocks(key, n_blocks=N_BLOCKS, d_model=D_MODEL, d_ff=D_FF, batch=BLOCK_BATCH):
    k_in, k_out, kx, ky = jax.random.split(key, 4)
    W_in = jax.random.normal(k_in, (n_blocks, d_model, d_ff)) / jnp.sqrt(d_model)
    W_out = jax.random.normal(k_out, (n_blocks, d_ff, d_model)) / jnp.sqrt(4 * d_ff)
    x = jax.random.normal(kx, (batch, d_model))
    y = jax.random.normal(ky, (batch, d_model))
    return (W_in, W_out), x, y


def blocks_loss(params, x, y):
    """The loss of the stacked blocks, every residual stored."""
    def body(h, block_params):
        return mlp_block(h, *block_params), None

    h, _ = lax.scan(body, x, params)
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


def full_remat_blocks_loss(params, x, y):
    def body(h, block_params):
        return jax.checkpoint(mlp_block)(h, *block_params), None

    h, _ = lax.scan(body, x, params)
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


def residual_shapes(loss_fn, *args):
    """The shapes of the residuals print_saved_residuals lists, except the arguments."""
    import contextlib
    import io

    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        print_saved_residuals(loss_fn, *args)
    return [line.split()[0] for line in text.getvalue().splitlines()
            if line and "from the argument" not in line]


block_params, block_x, block_y = init_blocks(jax.random.key(1))


# ---- my reference for Task 2 ----
def policy_loss(params, x, y):
    def block(h, W_in, W_out):
        hidden = checkpoint_name(h @ W_in, "hidden")
        return h + jnp.tanh(hidden) @ W_out

    block = jax.checkpoint(block, policy=jax.checkpoint_policies.save_only_these_names("hidden"))

    def body(h, block_params):
        return block(h, *block_params), None

    h, _ = lax.scan(body, x, params)
    return jnp.mean(jnp.sum((h - y) ** 2, axis=-1))


LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8


# ---- my reference for Task 3 ----
def adam_update(param, grad, m, v, t, lr=LR, b1=B1, b2=B2, eps=EPS):
    m = b1 * m + (1 - b1) * grad
    v = b2 * v + (1 - b2) * grad ** 2
    m_hat = m / (1 - b1 ** t)
    v_hat = v / (1 - b2 ** t)
    return param - lr * m_hat / (jnp.sqrt(v_hat) + eps), m, v


ZERO_STEPS = 3


def regression_loss(W, x, y):
    return jnp.mean(jnp.sum((jnp.tanh(x @ W) - y) ** 2, axis=-1))


def init_regression(key, d_in=64, d_out=16, batch=32, steps=ZERO_STEPS):
    kW, *kb = jax.random.split(key, 1 + 2 * steps)
    W = jax.random.normal(kW, (d_in, d_out)) / jnp.sqrt(d_in)
    batches = [(jax.random.normal(kb[2 * i], (batch, d_in)),
                jax.random.normal(kb[2 * i + 1], (batch, d_out))) for i in range(steps)]
    return W, batches


reg_W, reg_batches = init_regression(jax.random.key(2))

mesh_data = jax.make_mesh((N_DEVICES,), ("data",), axis_types=(AxisType.Explicit,),
                          devices=devices)


@jax.jit
def replicated_step(state, x, y, t):
    W, m, v = state
    return adam_update(W, jax.grad(regression_loss)(W, x, y), m, v, t)


def step_shapes(state_spec, d_in=1024, d_out=512, batch=64):
    spec = lambda shape, s: jax.ShapeDtypeStruct(  # noqa: E731
        shape, jnp.float32, sharding=NamedSharding(mesh_data, s))
    state = tuple(spec((d_in, d_out), state_spec) for _ in range(3))
    return state, spec((batch, d_in), P("data")), spec((batch, d_out), P("data")), 1


# ---- my reference for Task 4 ----
def zero_init(W):
    rows = NamedSharding(mesh_data, P("data", None))
    W = jax.device_put(W, rows)
    return W, jax.device_put(jnp.zeros(W.shape, W.dtype), rows), \
        jax.device_put(jnp.zeros(W.shape, W.dtype), rows)


def zero_step(state, x, y, t):
    def local(W_blk, m_blk, v_blk, x_blk, y_blk, t):
        W_full = lax.all_gather(W_blk, "data", axis=0, tiled=True)
        g = jax.grad(regression_loss)(W_full, x_blk, y_blk)
        g_blk = lax.psum_scatter(g, "data", scatter_dimension=0, tiled=True) / N_DEVICES
        return adam_update(W_blk, g_blk, m_blk, v_blk, t)

    rows = P("data", None)
    W, m, v = state
    return jax.shard_map(local, mesh=mesh_data, in_specs=(rows, rows, rows, rows, rows, P()),
                         out_specs=(rows, rows, rows))(W, m, v, x, y, jnp.asarray(t))


def place_rows(a, mesh=mesh_data):
    return jax.device_put(a, NamedSharding(mesh, P("data", None)))


S_DEMO, D_HEAD = 64, 16
att_q, att_k, att_v = jax.random.normal(jax.random.key(3), (3, S_DEMO, D_HEAD))


# ---- my reference for Task 5 ----
def attention(q, k, v):
    S, d = q.shape
    s = q @ k.T / jnp.sqrt(jnp.float32(d))
    mask = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
    s = jnp.where(mask, s, -jnp.inf)
    s = s - s.max(axis=-1, keepdims=True)
    p = jnp.exp(s)
    return (p / p.sum(axis=-1, keepdims=True)) @ v


S_LONG = 2048


def seq_shapes(S, d=D_HEAD, sharding=None):
    return [jax.ShapeDtypeStruct((S, d), jnp.float32, sharding=sharding)] * 3


attention_temp = jax.jit(attention).lower(*seq_shapes(S_LONG)).compile().memory_analysis(
    ).temp_size_in_bytes


# ---- my reference for Task 6 ----
def blocked_attention(q, k, v, block_size):
    S, d = q.shape
    scale = 1 / math.sqrt(d)
    rows = jnp.arange(S)[:, None]
    m = jnp.full((S,), -jnp.inf, q.dtype)
    l = jnp.zeros((S,), q.dtype)
    o = jnp.zeros((S, v.shape[1]), q.dtype)
    for start in range(0, S, block_size):
        s = q @ k[start:start + block_size].T * scale
        cols = start + jnp.arange(block_size)[None, :]
        s = jnp.where(cols <= rows, s, -1e30)
        m_new = jnp.maximum(m, s.max(axis=-1))
        sc = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        l = sc * l + p.sum(axis=-1)
        o = sc[:, None] * o + p @ v[start:start + block_size]
        m = m_new
    return o / l[:, None]


mesh_seq = jax.make_mesh((N_DEVICES,), ("seq",), axis_types=(AxisType.Auto,), devices=devices)
RING = [(j, (j + 1) % N_DEVICES) for j in range(N_DEVICES)]


def sum_around_the_ring(block, start):
    def step(_, carry):
        total, travelling = carry
        return total + travelling, lax.ppermute(travelling, "seq", RING)

    total, _ = lax.fori_loop(0, N_DEVICES, step, (start(block), block))
    return total


def varying_zeros(block):
    return lax.pcast(jnp.zeros(block.shape), "seq", to="varying")


# ---- my reference for Task 7 ----
def _ring_local(q, k, v):
    n = N_DEVICES
    b, d = q.shape
    i = lax.axis_index("seq")
    qpos = i * b + jnp.arange(b)[:, None]
    scale = 1 / math.sqrt(d)

    def fold(t, k_blk, v_blk, m, l, o):
        src = (i - t) % n
        kpos = src * b + jnp.arange(b)[None, :]
        s = jnp.where(kpos <= qpos, q @ k_blk.T * scale, -1e30)
        m_new = jnp.maximum(m, s.max(axis=-1))
        sc = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])
        return m_new, sc * l + p.sum(axis=-1), sc[:, None] * o + p @ v_blk

    m = jnp.full((b,), -1e30, q.dtype) + 0 * q[:, 0]
    l = jnp.zeros_like(q[:, 0])
    o = jnp.zeros_like(v)
    m, l, o = fold(0, k, v, m, l, o)
    for t in range(1, n):
        k = lax.ppermute(k, "seq", RING)
        v = lax.ppermute(v, "seq", RING)
        m, l, o = fold(t, k, v, m, l, o)
    return o / l[:, None]


ring_attention = jax.shard_map(_ring_local, mesh=mesh_seq, in_specs=(P("seq"),) * 3,
                               out_specs=P("seq"))

COLLECTIVE = re.compile(r"= (\w+\[[\d,]*\])\S* (all-gather|all-reduce|reduce-scatter|"
                        r"collective-permute|all-to-all)(?:-start)?\(")


def hlo_collectives(compiled):
    return COLLECTIVE.findall(compiled.as_text())


I_DEMO, J_DEMO, K_DEMO = 512, 1024, 256


def case_programs(mesh):
    smap = partial(jax.shard_map, mesh=mesh)
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


def compile_case(case, I, J, K, n_devices):
    mesh = jax.make_mesh((n_devices,), ("x",), axis_types=(AxisType.Auto,),
                         devices=devices[:n_devices])
    program, a_spec, b_spec = case_programs(mesh)[case]
    a = jax.ShapeDtypeStruct((I, J), jnp.float32, sharding=NamedSharding(mesh, a_spec))
    b = jax.ShapeDtypeStruct((J, K), jnp.float32, sharding=NamedSharding(mesh, b_spec))
    return jax.jit(program).lower(a, b).compile()


# ---- my reference for Task 8 ----
def matmul_costs(case, I, J, K, n_devices):
    n = n_devices
    flops = 2 * I * J * K / n
    if case == 1:
        return flops, 0, "none"
    if case == 2:
        return flops, (n - 1) / n * 4 * J * K, "all-gather"
    if case == 3:
        return flops, 2 * (n - 1) / n * 4 * I * K, "all-reduce"
    return flops, (n - 1) / n * 4 * I * K, "reduce-scatter"


CHIPS = {
    "TPU v5e": {"flop_per_s": 1.97e14, "hbm_bytes_per_s": 8.2e11, "link_bytes_per_s": 4.5e10},
    "H100 SXM": {"flop_per_s": 9.9e14, "hbm_bytes_per_s": 3.35e12, "link_bytes_per_s": 4.5e11},
}


def matmul_intensity(B, D, F, bytes_per_number=2):
    return 2 * B * D * F / (bytes_per_number * (B * D + D * F + B * F))


# ---- my reference for Task 9 ----
def roofline_time(flops, hbm_bytes, comm_bytes, chip):
    times = {"compute": flops / chip["flop_per_s"], "memory": hbm_bytes / chip["hbm_bytes_per_s"],
             "communication": comm_bytes / chip["link_bytes_per_s"]}
    bound = max(times, key=times.get)
    return times[bound], bound


def critical_batch(D, F, chip):
    from fractions import Fraction
    fps, hbm = Fraction(chip["flop_per_s"]), Fraction(chip["hbm_bytes_per_s"])
    # compute >= memory  <=>  2BDF/fps >= 2(BD + DF + BF)/hbm  <=>  B (DF/fps - (D+F)/hbm) >= DF/hbm
    slope = Fraction(D * F) / fps - Fraction(D + F) / hbm
    if slope <= 0:
        return None
    return max(1, math.ceil(Fraction(D * F) / hbm / slope))
'''

# --------------------------------------------------------------------------- the notebook's kernel
NB = {"__name__": "__notebook__"}
exec(compile(NOTEBOOK_CODE, "<notebook starter code + my references>", "exec"), NB)
jnp, lax, P, NamedSharding = NB["jnp"], NB["lax"], NB["P"], NB["NamedSharding"]

QUESTION_NAMES = {
    "q1_remat_scan": ["remat_loss"],
    "q2_remat_policy": ["policy_loss"],
    "q3_adam_reference": ["adam_update"],
    "q4_zero_sharded_adam": ["zero_init", "zero_step"],
    "q5_attention_reference": ["attention"],
    "q6_online_softmax": ["blocked_attention"],
    "q7_ring_attention": ["ring_attention"],
    "q8_matmul_costs": ["matmul_costs"],
    "q9_roofline": ["roofline_time", "critical_batch"],
}
ORDER = list(QUESTION_NAMES)


class Wrong(Exception):
    pass


def need(cond, message):
    if not cond:
        raise Wrong(message)


def namespace_for(question):
    """The kernel at the answer cell: earlier names (with my reference answers), the question's
    own names and those of later tasks set back to the placeholder `...`."""
    ns = dict(NB)
    for q in ORDER[ORDER.index(question):]:
        for name in QUESTION_NAMES[q]:
            ns[name] = ...
    return ns


def rng(seed):
    return np.random.default_rng(seed)


def close(actual, expected, rtol, atol, what):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    need(actual.shape == expected.shape, f"{what}: shape {actual.shape}, expected {expected.shape}")
    need(np.all(np.isfinite(actual)), f"{what}: not finite")
    err = np.max(np.abs(actual - expected)) if actual.size else 0.0
    need(np.allclose(actual, expected, rtol=rtol, atol=atol), f"{what}: off by {err:.3g}")


# --------------------------------------------------------------------------- jaxpr helpers
def sub_jaxprs(eqn):
    for value in eqn.params.values():
        for sub in value if isinstance(value, (list, tuple)) else (value,):
            if hasattr(sub, "eqns"):
                yield sub
            elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                yield sub.jaxpr


def walk(jaxpr, mult=1, inside=()):
    """(eqn, trip multiplier, names of the enclosing primitives) for every equation."""
    for eqn in jaxpr.eqns:
        yield eqn, mult, inside
        m = mult * eqn.params["length"] if eqn.primitive.name == "scan" else mult
        for sub in sub_jaxprs(eqn):
            yield from walk(sub, m, inside + (eqn.primitive.name,))


def shape_of(var):
    return tuple(int(n) for n in getattr(var.aval, "shape", ()))


def saved_residuals(fn, *args):
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        NB["print_saved_residuals"](fn, *args)
    return [line.split()[0] for line in text.getvalue().splitlines()
            if line and "from the argument" not in line]


def growing_residuals(fn, args_small, args_big):
    a = collections.Counter(saved_residuals(fn, *args_small))
    b = collections.Counter(saved_residuals(fn, *args_big))
    common = a & b
    return a - common, b - common


def temp_bytes(fn, *args):
    return NB["compiled_grad"](fn, *args).memory_analysis().temp_size_in_bytes


_REF_CACHE = {}


def compare_value_and_grad(f, ref, args, what):
    key = (ref.__name__, what)
    if key not in _REF_CACHE:
        _REF_CACHE[key] = jax.jit(jax.value_and_grad(ref))(*args)
    value_ref, grad_ref = _REF_CACHE[key]
    value, grad = jax.jit(jax.value_and_grad(f))(*args)
    close(value, value_ref, 1e-5, 1e-6, f"value {what}")
    for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(grad_ref)):
        close(a, b, 1e-4, 1e-5, f"gradient {what}")


# --------------------------------------------------------------------------- Task 1
_Q1_BASE_TEMP = {}


def q1_args(L, width, batch, seed):
    return NB["init_deep"](jax.random.key(seed), n_layers=L, width=width, batch=batch)


def check_q1(ns):
    f = ns["remat_loss"]
    need(callable(f), "remat_loss is not a function")
    ref = NB["deep_loss"]
    # residuals: only one stacked (L, batch, width) array grows with L
    (L1, L2, width, batch) = (6, 7, 24, 10)
    g1, g2 = growing_residuals(f, q1_args(L1, width, batch, 7), q1_args(L2, width, batch, 7))
    need(g1 == collections.Counter({f"f32[{L1},{batch},{width}]": 1}) and
         g2 == collections.Counter({f"f32[{L2},{batch},{width}]": 1}),
         f"residuals growing with L: {dict(g1)}")
    # method: a scan whose body holds a checkpoint
    params, x, y = q1_args(4, 8, 2, 0)
    jaxpr = jax.make_jaxpr(f)(params, x, y).jaxpr
    need(any(e.primitive.name == "remat2" and "scan" in inside for e, _, inside in walk(jaxpr)),
         "no jax.checkpoint inside a lax.scan body")
    for i, (L, width, batch) in enumerate([(16, 128, 64), (1, 8, 4), (7, 24, 10)]):
        args = q1_args(L, width, batch, 100 + i)
        compare_value_and_grad(f, ref, args, f"L={L}")
    # memory: under 80% of deep_loss's temporary memory
    for L in (16,):
        if L not in _Q1_BASE_TEMP:
            _Q1_BASE_TEMP[L] = temp_bytes(NB["deep_loss"], *NB["deep_shapes"](L))
        ratio = temp_bytes(f, *NB["deep_shapes"](L)) / _Q1_BASE_TEMP[L]
        need(ratio < 0.8, f"temporary memory at L={L} is {ratio:.0%} of deep_loss's")


# --------------------------------------------------------------------------- Task 2
def q2_args(L, D, F, batch, seed):
    return NB["init_blocks"](jax.random.key(seed), n_blocks=L, d_model=D, d_ff=F, batch=batch)


def policy_saves(policy, prim, *avals, **params):
    r = policy(prim, *avals, **params)
    if isinstance(r, (bool, np.bool_)):
        return bool(r)
    return type(r).__name__ == "Saveable" or r is True


def check_q2(ns):
    from jax._src.ad_checkpoint import name_p
    from jax._src.lax import lax as lax_internal

    f = ns["policy_loss"]
    need(callable(f), "policy_loss is not a function")
    ref = NB["blocks_loss"]
    L1, L2, D, F, batch = 4, 5, 6, 20, 3
    g1, g2 = growing_residuals(f, q2_args(L1, D, F, batch, 1), q2_args(L2, D, F, batch, 1))
    want = lambda L: collections.Counter({f"f32[{L},{batch},{D}]": 1, f"f32[{L},{batch},{F}]": 1})  # noqa: E731
    need(g1 == want(L1) and g2 == want(L2), f"residuals growing with L: {dict(g1)}")
    # method: inside the scan body a checkpoint; inside it "hidden" names a dot_general result;
    # the checkpoint's policy saves exactly the values named "hidden"
    jaxpr = jax.make_jaxpr(f)(*q2_args(3, D, F, batch, 0)).jaxpr
    remats = [e for e, _, inside in walk(jaxpr) if e.primitive.name == "remat2" and "scan" in inside]
    need(remats, "no jax.checkpoint inside the lax.scan body")
    found = False
    for r in remats:
        body = r.params["jaxpr"]
        producers = {}
        for e, _, _ in walk(body):
            for v in e.outvars:
                producers[id(v)] = e.primitive.name
        for e, _, _ in walk(body):
            if e.primitive.name == "name" and e.params.get("name") == "hidden":
                need(producers.get(id(e.invars[0])) == "dot_general",
                     f"'hidden' names the result of {producers.get(id(e.invars[0]))}, "
                     "not of the product h @ W_in")
                pol = r.params["policy"]
                need(pol is not None, "jax.checkpoint without a policy")
                a = jax.core.ShapedArray((batch, F), jnp.float32)
                b = jax.core.ShapedArray((D, F), jnp.float32)
                need(policy_saves(pol, name_p, a, name="hidden"), "policy does not save 'hidden'")
                need(not policy_saves(pol, name_p, a, name="other"), "policy saves other names")
                need(not policy_saves(pol, lax_internal.dot_general_p, a, b,
                                      dimension_numbers=(((1,), (0,)), ((), ())), precision=None,
                                      preferred_element_type=jnp.float32, out_sharding=None),
                     "policy saves unnamed matrix products")
                need(not policy_saves(pol, lax_internal.tanh_p, a, accuracy=None),
                     "policy saves unnamed values")
                found = True
    need(found, "no value named 'hidden' inside the checkpointed block")
    for i, (L, D, F, batch) in enumerate([(12, 64, 256, 32), (1, 4, 8, 2), (5, 6, 20, 3)]):
        args = q2_args(L, D, F, batch, 200 + i)
        compare_value_and_grad(f, ref, args, f"L={L}")


# --------------------------------------------------------------------------- Task 3
def adam_ref(p, g, m, v, t, lr=1e-2, b1=0.9, b2=0.999, eps=1e-8):
    p, g, m, v = (np.asarray(a, np.float64) for a in (p, g, m, v))
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g ** 2
    mh, vh = m / (1 - b1 ** t), v / (1 - b2 ** t)
    return p - lr * mh / (np.sqrt(vh) + eps), m, v


def q3_compare(out, p, ref, what):
    need(isinstance(out, (tuple, list)) and len(out) == 3, f"{what}: not a tuple of 3")
    new_p, new_m, new_v = (np.asarray(a, np.float64) for a in out)
    rp, rm, rv = ref
    for name, a, b in (("m", new_m, rm), ("v", new_v, rv)):
        close(a, b, 1e-5, 1e-7 * (np.max(np.abs(b)) if b.size else 0) + 1e-30, f"{what} new_{name}")
    close(new_p - np.asarray(p, np.float64), rp - np.asarray(p, np.float64), 1e-3, 1e-6,
          f"{what} new_param - param")


def check_q3(ns):
    f = ns["adam_update"]
    need(callable(f), "adam_update is not a function")
    r = rng(3)
    jf = jax.jit(f)
    for shape in [(), (7,), (3, 4, 5)]:
        for t in [1, 2, 10, 1000]:
            for scale in [1e-6, 1e-3, 1.0, 100.0]:
                p = (0.1 * r.standard_normal(shape)).astype(np.float32)
                g = (scale * r.standard_normal(shape)).astype(np.float32)
                if t == 1:
                    m = np.zeros(shape, np.float32)
                    v = np.zeros(shape, np.float32)
                    if g.size > 1:
                        g.flat[0] = 0.0
                else:
                    m = (0.5 * scale * r.standard_normal(shape)).astype(np.float32)
                    v = ((scale * r.standard_normal(shape)) ** 2).astype(np.float32)
                ref = adam_ref(p, g, m, v, t)
                args = [jnp.asarray(a) for a in (p, g, m, v)]
                q3_compare(f(*args, t), p, ref, f"shape {shape} t={t} scale={scale:g}")
                if shape == (7,):
                    q3_compare(jf(*args, jnp.int32(t)), p, ref,
                               f"jit, t an int32 array, t={t} scale={scale:g}")
    # other settings passed by keyword
    p, g, m, v = (r.standard_normal((5,)).astype(np.float32) for _ in range(4))
    v = v ** 2
    kw = dict(lr=0.1, b1=0.5, b2=0.8, eps=1e-3)
    q3_compare(f(*(jnp.asarray(a) for a in (p, g, m, v)), 3, **kw), p, adam_ref(p, g, m, v, 3, **kw),
               "keyword settings")
    # purity: NumPy arguments must come back unchanged
    keep = [a.copy() for a in (p, g, m, v)]
    f(p, g, m, v, 2)
    need(all(np.array_equal(a, b) for a, b in zip((p, g, m, v), keep)),
         "changed its (NumPy) arguments in place")
    args = [jnp.asarray(a) for a in keep]
    f(*args, 2)
    need(all(np.array_equal(np.asarray(a), b) for a, b in zip(args, keep)), "changed its arguments")


# --------------------------------------------------------------------------- Task 4
def regression_grad64(W, x, y):
    a = np.tanh(x @ W)
    return x.T @ (2 * (a - y) * (1 - a ** 2)) / x.shape[0]


_Q4_REPLICATED = []


def check_q4(ns):
    zi, zs = ns["zero_init"], ns["zero_step"]
    need(callable(zi) and callable(zs), "zero_init / zero_step not functions")
    mesh = NB["mesh_data"]
    rows = NamedSharding(mesh, P("data", None))

    def layout(state, what):
        need(isinstance(state, (tuple, list)) and len(state) == 3, f"{what}: not a state of 3")
        for name, a in zip("Wmv", state):
            need(type(a).__name__ == "ArrayImpl", f"{what}: {name} is not a jax.Array")
            s = a.sharding
            need(isinstance(s, NamedSharding) and s.mesh == mesh,
                 f"{what}: {name} is not on mesh_data ({s})")
            need(s.is_equivalent_to(rows, 2), f"{what}: {name} is not split by rows ({s.spec})")

    # method: one shard_map on mesh_data; in it one all_gather, one reduce-scatter, no psum;
    # the state handed to it split by rows
    d_in, d_out, batch = 64, 16, 32
    state = zi(jnp.asarray(np.ones((d_in, d_out), np.float32)))
    layout(state, 'zero_init')
    x = NB["place_rows"](jnp.ones((batch, d_in)))
    y = NB["place_rows"](jnp.ones((batch, d_out)))
    jaxpr = jax.make_jaxpr(zs)(state, x, y, 1).jaxpr
    smaps = [e for e, _, _ in walk(jaxpr) if e.primitive.name == "shard_map"]
    need(len(smaps) == 1, f"{len(smaps)} shard_map calls, expected one")
    sm = smaps[0]
    need(sm.params["mesh"] == mesh or getattr(sm.params["mesh"], "abstract_mesh", None) == mesh.abstract_mesh,
         f"shard_map on {sm.params['mesh']}, not mesh_data")
    for v, spec in zip(sm.invars, sm.params["in_specs"]):
        if shape_of(v) == (d_in, d_out):
            entries = list(spec) + [None] * (2 - len(spec))
            need(entries[0] in ("data", ("data",)) and entries[1] is None,
                 f"state handed to shard_map with in_specs {spec}")
    prims = collections.Counter(e.primitive.name for e, _, _ in walk(sm.params["jaxpr"]))
    need(prims["all_gather"] == 1, f"{prims['all_gather']} all_gathers, expected one (of W)")
    need(prims["reduce_scatter"] == 1, f"{prims['reduce_scatter']} psum_scatters, expected one")
    psums = [p for p in prims if "psum" in p or "all_reduce" in p]
    need(not psums, f"all-reduce in the step: {psums}")
    r = rng(4)
    for d_in, d_out, batch, steps in [(64, 16, 32, 2), (8, 5, 8, 2), (24, 7, 40, 1)]:
        W = (r.standard_normal((d_in, d_out)) / np.sqrt(d_in)).astype(np.float32)
        state = zi(jnp.asarray(W))
        layout(state, f"zero_init d_in={d_in}")
        need(not np.any(np.asarray(state[1])) and not np.any(np.asarray(state[2])),
             "m and v do not start at zero")
        close(state[0], W, 0, 0, "zero_init W")
        W64, m64, v64 = W.astype(np.float64), np.zeros((d_in, d_out)), np.zeros((d_in, d_out))
        for t in range(1, steps + 1):
            x = r.standard_normal((batch, d_in)).astype(np.float32)
            y = r.standard_normal((batch, d_out)).astype(np.float32)
            step = zs if d_in == 64 else jax.jit(zs)  # as written once, then jitted (faster)
            state = step(state, NB["place_rows"](jnp.asarray(x)), NB["place_rows"](jnp.asarray(y)), t)
            layout(state, f"zero_step d_in={d_in} t={t}")
            g = regression_grad64(W64, x.astype(np.float64), y.astype(np.float64))
            W64, m64, v64 = adam_ref(W64, g, m64, v64, t)
        for name, a, b in zip("Wmv", state, (W64, m64, v64)):
            close(a, b, 1e-3, 1e-4 * np.max(np.abs(b)), f"{name} after {steps} steps (d_in={d_in}, batch={batch})")
    # memory: the step's arguments per device far below the replicated step's
    if not _Q4_REPLICATED:
        _Q4_REPLICATED.append(NB["replicated_step"].lower(*NB["step_shapes"](P())).compile(
            ).memory_analysis().argument_size_in_bytes)
    args = jax.jit(zs).lower(*NB["step_shapes"](P("data"))).compile().memory_analysis(
        ).argument_size_in_bytes
    need(args < 0.25 * _Q4_REPLICATED[0], f"arguments {args} bytes per device, replicated "
         f"{_Q4_REPLICATED[0]}")


# --------------------------------------------------------------------------- Task 5
def attention64(q, k, v):
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    S, d = q.shape
    s = q @ k.T / np.sqrt(d)
    s = np.where(np.tril(np.ones((S, S), bool)), s, -np.inf)
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True) @ v


def qkv(r, S, d, scale=1.0):
    q, k, v = (r.standard_normal((S, d)).astype(np.float32) for _ in range(3))
    return (scale * q).astype(np.float32), (scale * k).astype(np.float32), v


def attention_cases(fn, seed, sizes, large, what=""):
    r = rng(seed)
    for S, d in sizes:
        q, k, v = qkv(r, S, d)
        close(fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)), attention64(q, k, v), 1e-4, 1e-5,
              f"{what}S={S} d={d}")
    for S, d, scale in large:
        q, k, v = qkv(r, S, d, scale)
        close(fn(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)), attention64(q, k, v), 0, 2e-2,
              f"{what}S={S} d={d}, q and k times {scale:g}")


def check_q5(ns):
    f = ns["attention"]
    need(callable(f), "attention is not a function")
    attention_cases(f, 5, [(64, 16), (1, 1), (5, 3), (33, 8), (100, 32)],
                    [(64, 16, 100.0), (40, 4, 1000.0)])


# --------------------------------------------------------------------------- Task 6
def check_q6(ns):
    f = ns["blocked_attention"]
    need(callable(f), "blocked_attention is not a function")
    # method: scores of shape (S, block_size), no S x S array when block_size < S
    S, d, bs = 64, 8, 8
    r = rng(60)
    q, k, v = (jnp.asarray(a) for a in qkv(r, S, d))
    jaxpr = jax.make_jaxpr(lambda q, k, v: f(q, k, v, bs))(q, k, v).jaxpr
    big = [shape_of(o) for e, _, _ in walk(jaxpr) for o in e.outvars
           if math.prod(shape_of(o)) >= S * S]
    need(not big, f"arrays of S x S entries or more appear: {big[:3]}")
    dots = [shape_of(o) for e, _, _ in walk(jaxpr) if e.primitive.name == "dot_general"
            for o in e.outvars]
    need((S, bs) in dots, f"no score block of shape (S, block_size) = {(S, bs)}; products {set(dots)}")
    r = rng(6)
    for S, d, sizes in [(64, 16, (1, 8, 64)), (1, 1, (1,)), (24, 3, (4, 6, 24)), (40, 8, (5,))]:
        q, k, v = qkv(r, S, d)
        ref = attention64(q, k, v)
        for bs in sizes:
            close(f(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), bs), ref, 1e-4, 1e-5,
                  f"S={S} d={d} block_size={bs}")
    for S, d, bs, scale in [(32, 8, 4, 100.0), (16, 4, 2, 1000.0)]:
        q, k, v = qkv(r, S, d, scale)
        close(f(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), bs), attention64(q, k, v), 0, 2e-2,
              f"S={S} d={d} block_size={bs}, q and k times {scale:g}")


# --------------------------------------------------------------------------- Task 7
def check_q7(ns):
    f = ns["ring_attention"]
    need(callable(f), "ring_attention is not a function")
    mesh = NB["mesh_seq"]
    n = mesh.shape["seq"]
    ring = tuple((j, (j + 1) % n) for j in range(n))
    # method, read from the jaxpr at S = 64, d = 8 (b = 8)
    S, d = 64, 8
    b = S // n
    r = rng(70)
    q, k, v = (jnp.asarray(a) for a in qkv(r, S, d))
    jaxpr = jax.make_jaxpr(f)(q, k, v).jaxpr
    smaps = [e for e, _, _ in walk(jaxpr) if e.primitive.name == "shard_map"]
    need(len(smaps) == 1, f"{len(smaps)} shard_map calls, expected one")
    sm = smaps[0]
    need(sm.params["mesh"] == mesh, f"shard_map on {sm.params['mesh']}, not mesh_seq")
    for spec in tuple(sm.params["in_specs"]) + tuple(sm.params["out_specs"]):
        entries = list(spec) + [None] * (2 - len(spec))
        need(entries[0] in ("seq", ("seq",)) and entries[1] is None, f"spec {spec}, expected P('seq')")
    moved, unknown = 0, False
    for e, mult, inside in walk(sm.params["jaxpr"]):
        name = e.primitive.name
        need(not any(c in name for c in ("all_gather", "all_to_all", "psum", "all_reduce",
                                           "reduce_scatter")), f"collective {name} in the program")
        if name == "ppermute":
            need(tuple(map(tuple, e.params["perm"])) == ring,
                 f"ppermute perm {e.params['perm']}, expected the ring j -> j + 1 (last to 0)")
            unknown |= "while" in inside
            moved += mult * sum(math.prod(shape_of(x)) for x in e.invars)
        for o in e.outvars:
            need(S not in shape_of(o), f"an array of shape {shape_of(o)} (all S = {S} positions) "
                 "on a device")
    need(not unknown, "ppermute inside a while loop: moves cannot be counted")
    need(moved == 2 * (n - 1) * b * d,
         f"{moved / (b * d):g} blocks moved, expected n - 1 = {n - 1} moves of k and of v")
    # values, for several S divisible by 8 (one position per device too) and d
    rows = NamedSharding(mesh, P("seq"))
    r = rng(7)
    jf = jax.jit(f)  # (called as the notebook does; eager shard_map runs op by op, slowly)
    for S, d in [(64, 16), (8, 3), (128, 5), (24, 8)]:
        q, k, v = qkv(r, S, d)
        close(jf(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)), attention64(q, k, v), 1e-4, 1e-5,
              f"S={S} d={d}")
    q, k, v = qkv(r, 64, 16, 100.0)
    out = jax.jit(f)(*(jax.device_put(jnp.asarray(a), rows) for a in (q, k, v)))
    close(out, attention64(q, k, v), 0, 2e-2, "jitted, placed by rows, S=64 d=16 q and k times 100")
    # memory: temporary memory per device under 10% of attention's on one device
    temp = jax.jit(f).lower(*NB["seq_shapes"](NB["S_LONG"], sharding=rows)).compile(
        ).memory_analysis().temp_size_in_bytes
    need(temp < 0.1 * NB["attention_temp"], f"temporary memory {temp} bytes per device, "
         f"attention on one device {NB['attention_temp']}")


# --------------------------------------------------------------------------- Task 8
Q8_SIZES = [(512, 1024, 256, 8), (64, 32, 48, 4), (40, 24, 16, 2), (24, 48, 72, 3), (16, 8, 8, 1)]
_Q8_SELF = []


def q8_reference(case, I, J, K, n):
    flops = 2 * I * J * K / n
    N = {1: 0, 2: 4 * J * K, 3: 4 * I * K, 4: 4 * I * K}[case]
    return flops, (2 if case == 3 else 1) * (n - 1) / n * N, \
        {1: "none", 2: "all-gather", 3: "all-reduce", 4: "reduce-scatter"}[case]


def q8_self_check():
    """My reference against the compiled programs (cost_analysis, HLO), once."""
    for I, J, K, n in Q8_SIZES[1:3]:
        for case in (1, 2, 3, 4):
            compiled = NB["compile_case"](case, I, J, K, n)
            flops, _, name = q8_reference(case, I, J, K, n)
            extra = I * K if case == 3 else 0  # the all-reduce's additions
            assert compiled.cost_analysis()["flops"] == flops + extra, (case, I, J, K, n)
            found = [c for _, c in NB["hlo_collectives"](compiled)]
            assert found == ([] if name == "none" else [name]), (case, found)
    _Q8_SELF.append(True)


def check_q8(ns):
    if not _Q8_SELF:
        q8_self_check()
    f = ns["matmul_costs"]
    need(callable(f), "matmul_costs is not a function")
    for I, J, K, n in Q8_SIZES:
        for case in (1, 2, 3, 4):
            out = f(case, I, J, K, n)
            need(isinstance(out, (tuple, list)) and len(out) == 3, "not a tuple of 3")
            flops, comm, name = out
            rf, rc, rn = q8_reference(case, I, J, K, n)
            what = f"case {case}, I={I} J={J} K={K}, {n} devices"
            need(math.isclose(float(flops), rf, rel_tol=1e-9), f"{what}: flops {flops}, expected {rf}")
            need(math.isclose(float(comm), rc, rel_tol=1e-9, abs_tol=1e-6),
                 f"{what}: comm_bytes {comm}, expected {rc}")
            need(name == rn, f"{what}: collective {name!r}, expected {rn!r}")


# --------------------------------------------------------------------------- Task 9
def roof_ref(flops, hbm, comm, chip):
    times = [(flops / chip["flop_per_s"], "compute"), (hbm / chip["hbm_bytes_per_s"], "memory"),
             (comm / chip["link_bytes_per_s"], "communication")]
    return max(times)


def is_plain_number(x):
    return type(x) in (int, float)


def check_q9(ns):
    rt, cb = ns["roofline_time"], ns["critical_batch"]
    need(callable(rt) and callable(cb), "roofline_time / critical_batch not functions")
    r = rng(9)
    chips = list(NB["CHIPS"].values()) + [
        {"flop_per_s": 1e12, "hbm_bytes_per_s": 1e12, "link_bytes_per_s": 1e11},
        {"flop_per_s": 1e12, "hbm_bytes_per_s": 1e13, "link_bytes_per_s": 1e10}]
    for _ in range(4):
        chips.append({"flop_per_s": float(10 ** r.uniform(13, 15.5)),
                      "hbm_bytes_per_s": float(10 ** r.uniform(11, 13)),
                      "link_bytes_per_s": float(10 ** r.uniform(9.5, 11.5))})
    # roofline_time: each resource the largest in turn, no ties
    for chip in chips:
        for top in range(3):
            t = sorted(float(x) for x in r.uniform(1e-6, 1e-2, 3))
            times = [t[0], t[1]]
            times.insert(top, t[2] * 1.5)
            flops = times[0] * chip["flop_per_s"]
            hbm = times[1] * chip["hbm_bytes_per_s"]
            comm = times[2] * chip["link_bytes_per_s"]
            out = rt(flops, hbm, comm, chip)
            need(isinstance(out, (tuple, list)) and len(out) == 2, "roofline_time: not a pair")
            seconds, bound = out
            ref_s, ref_b = roof_ref(flops, hbm, comm, chip)
            need(is_plain_number(seconds), f"roofline_time returned a {type(seconds).__name__}")
            need(math.isclose(seconds, ref_s, rel_tol=1e-9), f"roofline_time {seconds}, expected {ref_s}")
            need(bound == ref_b, f"roofline_time says {bound!r}, expected {ref_b!r}")
    # critical_batch, checked against my exact (fractions) reference
    cases = [(8192, 8192), (64, 64), (4096, 16384), (1000, 3000), (128, 100000), (4, 4),
             (12288, 49152)]
    cases += [(int(r.integers(16, 20000)), int(r.integers(16, 20000))) for _ in range(6)]
    for chip in chips:
        for D, F in cases:
            got, ref = cb(D, F, chip), NB["critical_batch"](D, F, chip)
            what = f"critical_batch({D}, {F}) on {chip}"
            if ref is None:
                need(got is None, f"{what} = {got!r}, expected None")
            else:
                need(type(got) is int, f"{what} returned a {type(got).__name__} ({got!r}), not an int")
                need(got == ref, f"{what} = {got}, expected {ref}")


# --------------------------------------------------------------------------- driver
CHECKS = {q: globals()["check_" + q.split("_")[0]] for q in ORDER if "check_" + q.split("_")[0] in globals()}


def notebook_text():
    import nbformat
    nb = nbformat.read(str(NOTEBOOK), 4)
    return " ".join(" ".join(c.source for c in nb.cells).split())


def run_answer(question, answer):
    ns = namespace_for(question)
    with contextlib.redirect_stdout(io.StringIO()):
        exec(compile(answer["code"], f"<{question}:{answer['name']}>", "exec"), ns)
    for name in QUESTION_NAMES[question]:
        need(ns.get(name, ...) is not ..., f"{name} not defined")
    CHECKS[question](ns)


def main(selected):
    text = notebook_text()
    totals, disagreements = collections.OrderedDict(), []
    for question in ORDER:
        if selected and question not in selected:
            continue
        path = HERE / f"{question}.yaml"
        if not path.exists() or question not in CHECKS:
            continue
        data = yaml.safe_load(path.read_text())
        counts = collections.Counter()
        for label in ("correct", "wrong"):
            for answer in data.get(label, []):
                quote = " ".join(answer["sentence"].split())
                quote_ok = quote in text
                t0 = time.time()
                try:
                    run_answer(question, answer)
                    verdict, reason = "correct", ""
                except Wrong as exc:
                    verdict, reason = "wrong", str(exc)
                except Exception as exc:  # an answer that raises is wrong
                    verdict, reason = "wrong", f"raised {type(exc).__name__}: {str(exc).splitlines()[0][:150] if str(exc) else ''}"
                agree = verdict == label and quote_ok
                counts[(label, agree)] += 1
                if not agree:
                    disagreements.append((question, answer["name"]))
                print(f"{question:24} {answer['name']:38} label={label:7} oracle={verdict:7} "
                      f"{'OK ' if agree else 'MISMATCH'}{'' if quote_ok else ' (quote not found)'}"
                      f" [{time.time() - t0:4.1f}s] {reason[:140]}", flush=True)
        totals[question] = counts
    print("\nSummary (answers whose label the oracle confirms / total):")
    for question, c in totals.items():
        nc = c[("correct", True)] + c[("correct", False)]
        nw = c[("wrong", True)] + c[("wrong", False)]
        print(f"  {question:24} correct {c[('correct', True)]}/{nc}   wrong {c[('wrong', True)]}/{nw}")
    print("ALL LABELS CONFIRMED" if not disagreements else f"MISMATCHES: {disagreements}")
    return 0 if not disagreements else 1


if __name__ == "__main__":
    sys.exit(main(set(sys.argv[1:])))
