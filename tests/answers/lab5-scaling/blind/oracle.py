"""Blind oracle for lab5-scaling: confirms the label of every answer in this folder's YAML files.

Written from the student notebook's text alone (see README.md). Run with
    /work/main/.venv/bin/python oracle.py [question-substring ...] [--self-test | --only-self-test]
(--self-test also judges the oracle's own reference solutions; --only-self-test judges only them).
It sets up 8 CPU devices as the notebook does, re-creates the notebook's earlier cells (starter
code copied from the student notebook, with this folder's OWN reference solutions for the
earlier tasks), then runs every answer's code in a fresh copy of the namespace at that answer's
cell and judges it against the task's sentences: values against float64 references on new
random inputs and on every size the text lets vary, and the method the text requires (read
from jax.make_jaxpr, the compiled HLO, jax.typeof, shardings, or - for Part D - what each
process really did, recorded by a wrapper around the training script).
"""
import os

os.environ.setdefault("PJRT_NPROC", "16")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import math  # noqa: E402
import pathlib  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import yaml  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parent
DEVICES = jax.devices()[:8]
assert len(DEVICES) == 8, DEVICES

# ----------------------------------------------------------------------------------------------
# The notebook's cells before each task (starter code copied from the student notebook; prints
# dropped), and this oracle's own reference solutions of the tasks.
# ----------------------------------------------------------------------------------------------
CELLS_SETUP = r'''
import itertools
import math
import os
import re
from collections import Counter
from functools import partial
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
N_DEVICES = 8
devices = jax.devices()[:N_DEVICES]

def answered(*answers):
    if any(answer is ... for answer in answers):
        return False
    return True

grid_mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2,
                          devices=devices)
grid = np.arange(64.0).reshape(8, 8)


def forward(params, x):
    W1, b1, W2, b2 = params
    return jnp.tanh(x @ W1 + b1) @ W2 + b2


def mlp_loss(params, batch):
    x, y = batch
    return jnp.mean(jnp.sum((forward(params, x) - y) ** 2, axis=-1))


def init_mlp(key, n_in=16, n_hidden=64, n_out=8, batch_size=32):
    k = jax.random.split(key, 6)
    W1 = jax.random.normal(k[0], (n_in, n_hidden)) / jnp.sqrt(n_in)
    b1 = 0.1 * jax.random.normal(k[1], (n_hidden,))
    W2 = jax.random.normal(k[2], (n_hidden, n_out)) / jnp.sqrt(n_hidden)
    b2 = 0.1 * jax.random.normal(k[3], (n_out,))
    x = jax.random.normal(k[4], (batch_size, n_in))
    y = jax.random.normal(k[5], (batch_size, n_out))
    return (W1, b1, W2, b2), (x, y)


mlp_params, (x_mlp, y_mlp) = init_mlp(jax.random.key(0))
'''

REF_Q1 = r'''
mesh_2d = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2,
                        devices=devices)
x_2d = jax.device_put(x_mlp, NamedSharding(mesh_2d, P("data", None)))
params_2d = tuple(jax.device_put(p, NamedSharding(mesh_2d, s)) for p, s in
                  zip(mlp_params, (P(None, "model"), P("model"), P("model", None), P())))


@jax.jit
def forward_2d(params, x):
    W1, b1, W2, b2 = params
    h = jnp.tanh(x @ W1 + b1)
    return jnp.dot(h, W2, out_sharding=NamedSharding(mesh_2d, P("data", None))) + b2


out_2d = forward_2d(params_2d, x_2d)
'''

REF_Q2 = r'''
@partial(jax.shard_map, mesh=mesh_2d,
         in_specs=((P(None, "model"), P("model"), P("model", None), P()),
                   (P("data", None), P("data", None))),
         out_specs=P())
def loss_2d(params, batch):
    W1, b1, W2, b2 = params
    x, y = batch
    h = jnp.tanh(x @ W1 + b1)
    out = lax.psum(h @ W2, "model") + b2
    return lax.pmean(jnp.mean(jnp.sum((out - y) ** 2, axis=-1)), "data")
'''

CELLS_B = r'''
N_STAGES = 8
LAYERS_PER_STAGE = 2
N_LAYERS = N_STAGES * LAYERS_PER_STAGE
WIDTH = 24


def layer(h, W, b):
    return jnp.tanh(h @ W + b)


def sequential_forward(layers, x):
    for W, b in layers:
        x = layer(x, W, b)
    return x


def init_layers(key, n_layers=N_LAYERS, width=WIDTH):
    layers = []
    for k in jax.random.split(key, n_layers):
        kW, kb = jax.random.split(k)
        layers.append((jax.random.normal(kW, (width, width)) / jnp.sqrt(width),
                       0.1 * jax.random.normal(kb, (width,))))
    return layers


layers = init_layers(jax.random.key(1))
'''

REF_Q3 = r'''
mesh_stage = jax.make_mesh((N_STAGES,), ("stage",), devices=devices)
stage_params = tuple(jax.device_put(jnp.stack(group), NamedSharding(mesh_stage, P("stage")))
                     for group in zip(*layers))
'''

CELLS_B2 = r'''
def print_schedule(n_stages, n_micro):
    pass


N_MICRO, MICRO_SIZE = 8, 4
micro_x = jax.random.normal(jax.random.key(2), (N_MICRO, MICRO_SIZE, WIDTH))
micro_y = jax.random.normal(jax.random.key(3), (N_MICRO, MICRO_SIZE, WIDTH))
expected_outputs = jax.vmap(partial(sequential_forward, layers))(micro_x)


def sequential_loss(layers, x, y):
    """Task 5's loss on one device: the mean over all examples of the squared error summed over
    the outputs."""
    return jnp.mean(jnp.sum((jax.vmap(partial(sequential_forward, layers))(x) - y) ** 2,
                            axis=-1))
'''

REF_Q4 = r'''
@jax.jit
@partial(jax.shard_map, mesh=mesh_stage, in_specs=(P("stage"), P()), out_specs=P())
def pipeline_forward(stage_params, microbatches):
    W, b = stage_params
    n = lax.axis_size("stage")
    s = lax.axis_index("stage")
    M = microbatches.shape[0]
    perm = [(i, i + 1) for i in range(n - 1)]

    def step(carry, t):
        state, outs = carry
        h = jnp.where(s == 0, microbatches[jnp.minimum(t, M - 1)], state)
        for j in range(W.shape[0]):
            h = layer(h, W[j], b[j])
        k = t - (n - 1)
        outs = jnp.where((s == n - 1) & (k >= 0), outs.at[jnp.maximum(k, 0)].set(h), outs)
        return (lax.ppermute(h, "stage", perm), outs), None

    init = lax.pcast((jnp.zeros(microbatches.shape[1:], microbatches.dtype),
                      jnp.zeros_like(microbatches)), "stage", to="varying")
    (_, outs), _ = lax.scan(step, init, jnp.arange(M + n - 1))
    return lax.psum(outs, "stage")
'''

REF_Q5 = r'''
@jax.jit
def pipeline_loss(stage_params, microbatches, targets):
    out = pipeline_forward(stage_params, microbatches)
    return jnp.mean(jnp.sum((out - targets) ** 2, axis=-1))
'''

REF_Q6 = r'''
def bubble_fraction(n_stages, n_micro):
    return (n_stages - 1) / (n_micro + n_stages - 1)


def microbatches_needed(n_stages, max_bubble):
    m = 1
    while bubble_fraction(n_stages, m) >= max_bubble:
        m += 1
    return m
'''

CELLS_C = r'''
N_EXPERTS = 8
D_MODEL, D_HIDDEN = 16, 32
EXPERT_CAPACITY = 2
TOKENS_PER_DEVICE = 8


def expert_mlp(x, W_in, W_out):
    """One expert: a small ReLU MLP."""
    return jax.nn.relu(x @ W_in) @ W_out


def init_moe(key):
    k = jax.random.split(key, 4)
    tokens = jax.random.normal(k[0], (N_EXPERTS * TOKENS_PER_DEVICE, D_MODEL))
    router_weights = jax.random.normal(k[1], (D_MODEL, N_EXPERTS))
    W_in = jax.random.normal(k[2], (N_EXPERTS, D_MODEL, D_HIDDEN)) / jnp.sqrt(D_MODEL)
    W_out = jax.random.normal(k[3], (N_EXPERTS, D_HIDDEN, D_MODEL)) / jnp.sqrt(D_HIDDEN)
    return tokens, router_weights, W_in, W_out


moe_tokens, moe_router, moe_W_in, moe_W_out = init_moe(jax.random.key(4))
'''

REF_Q7 = r'''
def route(tokens, router_weights, capacity):
    scores = tokens @ router_weights
    probs = jax.nn.softmax(scores, axis=-1)
    expert = jnp.argmax(scores, axis=-1)
    onehot = jax.nn.one_hot(expert, router_weights.shape[1], dtype=jnp.int32)
    slot = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=-1)
    gate = jnp.take_along_axis(probs, expert[:, None], axis=-1)[:, 0]
    return expert, jnp.where(slot < capacity, gate, 0.0), slot
'''

CELLS_C2 = r'''
mesh_expert = jax.make_mesh((N_EXPERTS,), ("expert",), axis_types=(AxisType.Auto,),
                            devices=devices)
messages = jnp.arange(64)


@jax.jit
@partial(jax.shard_map, mesh=mesh_expert, in_specs=P("expert"), out_specs=P("expert"))
def exchange(block):
    return lax.all_to_all(block, "expert", 0, 0, tiled=True)


def moe_dense(tokens, router_weights, W_in, W_out):
    """The layer on one device: each device's tokens routed with its own capacity, then every
    expert's output computed and each token's own kept, times its gate."""
    rows = []
    for group in jnp.split(tokens, N_EXPERTS):  # the tokens of each device
        expert, gate, _ = route(group, router_weights, EXPERT_CAPACITY)
        all_experts = jax.vmap(expert_mlp, in_axes=(None, 0, 0))(group, W_in, W_out)
        rows.append(gate[:, None] * all_experts[expert, jnp.arange(len(group))])
    return jnp.concatenate(rows)
'''

REF_Q8 = r'''
@jax.jit
@partial(jax.shard_map, mesh=mesh_expert,
         in_specs=(P("expert"), P(), P("expert"), P("expert")), out_specs=P("expert"))
def moe_layer(tokens, router_weights, W_in, W_out):
    E, C = router_weights.shape[1], EXPERT_CAPACITY
    expert, gate, slot = route(tokens, router_weights, C)
    dispatch = jax.nn.one_hot(expert, E)[:, :, None] * jax.nn.one_hot(slot, C)[:, None, :]
    buffer = jnp.einsum("tec,td->ecd", dispatch, tokens)
    received = lax.all_to_all(buffer, "expert", 0, 0, tiled=True)
    done = expert_mlp(received, W_in[0], W_out[0])
    back = lax.all_to_all(done, "expert", 0, 0, tiled=True)
    return jnp.einsum("tec,ecd->td", dispatch * gate[:, None, None], back)
'''

QUESTIONS = ["q1_mesh_2d", "q2_dp_tp_shard_map", "q3_stage_params", "q4_pipeline_forward",
             "q5_pipeline_grad", "q6_bubble", "q7_router", "q8_moe_all_to_all",
             "q9_multi_process"]


def build_bases():
    """The namespace each task's answer cell sees (earlier cells, reference answers)."""
    ns = {"__name__": "__main__"}
    bases = {}
    exec(CELLS_SETUP, ns)
    bases["q1_mesh_2d"] = dict(ns)
    exec(REF_Q1, ns)
    bases["q2_dp_tp_shard_map"] = dict(ns)
    exec(REF_Q2, ns)
    exec(CELLS_B, ns)
    bases["q3_stage_params"] = dict(ns)
    exec(REF_Q3, ns)
    exec(CELLS_B2, ns)
    bases["q4_pipeline_forward"] = dict(ns)
    exec(REF_Q4, ns)
    bases["q5_pipeline_grad"] = dict(ns)
    exec(REF_Q5, ns)
    bases["q6_bubble"] = dict(ns)
    exec(REF_Q6, ns)
    exec(CELLS_C, ns)
    bases["q7_router"] = dict(ns)
    exec(REF_Q7, ns)
    exec(CELLS_C2, ns)
    bases["q8_moe_all_to_all"] = dict(ns)
    exec(REF_Q8, ns)
    bases["q9_multi_process"] = dict(ns)
    return bases


# ----------------------------------------------------------------------------------------------
# Helpers: verdicts, float64 references, programs
# ----------------------------------------------------------------------------------------------
class Wrong(Exception):
    """The answer breaks the task: the message says which requirement."""


def need(cond, message):
    if not cond:
        raise Wrong(message)


# Failures of form/method (layout, mesh, collectives, jit, which process did what) are recorded
# here and the check goes on, so that one run says both whether the answer is right and whether
# its NUMBERS are right (a wrong answer with right numbers is one only a method check catches).
FORM_FAILS = []


def soft(fn, *args, **kwargs):
    """Run a form/method check; record its failure instead of stopping."""
    try:
        return fn(*args, **kwargs)
    except Wrong as exc:
        FORM_FAILS.append(str(exc))
    except Exception as exc:  # noqa: BLE001 - a program that cannot be read is a failure too
        FORM_FAILS.append(f"form check raised {type(exc).__name__}: {exc}"[:300])
    return None


def form(cond, message):
    if not cond:
        FORM_FAILS.append(message)


def f64(x):
    return np.asarray(jax.device_get(x), dtype=np.float64)


def close(actual, expected, what, rtol=1e-4, atol=1e-5):
    a = np.asarray(jax.device_get(actual))
    need(a.shape == np.shape(expected), f"{what}: shape {a.shape}, expected {np.shape(expected)}")
    a = a.astype(np.float64)
    need(np.all(np.isfinite(a)), f"{what}: not finite")
    err = float(np.max(np.abs(a - expected))) if a.size else 0.0
    need(np.allclose(a, expected, rtol=rtol, atol=atol), f"{what}: off by {err:.3g}")


def laid_out(arr, mesh, spec, what):
    """``arr`` is a jax.Array on ``mesh`` (the same mesh) laid out as ``spec``."""
    need(isinstance(arr, jax.Array), f"{what} is not a jax.Array ({type(arr).__name__})")
    sh = arr.sharding
    need(isinstance(sh, NamedSharding), f"{what} has a {type(sh).__name__}, not a NamedSharding")
    need(sh.mesh == mesh, f"{what} lives on another mesh: {sh.mesh}")
    need(sh.is_equivalent_to(NamedSharding(mesh, spec), arr.ndim),
         f"{what} is laid out as {sh.spec}, expected {spec}")


COMM = {"psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant",
        "ppermute", "all_to_all", "reduce_scatter", "psum_scatter", "ragged_all_to_all",
        "pbroadcast", "pmax_invariant", "pmin_invariant", "psum2"}


def sub_jaxprs(params):
    for value in params.values():
        for sub in value if isinstance(value, (list, tuple)) else (value,):
            if hasattr(sub, "eqns"):
                yield sub
            elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                yield sub.jaxpr


def walk(jaxpr, mult=1):
    """(eqn, how many times it runs) for every equation, nested ones included (scan bodies
    count `length` times)."""
    for eqn in jaxpr.eqns:
        yield eqn, mult
        inner = mult * int(eqn.params["length"]) if eqn.primitive.name == "scan" else mult
        for sub in sub_jaxprs(eqn.params):
            yield from walk(sub, inner)


def axes_of(eqn):
    a = eqn.params.get("axes", eqn.params.get("axis_name"))
    if a is None:
        return ()
    return tuple(a) if isinstance(a, (tuple, list)) else (a,)


def comms(jaxpr):
    """[(primitive, axes, times, output shapes, eqn)] of the communicating equations."""
    return [(e.primitive.name, axes_of(e), m, [tuple(v.aval.shape) for v in e.outvars], e)
            for e, m in walk(jaxpr) if e.primitive.name in COMM]


def shard_map_eqns(jaxpr):
    return [e for e, _ in walk(jaxpr) if e.primitive.name == "shard_map"]


def is_jitted(fn, *args):
    top = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    return len(top) == 1 and top[0].primitive.name in ("jit", "pjit")


def spec_equiv(spec, want, mesh, ndim):
    return NamedSharding(mesh, spec).is_equivalent_to(NamedSharding(mesh, want), ndim)


def in_specs_by_shape(eqn):
    return [(tuple(v.aval.shape), s) for v, s in zip(eqn.invars, eqn.params["in_specs"])]


def expect_in_spec(eqn, mesh, shape, want, what):
    found = [s for sh, s in in_specs_by_shape(eqn) if sh == tuple(shape)]
    need(found, f"no shard_map operand of shape {shape} ({what})")
    for s in found:
        need(spec_equiv(s, want, mesh, len(shape)),
             f"{what} enters shard_map with in_specs {s}, expected {want}")


def hlo_collectives(text):
    """[(kind, replica groups as a list of lists or None)] of the collectives in an HLO text."""
    found = []
    for line in text.splitlines():
        m = re.search(r"= \S+ (all-reduce|all-gather|reduce-scatter|all-to-all|"
                      r"collective-permute|all-reduce-start|all-gather-start|"
                      r"collective-permute-start)\(", line)
        if not m:
            continue
        groups = None
        g = re.search(r"replica_groups=\{(\{[\d,]*\}(?:,\{[\d,]*\})*)\}", line)
        if g:
            groups = [[int(i) for i in grp.split(",") if i]
                      for grp in re.findall(r"\{([\d,]*)\}", g.group(1))]
        else:
            g = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
            if g:
                dims = [int(i) for i in g.group(3).split(",")]
                ids = np.arange(int(np.prod(dims))).reshape(dims)
                if g.group(4):
                    ids = ids.transpose([int(i) for i in g.group(4).split(",")])
                groups = ids.reshape(int(g.group(1)), int(g.group(2))).tolist()
        found.append((m.group(1).replace("-start", ""), groups))
    return found


def run_answer(base, code):
    ns = dict(base)
    exec(compile(code, "<answer>", "exec"), ns)
    return ns


# ----------------------------------------------------------------------------------------------
# Part A
# ----------------------------------------------------------------------------------------------
MEGATRON = (P(None, "model"), P("model"), P("model", None), P())


def f64_forward(params, x):
    W1, b1, W2, b2 = map(f64, params)
    return np.tanh(f64(x) @ W1 + b1) @ W2 + b2


def f64_loss_and_grad(params, x, y):
    W1, b1, W2, b2 = map(f64, params)
    x, y = f64(x), f64(y)
    B = x.shape[0]
    z = x @ W1 + b1
    h = np.tanh(z)
    out = h @ W2 + b2
    r = out - y
    loss = np.mean(np.sum(r ** 2, axis=-1))
    dout = 2 * r / B
    dW2 = h.T @ dout
    db2 = dout.sum(0)
    dz = (dout @ W2.T) * (1 - h ** 2)
    return loss, (x.T @ dz, dz.sum(0), dW2, db2)


def placed_mlp(mesh, seed, batch):
    (W1, b1, W2, b2), (x, y) = BASES["q1_mesh_2d"]["init_mlp"](jax.random.key(seed),
                                                               batch_size=batch)
    params = tuple(jax.device_put(p, NamedSharding(mesh, s))
                   for p, s in zip((W1, b1, W2, b2), MEGATRON))
    rows = NamedSharding(mesh, P("data", None))
    return params, jax.device_put(x, rows), jax.device_put(y, rows)


def check_q1(ns):
    base = BASES["q1_mesh_2d"]
    mesh = ns["mesh_2d"]
    need(isinstance(mesh, Mesh), f"mesh_2d is a {type(mesh).__name__}, not a Mesh")
    form(tuple(mesh.axis_names) == ("data", "model"), f"mesh axes {mesh.axis_names}")
    form(tuple(mesh.devices.shape) == (4, 2), f"mesh shape {mesh.devices.shape}, expected 4 x 2")
    form(all(t == AxisType.Explicit for t in mesh.axis_types),
         f"mesh axis types {mesh.axis_types}, expected both Explicit")
    form(set(mesh.devices.flat) == set(base["devices"]), "mesh is not made of `devices`")
    close(ns["x_2d"], f64(base["x_mlp"]), "x_2d")
    soft(laid_out, ns["x_2d"], mesh, P("data", None), "x_2d")
    params = ns["params_2d"]
    need(type(params) is tuple and len(params) == 4, "params_2d is not a tuple of 4 arrays")
    for name, p, ref, spec in zip(("W1", "b1", "W2", "b2"), params, base["mlp_params"], MEGATRON):
        close(p, f64(ref), f"params_2d's {name}")
        soft(laid_out, p, mesh, spec, f"params_2d's {name}")
    fwd = ns["forward_2d"]
    form(soft(is_jitted, fwd, params, ns["x_2d"]), "forward_2d is not wrapped in jax.jit")
    for seed, batch in ((11, 32), (12, 4), (13, 12)):
        p, x, _ = placed_mlp(mesh, seed, batch)
        out = fwd(p, x)
        close(out, f64_forward(p, x), f"forward_2d on {batch} new examples")
        form(str(jax.typeof(out)) == f"float32[{batch}@data,8]",
             f"forward_2d's output for {batch} examples is {jax.typeof(out)}, expected "
             f"float32[{batch}@data,8]")
        soft(laid_out, out, mesh, P("data", None), "forward_2d's output")

    def collectives():
        hlo = fwd.lower(p, x).compile().as_text() if hasattr(fwd, "lower") else \
            jax.jit(fwd).lower(p, x).compile().as_text()
        col = hlo_collectives(hlo)
        model_groups = sorted(sorted(d.id for d in row) for row in mesh.devices)
        need(all(k == "all-reduce" for k, _ in col),
             f"forward_2d communicates with {[k for k, _ in col]}: only the all-reduce over "
             "'model' is allowed (never gather W1)")
        need(col, "forward_2d has no all-reduce")
        for _, groups in col:
            need(groups is not None and sorted(map(sorted, groups)) == model_groups,
                 f"an all-reduce over groups {groups}, not over the 'model' axis {model_groups}")

    soft(collectives)
    out = ns["out_2d"]
    close(out, f64_forward(base["mlp_params"], base["x_mlp"]), "out_2d")
    form(str(jax.typeof(out)) == "float32[32@data,8]", f"out_2d is {jax.typeof(out)}")


def check_q2(ns):
    base = BASES["q2_dp_tp_shard_map"]
    mesh = base["mesh_2d"]
    loss_2d = ns["loss_2d"]
    for seed, batch in ((21, 32), (23, 12)):
        p, x, y = placed_mlp(mesh, seed, batch)
        ref, gref = f64_loss_and_grad(p, x, y)
        close(loss_2d(p, (x, y)), ref, f"loss_2d on {batch} new examples", rtol=1e-4)
        grads = jax.jit(jax.grad(loss_2d))(p, (x, y))
        for name, g, r in zip(("W1", "b1", "W2", "b2"), grads, gref):
            close(g, r, f"grad of loss_2d for {name} ({batch} examples)", rtol=1e-3, atol=1e-5)
        soft(q2_program, loss_2d, mesh, p, x, y, batch)


def q2_program(loss_2d, mesh, p, x, y, batch):
    closed = jax.make_jaxpr(loss_2d)(p, (x, y))
    sms = shard_map_eqns(closed.jaxpr)
    need(len(sms) == 1, f"loss_2d has {len(sms)} shard_maps, expected one")
    sm = sms[0]
    need(sm.params["mesh"] == mesh or (dict(sm.params["mesh"].shape) == dict(mesh.shape)
                                       and tuple(sm.params["mesh"].axis_names)
                                       == ("data", "model")),
         f"shard_map on {sm.params['mesh']}, not mesh_2d")
    for shape, want, what in (((16, 64), P(None, "model"), "W1"), ((64,), P("model"), "b1"),
                              ((64, 8), P("model", None), "W2"), ((8,), P(), "b2"),
                              ((batch, 16), P("data", None), "x"),
                              ((batch, 8), P("data", None), "y")):
        expect_in_spec(sm, mesh, shape, want, what)
    outs = sm.params["out_specs"]
    need(len(outs) == 1 and tuple(outs[0]) == () and sm.outvars[0].aval.shape == (),
         f"out_specs {outs}: expected one scalar with P()")
    body = sm.params["jaxpr"]
    c = [(n, ax, shp) for n, ax, _, shp, _ in comms(body)]
    need([n for n, *_ in c if n.startswith("all_gather")] == [], "loss_2d uses all_gather")
    need(len(c) == 2, f"loss_2d's collectives are {[(n, ax) for n, ax, _ in c]}: expected "
         "one psum over 'model' and one mean over 'data'")
    (n1, ax1, s1), (n2, ax2, s2) = c
    need(n1.startswith("psum") and ax1 == ("model",) and s1 == [(batch // 4, 8)],
         f"first collective {n1} over {ax1} of shape {s1}: expected the psum over 'model' "
         "of the output block")
    need(n2.startswith("psum") and ax2 == ("data",) and s2 == [()],
         f"second collective {n2} over {ax2} of shape {s2}: expected the mean over 'data'")


# ----------------------------------------------------------------------------------------------
# Part B
# ----------------------------------------------------------------------------------------------
def check_q3(ns):
    base = BASES["q3_stage_params"]
    mesh = ns["mesh_stage"]
    need(isinstance(mesh, Mesh), f"mesh_stage is a {type(mesh).__name__}")
    form(tuple(mesh.axis_names) == ("stage",), f"mesh_stage's axes are {mesh.axis_names}")
    form(list(mesh.devices.flat) == list(base["devices"]),
         "mesh_stage is not the 8 `devices` in order (device k must hold layers 2k, 2k+1)")
    sp = ns["stage_params"]
    need(type(sp) is tuple and len(sp) == 2, "stage_params is not a tuple (W_stack, b_stack)")
    refs = [np.stack([f64(l[i]) for l in base["layers"]]) for i in (0, 1)]
    for name, arr, ref in zip(("W_stack", "b_stack"), sp, refs):
        need(arr.dtype == np.float32, f"{name} has dtype {arr.dtype}")
        close(arr, ref, name, rtol=0, atol=0)
        soft(laid_out, arr, mesh, P("stage"), name)
        for shard in arr.addressable_shards:
            k = list(base["devices"]).index(shard.device)
            start = shard.index[0].start or 0
            form(start == 2 * k and shard.data.shape[0] == 2,
                 f"device {k} holds layers from {start}, expected {2 * k} and {2 * k + 1}")


def stacked_on(mesh, seed):
    lay = BASES["q3_stage_params"]["init_layers"](jax.random.key(seed))
    W = jnp.stack([w for w, _ in lay])
    b = jnp.stack([bb for _, bb in lay])
    sh = NamedSharding(mesh, P("stage"))
    return (jax.device_put(W, sh), jax.device_put(b, sh)), (f64(W), f64(b))


def f64_seq(Wb, x):
    W, b = Wb
    h = f64(x)
    for i in range(W.shape[0]):
        h = np.tanh(h @ W[i] + b[i])
    return h


def expect_pipeline_program(closed, mesh, M, B, what):
    sms = shard_map_eqns(closed.jaxpr)
    need(len(sms) >= 1, f"{what} has no shard_map")
    sm = [s for s in sms if tuple(s.params["mesh"].axis_names) == ("stage",)]
    need(len(sm) == 1, f"{what}: expected one shard_map on mesh_stage, found {len(sm)}")
    sm = sm[0]
    expect_in_spec(sm, mesh, (16, 24, 24), P("stage"), "W_stack")
    expect_in_spec(sm, mesh, (16, 24), P("stage"), "b_stack")
    expect_in_spec(sm, mesh, (M, B, 24), P(), "microbatches")
    c = comms(sm.params["jaxpr"])
    names = sorted({n for n, *_ in c})
    need(set(names) <= {"ppermute", "psum", "psum_invariant"},
         f"{what} communicates with {names}: only ppermute and the final psum are expected")
    steps = sum(m for n, _, m, _, _ in c if n == "ppermute")
    need(steps in (M + 6, M + 7), f"{what} runs {steps} ppermute steps for M={M}, expected "
         f"M + 8 - 1 = {M + 7} (or {M + 6}, the last useless send left out)")
    for n, ax, _, _, e in c:
        need(ax == ("stage",), f"{n} over {ax}, expected 'stage'")
        if n == "ppermute":
            perm = {tuple(p) for p in e.params["perm"]}
            fwd = {(i, i + 1) for i in range(7)}
            need(fwd <= perm <= fwd | {(7, 0)},
                 f"ppermute pairs {sorted(perm)}: expected (s, s + 1) for every stage")
    need(any(n.startswith("psum") for n, *_ in c), f"{what}: no psum over 'stage' of the outputs")
    return sm


def check_q4(ns):
    base = BASES["q4_pipeline_forward"]
    mesh = base["mesh_stage"]
    pf = ns["pipeline_forward"]
    sp0 = base["stage_params"]
    form(soft(is_jitted, pf, sp0, base["micro_x"]), "pipeline_forward is not wrapped in jax.jit")
    run = jax.jit(pf)  # the numbers do not depend on jit; an unjitted unrolled loop is very slow
    for seed, M, B in ((41, 8, 4), (42, 3, 2), (43, 1, 5), (44, 12, 1)):
        sp, ref = stacked_on(mesh, seed)
        mb = jax.random.normal(jax.random.key(seed + 100), (M, B, 24))
        close(run(sp, mb), f64_seq(ref, mb), f"pipeline_forward, M={M}, microbatch size {B}")
        soft(q4_program, pf, sp, mb, mesh, M, B)


def q4_program(pf, sp, mb, mesh, M, B):
    sm = expect_pipeline_program(jax.make_jaxpr(pf)(sp, mb), mesh, M, B, "pipeline_forward")
    outs = sm.params["out_specs"]
    need(len(outs) == 1 and spec_equiv(outs[0], P(), mesh, 3), f"out_specs {outs}, expected P()")


def f64_pipe_loss_grad(ref, x, y):
    W, b = ref
    x, y = f64(x), f64(y)
    M, B, D = x.shape
    n = M * B
    hs = [x.reshape(n, D)]
    for i in range(W.shape[0]):
        hs.append(np.tanh(hs[-1] @ W[i] + b[i]))
    r = hs[-1] - y.reshape(n, D)
    loss = np.sum(r ** 2) / n
    d = 2 * r / n
    gW, gb = np.zeros_like(W), np.zeros_like(b)
    for i in reversed(range(W.shape[0])):
        dz = d * (1 - hs[i + 1] ** 2)
        gW[i] = hs[i].T @ dz
        gb[i] = dz.sum(0)
        d = dz @ W[i].T
    return loss, (gW, gb)


def check_q5(ns):
    base = BASES["q5_pipeline_grad"]
    mesh = base["mesh_stage"]
    pl = ns["pipeline_loss"]
    for seed, M, B in ((51, 8, 4), (52, 3, 2)):
        sp, ref = stacked_on(mesh, seed)
        x = jax.random.normal(jax.random.key(seed + 100), (M, B, 24))
        y = jax.random.normal(jax.random.key(seed + 200), (M, B, 24))
        lref, gref = f64_pipe_loss_grad(ref, x, y)
        close(pl(sp, x, y), lref, f"pipeline_loss (M={M}, size {B})", rtol=1e-4)
        grads = jax.jit(jax.grad(pl))(sp, x, y)
        need(len(grads) == 2, "gradient is not a pair")
        for name, g, r in zip(("W_stack", "b_stack"), grads, gref):
            close(g, r, f"gradient of {name} (M={M}, size {B})", rtol=1e-3, atol=1e-5)
            soft(laid_out, g, mesh, P("stage"), f"gradient of {name}")
        soft(expect_pipeline_program, jax.make_jaxpr(pl)(sp, x, y), mesh, M, B, "pipeline_loss")
        gc = soft(lambda: comms(jax.make_jaxpr(jax.grad(pl))(sp, x, y).jaxpr)) or []
        form(not any(n.startswith("all_gather") for n, *_ in gc),
             "the gradient's program gathers parameters")


# ----------------------------------------------------------------------------------------------
# Part B, the bubble
# ----------------------------------------------------------------------------------------------
def ref_bubble(L, M):
    return (L - 1) / (M + L - 1)


def ref_needed(L, beta):
    # smallest M with ref_bubble(L, M) < beta, by bisection on the monotone float sequence
    lo, hi = 1, 1
    while ref_bubble(L, hi) >= beta:
        hi *= 2
    while lo < hi:
        mid = (lo + hi) // 2
        if ref_bubble(L, mid) < beta:
            hi = mid
        else:
            lo = mid + 1
    return lo


def check_q6(ns):
    bf, mn = ns["bubble_fraction"], ns["microbatches_needed"]
    for L in range(1, 21):
        for M in list(range(1, 40)) + [63, 64, 100, 128, 1000]:
            v = bf(L, M)
            form(type(v) is float, f"bubble_fraction({L}, {M}) returns a {type(v).__name__}")
            need(abs(v - ref_bubble(L, M)) <= 1e-12, f"bubble_fraction({L}, {M}) = {v}, "
                 f"expected {ref_bubble(L, M)}")
    cases = [(8, 0.1), (1, 0.5), (1, 0.01), (2, 0.5), (4, 0.25), (16, 0.05), (8, 0.999),
             (3, 0.2), (5, 0.3), (64, 0.01), (32, 0.5)]
    rng = np.random.default_rng(6)
    for _ in range(150):   # ties: max_bubble exactly the idle fraction of some M
        L, M = int(rng.integers(1, 70)), int(rng.integers(1, 400))
        cases.append((L, ref_bubble(L, M) if L > 1 else float(rng.uniform(0.01, 0.99))))
    for _ in range(100):
        cases.append((int(rng.integers(1, 70)), float(rng.uniform(0.002, 0.999))))
    for L, beta in cases:
        v = mn(L, beta)
        form(type(v) is int, f"microbatches_needed({L}, {beta}) returns a {type(v).__name__}")
        need(v == ref_needed(L, beta), f"microbatches_needed({L}, {beta!r}) = {v}, expected "
             f"{ref_needed(L, beta)}")


# ----------------------------------------------------------------------------------------------
# Part C
# ----------------------------------------------------------------------------------------------
def clear_inputs(seed, T, D, E, scale=1.0, margin=1e-3):
    """Tokens and router weights whose top-1 choice is clear in float32 (no near-ties)."""
    for s in range(seed, seed + 1000):
        k1, k2 = jax.random.split(jax.random.key(s))
        tok = jax.random.normal(k1, (T, D))
        rw = scale * jax.random.normal(k2, (D, E))
        sc = f64(tok) @ f64(rw)
        top2 = np.sort(sc, axis=-1)[:, -2:] if E > 1 else None
        if E == 1 or np.all(top2[:, 1] - top2[:, 0] > margin):
            return tok, rw
    raise RuntimeError("no clear inputs")


def f64_route(tok, rw, capacity):
    sc = f64(tok) @ f64(rw)
    expert = np.argmax(sc, axis=-1)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    slot = np.array([np.sum(expert[:i] == expert[i]) for i in range(len(expert))])
    gate = np.where(slot < capacity, p[np.arange(len(expert)), expert], 0.0)
    return expert, gate, slot


def check_q7(ns):
    route = ns["route"]
    cases = [(8, 16, 8, 2), (64, 16, 8, 2), (13, 5, 3, 1), (20, 7, 4, 3), (30, 6, 12, 2),
             (9, 4, 10, 1), (5, 3, 1, 2), (40, 8, 16, 3)]
    jitted = jax.jit(route, static_argnums=2)
    for i, (T, D, E, C) in enumerate(cases):
        tok, rw = clear_inputs(700 + 10 * i, T, D, E)
        ex, gt, sl = f64_route(tok, rw, C)
        for how, fn in (("eager", route), ("jit", jitted)) if i < 3 else (("jit", jitted),):
            res = fn(tok, rw, C)
            need(type(res) in (tuple, list) and len(res) == 3,
                 f"route returns {type(res).__name__}, expected (expert, gate, slot)")
            expert, gate, slot = res
            what = f"route ({how}, T={T}, D={D}, E={E}, capacity={C})"
            for nm, arr in (("expert", expert), ("gate", gate), ("slot", slot)):
                need(np.shape(arr) == (T,), f"{what}: {nm} has shape {np.shape(arr)}")
            form(jnp.issubdtype(jnp.asarray(expert).dtype, jnp.integer),
                 f"{what}: expert is {jnp.asarray(expert).dtype}, not integers")
            form(jnp.issubdtype(jnp.asarray(slot).dtype, jnp.integer),
                 f"{what}: slot is {jnp.asarray(slot).dtype}, not integers")
            form(jnp.issubdtype(jnp.asarray(gate).dtype, jnp.floating), f"{what}: gate dtype")
            need(np.array_equal(np.asarray(expert), ex), f"{what}: wrong expert")
            need(np.array_equal(np.asarray(slot), sl), f"{what}: wrong slot")
            close(gate, gt, f"{what}: gate", rtol=1e-5, atol=1e-6)


def f64_moe(tok, rw, Win, Wout, capacity=2, E=8):
    tok, Win, Wout = f64(tok), f64(Win), f64(Wout)
    out = np.zeros_like(tok)
    for d, rows in enumerate(np.split(np.arange(len(tok)), E)):
        ex, gt, _ = f64_route(tok[rows], rw, capacity)
        for r, e, g in zip(rows, ex, gt):
            out[r] = g * (np.maximum(tok[r] @ Win[e], 0) @ Wout[e])
    return out


def check_q8(ns):
    base = BASES["q8_moe_all_to_all"]
    mesh = base["mesh_expert"]
    ml = ns["moe_layer"]
    for seed, tpd in ((81, 8), (82, 3), (84, 1)):
        T = 8 * tpd
        tok, rw = clear_inputs(seed * 10, T, 16, 8)
        k1, k2 = jax.random.split(jax.random.key(seed))
        Win = jax.random.normal(k1, (8, 16, 32)) / 4.0
        Wout = jax.random.normal(k2, (8, 32, 16)) / math.sqrt(32)
        args = (jax.device_put(tok, NamedSharding(mesh, P("expert"))),
                jax.device_put(rw, NamedSharding(mesh, P())),
                jax.device_put(Win, NamedSharding(mesh, P("expert"))),
                jax.device_put(Wout, NamedSharding(mesh, P("expert"))))
        out = jax.jit(ml)(*args)  # (the task does not ask for jit; the numbers do not depend on it)
        close(out, f64_moe(tok, rw, Win, Wout), f"moe_layer ({tpd} tokens per device)",
              rtol=1e-4, atol=1e-5)
        soft(laid_out, out, mesh, P("expert"), "moe_layer's output")
        soft(q8_program, ml, args, mesh, T)


def q8_program(ml, args, mesh, T):
    sms = shard_map_eqns(jax.make_jaxpr(ml)(*args).jaxpr)
    need(len(sms) == 1, f"moe_layer has {len(sms)} shard_maps, expected one")
    sm = sms[0]
    need(tuple(sm.params["mesh"].axis_names) == ("expert",), "shard_map not on mesh_expert")
    expect_in_spec(sm, mesh, (T, 16), P("expert"), "tokens")
    expect_in_spec(sm, mesh, (16, 8), P(), "router_weights")
    expect_in_spec(sm, mesh, (8, 16, 32), P("expert"), "W_in")
    expect_in_spec(sm, mesh, (8, 32, 16), P("expert"), "W_out")
    outs = sm.params["out_specs"]
    need(len(outs) == 1 and spec_equiv(outs[0], P("expert"), mesh, 2),
         f"out_specs {outs}, expected rows split over 'expert'")
    found = comms(sm.params["jaxpr"])
    c = [(n, ax, m) for n, ax, m, _, _ in found]
    need([n for n, _, _ in c] == ["all_to_all", "all_to_all"] and
         all(ax == ("expert",) and m == 1 for _, ax, m in c),
         f"moe_layer's collectives are {c}: expected exactly two all_to_all over 'expert'")
    sizes = [int(np.prod(e.invars[0].aval.shape)) for *_, e in found]
    need(sizes == [8 * 2 * 16] * 2,
         f"the all_to_all buffers hold {sizes} numbers per device, expected a buffer of "
         "shape (E, capacity, D) = (8, 2, 16), 256 numbers")


# ----------------------------------------------------------------------------------------------
# Part D: the training script, run as two processes under a recording wrapper
# ----------------------------------------------------------------------------------------------
PD_MODEL = r'''"""Lab 3's regression network, for the training script of Part D."""
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
    """Store a list of (W, b) pairs in the .npz file `path`."""
    arrays = {}
    for i, (W, b) in enumerate(params):
        arrays[f"W{i}"], arrays[f"b{i}"] = np.asarray(W), np.asarray(b)
    np.savez(path, **arrays)
'''

# Runs the student's script as __main__ after patching, in this process, what the task asks
# the script to do, so that the oracle can read what happened: the config it set, what it
# passed to make_array_from_process_local_data, which process saved.
PD_WRAPPER = r'''
import os, pickle, runpy, sys
log_dir, script = sys.argv[1], sys.argv[2]
sys.argv = [script] + sys.argv[3:]
pid = sys.argv[3]
events = []
def record(*event):
    events.append(event)
    with open(os.path.join(log_dir, f"events{pid}.pkl"), "wb") as f:
        pickle.dump(events, f)
import jax
import numpy as np
_update = jax.config.update
def update(name, value):
    record("config", name, value)
    return _update(name, value)
jax.config.update = update
_init = jax.distributed.initialize
def initialize(*a, **k):
    record("initialize", a, k)
    return _init(*a, **k)
jax.distributed.initialize = initialize
_make = jax.make_array_from_process_local_data
def make(sharding, local_data, *a, **k):
    out = _make(sharding, local_data, *a, **k)
    mesh = getattr(sharding, "mesh", None)
    record("make", jax.process_index(), np.array(local_data), type(sharding).__name__,
           None if mesh is None else (tuple(mesh.axis_names), dict(mesh.shape),
                                       sorted(d.id for d in mesh.devices.flat)),
           str(getattr(sharding, "spec", None)), tuple(out.shape),
           sorted(d.id for d in out.sharding.device_set),
           [(s.device.id, s.index[0].start, s.index[0].stop, s.data.shape[0])
            for s in out.addressable_shards] if out.ndim else [],
           sorted(d.id for d in jax.devices()))
    return out
jax.make_array_from_process_local_data = make
_put = jax.device_put
def device_put(x, *a, **k):
    out = _put(x, *a, **k)
    try:
        record("device_put", [(tuple(v.shape), bool(v.sharding.is_fully_replicated),
                               sorted(d.id for d in v.sharding.device_set))
                              for v in jax.tree.leaves(out) if isinstance(v, jax.Array)])
    except Exception as exc:
        record("device_put_error", repr(exc))
    return out
jax.device_put = device_put
class Printed:
    def __init__(self, stream):
        self.stream = stream
    def write(self, text):
        if text:
            record("print", text)
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)
sys.stdout = Printed(sys.stdout)
import pd_model
_save = pd_model.save_params
def save_params(path, params):
    record("save", jax.process_index(), str(path))
    return _save(path, params)
pd_model.save_params = save_params
_savez = np.savez
def savez(*a, **k):
    record("savez", jax.process_index())
    return _savez(*a, **k)
np.savez = savez
runpy.run_path(script, run_name="__main__")
record("done")
'''


def pd_free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pd_make_data(folder, n_rows, seed):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.0, 2.0, size=(n_rows, 1)).astype(np.float32)
    y = (np.sin(6 * x) - 0.5 * x ** 2 + 0.1 * rng.normal(size=x.shape)).astype(np.float32)
    init = {}
    for i, (a, b) in enumerate(zip([1, 64, 64], [64, 64, 1])):
        init[f"W{i}"] = (0.1 * rng.normal(size=(a, b))).astype(np.float32)
        init[f"b{i}"] = (0.1 * rng.normal(size=(b,))).astype(np.float32)
    np.savez(folder / "data.npz", x=x, y=y, **init)
    return x, y, [(init[f"W{i}"], init[f"b{i}"]) for i in range(3)]


def pd_reference(x, y, params):
    """Training on one process (float32 on one device, as pd_train_step does)."""
    mod = types.ModuleType("pd_model_ref")
    exec(PD_MODEL, mod.__dict__)

    @jax.jit
    def step(params, x, y):
        grads = jax.grad(mod.loss)(params, x, y)
        return [(W - mod.STEP_SIZE * dW, b - mod.STEP_SIZE * db)
                for (W, b), (dW, db) in zip(params, grads)]

    dev = DEVICES[0]
    params = jax.device_put(params, dev)
    x, y = jax.device_put(x, dev), jax.device_put(y, dev)
    for _ in range(mod.STEPS):
        params = step(params, x, y)
    return [(np.asarray(W), np.asarray(b)) for W, b in params]


PD_CACHE = {}


def check_q9(ns):
    import pickle
    script = ns["train_script"]
    need(type(script) is str, "train_script is not a string")
    compile(script, "pd_train.py", "exec")
    folder = pathlib.Path(tempfile.mkdtemp(prefix="blind-lab5-q9-"))
    try:
        (folder / "pd_model.py").write_text(PD_MODEL)
        (folder / "pd_train.py").write_text(script)
        (folder / "wrap.py").write_text(PD_WRAPPER)
        n_rows = 96
        x, y, init = pd_make_data(folder, n_rows, seed=9)
        if "ref" not in PD_CACHE:
            PD_CACHE["ref"] = pd_reference(x, y, init)
        ref = PD_CACHE["ref"]
        coord = f"127.0.0.1:{pd_free_port()}"
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS",)}
        env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", PJRT_NPROC="16",
                   PYTHONPATH=str(folder))
        logs = [open(folder / f"out{i}.txt", "w") for i in range(2)]
        procs = [subprocess.Popen([sys.executable, "wrap.py", str(folder), "pd_train.py", coord,
                                   "2", str(i), "data.npz", "params_out.npz"],
                                  cwd=folder, stdout=logs[i], stderr=subprocess.STDOUT, env=env)
                 for i in range(2)]
        deadline = time.monotonic() + 150
        while None in [p.poll() for p in procs] and time.monotonic() < deadline:
            if any(p.returncode for p in procs):
                deadline = min(deadline, time.monotonic() + 5)
            time.sleep(0.1)
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
        codes = [p.returncode for p in procs]
        if any(codes):
            tails = [(folder / f"out{i}.txt").read_text().splitlines()[-3:] for i in range(2)]
            raise Wrong(f"the processes exit with {codes}: {tails}")
        ev = {}
        for i in range(2):
            with open(folder / f"events{i}.pkl", "rb") as f:
                ev[i] = pickle.load(f)
        for i in range(2):
            e = ev[i]
            form(e[-1] == ("done",), f"process {i} did not finish the script")
            conf = {c[1]: c[2] for c in e if c[0] == "config"}
            init_at = [j for j, c in enumerate(e) if c[0] == "initialize"]
            form(init_at, f"process {i} never calls jax.distributed.initialize")
            before = {c[1]: c[2] for c in e[:init_at[0] if init_at else 0] if c[0] == "config"}
            form(before.get("jax_num_cpu_devices") == 4,
                 f"process {i} does not set jax_num_cpu_devices to 4 before initialize ({conf})")
            form(before.get("jax_cpu_collectives_implementation") == "gloo",
                 f"process {i} does not pick the gloo CPU collectives before initialize")
            makes = [c for c in e if c[0] == "make"]
            form(len(makes) == 2, f"process {i} calls make_array_from_process_local_data "
                 f"{len(makes)} times, expected twice (x and y)")
            half = n_rows // 2
            for c, full, nm in zip(makes, (x, y), ("x", "y")):
                _, proc, local, kind, mesh, spec, gshape, gdev, shards, every = c
                form(len(every) == 8, f"the processes see {len(every)} devices in all, not 8")
                form(proc == i, "process index mismatch")
                want = full[i * half:(i + 1) * half]
                form(local.shape == want.shape and np.array_equal(local, want),
                     f"process {i} passes {local.shape[0]} rows of {nm} that are not rows "
                     f"{i * half}..{(i + 1) * half - 1} in order")
                form(gshape == (n_rows, 1), f"global {nm} has shape {gshape}")
                form(gdev == every, f"global {nm} is on devices {gdev}, not all 8 {every}")
                form(mesh is not None and mesh[2] == every and len(mesh[0]) == 1,
                     f"{nm}'s mesh {mesh} is not one 1-D mesh of the 8 devices")
                form(len(shards) == 4 and all(n == n_rows // 8 for *_, n in shards),
                     f"global {nm} is not split over the 8 devices by rows: {shards}")
            every = next((c[-1] for c in makes), None)
            shapes = {tuple(a.shape) for pair in init for a in pair}
            placed = {shp for c in e if c[0] == "device_put" for shp, repl, devs in c[1]
                      if repl and every is not None and devs == every}
            form(shapes <= placed, f"process {i} does not place the parameters replicated on the "
                 "8 devices with jax.device_put(params, NamedSharding(mesh, P()))")
            printed = "".join(c[1] for c in e if c[0] == "print").strip()
            if i > 0:
                form(not printed, f"process {i} prints {printed[:60]!r}: only process 0 may print")
            saves = [c for c in e if c[0] in ("save", "savez")]
            if i == 0:
                form(any(c[0] == "save" for c in saves),
                     "process 0 does not save with pd_model.save_params")
            else:
                form(not saves, "process 1 writes OUT_FILE too: process 0 only must save")
        with np.load(folder / "params_out.npz") as got:
            for k, (W, b) in enumerate(ref):
                for nm, want in ((f"W{k}", W), (f"b{k}", b)):
                    close(got[nm], want.astype(np.float64), f"trained {nm}", rtol=1e-4,
                          atol=1e-5)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


CHECKS = {"q1_mesh_2d": check_q1, "q2_dp_tp_shard_map": check_q2, "q3_stage_params": check_q3,
          "q4_pipeline_forward": check_q4, "q5_pipeline_grad": check_q5, "q6_bubble": check_q6,
          "q7_router": check_q7, "q8_moe_all_to_all": check_q8,
          "q9_multi_process": check_q9}


def judge(question, code):
    """(verdict, numbers right?, why): numbers = every numeric comparison passed."""
    FORM_FAILS.clear()
    try:
        ns = run_answer(BASES[question], code)
        CHECKS[question](ns)
    except Wrong as exc:
        return "wrong", False, str(exc)
    except Exception as exc:  # the answer crashed on the task's inputs
        text = f"{type(exc).__name__}: {exc}".strip().splitlines()
        return "wrong", False, "raised " + (text[0] if text else type(exc).__name__)[:300]
    if FORM_FAILS:
        return "wrong", True, FORM_FAILS[0]
    return "correct", True, ""


def main(selected):
    global BASES
    t0 = time.time()
    BASES = build_bases()
    # with --self-test, the oracle's own reference solutions must pass its checks too
    references = {"q1_mesh_2d": REF_Q1, "q2_dp_tp_shard_map": REF_Q2, "q3_stage_params": REF_Q3,
                  "q4_pipeline_forward": REF_Q4, "q5_pipeline_grad": REF_Q5, "q6_bubble": REF_Q6,
                  "q7_router": REF_Q7, "q8_moe_all_to_all": REF_Q8}
    for q, code in references.items():
        if q in selected and ("--self-test" in sys.argv or "--only-self-test" in sys.argv):
            verdict, _, why = judge(q, code)
            print(f"{q:22s} {'(oracle reference)':36s} label=correct oracle={verdict} "
                  f"{'OK' if verdict == 'correct' else 'MISMATCH ' + why}", flush=True)
    summary, mismatches = {}, 0
    print("question               answer                               label   oracle  agree "
          "numbers  (seconds) first failed requirement")
    for q in selected if "--only-self-test" not in sys.argv else ():
        path = HERE / f"{q}.yaml"
        if not path.exists():
            print(f"{q}: no YAML file")
            continue
        data = yaml.safe_load(path.read_text())
        counts = {"correct": 0, "wrong": 0, "agree": 0, "wrong_numbers_right": 0}
        for label in ("correct", "wrong"):
            for ans in data.get(label) or []:
                t = time.time()
                verdict, numbers, why = judge(q, ans["code"])
                ok = verdict == label
                counts[label] += 1
                counts["agree"] += ok
                counts["wrong_numbers_right"] += label == "wrong" and numbers
                mismatches += not ok
                print(f"{q:22s} {ans['name']:36s} {label:7s} {verdict:7s} "
                      f"{'OK ' if ok else 'MISMATCH'} {'right' if numbers else 'wrong':7s} "
                      f"({time.time() - t:.1f}s) {why}"[:420], flush=True)
        summary[q] = counts
    print("\nSUMMARY (numbers right = wrong answers whose every numeric result is right: only a "
          "check of the method/form catches them)")
    for q, c in summary.items():
        print(f"  {q:22s} correct={c['correct']} wrong={c['wrong']} "
              f"agree={c['agree']}/{c['correct'] + c['wrong']} "
              f"wrong-with-right-numbers={c['wrong_numbers_right']}")
    total = sum(c["correct"] + c["wrong"] for c in summary.values())
    print(f"  all: {total} answers, {mismatches} label/oracle mismatches, "
          f"{time.time() - t0:.0f} s")
    return mismatches


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    sel = [q for q in QUESTIONS if not args or any(a in q for a in args)]
    sys.exit(1 if main(sel) else 0)
