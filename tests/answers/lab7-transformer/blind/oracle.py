"""Blind oracle for lab7-transformer: written from the student notebook's text alone.

Run:  /work/main/.venv/bin/python oracle.py [question ...]
It loads every <question>.yaml beside it, runs each answer's code in a fresh copy of a
namespace that re-creates the notebook's earlier cells (with this file's own reference
solutions for earlier tasks), and judges it against this file's own references and the
method the notebook's text requires.  One line per answer, then a summary.
"""
import os

os.environ.setdefault("PJRT_NPROC", "16")
import ctypes
import ctypes.util

try:
    ctypes.CDLL(ctypes.util.find_library("c")).mallopt(-3, 128 * 1024)
except (OSError, AttributeError, TypeError):
    pass

import jax

jax.config.update("jax_num_cpu_devices", 8)

import contextlib
import functools
import gc
import glob
import io
import math
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from functools import partial
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import yaml
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

warnings.filterwarnings("ignore")
import logging

logging.getLogger("absl").setLevel(logging.ERROR)

HERE = os.path.dirname(os.path.abspath(__file__))
SCRATCH = "/tmp/blind-lab7/oracle-scratch"
os.makedirs(SCRATCH, exist_ok=True)

# ---------------------------------------------------------------------------------------------
# The notebook's earlier cells (copied from the student notebook; prints and plots left out)
# ---------------------------------------------------------------------------------------------
NOTEBOOK_CELLS = r'''
import ctypes
import ctypes.util
import os
import jax
N_DEVICES = 8
devices = jax.devices()
if len(devices) < N_DEVICES:
    devices = jax.devices("cpu")
devices = devices[:N_DEVICES]

import importlib.metadata
import importlib.util
import subprocess
import sys
import contextlib
import functools
import math
import re
import tempfile
import time
from functools import partial
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

MiB = 2**20


def answered(*answers):
    if any(answer is ... for answer in answers):
        print("Skipped: this cell uses your answer to the task above. Fill that in first.")
        return False
    return True


import gc


def free_compiled():
    jax.clear_caches()
    gc.collect()
    try:
        ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


class Config(NamedTuple):
    vocab: int = 64
    d_model: int = 64
    n_heads: int = 4
    d_ff: int = 256
    n_layers: int = 2
    seq: int = 32


def init_params(key, cfg):
    V, D, F, L, S = cfg.vocab, cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.seq
    k = jax.random.split(key, 9)

    def normal(key, shape, scale):
        return scale * jax.random.normal(key, shape)

    return {
        "embed": normal(k[0], (V, D), 0.5), "pos": normal(k[1], (S, D), 0.1),
        "layers": {"wq": normal(k[2], (L, D, D), D**-0.5), "wk": normal(k[3], (L, D, D), D**-0.5),
                   "wv": normal(k[4], (L, D, D), D**-0.5), "wo": normal(k[5], (L, D, D), D**-0.5),
                   "w1": normal(k[6], (L, D, F), D**-0.5), "w2": normal(k[7], (L, F, D), F**-0.5),
                   "norm1": jnp.ones((L, D)), "norm2": jnp.ones((L, D))},
        "norm_f": jnp.ones((D,)), "unembed": normal(k[8], (D, V), D**-0.5),
    }


def rms_norm(x, scale):
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def attention(q, k, v):
    """Causal attention of q, k, v of shape (batch, seq, heads, head_dim)."""
    S, d = q.shape[1], q.shape[3]
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / math.sqrt(d)
    causal = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    return jnp.einsum("bhst,bthd->bshd", weights, v)


def block(x, p, n_heads):
    B, S, D = x.shape
    h = rms_norm(x, p["norm1"])
    q, k, v = [(h @ p[w]).reshape(B, S, n_heads, D // n_heads) for w in ("wq", "wk", "wv")]
    x = x + attention(q, k, v).reshape(B, S, D) @ p["wo"]
    h = rms_norm(x, p["norm2"])
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def forward(params, tokens, n_heads):
    x = params["embed"][tokens] + params["pos"][:tokens.shape[1]]
    x, _ = lax.scan(lambda x, p: (block(x, p, n_heads), None), x, params["layers"])
    return rms_norm(x, params["norm_f"]) @ params["unembed"]


def cross_entropy(logits, targets):
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def loss_fn(params, tokens, n_heads):
    return cross_entropy(forward(params, tokens[:, :-1], n_heads), tokens[:, 1:])


cfg = Config()
params = init_params(jax.random.key(0), cfg)
BATCH = 16
tokens = jax.random.randint(jax.random.key(1), (BATCH, cfg.seq), 0, cfg.vocab)
n_params = sum(x.size for x in jax.tree.leaves(params))

mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto, AxisType.Auto),
                     devices=devices)


def shard(params, specs, mesh):
    return jax.tree.map(lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec)), params,
                        specs, is_leaf=lambda x: isinstance(x, P))


explicit_mesh = jax.make_mesh((4, 2), ("data", "model"), devices=devices)


@contextlib.contextmanager
def remat_disabled():
    saved = jax.checkpoint, jax.remat

    def no_remat(fun=None, **options):
        return fun if fun is not None else (lambda fun: fun)

    jax.checkpoint = jax.remat = no_remat
    try:
        yield
    finally:
        jax.checkpoint, jax.remat = saved


a = jnp.ones((4, 8))

abstract_state = jax.eval_shape(lambda: {"params": init_params(jax.random.key(0), cfg),
                                         "step": jnp.zeros((), jnp.int32)})

small_mesh = jax.make_mesh((2, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                           devices=devices[:4])


def traced_matmul_flops(jaxpr, times=1):
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            total += times * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(
                eqn.invars[0].aval.shape[d] for d in contract)
        inner = times * (eqn.params["length"] if eqn.primitive.name == "scan" else 1)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    total += traced_matmul_flops(sub, inner)
    return total


def collective_ops(compiled, mesh):
    """[(kind, where, over, bytes)] for each collective of a compiled program: `where` is
    'forward loop', 'backward loop' or 'outside the loops' (a loop's body runs once per layer),
    `over` the mesh axes its groups of devices span, `bytes` its result's size on one device."""
    kinds = "all-reduce|all-gather|reduce-scatter|collective-permute|all-to-all"
    computations, name = {}, None
    for line in compiled.as_text().splitlines():
        head = re.match(r"(?:ENTRY )?%(\S+) ", line)
        if head:
            name, computations[head.group(1)] = head.group(1), []
        elif name:
            computations[name].append(line)
    where = {}  # a loop's body, and what it calls, by the direction of its loop
    for lines in computations.values():
        for line in lines:
            loop = re.search(r" while\(.*body=%([\w.\-]+)", line)
            if loop:  # the backward pass's loops are traced under `transpose`
                label = "backward loop" if "transpose(" in line else "forward loop"
                stack = [loop.group(1)]
                while stack:
                    body = stack.pop()
                    if body not in where:
                        where[body] = label
                        for inner in computations.get(body, []):
                            stack += re.findall(r"(?:calls|body|condition|to_apply)=%([\w.\-]+)",
                                                inner)
    sizes = dict(mesh.shape)
    axes_of = {math.prod(sizes[a] for a in axes): " and ".join(f"'{a}'" for a in axes)
               for axes in ([a] for a in reversed(list(sizes)))}
    axes_of.setdefault(mesh.size, " and ".join(f"'{a}'" for a in sizes))
    element = {"f32": 4, "bf16": 2, "s32": 4, "f16": 2, "pred": 1, "s8": 1, "u8": 1, "f64": 8}
    found = []
    for body, lines in computations.items():
        for line in lines:
            op = re.match(rf"\s*(?:ROOT )?%\S+ = (.*?) ({kinds})(?:-start)?\((.*)", line)
            if not op:
                continue
            result, kind, rest = op.groups()
            size = sum(element.get(t, 4) * math.prod(int(n) for n in dims.split(",") if n)
                       for t, dims in re.findall(r"(\w+)\[([\d,]*)\]", result))
            groups = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest)
            named = re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", rest)
            listed = re.search(r"replica_groups=\{\{([\d,]*)\}", rest)
            if groups:
                group = int(groups.group(2))
            elif named:
                mesh_axes = dict(re.findall(r"'(\w+)'=(\d+)", named.group(1)))
                group = math.prod(int(mesh_axes[a]) for a in re.findall(r"'(\w+)'",
                                                                        named.group(2)))
            else:
                group = len(listed.group(1).split(",")) if listed else mesh.size
            found.append((kind, where.get(body, "outside the loops"),
                          axes_of.get(group, f"groups of {group}"), size))
    return found


def show_collectives(title, ops):
    """Print the collectives of `collective_ops`, grouped by loop, kind and axes."""
    print(title)
    for place in ("forward loop", "backward loop", "outside the loops"):
        here = [op for op in ops if op[1] == place]
        if not here:
            continue
        counts = {}
        for kind, _, over, size in here:
            counts.setdefault((kind, over), []).append(size)
        per = ", per layer" if place != "outside the loops" else ""
        print(f"  {place}{per}: " + "; ".join(
            f"{len(sizes)} {kind} over {over} ({sum(sizes):,d} B)"
            for (kind, over), sizes in sorted(counts.items())))

LAYER_COUNTS = (1, 2, 4, 8)
STEPS, N_MICRO = 16, 2
LEARNING_RATE, BETAS, EPS, WEIGHT_DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.01
'''

# ---------------------------------------------------------------------------------------------
# This oracle's own reference solutions (written blind, from the text)
# ---------------------------------------------------------------------------------------------
COLUMNS, ROWS = ("wq", "wk", "wv", "w1"), ("wo", "w2")


def ref_tp_specs(params):
    def spec(path, x):
        keys = [k.key for k in path]
        if keys[0] == "layers" and keys[-1] in COLUMNS:
            return P(None, None, "model")
        if keys[0] == "layers" and keys[-1] in ROWS:
            return P(None, "model", None)
        return P()
    return jax.tree_util.tree_map_with_path(spec, params)


def ref_fsdp_specs(params):
    table = {"embed": P(None, "data"), "pos": P(None, "data"), "unembed": P("data", None)}

    def spec(path, x):
        keys = [k.key for k in path]
        if keys[0] == "layers" and keys[-1] in COLUMNS:
            return P(None, "data", "model")
        if keys[0] == "layers" and keys[-1] in ROWS:
            return P(None, "model", "data")
        if keys[0] == "layers":
            return P()
        return table.get(keys[0], P())
    return jax.tree_util.tree_map_with_path(spec, params)


def _ns_ref(base):
    """Reference solutions that use the notebook's model functions, bound to `base`."""
    rms_norm, attention, block, cross_entropy = (base[n] for n in (
        "rms_norm", "attention", "block", "cross_entropy"))

    def tp_forward(params, tokens, mesh, n_heads):
        def c(x, *spec):
            return lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))

        def body(x, p):
            B, S, D = x.shape
            h = rms_norm(x, p["norm1"])
            q, k, v = [c((h @ p[w]).reshape(B, S, n_heads, D // n_heads), "data", None, "model", None)
                       for w in ("wq", "wk", "wv")]
            x = x + attention(q, k, v).reshape(B, S, D) @ p["wo"]
            h = rms_norm(x, p["norm2"])
            u = c(jax.nn.gelu(h @ p["w1"]), "data", None, "model")
            return c(x + u @ p["w2"], "data", None, None), None

        x = params["embed"][tokens] + params["pos"][:tokens.shape[1]]
        x, _ = lax.scan(body, x, params["layers"])
        return rms_norm(x, params["norm_f"]) @ params["unembed"]

    def fsdp_loss_and_grad(params, tokens, mesh, n_heads):
        tp, fs = ref_tp_specs(params), ref_fsdp_specs(params)

        def c(x, spec):
            return lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

        def loss(params):
            embed, pos, unembed = (c(params[n], P()) for n in ("embed", "pos", "unembed"))
            inputs = tokens[:, :-1]
            x = embed[inputs] + pos[:inputs.shape[1]]

            @jax.checkpoint
            def body(x, p):
                p = {n: c(w, P(*tp["layers"][n][1:])) for n, w in p.items()}
                return block(x, p, n_heads), None

            x, _ = lax.scan(body, x, params["layers"])
            return cross_entropy(rms_norm(x, params["norm_f"]) @ unembed, tokens[:, 1:])

        value, grads = jax.value_and_grad(loss)(params)
        return value, jax.tree.map(c, grads, fs)

    def mm(a, b):
        return jnp.matmul(a.astype(jnp.bfloat16), b.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)

    def mp_attention(q, k, v):
        S, d = q.shape[1], q.shape[3]
        scores = jnp.einsum("bshd,bthd->bhst", q.astype(jnp.bfloat16), k.astype(jnp.bfloat16),
                            preferred_element_type=jnp.float32) / math.sqrt(d)
        causal = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
        return jnp.einsum("bhst,bthd->bshd", weights.astype(jnp.bfloat16), v.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)

    def mp_block(x, p, n_heads, gather=lambda n, w: w):
        B, S, D = x.shape
        h = rms_norm(x, p["norm1"])
        q, k, v = [mm(h, gather(w, p[w])).reshape(B, S, n_heads, D // n_heads)
                   for w in ("wq", "wk", "wv")]
        x = x + mm(mp_attention(q, k, v).reshape(B, S, D), gather("wo", p["wo"]))
        h = rms_norm(x, p["norm2"])
        return x + mm(jax.nn.gelu(mm(h, gather("w1", p["w1"]))), gather("w2", p["w2"]))

    def mp_loss(params, tokens, n_heads):
        inputs = tokens[:, :-1]
        x = params["embed"][inputs] + params["pos"][:inputs.shape[1]]
        x, _ = lax.scan(lambda x, p: (mp_block(x, p, n_heads), None), x, params["layers"])
        return cross_entropy(mm(rms_norm(x, params["norm_f"]), params["unembed"]), tokens[:, 1:])

    def accumulated_loss_and_grad(params, tokens, n_heads, n_micro):
        micro = tokens.reshape(n_micro, -1, tokens.shape[1])

        def body(carry, batch):
            loss, grads = jax.value_and_grad(base["loss_fn"])(params, batch, n_heads)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = lax.scan(body, zeros, micro)
        return loss / n_micro, jax.tree.map(lambda g: g / n_micro, grads)

    def save_state(path, state):
        with ocp.StandardCheckpointer() as checkpointer:
            checkpointer.save(path, state)
            checkpointer.wait_until_finished()

    def restore_state(path, abstract_state, mesh):
        specs = {"params": ref_fsdp_specs(abstract_state["params"]), "step": P()}
        target = jax.tree.map(
            lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec)),
            abstract_state, specs)
        with ocp.StandardCheckpointer() as checkpointer:
            return checkpointer.restore(path, target)

    def step_flops(cfg, batch, seq):
        B, S, D, F, L, V = batch, seq, cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab
        forward_flops = L * (2 * B * S * (4 * D * D + 2 * D * F) + 2 * 2 * B * S * S * D) + 2 * B * S * D * V
        return int(3 * forward_flops)

    def time_step(step, args, repeats):
        jax.block_until_ready(step(*args))
        start = time.perf_counter()
        for _ in range(repeats):
            out = step(*args)
        jax.block_until_ready(out)
        return float((time.perf_counter() - start) / repeats)

    def mfu(flops, seconds, peak_flops_per_s):
        return float(flops / seconds / peak_flops_per_s)

    def composed_loss_and_grad(params, tokens, mesh, n_heads, n_micro):
        tp, fs = ref_tp_specs(params), ref_fsdp_specs(params)

        def c(x, spec):
            return lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

        def gather(name, w):
            return c(w, P(*tp["layers"][name][1:]))

        def micro_loss(params, batch):
            embed, pos, unembed = (c(params[n], P()) for n in ("embed", "pos", "unembed"))
            inputs = batch[:, :-1]
            x = embed[inputs] + pos[:inputs.shape[1]]
            body = jax.checkpoint(lambda x, p: (mp_block(x, p, n_heads, gather), None))
            x, _ = lax.scan(body, x, params["layers"])
            return cross_entropy(mm(rms_norm(x, params["norm_f"]), unembed), batch[:, 1:])

        def step(carry, batch):
            loss, grads = jax.value_and_grad(micro_loss)(params, batch)
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
        (loss, grads), _ = lax.scan(step, zeros, tokens.reshape(n_micro, -1, tokens.shape[1]))
        return loss / n_micro, jax.tree.map(lambda g, s: c(g / n_micro, s), grads, fs)

    return dict(tp_forward=tp_forward, fsdp_loss_and_grad=fsdp_loss_and_grad, mp_loss=mp_loss,
                accumulated_loss_and_grad=accumulated_loss_and_grad, save_state=save_state,
                restore_state=restore_state, step_flops=step_flops, time_step=time_step, mfu=mfu,
                composed_loss_and_grad=composed_loss_and_grad)


def make_base():
    base = {"__name__": "__main__"}
    with contextlib.redirect_stdout(io.StringIO()):
        exec(NOTEBOOK_CELLS, base)
    refs = _ns_ref(base)
    base.update(tp_specs=ref_tp_specs, fsdp_specs=ref_fsdp_specs, **refs)
    m = base["mesh"]
    base["tp_params"] = base["shard"](base["params"], ref_tp_specs(base["params"]), m)
    base["data_tokens"] = jax.device_put(base["tokens"], NamedSharding(m, P("data", None)))
    base["fsdp_params"] = base["shard"](base["params"], ref_fsdp_specs(base["params"]), m)
    return base, refs


BASE, REFS = make_base()
DEVICES = BASE["devices"]
Config = BASE["Config"]
init_params, loss_fn, forward = BASE["init_params"], BASE["loss_fn"], BASE["forward"]
MESH42 = BASE["mesh"]
MESH24 = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=DEVICES)
MESH22 = BASE["small_mesh"]
MESH81 = jax.make_mesh((8, 1), ("data", "model"), axis_types=(AxisType.Auto,) * 2, devices=DEVICES)
CFG_A = Config()  # the notebook's
CFG_B = Config(vocab=40, d_model=32, n_heads=8, d_ff=16, n_layers=3, seq=16)  # d_ff < d_model


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------
free_compiled, shard, cfg = BASE["free_compiled"], BASE["shard"], BASE["cfg"]
MESH = {"4x2": MESH42, "2x4": MESH24, "2x2": MESH22, "8x1": MESH81}
TASK_NAMES = [("q1_tp_specs", ["tp_specs"]), ("q2_tp_forward", ["tp_forward"]),
              ("q3_fsdp_specs", ["fsdp_specs"]), ("q4_fsdp_step", ["fsdp_loss_and_grad"]),
              ("q5_mixed_precision", ["mp_loss"]), ("q6_accumulation", ["accumulated_loss_and_grad"]),
              ("q7_checkpoint", ["save_state", "restore_state"]), ("q8_step_flops", ["step_flops"]),
              ("q9_utilisation", ["time_step", "mfu"]), ("q10_composed_step", ["composed_loss_and_grad"])]


class Fail(Exception):
    pass


def need(cond, msg):
    if not cond:
        raise Fail(msg)


def namespace_for(question):
    """The notebook's namespace just before `question`'s answer cell."""
    ns = dict(BASE)
    later = False
    for q, names in TASK_NAMES:
        if q == question:
            later = True
        if later:
            for n in names:
                ns[n] = ...
    return ns


def same_layout(a, b, ndim, mesh=MESH42):
    return NamedSharding(mesh, a).is_equivalent_to(NamedSharding(mesh, b), ndim)


def pad(spec, ndim):
    s = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(tuple(e) if isinstance(e, list) else e for e in s)


def norm_entry(e):
    if isinstance(e, (tuple, list)):
        e = tuple(e)
        return e[0] if len(e) == 1 else (e if e else None)
    return e


def norm_spec(spec, ndim):
    return tuple(norm_entry(e) for e in pad(spec, ndim))


def walk(jaxpr, scans=0, remat=False):
    """Yield (eqn, number of enclosing scans, under checkpoint)."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    for eqn in jaxpr.eqns:
        yield eqn, scans, remat
        name = eqn.primitive.name
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    yield from walk(sub, scans + (name == "scan"),
                                    remat or name in ("checkpoint", "remat2"))


def constraints(jaxpr, mesh=None):
    """[(shape, normalised spec, scans, remat)] of every sharding_constraint (on `mesh`'s shape)."""
    out = []
    for eqn, scans, remat in walk(jaxpr):
        if eqn.primitive.name == "sharding_constraint":
            aval = eqn.invars[0].aval
            spec = getattr(eqn.params["sharding"], "spec", None)
            m = getattr(eqn.params["sharding"], "mesh", None)
            if mesh is not None and (m is None or dict(m.shape) != dict(mesh.shape)
                                     or list(m.devices.flat) != list(mesh.devices.flat)):
                continue
            if spec is not None:
                out.append((tuple(aval.shape), norm_spec(spec, aval.ndim), scans, remat))
    return out


def dots(jaxpr):
    return [(eqn, scans) for eqn, scans, _ in walk(jaxpr) if eqn.primitive.name == "dot_general"]


def tree_close(a, b, rtol, what):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    need(jax.tree.structure(a) == jax.tree.structure(b), f"{what}: structure differs")
    for x, y in zip(la, lb):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        need(x.shape == y.shape, f"{what}: shape {x.shape} vs {y.shape}")
        err = np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30)
        need(err <= rtol, f"{what}: relative error {err:.2e} > {rtol}")


def grads_layout(grads, params, mesh, specs_fn):
    specs = specs_fn(params)
    for g, s, p in zip(jax.tree.leaves(grads), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
                       jax.tree.leaves(params)):
        need(hasattr(g, "sharding") and g.sharding.is_equivalent_to(NamedSharding(mesh, s), p.ndim),
             f"gradient layout {getattr(g.sharding, 'spec', g.sharding)} != {s}")


def case(cfg_, mesh, batch=16, seed=0):
    p = init_params(jax.random.key(10 + seed), cfg_)
    t = jax.random.randint(jax.random.key(20 + seed), (batch, cfg_.seq), 0, cfg_.vocab)
    return p, t


def ref_value_and_grad(p, t, n_heads):
    return jax.jit(jax.value_and_grad(loss_fn), static_argnums=2)(p, t, n_heads)


def mem(compiled):
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.temp_size_in_bytes


# ---------------------------------------------------------------------------------------------
# Judges: each raises Fail (or any exception) when the answer breaks the text
# ---------------------------------------------------------------------------------------------
SPEC_PARAMS = {}


def check_specs(fn, ref):
    for c in (CFG_A, CFG_B, Config(vocab=16, d_model=48, n_heads=6, d_ff=24, n_layers=1, seq=8)):
        if c not in SPEC_PARAMS:
            SPEC_PARAMS[c] = jax.eval_shape(lambda: init_params(jax.random.key(3), c))
        p = SPEC_PARAMS[c]
        got = fn(p)
        need(isinstance(got, dict), "not a dict")
        want = ref(p)
        need(jax.tree.structure(got, is_leaf=lambda x: isinstance(x, P))
             == jax.tree.structure(want, is_leaf=lambda x: isinstance(x, P)), "structure differs from params")
        for (path, g), w, x in zip(jax.tree_util.tree_flatten_with_path(got, is_leaf=lambda x: isinstance(x, P))[0],
                                   jax.tree.leaves(want, is_leaf=lambda x: isinstance(x, P)),
                                   jax.tree.leaves(p)):
            need(isinstance(g, P), f"{jax.tree_util.keystr(path)} is not a PartitionSpec")
            need(len(tuple(g)) <= x.ndim, f"{jax.tree_util.keystr(path)}: too many entries")
            need(norm_spec(g, x.ndim) == norm_spec(w, x.ndim),
                 f"{jax.tree_util.keystr(path)}: {g} != {w} (config {c})")


def judge_q1(ns):
    check_specs(ns["tp_specs"], ref_tp_specs)


def judge_q3(ns):
    check_specs(ns["fsdp_specs"], ref_fsdp_specs)


def judge_q2(ns):
    f = ns["tp_forward"]
    for c, mname in ((CFG_A, "4x2"), (CFG_B, "2x4")):
        m = MESH[mname]
        p, t = case(c, m)
        tp = shard(p, ref_tp_specs(p), m)
        td = jax.device_put(t, NamedSharding(m, P("data", None)))
        fn = jax.jit(partial(f, mesh=m, n_heads=c.n_heads))
        got = fn(tp, td)
        want = forward(p, t, c.n_heads)
        need(got.shape == want.shape, "logits shape")
        gap = float(jnp.max(jnp.abs(got - want)))
        need(gap < 1e-3, f"logits differ from forward by {gap:.2e} ({mname})")
        cons = [x for x in constraints(jax.make_jaxpr(fn)(tp, td), m) if x[2] >= 1]
        B, S, D, H = t.shape[0], t.shape[1], c.d_model, c.n_heads
        qkv = [x for x in cons if x[0] == (B, S, H, D // H) and x[1] == ("data", None, "model", None)]
        hid = [x for x in cons if x[0] == (B, S, c.d_ff) and x[1] == ("data", None, "model")]
        res = [x for x in cons if x[0] == (B, S, D) and x[1] == ("data", None, None)]
        need(len(qkv) >= 3, f"{len(qkv)} constraints of q/k/v (4-D) to P('data', None, 'model', None) in the scan body")
        need(len(hid) >= 1, "no constraint of the MLP hidden units to P('data', None, 'model') in the scan body")
        need(len(res) >= 1, "no constraint of the residual stream to P('data', None, None) in the scan body")
        free_compiled()


TP_LAYER = {"wq": (None, "model"), "wk": (None, "model"), "wv": (None, "model"), "w1": (None, "model"),
            "wo": ("model", None), "w2": ("model", None)}


def check_fsdp_method(fn, p, t, m, c, tag):
    """The method of Tasks 4 and 10 read from the traced program (jaxpr)."""
    cons = constraints(jax.make_jaxpr(fn)(p, t), m)
    D, F, V, S = c.d_model, c.d_ff, c.vocab, c.seq
    layer_shapes = {"wq": (D, D), "w1": (D, F), "wo": (D, D), "w2": (F, D)}
    for name in ("wq", "w1", "wo", "w2"):
        hits = [x for x in cons if x[2] >= 1 and x[0] == layer_shapes[name] and x[1] == TP_LAYER[name]]
        need(hits, f"no constraint of one layer's {name} to {TP_LAYER[name]} inside the scan's body")
    for what, shape in (("embed", (V, D)), ("unembed", (D, V))):
        need(any(x[0] == shape and x[1] == (None, None) for x in cons),
             f"the {what} table is not constrained to the replicated layout before use")
    need(any(len(x[0]) == 2 and x[0][1] == D and x[0][0] <= S and x[1] == (None, None)
             and x[0] not in ((V, D), (D, V)) or (x[0] == (S, D) and x[1] == (None, None)) for x in cons),
         "the position table is not constrained to the replicated layout before use")


def gathers(compiled, m):
    ops = ns_collective_ops(compiled, m)
    fwd = [o for o in ops if o[0] == "all-gather" and o[1] == "forward loop"]
    bwd = [o for o in ops if o[0] == "all-gather" and o[1] == "backward loop"]
    return fwd, bwd


def ns_collective_ops(compiled, m):
    return BASE["collective_ops"](compiled, m)


def judge_q4(ns):
    f = ns["fsdp_loss_and_grad"]
    for c, mname in ((CFG_A, "4x2"), (CFG_B, "2x4")):
        m = MESH[mname]
        p, t = case(c, m, seed=1)
        fp = shard(p, ref_fsdp_specs(p), m)
        td = jax.device_put(t, NamedSharding(m, P("data", None)))
        fn = jax.jit(partial(f, mesh=m, n_heads=c.n_heads))
        loss, grads = fn(fp, td)
        wl, wg = ref_value_and_grad(p, t, c.n_heads)
        need(abs(float(loss) - float(wl)) <= 1e-4 * abs(float(wl)), f"loss {float(loss)} vs {float(wl)}")
        tree_close(grads, wg, 1e-3, "gradients")
        grads_layout(grads, p, m, ref_fsdp_specs)
        check_fsdp_method(fn, fp, td, m, c, mname)
        compiled = fn.lower(fp, td).compile()
        fwd, bwd = gathers(compiled, m)
        need(fwd, "no all-gather in the forward loop (weights not gathered one layer at a time)")
        need(bwd, "no all-gather in the backward loop: no rematerialisation of the gathered weights")
        if mname == "4x2":
            tp = shard(p, ref_tp_specs(p), m)
            tpc = jax.jit(jax.value_and_grad(partial(loss_fn, n_heads=c.n_heads))).lower(tp, td).compile()
            need(mem(compiled) < mem(tpc), f"memory per device {mem(compiled)} not below TP's {mem(tpc)}")
        free_compiled()


def check_mp_dots(jaxpr, training=False):
    """Every product bf16 x bf16 accumulated in f32.  In a traced training step (value and
    gradient) the backward products multiply a float32 cotangent by a bf16 operand: there only
    products with no bf16 operand at all are refused, and at least 9 forward bf16 products
    (7 per layer in the scan's body + the unembedding) must be present."""
    ds = dots(jaxpr)
    need(ds, "no matrix products")
    for eqn, _ in ds:
        ins = [v.aval.dtype for v in eqn.invars]
        if training:
            need(any(d == jnp.bfloat16 for d in ins), f"a dot_general with operands {ins}")
        else:
            need(all(d == jnp.bfloat16 for d in ins), f"a dot_general with operands {ins}")
        need(eqn.params.get("preferred_element_type") == jnp.float32 and eqn.outvars[0].aval.dtype == jnp.float32,
             f"a dot_general accumulating in {eqn.params.get('preferred_element_type')}")
    SHAPE_OPS = {"convert_element_type", "dot_general", "reshape", "transpose", "squeeze", "expand_dims",
                 "broadcast_in_dim", "slice", "dynamic_slice", "concatenate", "copy", "copy_p",
                 "sharding_constraint", "pjit", "jit", "scan", "checkpoint", "remat2",
                 "reduce_precision", "dynamic_update_slice", "gather", "pad"}
    for eqn, _, _ in walk(jaxpr):
        if eqn.primitive.name in SHAPE_OPS:
            continue
        for v in eqn.outvars:
            need(getattr(v.aval, "dtype", None) != jnp.bfloat16,
                 f"{eqn.primitive.name} computes in bfloat16 (only the products' operands may be bfloat16)")
    if training:
        full = [e for e, _ in ds if all(v.aval.dtype == jnp.bfloat16 for v in e.invars)]
        need(len(full) >= 9, f"only {len(full)} products with bfloat16 operands")


def judge_q5(ns):
    f = ns["mp_loss"]
    for c in (CFG_A, CFG_B):
        p, t = case(c, None, seed=2)
        val, g = jax.jit(jax.value_and_grad(f), static_argnums=2)(p, t, c.n_heads)
        wl, wg = ref_value_and_grad(p, t, c.n_heads)
        need(val.dtype == jnp.float32, f"loss dtype {val.dtype}")
        need(abs(float(val) - float(wl)) <= 0.02 * abs(float(wl)), "loss not within 2%")
        need(all(x.dtype == jnp.float32 for x in jax.tree.leaves(g)), "gradients not float32")
        tree_close(g, wg, 0.10, "gradients")
        jp = jax.make_jaxpr(partial(f, n_heads=c.n_heads))(p, t)
        need(all(v.aval.dtype == jnp.float32 for v in jp.jaxpr.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)),
             "params not float32")
        check_mp_dots(jp)
        nd = len(dots(jp))
        need(nd >= 9, f"only {nd} matrix products traced")
        free_compiled()


def standin_loss(real):
    """loss_fn plus a term that depends on which rows each microbatch starts with."""
    def loss_fn(params, tokens, n_heads):
        return real(params, tokens, n_heads) + 1e-2 * tokens[0, 0].astype(jnp.float32)
    return loss_fn


def judge_q6(ns):
    real = ns["loss_fn"]
    for c, n_micro in ((CFG_A, 1), (CFG_A, 4), (CFG_B, 8), (CFG_B, 2)):
        p, t = case(c, None, seed=3)
        fn = jax.jit(partial(ns["accumulated_loss_and_grad"], n_heads=c.n_heads, n_micro=n_micro))
        loss, grads = fn(p, t)
        wl, wg = jax.jit(jax.value_and_grad(real), static_argnums=2)(p, t, c.n_heads)
        need(jnp.asarray(loss).dtype == jnp.float32, "loss not float32")
        need(all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads)), "gradients not float32")
        need(abs(float(loss) - float(wl)) <= 1e-4 * abs(float(wl)), f"loss {float(loss)} vs {float(wl)} (n_micro={n_micro})")
        tree_close(grads, wg, 1e-4, f"gradients (n_micro={n_micro})")
        if n_micro > 1:
            jp = jax.make_jaxpr(fn)(p, t)
            outer = [e for e, s, _ in walk(jp) if e.primitive.name == "scan" and e.params["length"] == n_micro
                     and any(x.primitive.name == "scan" for x, _, _ in walk(e.params["jaxpr"]))]
            need(outer, f"no lax.scan of length {n_micro} over the microbatches")
    # consecutive rows: a stand-in loss_fn whose value depends on each microbatch's first row
    stand = standin_loss(real)
    ns["loss_fn"] = stand
    try:
        p, t = case(CFG_A, None, seed=4)
        loss, _ = jax.jit(partial(ns["accumulated_loss_and_grad"], n_heads=CFG_A.n_heads, n_micro=4))(p, t)
        ref = np.mean([float(stand(p, t[i * 4:(i + 1) * 4], CFG_A.n_heads)) for i in range(4)])
        need(abs(float(loss) - ref) < 1e-4, "microbatches are not consecutive rows of tokens (or loss_fn not used)")
    finally:
        ns["loss_fn"] = real
    big = jax.ShapeDtypeStruct((64, cfg.seq), jnp.int32)
    full = jax.jit(jax.value_and_grad(partial(real, n_heads=cfg.n_heads))).lower(params_a, big).compile()
    micro = jax.jit(partial(ns["accumulated_loss_and_grad"], n_heads=cfg.n_heads, n_micro=8)).lower(params_a, big).compile()
    ft, mt = full.memory_analysis().temp_size_in_bytes, micro.memory_analysis().temp_size_in_bytes
    need(mt < ft / 2, f"temporaries {mt} not below half of {ft}")
    free_compiled()


params_a = BASE["params"]

RESTORE_TARGETS = []
_std_restore = ocp.StandardCheckpointHandler.restore


def _recording_restore(self, directory, args=None, *a, **k):
    RESTORE_TARGETS.append(getattr(args, "item", None))
    return _std_restore(self, directory, *a, args=args, **k)


ocp.StandardCheckpointHandler.restore = _recording_restore


def fresh_dir(tag):
    d = tempfile.mkdtemp(dir=SCRATCH)
    return os.path.join(d, tag)


def judge_q7(ns):
    save_state, restore_state = ns["save_state"], ns["restore_state"]
    # save: sharded arrays as laid out, finished on return
    for c, mname in ((CFG_A, "4x2"), (CFG_B, "2x4")):
        m = MESH[mname]
        p, _ = case(c, m, seed=5)
        state = {"params": shard(p, ref_fsdp_specs(p), m), "step": jnp.array(7, jnp.int32)}
        path = fresh_dir("save")
        save_state(path, state)
        need(os.path.isdir(path) and not glob.glob(path + "*tmp*"), "checkpoint not finished when save_state returned")
        with ocp.StandardCheckpointer() as ck:
            md = ck.metadata(path)
            md = getattr(md, "item_metadata", md)
            for name in ("wq", "w2", "w1"):
                info, arr = md["params"]["layers"][name], state["params"]["layers"][name]
                need(info.sharding is not None, f"no sharding recorded for {name}: saved from the host")
                need(tuple(info.storage.chunk_shape) == tuple(arr.sharding.shard_shape(arr.shape)),
                     f"{name} chunks {info.storage.chunk_shape} are not one device's block")
            abstract = jax.eval_shape(lambda: state)
            target = jax.tree.map(lambda s, x: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=x.sharding),
                                  abstract, state)
            back = ck.restore(path, target)
        tree_close(back["params"], p, 0, "saved parameters")
        need(int(back["step"]) == 7, "saved step")
    # restore: Orbax-written checkpoints, onto 2x2 and 8x1, straight into the fsdp layout
    for c, mname in ((CFG_A, "2x2"), (CFG_B, "8x1"), (CFG_A, "8x1")):
        m = MESH[mname]
        p, _ = case(c, m, seed=6)
        state = {"params": shard(p, ref_fsdp_specs(p), MESH42), "step": jnp.array(3, jnp.int32)}
        path = fresh_dir("orbax")
        with ocp.StandardCheckpointer() as ck:
            ck.save(path, state)
            ck.wait_until_finished()
        abstract = jax.eval_shape(lambda: {"params": init_params(jax.random.key(0), c), "step": jnp.zeros((), jnp.int32)})
        RESTORE_TARGETS.clear()
        moves = []
        saved_put = jax.device_put

        def counting_put(*a, **k):
            if sys._getframe(1).f_code.co_filename == "<string>":  # called from the answer's code
                moves.append(1)
            return saved_put(*a, **k)

        jax.device_put = counting_put
        try:
            got = restore_state(path, abstract, m)
        finally:
            jax.device_put = saved_put
        need(not moves, "arrays moved with jax.device_put after/around the restore")
        need(RESTORE_TARGETS and RESTORE_TARGETS[-1] is not None, "Orbax not given a target")
        specs = {"params": ref_fsdp_specs(abstract["params"]), "step": P()}
        for t_, s_, a_ in zip(jax.tree.leaves(RESTORE_TARGETS[-1]), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
                              jax.tree.leaves(abstract)):
            sh = getattr(t_, "sharding", None)
            need(sh is not None and sh.is_equivalent_to(NamedSharding(m, s_), len(a_.shape)),
                 f"restore target sharding {sh} is not {s_} on the given mesh")
        for g_, s_, a_ in zip(jax.tree.leaves(got), jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)),
                              jax.tree.leaves(abstract)):
            need(isinstance(g_, jax.Array) and g_.sharding.is_equivalent_to(NamedSharding(m, s_), len(a_.shape)),
                 f"restored layout {getattr(g_, 'sharding', None)} is not {s_} on {mname}")
        tree_close(got["params"], p, 0, "restored parameters")
        need(int(got["step"]) == 3, "restored step")
    free_compiled()


def ref_flops(c, B, S):
    D, F, L, V = c.d_model, c.d_ff, c.n_layers, c.vocab
    return 3 * (L * (2 * B * S * (4 * D * D + 2 * D * F) + 2 * 2 * B * S * S * D) + 2 * B * S * D * V)


def judge_q8(ns):
    f = ns["step_flops"]
    for c, B, S in ((CFG_A, 16, 31), (CFG_B, 8, 12), (Config(vocab=1000, d_model=96, n_heads=3, d_ff=40, n_layers=5, seq=64), 3, 64),
                    (Config(), 2, 100)):
        got = f(c, B, S)
        need(type(got) is int, f"returns {type(got).__name__}, not int")
        need(got == ref_flops(c, B, S), f"{got} != {ref_flops(c, B, S)} for {c}, {B}, {S}")


class FakeClock:
    """A stand-in step: compiles (synchronously) on the first call, then queues work."""

    def __init__(self, compile_s, first_s, works, tuple_out):
        self.compile_s, self.first_s, self.works, self.tuple_out = compile_s, first_s, list(works), tuple_out
        self.busy_until, self.calls = 0.0, 0

    def __call__(self, *args):
        now = time.perf_counter()
        if self.calls == 0:
            time.sleep(self.compile_s)
            now = time.perf_counter()
            w = self.first_s
        else:
            w = self.works[(self.calls - 1) % len(self.works)]
        self.calls += 1
        self.busy_until = max(now, self.busy_until) + w
        out = FakeResult(self.busy_until)
        return (out, FakeResult(self.busy_until)) if self.tuple_out else out


class FakeResult:
    def __init__(self, done):
        self.done = done

    def block_until_ready(self):
        time.sleep(max(0.0, self.done - time.perf_counter()))
        return self


class CountingTime:
    def __init__(self):
        self.count = 0

    def perf_counter(self):
        self.count += 1
        return time.perf_counter()

    def __getattr__(self, name):
        return getattr(time, name)


def judge_q9(ns):
    clock = CountingTime()
    ns["time"] = clock
    works = [0.02, 0.02, 0.02, 0.14]
    for tuple_out, repeats in ((False, 4), (True, 4)):
        step = FakeClock(0.4, 0.4, works, tuple_out)
        before = clock.count
        got = ns["time_step"](step, (1, 2), repeats)
        need(type(got) is float, f"time_step returns {type(got).__name__}")
        need(clock.count - before >= 2, "time.perf_counter not used")
        need(step.calls == repeats + 1, f"{step.calls} calls for {repeats} repeats")
        want = sum(works[:repeats]) / repeats
        need(abs(got - want) <= 0.25 * want, f"time_step {got:.4f}s, expected the mean {want:.4f}s")
    mfu = ns["mfu"]
    for f_, s_, p_ in ((1e12, 0.5, 4e12), (3e9, 0.01, 1e12), (7, 2.0, 10.0)):
        got = mfu(f_, s_, p_)
        need(type(got) is float, f"mfu returns {type(got).__name__}")
        need(abs(got - f_ / s_ / p_) <= 1e-9 * (f_ / s_ / p_), f"mfu {got} != {f_ / s_ / p_}")


def judge_q10(ns):
    f = ns["composed_loss_and_grad"]
    for c, mname, n_micro in ((CFG_A, "2x4", 2), (CFG_B, "4x2", 4), (CFG_A, "4x2", 1)):
        m = MESH[mname]
        p, t = case(c, m, seed=7)
        fp = shard(p, ref_fsdp_specs(p), m)
        td = jax.device_put(t, NamedSharding(m, P("data", None)))
        fn = jax.jit(partial(f, mesh=m, n_heads=c.n_heads, n_micro=n_micro))
        loss, grads = fn(fp, td)
        wl, wg = ref_value_and_grad(p, t, c.n_heads)
        need(jnp.asarray(loss).dtype == jnp.float32, "loss not float32")
        need(abs(float(loss) - float(wl)) <= 0.02 * abs(float(wl)), f"loss {float(loss)} vs {float(wl)}")
        need(all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads)), "gradients not float32")
        tree_close(grads, wg, 0.10, "gradients")
        grads_layout(grads, p, m, ref_fsdp_specs)
        check_fsdp_method(fn, fp, td, m, c, mname)
        jp = jax.make_jaxpr(fn)(fp, td)
        need(all(v.aval.dtype == jnp.float32 for v in jp.jaxpr.invars if jnp.issubdtype(v.aval.dtype, jnp.floating)),
             "params not float32")
        check_mp_dots(jp, training=True)
        if n_micro > 1:
            outer = [e for e, s, _ in walk(jp) if e.primitive.name == "scan" and e.params["length"] == n_micro
                     and any(x.primitive.name == "scan" for x, _, _ in walk(e.params["jaxpr"]))]
            need(outer, f"no lax.scan of length {n_micro} over the microbatches")
            compiled = fn.lower(fp, td).compile()
            fwd, bwd = gathers(compiled, m)
            need(fwd, "no all-gather in a forward loop")
            need(bwd, "no all-gather in the backward loop: no rematerialisation")
        free_compiled()


JUDGES = {q: globals()["judge_" + q.split("_")[0]] for q, _ in TASK_NAMES}


# ---------------------------------------------------------------------------------------------
# Runner
# ---------------------------------------------------------------------------------------------
def notebook_text():
    import json
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "..", "..", "student", "lab7-transformer", "lab7-transformer.ipynb")
    if not os.path.exists(path):
        path = "/work/main/student/lab7-transformer/lab7-transformer.ipynb"
    nb = json.load(open(path))
    text = " ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    return " ".join(text.split())


def run(questions):
    text = notebook_text()
    bad, total = [], 0
    for q in questions:
        data = yaml.safe_load(open(os.path.join(HERE, q + ".yaml")))
        assert set(data) == {"correct", "wrong"}, q
        names = [a["name"] for a in data["correct"] + data["wrong"]]
        assert len(names) == len(set(names)), f"{q}: duplicate names"
        for label in ("correct", "wrong"):
            for ans in data[label]:
                total += 1
                t0 = time.time()
                sentence_ok = " ".join(ans["sentence"].split()) in text
                ns = namespace_for(q)
                try:
                    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                        warnings.simplefilter("ignore")
                        exec(ans["code"], ns)
                        for n in dict(TASK_NAMES)[q]:
                            need(ns.get(n, ...) is not ..., f"{n} not defined")
                        JUDGES[q](ns)
                    verdict, why = "correct", "passes"
                except Fail as e:
                    verdict, why = "wrong", str(e)
                except Exception as e:  # noqa: BLE001
                    verdict, why = "wrong", f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
                if q not in ("q1_tp_specs", "q3_fsdp_specs", "q8_step_flops", "q9_utilisation"):
                    free_compiled()
                agree = verdict == label and sentence_ok
                if not agree:
                    bad.append((q, ans["name"]))
                print(f"{'OK ' if agree else 'BAD'} {q:20s} {label:7s} {ans['name']:36s} -> {verdict:7s}"
                      f"{'' if sentence_ok else ' [SENTENCE NOT FOUND]'} ({time.time() - t0:.1f}s) {why}", flush=True)
    print(f"SUMMARY: {total - len(bad)}/{total} labels confirmed, {len(bad)} disagreements"
          + (": " + ", ".join(f"{q}/{n}" for q, n in bad) if bad else ""))
    return not bad


if __name__ == "__main__":
    qs = sys.argv[1:] or [q for q, _ in TASK_NAMES]
    start = time.time()
    ok = run(qs)
    print(f"run time {time.time() - start:.0f}s")
    sys.exit(0 if ok else 1)
