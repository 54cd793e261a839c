"""Hidden checks of Lab 7 (shipped only in the autograder zip, as ``jaxlab_lab7.py``).

Same design as Labs 3-6: a probe runs in the student's kernel, calls the student's functions on
fresh random parameters and tokens of other sizes (other layer counts, widths, heads, batches)
on the meshes the tasks name, and records as plain data the results, their shardings, the
traced program (``jax.make_jaxpr``: sharding constraints, dtypes of the matrix products, scans)
and what the compiled program says (argument and temporary bytes, collectives). A verdict judges
that data only.

References: the forward pass (q2) is recomputed in float64 NumPy in the verdict from the lab's
recipe; losses and gradients (q4-q6) come from this module's own copy of the lab's model, run by
the probe in float32 on one device (a float64 backward pass of a transformer in NumPy would be a
second model to keep in step). ``tests/test_checks_lab7.py`` checks that copy against the
notebook's cells. Checkpoints (q7) are read and written with Orbax itself, each direction
against the student's function. Step timing (q9) is checked on fake steps whose compilation and
queued work take known times.

Parts: A (q1, q2: tensor parallelism), B (q3, q4: FSDP), C (q5, q6: mixed precision,
accumulation), D (q7: checkpoints), E (q8, q9: FLOPs and utilisation).
"""

import contextlib
import functools
import io
import math
import os
import re
import tempfile
import time
from typing import NamedTuple

import numpy as np

try:
    from . import form
except ImportError:  # in the autograder the checks are flat modules beside the notebook
    import jaxlab_form as form

# logits through a few float32 layers, against float64
RTOL = 1e-3
ATOL = 1e-4
# losses and gradients of the same float32 model computed in another order or layout
GRAD_RTOL = 1e-3
GRAD_ATOL = 1e-5
# mixed precision, as the task states it
# (the solution, per parameter, on the fixed sizes: median 1.3%, 99th percentile 3.3%, worst 3.8% of
# 200 cases, and once above 5% in a whole suite's run, on the attention's small wk gradient,
# where bfloat16 rounding of the weights meets cancellation in the softmax's derivative)
MP_LOSS_RTOL = 0.02
MP_GRAD_RELATIVE = 0.10
N_DEVICES = 8

_rng = form.fresh_rng
_error = form.student_error
_fail = form.fail
_label = form.label


def _devices(count=N_DEVICES):
    return form.check_devices(count)


def _quiet(fn, *args, **kwargs):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args, **kwargs)


# =========================================================================== the lab's model
class Config(NamedTuple):
    vocab: int
    d_model: int
    n_heads: int
    d_ff: int
    n_layers: int
    seq: int


LAYER_NAMES = ("wq", "wk", "wv", "wo", "w1", "w2", "norm1", "norm2")
COLUMNS = ("wq", "wk", "wv", "w1")  # split by columns over `model`
ROWS = ("wo", "w2")  # split by rows over `model`


def _fresh_params(rng, cfg):
    """Parameters of the lab's layout as NumPy float32 (the norms' scales near 1, not 1)."""
    V, D, F, L, S = cfg.vocab, cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.seq

    def normal(shape, scale):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    layers = {w: normal((L, D, D), D**-0.5) for w in ("wq", "wk", "wv", "wo")}
    layers.update(w1=normal((L, D, F), D**-0.5), w2=normal((L, F, D), F**-0.5),
                  norm1=(1 + 0.1 * rng.standard_normal((L, D))).astype(np.float32),
                  norm2=(1 + 0.1 * rng.standard_normal((L, D))).astype(np.float32))
    return {"embed": normal((V, D), 0.5), "pos": normal((S, D), 0.1), "layers": layers,
            "norm_f": (1 + 0.1 * rng.standard_normal(D)).astype(np.float32),
            "unembed": normal((D, V), D**-0.5)}


def _fresh_tokens(rng, cfg, batch, seq):
    return rng.integers(0, cfg.vocab, (batch, seq)).astype(np.int32)


# the lab's recipe in JAX (the reference for losses and gradients): the notebook's cells
def _rms_norm(x, scale):
    from jax import lax
    import jax.numpy as jnp

    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _attention(q, k, v):
    import jax
    import jax.numpy as jnp

    S, d = q.shape[1], q.shape[3]
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / math.sqrt(d)
    causal = jnp.arange(S)[:, None] >= jnp.arange(S)[None, :]
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e30), axis=-1)
    return jnp.einsum("bhst,bthd->bshd", weights, v)


def _block(x, p, n_heads):
    import jax

    B, S, D = x.shape
    h = _rms_norm(x, p["norm1"])
    q, k, v = [(h @ p[w]).reshape(B, S, n_heads, D // n_heads) for w in ("wq", "wk", "wv")]
    x = x + _attention(q, k, v).reshape(B, S, D) @ p["wo"]
    h = _rms_norm(x, p["norm2"])
    return x + jax.nn.gelu(h @ p["w1"]) @ p["w2"]


def _forward(params, tokens, n_heads):
    from jax import lax

    x = params["embed"][tokens] + params["pos"][:tokens.shape[1]]
    x, _ = lax.scan(lambda x, p: (_block(x, p, n_heads), None), x, params["layers"])
    return _rms_norm(x, params["norm_f"]) @ params["unembed"]


def _loss(params, tokens, n_heads):
    import jax
    import jax.numpy as jnp

    logits = _forward(params, tokens[:, :-1], n_heads)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def _reference_loss_and_grad(params, tokens, n_heads):
    """The lab's loss and gradient, float32, on one device, as NumPy."""
    import jax

    loss, grads = jax.jit(jax.value_and_grad(_loss), static_argnums=2)(params, tokens, n_heads)
    return float(loss), jax.tree.map(np.asarray, grads)


# float64 NumPy forward for q2
def _np_rms(x, scale):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _np_gelu(x):  # jax.nn.gelu's default (tanh) form
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def _np_forward(params, tokens, n_heads):
    p64 = _tree_map(lambda a: np.asarray(a, np.float64), params)
    B, S = tokens.shape
    x = p64["embed"][tokens] + p64["pos"][:S]
    D = x.shape[-1]
    dh = D // n_heads
    causal = np.arange(S)[:, None] >= np.arange(S)[None, :]
    for i in range(p64["layers"]["wq"].shape[0]):
        p = {k: v[i] for k, v in p64["layers"].items()}
        h = _np_rms(x, p["norm1"])
        q, k, v = [(h @ p[w]).reshape(B, S, n_heads, dh) for w in ("wq", "wk", "wv")]
        scores = np.einsum("bshd,bthd->bhst", q, k) / np.sqrt(dh)
        scores = np.where(causal, scores, -np.inf)
        w = np.exp(scores - scores.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        x = x + np.einsum("bhst,bthd->bshd", w, v).reshape(B, S, D) @ p["wo"]
        h = _np_rms(x, p["norm2"])
        x = x + _np_gelu(h @ p["w1"]) @ p["w2"]
    return _np_rms(x, p64["norm_f"]) @ p64["unembed"]


def _tree_map(fn, tree):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    return fn(tree)


def _leaves(tree, prefix=()):
    """(path, leaf) pairs of a dict tree, in sorted key order."""
    if isinstance(tree, dict):
        return [pair for k in sorted(tree) for pair in _leaves(tree[k], prefix + (k,))]
    return [(prefix, tree)]


def _path_words(path):
    return "".join(f"[{k!r}]" for k in path)


# =========================================================================== layouts
def _tp_spec(path):
    name = path[-1]
    if path[0] == "layers" and name in COLUMNS:
        return (None, None, "model")
    if path[0] == "layers" and name in ROWS:
        return (None, "model")
    return ()


def _fsdp_spec(path):
    name = path[-1]
    if path[0] == "layers" and name in COLUMNS:
        return (None, "data", "model")
    if path[0] == "layers" and name in ROWS:
        return (None, "model", "data")
    return {"embed": (None, "data"), "pos": (None, "data"), "unembed": ("data",)}.get(name, ())


def _canonical(entries):
    """A spec's entries without its trailing Nones (P('a', None) lays out like P('a'))."""
    entries = [tuple(e) if isinstance(e, list) and len(e) != 1 else
               (e[0] if isinstance(e, list) else e) for e in entries]
    while entries and entries[-1] is None:
        entries.pop()
    return tuple(entries)


def _specs_tree(params, spec_of):
    from jax.sharding import PartitionSpec as P

    return {k: (_specs_tree(v, lambda p, k=k: spec_of((k,) + p)) if isinstance(v, dict)
                else P(*spec_of((k,)))) for k, v in params.items()}


def _shard(params, mesh, spec_of):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return {k: (_shard(v, mesh, lambda p, k=k: spec_of((k,) + p)) if isinstance(v, dict)
                else jax.device_put(v, NamedSharding(mesh, P(*spec_of((k,))))))
            for k, v in params.items()}


def _mesh(shape, count=N_DEVICES):
    import jax
    from jax.sharding import AxisType

    return jax.make_mesh(shape, ("data", "model"), axis_types=(AxisType.Auto,) * 2,
                         devices=_devices(count))


def _put(value, mesh, *spec):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.device_put(value, NamedSharding(mesh, P(*spec)))


def _flat(ev):
    """{path of keys: evidence} of the leaves of a dict tree's evidence (a non-dict: path ())."""
    flat = {}

    def walk(node, path):
        if node["kind"] == "dict":
            for key, value in node["items"]:
                walk(value, path + (key.get("value", repr(key)),))
        else:
            flat[path] = node

    walk(ev, ())
    return flat


def _spec_tree_evidence(tree):
    """{"a/b": evidence} of a returned tree of PartitionSpecs, or what else is there."""
    return {"/".join(map(str, path)): leaf for path, leaf in _flat(form.evidence(tree)).items()}


def _specs_verdict(name, ev, spec_of, layout_words):
    for case in ev["fresh"]:
        call = f"{name}(params)"
        if "error" in case:
            _fail(f"`{call}` raised {case['error']} {case['words']}; it should work for any "
                  "config.")
        got = case["specs"]
        if "" in got:
            _fail(f"`{call}` returned {form.describe(got[''])}; expected a dict of the "
                  "structure of `params` whose leaves are PartitionSpecs.")
        wanted = {"/".join(path): spec_of(path) for path, _ in _leaves(case["structure"])}
        missing = sorted(set(wanted) - set(got))
        extra = sorted(set(got) - set(wanted))
        if missing or extra:
            _fail(f"`{call}` {case['words']} has the keys {sorted(got)}; expected those of "
                  f"`params`, {sorted(wanted)} (missing: {missing or 'none'}, extra: "
                  f"{extra or 'none'}).")
        for key in sorted(wanted):
            leaf, path = got[key], tuple(key.split("/"))
            if leaf["kind"] != "spec":
                _fail(f"`{call}{_path_words(path)}` is {form.describe(leaf)}; expected a "
                      f"PartitionSpec.")
            if _canonical(leaf["entries"]) != _canonical(list(wanted[key])):
                _fail(f"`{call}{_path_words(path)}` is {form.spec_repr(leaf['entries'])}; "
                      f"expected {form.spec_repr(list(wanted[key]))} "
                      f"({layout_words(path)}).")


def _tp_words(path):
    name = path[-1]
    if path[0] == "layers" and name in COLUMNS:
        return f"{name} is split by its columns (output dimension) over 'model'"
    if path[0] == "layers" and name in ROWS:
        return f"{name} is split by its rows (input dimension) over 'model'"
    return f"{name} is replicated"


def _fsdp_words(path):
    name = path[-1]
    if path[0] == "layers" and name in COLUMNS:
        return f"{name}: rows over 'data', columns over 'model'"
    if path[0] == "layers" and name in ROWS:
        return f"{name}: rows over 'model', columns over 'data'"
    return {"embed": "embed is split by its columns over 'data'",
            "pos": "pos is split by its columns over 'data'",
            "unembed": "unembed is split by its rows over 'data'"}.get(
        name, f"{name} is replicated")


# The sizes of each compiled case are drawn once, from SIZE_SEED (other sizes than the
# notebook's, several per question); the values are fresh on every grading. Fixed sizes mean
# every grading compiles the same programs, which JAX's persistent cache (warmed by the
# solution in `jaxlab grade` and in the corpus) then serves: drawn afresh, every answer of the
# corpus compiled every probe again (about 35 s per answer).
SIZE_SEED = 7


def _sizes(case):
    """The generator of case ``case``'s sizes: the same draws on every grading."""
    return np.random.default_rng([SIZE_SEED, case])


def _fresh_config(rng, model=2, data=4, **fixed):
    heads = model * int(rng.integers(1, 3))
    cfg = dict(vocab=data * int(rng.integers(5, 9)), d_model=heads * int(rng.integers(2, 4)) * data,
               n_heads=heads, d_ff=model * data * int(rng.integers(3, 6)),
               n_layers=int(rng.integers(1, 4)), seq=data * int(rng.integers(2, 4)))
    cfg.update(fixed)
    return Config(**cfg)


def _cfg_words(cfg, batch=None):
    words = (f"{_count(cfg.n_layers, 'layer')}, d_model {cfg.d_model}, {_count(cfg.n_heads, 'head')}, "
             f"d_ff {cfg.d_ff}, vocab {cfg.vocab}")
    return f"for {words}" + (f", batch {batch}" if batch is not None else "")


def _count(n, thing):
    plural = "es" if thing.endswith(("ch", "sh", "s", "x")) else "s"
    return f"{n} {thing}" + ("" if n == 1 else plural)


# ---- q1, q3: the specs
SPEC_LAYERS = (1, 3)  # the layer counts of the fresh configs (other widths each time)


class MeshShape(NamedTuple):
    data: int
    model: int


def _probe_specs(name):
    def probe(values):
        fn = values.get(name)
        ev = form.evidence_of({name: fn})
        if not callable(fn):
            return ev
        rng = _rng()
        ev["fresh"] = []
        for layers in SPEC_LAYERS:
            cfg = _fresh_config(rng, n_layers=layers)
            params = _fresh_params(rng, cfg)
            case = {"words": _cfg_words(cfg), "structure": _tree_map(lambda a: 0, params)}
            try:
                case["specs"] = _spec_tree_evidence(_quiet(fn, params))
            except Exception as exc:
                case["error"] = _error(exc)
            ev["fresh"].append(case)
        return ev

    return probe


def _q1(ev):
    form.expect_callable("tp_specs", ev["tp_specs"])
    _specs_verdict("tp_specs", ev, _tp_spec, _tp_words)


def _q3(ev):
    form.expect_callable("fsdp_specs", ev["fsdp_specs"])
    _specs_verdict("fsdp_specs", ev, _fsdp_spec, _fsdp_words)


# =========================================================================== programs
def _walk(jaxpr, scans, steps):
    """Every equation of ``jaxpr`` and the jaxprs nested in it, with the scans (their lengths,
    outermost first) it runs inside."""
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        step = {"prim": name, "scans": list(scans),
                "in": [[int(n) for n in getattr(v.aval, "shape", ())] for v in eqn.invars],
                "in_dtypes": [str(getattr(v.aval, "dtype", "")) for v in eqn.invars],
                "out": [[int(n) for n in getattr(v.aval, "shape", ())] for v in eqn.outvars],
                "out_dtypes": [str(getattr(v.aval, "dtype", "")) for v in eqn.outvars]}
        if name == "sharding_constraint":
            sharding = eqn.params.get("sharding")
            spec = getattr(sharding, "spec", None)
            step["spec"] = None if spec is None else [form._spec_entry(e) for e in spec]
            mesh = getattr(sharding, "mesh", None)
            step["mesh"] = (None if mesh is None else
                            {str(a): int(mesh.shape[a]) for a in mesh.axis_names})
        if name == "dot_general":
            pref = eqn.params.get("preferred_element_type")
            step["preferred"] = None if pref is None else str(np.dtype(pref))
        if name == "scan":
            step["length"] = int(eqn.params["length"])
            step["carry"] = int(eqn.params["num_carry"])  # outputs after these are stacked
        steps.append(step)
        inner = scans + ([int(eqn.params["length"])] if name == "scan" else [])
        for sub in form._sub_jaxprs(eqn.params):
            _walk(getattr(sub, "jaxpr", sub), inner, steps)


def _trace(fn, *args):
    import jax

    try:
        closed = _quiet(jax.make_jaxpr(fn), *args)
    except Exception as exc:
        return {"jaxpr_error": _error(exc)}
    steps = []
    _walk(closed.jaxpr, [], steps)
    return {"steps": steps}


def _steps_of(name, trace):
    if "jaxpr_error" in trace:
        _fail(f"`{name}` could not be traced with jax.make_jaxpr: {trace['jaxpr_error']}")
    return trace["steps"]


COLLECTIVE = re.compile(r"= \S+ (all-reduce|all-gather|reduce-scatter|collective-permute|"
                        r"all-to-all)(?:-start)?\(")


def _compiled_facts(jitted, *args):
    try:
        compiled = _quiet(lambda: jitted.lower(*args).compile())
        memory = compiled.memory_analysis()
        found = COLLECTIVE.findall(compiled.as_text())
        return {"arguments": int(memory.argument_size_in_bytes),
                "temp": int(memory.temp_size_in_bytes),
                "collectives": {c: found.count(c) for c in sorted(set(found))}}
    except Exception as exc:
        return {"error": _error(exc)}


def _constraints(steps, shape, spec):
    return [s for s in steps if s["prim"] == "sharding_constraint" and s["in"]
            and s["in"][0] == list(shape) and s.get("spec") is not None
            and _canonical(s["spec"]) == _canonical(list(spec))]


def _other_meshes(name, steps, mesh, words):
    """Every constraint is on the mesh the function was given (not on a global one)."""
    wanted = {"data": mesh[0], "model": mesh[1]}
    for s in steps:
        if s["prim"] == "sharding_constraint" and s.get("mesh") not in (None, wanted):
            found = " × ".join(f"{n} {a!r}" for a, n in s["mesh"].items())
            _fail(f"traced {words}, `{name}` constrains a value to a mesh of {found}, not to the "
                  f"`mesh` it was given ({wanted['data']} 'data' × {wanted['model']} 'model'); "
                  "expected every NamedSharding built from the `mesh` argument.")


def _call_jit(fn, *args):
    import jax

    try:
        out = _quiet(lambda: jax.block_until_ready(fn(*args)))
        return {"output": out}
    except Exception as exc:
        return {"error": _error(exc)}


# ---- q2: the tensor-parallel forward pass
Q2_MESHES = (MeshShape(data=4, model=2), MeshShape(data=2, model=4))


def _probe_tp_forward(values):
    import jax

    fn = values.get("tp_forward")
    ev = form.evidence_of({"tp_forward": fn})
    if not callable(fn):
        return ev
    rng = _rng()
    ev["fresh"] = []
    for k, (data, model) in enumerate(Q2_MESHES):
        form.free_kernel_memory()  # the previous case's programs (768 MB containers)
        sizes = _sizes(20 + k)
        cfg = _fresh_config(sizes, model=model, data=data)
        batch = data * int(sizes.integers(1, 3))
        seq = cfg.seq - int(sizes.integers(0, 2)) * data // 2
        params, tokens = _fresh_params(rng, cfg), _fresh_tokens(rng, cfg, batch, seq)
        mesh = _mesh((data, model))
        sharded = _shard(params, mesh, _tp_spec)
        data_tokens = _put(tokens, mesh, "data", None)
        run = jax.jit(lambda p, t, mesh=mesh, h=cfg.n_heads: fn(p, t, mesh, h))
        case = {"mesh": [data, model], "cfg": list(cfg), "batch": batch, "seq": seq,
                "params": params, "tokens": tokens,
                "words": f"{_cfg_words(cfg, batch)}, {seq} tokens, on a {data} × {model} mesh"}
        result = _call_jit(run, sharded, data_tokens)
        if "error" in result:
            case["error"] = result["error"]
        else:
            case["output"] = form.evidence(result["output"])
            case["trace"] = _trace(run, sharded, data_tokens)
        ev["fresh"].append(case)
    return ev


def _q2(ev):
    form.expect_callable("tp_forward", ev["tp_forward"])
    for case in ev["fresh"]:
        call = f"tp_forward(params, tokens, mesh, n_heads) {case['words']}"
        if "error" in case:
            _fail(f"`{call}` under jax.jit raised {case['error']}; it should work for any "
                  "config and mesh the task allows.")
        cfg = Config(*case["cfg"])
        B, S = case["batch"], case["seq"]
        out = case["output"]
        shape = (B, S, cfg.vocab)
        if out["kind"] != "array" or tuple(out["shape"]) != shape:
            _fail(f"`{call}` returned {form.describe(out)}; expected the logits, a jax.Array "
                  f"of shape {shape}.")
        form.expect_close(call, out["value"], _np_forward(case["params"], case["tokens"],
                                                          cfg.n_heads),
                          "the logits of `forward` for those parameters and tokens",
                          rtol=RTOL, atol=ATOL)
        steps = _steps_of("tp_forward", case["trace"])
        _other_meshes("tp_forward", steps, case["mesh"], case["words"])
        H, dh = cfg.n_heads, cfg.d_model // cfg.n_heads
        wanted = (((B, S, H, dh), ("data", None, "model", None), 3,
                   "the queries, keys and values (each, as 4-D arrays of shape "
                   f"{(B, S, H, dh)})"),
                  ((B, S, cfg.d_ff), ("data", None, "model"), 1,
                   f"the MLP's hidden units (shape {(B, S, cfg.d_ff)})"),
                  ((B, S, cfg.d_model), ("data",), 1,
                   f"the residual stream after each block (shape {(B, S, cfg.d_model)})"))
        for shape, spec, count, what in wanted:
            found = _constraints(steps, shape, spec)
            inside = [s for s in found if cfg.n_layers in s["scans"][:1]]
            if len(inside) < count:
                where = (" only outside the scan over the layers" if len(found) >= count
                         else "")
                _fail(f"traced {case['words']}, `tp_forward` constrains {what} to "
                      f"{form.spec_repr(list(spec))} {len(found)} time(s){where}; expected "
                      f"{'each of them' if count > 1 else 'it'} constrained with "
                      "jax.lax.with_sharding_constraint inside the scan's body.")
        if out["sharding"].get("spec", [None])[:1] != ["data"]:
            _fail(f"`{call}` returns logits laid out "
                  f"{form.describe_sharding(out['sharding'])}; expected them split by "
                  "examples over 'data', as the residual stream is.")


# ---- q4: the FSDP x TP step
Q4_MESHES = (MeshShape(data=4, model=2), MeshShape(data=2, model=4))
FSDP_ARGUMENT_RATIO = 0.25


def _probe_fsdp(values):
    import jax

    fn = values.get("fsdp_loss_and_grad")
    ev = form.evidence_of({"fsdp_loss_and_grad": fn})
    if not callable(fn):
        return ev
    rng = _rng()
    ev["fresh"] = []
    for k, (data, model) in enumerate(Q4_MESHES):
        form.free_kernel_memory()  # the previous case's programs (768 MB containers)
        sizes = _sizes(40 + k)
        cfg = _fresh_config(sizes, model=model, data=data, n_layers=int(sizes.integers(2, 4)))
        while cfg.d_ff == cfg.d_model:
            cfg = cfg._replace(d_ff=cfg.d_ff + model * data)
        batch = data * int(sizes.integers(1, 3))
        params, tokens = _fresh_params(rng, cfg), _fresh_tokens(rng, cfg, batch, cfg.seq)
        mesh = _mesh((data, model))
        sharded = _shard(params, mesh, _fsdp_spec)
        data_tokens = _put(tokens, mesh, "data", None)
        run = jax.jit(lambda p, t, mesh=mesh, h=cfg.n_heads: fn(p, t, mesh, h))
        case = {"mesh": [data, model], "cfg": list(cfg), "batch": batch,
                "words": f"{_cfg_words(cfg, batch)}, on a {data} × {model} mesh"}
        loss, grads = _reference_loss_and_grad(params, tokens, cfg.n_heads)
        case["reference"] = {"loss": loss, "grads": grads}
        result = _call_jit(run, sharded, data_tokens)
        if "error" in result:
            case["error"] = result["error"]
            ev["fresh"].append(case)
            continue
        case["output"] = form.evidence(result["output"])
        case["trace"] = _trace(run, sharded, data_tokens)
        case["compiled"] = _compiled_facts(run, sharded, data_tokens)
        case["replicated"] = _compiled_facts(
            jax.jit(jax.value_and_grad(_loss), static_argnums=2), params, tokens, cfg.n_heads)
        ev["fresh"].append(case)
    return ev


def _grads_tree(call, ev, structure):
    """{path: array evidence} of a returned gradient dict of the structure of params."""
    if ev["kind"] != "dict":
        _fail(f"the gradient `{call}` returned is {form.describe(ev)}; expected a dict like "
              "`params`.")
    flat = _flat(ev)
    wanted = {path for path, _ in _leaves(structure)}
    if set(flat) != wanted:
        _fail(f"the gradient `{call}` returned has the leaves "
              f"{sorted('/'.join(map(str, p)) for p in flat)}; expected those of `params`.")
    return flat


def _pair(call, out):
    if out["kind"] not in ("tuple", "list") or len(out["items"]) != 2:
        _fail(f"`{call}` returned {form.describe(out)}; expected the tuple (loss, grads).")
    loss, grads = out["items"]
    if loss["kind"] not in ("array", "ndarray", "number") or loss.get("shape", []) != []:
        _fail(f"the loss `{call}` returned is {form.describe(loss)}; expected a scalar.")
    return float(loss["value"]), grads


def _compare_grads(call, flat, reference, words, rtol=GRAD_RTOL, atol=GRAD_ATOL):
    for path, expected in _leaves(reference):
        leaf = flat[path]
        if leaf["kind"] not in ("array", "ndarray"):
            _fail(f"the gradient of {_path_words(path)} from `{call}` is "
                  f"{form.describe(leaf)}; expected an array.")
        form.expect_close(f"the gradient of params{_path_words(path)} from `{call}`",
                          leaf["value"], expected, words, rtol=rtol, atol=atol)


def _q4(ev):
    form.expect_callable("fsdp_loss_and_grad", ev["fsdp_loss_and_grad"])
    for case in ev["fresh"]:
        call = f"fsdp_loss_and_grad(params, tokens, mesh, n_heads) {case['words']}"
        if "error" in case:
            _fail(f"`{call}` under jax.jit raised {case['error']}; it should work for any "
                  "config and mesh the task allows.")
        cfg = Config(*case["cfg"])
        ref = case["reference"]
        loss, grads = _pair(call, case["output"])
        form.expect_close(call + "'s loss", loss, ref["loss"],
                          "loss_fn(params, tokens, n_heads)", rtol=GRAD_RTOL, atol=GRAD_ATOL)
        flat = _grads_tree(call, grads, ref["grads"])
        _compare_grads(call, flat, ref["grads"], "the gradient of loss_fn in that parameter")
        for path, leaf in sorted(flat.items()):
            wanted = _fsdp_spec(path)
            sharding = leaf.get("sharding", {})
            if _canonical(sharding.get("spec", ["?"])) != _canonical(list(wanted)):
                _fail(f"the gradient of params{_path_words(path)} from `{call}` is laid out "
                      f"{form.describe_sharding(sharding) if sharding else 'off the mesh'}; "
                      f"expected the fsdp_specs layout {form.spec_repr(list(wanted))}.")
        steps = _steps_of("fsdp_loss_and_grad", case["trace"])
        _other_meshes("fsdp_loss_and_grad", steps, case["mesh"], case["words"])
        D, F, L = cfg.d_model, cfg.d_ff, cfg.n_layers
        gathers = (((D, D), (None, "model"), 3, "wq, wk and wv"), ((D, D), ("model",), 1, "wo"),
                   ((D, F), (None, "model"), 1, "w1"), ((F, D), ("model",), 1, "w2"))
        for shape, spec, count, names in gathers:
            found = _constraints(steps, shape, spec)
            inside = [s for s in found if s["scans"][:1] == [L]]
            stacked = _constraints(steps, (L,) + shape, (None,) + spec)
            if len(inside) < count:
                how = (f"; it constrains the stacked weights {form.spec_repr([None, *spec])} "
                       "outside the scan instead, which gathers every layer at once"
                       if stacked else "")
                _fail(f"traced {case['words']}, `fsdp_loss_and_grad` does not constrain the "
                      f"layer's {names} (shape {shape}) to the tensor-parallel layout "
                      f"{form.spec_repr(list(spec))} inside the body of the scan over the "
                      f"{L} layers{how}; expected that constraint (the gather, one layer at a "
                      "time).")
        compiled = case["compiled"]
        if "error" in compiled:
            _fail(f"`{call}` could not be compiled: {compiled['error']}")
        if not compiled["collectives"].get("all-gather"):
            _fail(f"compiled {case['words']}, `fsdp_loss_and_grad` has no all-gather: the "
                  "weights are never gathered over 'data', so they were not stored split over "
                  "it.")
        ratio = compiled["arguments"] / max(case["replicated"]["arguments"], 1)
        if ratio > FSDP_ARGUMENT_RATIO:
            _fail(f"compiled {case['words']}, `fsdp_loss_and_grad` takes "
                  f"{compiled['arguments']:,d} bytes of arguments per device, {ratio:.0%} of "
                  f"the replicated step's {case['replicated']['arguments']:,d}; expected at "
                  f"most {FSDP_ARGUMENT_RATIO:.0%} (about 1/8 with every matrix split over "
                  "both axes).")


# ---- q5: mixed precision
STRUCTURAL = {"reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims", "slice",
              "concatenate", "copy", "copy_p", "convert_element_type", "dot_general", "pjit",
              "jit", "closed_call", "scan", "dynamic_slice", "gather", "sharding_constraint"}


MP_LAYERS = (1, 3)  # the layer counts of the fresh configs (other widths each time)


def _probe_mixed(values):
    import jax

    fn = values.get("mp_loss")
    ev = form.evidence_of({"mp_loss": fn})
    if not callable(fn):
        return ev
    rng = _rng()
    ev["fresh"] = []
    for k, layers in enumerate(MP_LAYERS):
        form.free_kernel_memory()  # the previous case's programs (768 MB containers)
        sizes = _sizes(50 + k)
        # widths of 16 or more: bfloat16 sums of a few terms are rough
        cfg = _fresh_config(sizes, n_layers=layers)
        batch = int(sizes.integers(2, 5))
        params, tokens = _fresh_params(rng, cfg), _fresh_tokens(rng, cfg, batch, cfg.seq)
        case = {"cfg": list(cfg), "words": _cfg_words(cfg, batch)}
        loss, grads = _reference_loss_and_grad(params, tokens, cfg.n_heads)
        case["reference"] = {"loss": loss, "grads": grads}
        try:
            out = _quiet(lambda: jax.block_until_ready(jax.jit(jax.value_and_grad(
                fn), static_argnums=2)(params, tokens, cfg.n_heads)))
            case["output"] = form.evidence(out)
        except Exception as exc:
            case["error"] = _error(exc)
            ev["fresh"].append(case)
            continue
        case["trace"] = _trace(lambda p, t, h=cfg.n_heads: fn(p, t, h), params, tokens)
        ev["fresh"].append(case)
    return ev


def _q5(ev):
    form.expect_callable("mp_loss", ev["mp_loss"])
    for case in ev["fresh"]:
        call = f"mp_loss(params, tokens, n_heads) {case['words']}"
        if "error" in case:
            _fail(f"`jax.value_and_grad(mp_loss)` {case['words']} raised {case['error']}; "
                  "it should work for any config.")
        cfg = Config(*case["cfg"])
        ref = case["reference"]
        loss, grads = _pair(call, case["output"])
        if loss != loss or abs(loss - ref["loss"]) > MP_LOSS_RTOL * abs(ref["loss"]):
            _fail(f"`{call}` is {loss:.5g}; expected within {MP_LOSS_RTOL:.0%} of loss_fn's "
                  f"{ref['loss']:.5g}.")
        flat = _grads_tree(f"jax.grad(mp_loss) {case['words']}", grads, ref["grads"])
        for path, expected in _leaves(ref["grads"]):
            leaf = flat[path]
            if leaf.get("dtype") != "float32":
                _fail(f"the gradient of params{_path_words(path)} through `mp_loss` is "
                      f"{form.describe(leaf)}; expected float32 (the master parameters stay "
                      "float32; cast them inside the function).")
            gap = np.linalg.norm(np.asarray(leaf["value"], np.float64) - expected)
            size = max(np.linalg.norm(expected), 1e-12)
            if not gap <= MP_GRAD_RELATIVE * size:
                _fail(f"the gradient of params{_path_words(path)} through `{call}` is "
                      f"{gap / size:.1%} away from loss_fn's (the norm of the difference over "
                      f"the norm of the float32 gradient); expected within "
                      f"{MP_GRAD_RELATIVE:.0%}.")
        steps = _steps_of("mp_loss", case["trace"])
        dots = [s for s in steps if s["prim"] == "dot_general"]
        for s in dots:
            if s["in_dtypes"] != ["bfloat16", "bfloat16"]:
                _fail(f"traced {case['words']}, `mp_loss` multiplies {_operands(s)}; expected "
                      "every matrix product to take bfloat16 operands.")
            if s.get("preferred") != "float32" or s["out_dtypes"] != ["float32"]:
                _fail(f"traced {case['words']}, `mp_loss` multiplies {_operands(s)} into "
                      f"{s['out_dtypes'][0]}{tuple(s['out'][0])}; expected it accumulated and "
                      "returned in float32 (preferred_element_type=jnp.float32).")
        runs = sum(math.prod(s["scans"]) for s in dots)
        if runs < 8 * cfg.n_layers + 1:
            _fail(f"traced {case['words']}, `mp_loss` runs {runs} matrix product(s); expected "
                  f"the model's 8 per layer (wq, wk, wv, the scores, the weights times values, "
                  f"wo, w1, w2) and the unembedding, {8 * cfg.n_layers + 1} in all, each in "
                  "bfloat16.")
        low = [s for s in steps if s["prim"] not in STRUCTURAL
               and "bfloat16" in s["out_dtypes"]]
        if low:
            _fail(f"traced {case['words']}, `mp_loss` computes `{low[0]['prim']}` in bfloat16 "
                  f"(shape {tuple(low[0]['out'][0])}); expected everything but the matrix "
                  "products' operands to stay float32 (norms, softmax, gelu, the residual "
                  "stream and the loss).")


def _operands(step):
    return " by ".join(f"{d}{tuple(s)}" for d, s in zip(step["in_dtypes"], step["in"]))


# ---- q6: gradient accumulation
class Accumulation(NamedTuple):
    batch: int
    n_micro: int


ACCUMULATION_CASES = (Accumulation(batch=12, n_micro=3), Accumulation(batch=8, n_micro=1),
                      Accumulation(batch=8, n_micro=4))
ACCUMULATION_MEMORY = (64, 8)  # batch, microbatches
ACCUMULATION_MEMORY_CFG = Config(vocab=64, d_model=64, n_heads=4, d_ff=256, n_layers=2, seq=32)
ACCUMULATION_MEMORY_RATIO = 0.5


def _probe_accumulation(values):
    import jax
    import jax.numpy as jnp

    fn = values.get("accumulated_loss_and_grad")
    ev = form.evidence_of({"accumulated_loss_and_grad": fn})
    if not callable(fn):
        return ev
    rng = _rng()
    ev["fresh"] = []
    for k, (batch, n_micro) in enumerate(ACCUMULATION_CASES):
        form.free_kernel_memory()  # the previous case's programs (768 MB containers)
        cfg = _fresh_config(_sizes(60 + k), model=1, data=2)
        params, tokens = _fresh_params(rng, cfg), _fresh_tokens(rng, cfg, batch, cfg.seq)
        case = {"cfg": list(cfg), "batch": batch, "n_micro": n_micro,
                "words": f"{_cfg_words(cfg, batch)} in {_count(n_micro, 'microbatch')}"}
        loss, grads = _reference_loss_and_grad(params, tokens, cfg.n_heads)
        case["reference"] = {"loss": loss, "grads": grads}
        run = jax.jit(lambda p, t, h=cfg.n_heads, n=n_micro: fn(p, t, h, n))
        result = _call_jit(run, params, tokens)
        if "error" in result:
            case["error"] = result["error"]
        else:
            case["output"] = form.evidence(result["output"])
            case["trace"] = _trace(run, params, tokens)
        ev["fresh"].append(case)
    form.free_kernel_memory()
    batch, n_micro = ACCUMULATION_MEMORY
    cfg = ACCUMULATION_MEMORY_CFG
    shapes = _tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.float32),
                       _fresh_params(rng, cfg))
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq), jnp.int32)
    ev["memory"] = {
        "student": _compiled_facts(jax.jit(lambda p, t: fn(p, t, cfg.n_heads, n_micro)),
                                   shapes, tokens),
        "full": _compiled_facts(jax.jit(jax.value_and_grad(_loss), static_argnums=2),
                                shapes, tokens, cfg.n_heads)}
    return ev


def _q6(ev):
    form.expect_callable("accumulated_loss_and_grad", ev["accumulated_loss_and_grad"])
    for case in ev["fresh"]:
        call = (f"accumulated_loss_and_grad(params, tokens, n_heads, n_micro) "
                f"{case['words']}")
        if "error" in case:
            _fail(f"`{call}` under jax.jit raised {case['error']}; it should work for any "
                  "config and any n_micro that divides the batch.")
        ref = case["reference"]
        loss, grads = _pair(call, case["output"])
        form.expect_close(call + "'s loss", loss, ref["loss"],
                          "the whole batch's loss_fn(params, tokens, n_heads)",
                          rtol=GRAD_RTOL, atol=GRAD_ATOL)
        _compare_grads(call, _grads_tree(call, grads, ref["grads"]), ref["grads"],
                       "the whole batch's gradient of loss_fn in that parameter")
        steps = _steps_of("accumulated_loss_and_grad", case["trace"])
        n = case["n_micro"]
        loops = [s for s in steps if s["prim"] == "scan" and not s["scans"]
                 and s["length"] == n]
        if not loops:
            lengths = sorted({s["length"] for s in steps if s["prim"] == "scan"
                              and not s["scans"]})
            _fail(f"traced {case['words']}, `accumulated_loss_and_grad` has no lax.scan of "
                  f"length {n} at its top level (its top-level scans have lengths "
                  f"{lengths or 'none'}); expected one scan over the microbatches.")
        cfg = Config(*case["cfg"])
        D, F, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab
        weights = {(L, D, D), (L, D, F), (L, F, D), (V, D), (D, V)}
        if all(any(len(shape) > 1 and shape[0] == n and tuple(shape[1:]) in weights
                   for shape in loop["out"][loop["carry"]:]) for loop in loops):
            _fail(f"traced {case['words']}, the scan over the microbatches in "
                  "`accumulated_loss_and_grad` returns every microbatch's gradient, stacked "
                  f"({n} of them), and they are averaged afterwards; expected the scan to carry "
                  "running sums, so that one microbatch's gradient is held at a time.")
    memory = ev["memory"]
    batch, n_micro = ACCUMULATION_MEMORY
    if "error" in memory["student"]:
        _fail(f"`accumulated_loss_and_grad` could not be compiled for a batch of {batch} in "
              f"{n_micro} microbatches: {memory['student']['error']}")
    ratio = memory["student"]["temp"] / max(memory["full"]["temp"], 1)
    if ratio >= ACCUMULATION_MEMORY_RATIO:
        _fail(f"compiled for a batch of {batch} in {n_micro} microbatches, "
              f"`accumulated_loss_and_grad` needs {memory['student']['temp'] / 2**20:.2f} MiB "
              f"of temporary memory, {ratio:.0%} of the whole batch's "
              f"{memory['full']['temp'] / 2**20:.2f} MiB; expected less than "
              f"{ACCUMULATION_MEMORY_RATIO:.0%} (one microbatch's activations at a time).")


# ---- q7: checkpoints
class Restore(NamedTuple):
    data: int
    model: int
    devices: int


RESTORE_CASES = (Restore(data=2, model=2, devices=4), Restore(data=8, model=1, devices=8))
SAVE_MESH = (4, 2)


def _orbax():
    import orbax.checkpoint as ocp

    return ocp


def _probe_checkpoint(values):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    save, restore = values.get("save_state"), values.get("restore_state")
    ev = form.evidence_of({"save_state": save, "restore_state": restore})
    if not (callable(save) and callable(restore)):
        return ev
    ocp = _orbax()
    rng = _rng()
    cfg = _fresh_config(_sizes(70), model=1, data=8)
    params = _fresh_params(rng, cfg)
    step = int(rng.integers(1, 1000))
    mesh = _mesh(SAVE_MESH)
    state = {"params": _shard(params, mesh, _fsdp_spec),
             "step": _put(np.int32(step), mesh)}
    abstract = jax.eval_shape(lambda: state)
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), abstract)
    ev["cfg"], ev["params"], ev["step"] = list(cfg), params, step
    with tempfile.TemporaryDirectory() as root:
        # the student's save, read back by Orbax itself onto one device
        path = os.path.join(root, "saved_by_you")
        try:
            _quiet(save, path, state)
            one = NamedSharding(_mesh((1, 1), 1), P())
            target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one),
                                  abstract)
            ev["saved"] = form.evidence(_quiet(
                lambda: ocp.StandardCheckpointer().restore(path, target)))
        except Exception as exc:
            ev["saved"] = {"kind": "error", "error": _error(exc)}
        # Orbax's own save, restored by the student's function onto other meshes
        path = os.path.join(root, "saved_by_orbax")
        checkpointer = ocp.StandardCheckpointer()
        _quiet(checkpointer.save, path, state)
        checkpointer.wait_until_finished()
        ev["restored"] = []
        for data, model, count in RESTORE_CASES:
            record = {"mesh": [data, model], "devices": count}
            try:
                out = _quiet(restore, path, abstract, _mesh((data, model), count))
                record["output"] = form.evidence(jax.block_until_ready(out))
            except Exception as exc:
                record["error"] = _error(exc)
            ev["restored"].append(record)
    del jnp
    return ev


def _state_leaves(call, ev):
    if ev["kind"] != "dict":
        _fail(f"`{call}` returned {form.describe(ev)}; expected the state, a dict with keys "
              "'params' and 'step'.")
    return _flat(ev)


def _state_reference(ev):
    ref = {("params",) + path: leaf for path, leaf in _leaves(ev["params"])}
    ref[("step",)] = np.asarray(ev["step"], np.int32)
    return ref


def _q7(ev):
    form.expect_callable("save_state", ev["save_state"])
    form.expect_callable("restore_state", ev["restore_state"])
    reference = _state_reference(ev)
    saved = ev["saved"]
    if saved["kind"] == "error":
        _fail(f"a state saved with `save_state(path, state)` could not be restored by Orbax's "
              f"StandardCheckpointer ({saved['error']}); expected a checkpoint Orbax writes "
              "(ocp.StandardCheckpointer().save), complete when save_state returns "
              "(wait_until_finished).")
    flat = _state_leaves("Orbax's restore of your checkpoint", saved)
    for path, expected in sorted(reference.items()):
        leaf = flat.get(path)
        if leaf is None or leaf["kind"] not in ("array", "ndarray") or not np.array_equal(
                np.asarray(leaf["value"]), expected):
            _fail(f"Orbax restored state{_path_words(path)} from the checkpoint "
                  "`save_state(path, state)` wrote with other values than state's; expected "
                  "the state saved as it is.")
    for record in ev["restored"]:
        shape = record["mesh"]
        call = (f"restore_state(path, abstract_state, mesh) onto a {shape[0]} × {shape[1]} "
                f"mesh of {record['devices']} devices")
        if "error" in record:
            _fail(f"`{call}` raised {record['error']} (the checkpoint was written by Orbax's "
                  "StandardCheckpointer from a 4 × 2 mesh).")
        flat = _state_leaves(call, record["output"])
        if set(flat) != set(reference):
            _fail(f"`{call}` returned the leaves "
                  f"{sorted('/'.join(map(str, p)) for p in flat)}; expected those of the "
                  "state.")
        for path, expected in sorted(reference.items()):
            leaf = flat[path]
            if leaf["kind"] != "array":
                _fail(f"`{call}`{_path_words(path)} is {form.describe(leaf)}; expected a "
                      "jax.Array on the mesh.")
            if leaf["dtype"] != str(expected.dtype) or not np.array_equal(leaf["value"],
                                                                          expected):
                _fail(f"`{call}`{_path_words(path)} has other values (or dtype) than the "
                      "saved state's; expected them restored exactly.")
            sharding = leaf["sharding"]
            wanted = _fsdp_spec(path[1:]) if path[0] == "params" else ()
            what = ("the fsdp_specs layout" if path[0] == "params" else "replicated")
            if (sharding.get("mesh_shape") != shape
                    or _canonical(sharding.get("spec", ["?"])) != _canonical(list(wanted))):
                _fail(f"`{call}`{_path_words(path)} is laid out "
                      f"{form.describe_sharding(sharding)}; expected {what}, "
                      f"{form.spec_repr(list(wanted))} on the {shape[0]} × {shape[1]} mesh "
                      "given.")


# ---- q8: FLOPs of a step
FLOPS_CASES = 4


def _step_flops(cfg, batch, seq):
    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab, cfg.n_layers
    per_layer = 2 * batch * seq * (4 * D * D + 2 * D * F) + 2 * 2 * batch * seq * seq * D
    return 3 * (L * per_layer + 2 * batch * seq * D * V)


def _probe_flops(values):
    fn = values.get("step_flops")
    ev = form.evidence_of({"step_flops": fn})
    if not callable(fn):
        return ev
    rng = _rng()
    ev["fresh"] = []
    for _ in range(FLOPS_CASES):
        heads = int(rng.integers(1, 9))
        cfg = Config(vocab=int(rng.integers(50, 50000)), d_model=heads * int(rng.integers(8, 128)),
                     n_heads=heads, d_ff=int(rng.integers(64, 20000)),
                     n_layers=int(rng.integers(1, 25)), seq=int(rng.integers(64, 2048)))
        batch, seq = int(rng.integers(1, 65)), int(rng.integers(2, cfg.seq))
        case = {"cfg": list(cfg), "batch": batch, "seq": seq}
        try:
            case["output"] = form.evidence(_quiet(fn, cfg, batch, seq))
        except Exception as exc:
            case["output"] = {"kind": "error", "error": _error(exc)}
        ev["fresh"].append(case)
    return ev


def _q8(ev):
    form.expect_callable("step_flops", ev["step_flops"])
    for case in ev["fresh"]:
        cfg = Config(*case["cfg"])
        call = (f"step_flops(cfg, batch={case['batch']}, seq={case['seq']}) with vocab "
                f"{cfg.vocab}, d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.n_layers} layers")
        out = case["output"]
        if out["kind"] == "error":
            _fail(f"`{call}` raised {out['error']}; it should return an int for any config.")
        if out["kind"] != "number" or out.get("type") != "int":
            _fail(f"`{call}` returned {form.describe(out)}"
                  f"{' of type ' + out['type'] if out['kind'] == 'number' else ''}; expected a "
                  "Python int.")
        wanted = _step_flops(cfg, case["batch"], case["seq"])
        if out["value"] != wanted:  # every case stays below 2**53: floats hold it exactly
            B, S = case["batch"], case["seq"]
            D, V, L = cfg.d_model, cfg.vocab, cfg.n_layers
            mistakes = {
                wanted // 3: "That is the forward pass alone; a training step takes 3 × it.",
                wanted // 2: "That counts one FLOP per multiply-add; count 2 (a multiply and "
                             "an add).",
                _step_flops(cfg, B, cfg.seq): "That uses cfg.seq; use the seq argument.",
                wanted - 3 * 2 * B * S * D * V: "That leaves out the unembedding "
                                                "(2·B·S·D·V, once).",
                wanted - 3 * L * 2 * B * S * S * D: "That counts half of attention's two "
                                                    "products; count the whole S × S square.",
                wanted - 3 * L * 4 * B * S * S * D: "That leaves out attention's two products "
                                                    "(2·B·S·S·D each, per layer)."}
            hint = " " + mistakes[out["value"]] if out["value"] in mistakes else ""
            _fail(f"`{call}` is {int(out['value']):,d}; expected {wanted:,d}: 3 × (per layer "
                  "2·B·S·(4·D² + 2·D·F) + 2 · 2·B·S·S·D, and once 2·B·S·D·V)." + hint)


# ---- q9: timing and MFU
class _Done:
    """What a fake step returns: done at ``at`` (perf_counter); blocking waits until then."""

    def __init__(self, at):
        self.at = at

    def block_until_ready(self):
        time.sleep(max(0.0, self.at - time.perf_counter()))
        return self

    def __array__(self, dtype=None, copy=None):
        self.block_until_ready()
        return np.zeros((), dtype or np.float32)

    def __float__(self):
        self.block_until_ready()
        return 0.0


class _FakeStep:
    """A step whose first call compiles for ``compile_s`` (the caller waits) and queues a
    slower first run (``work_s + FIRST_RUN_S``, as a real first run allocates and warms up),
    and whose later calls queue ``work_s`` of work each behind the previous call's, as JAX
    dispatches them."""

    def __init__(self, compile_s, work_s, args):
        self.compile_s, self.work_s, self.args = compile_s, work_s, args
        self.calls, self.busy_until, self.bad_args = 0, 0.0, False

    def __call__(self, *args):
        if len(args) != len(self.args) or any(a is not b for a, b in zip(args, self.args)):
            self.bad_args = True
        self.calls += 1
        extra = 0.0
        if self.calls == 1:
            time.sleep(self.compile_s)
            extra = FIRST_RUN_S
        self.busy_until = max(time.perf_counter(), self.busy_until) + self.work_s + extra
        return _Done(self.busy_until)


# compile s, work s, repeats: chosen so that the usual mistakes (milliseconds, no division by
# repeats, compilation timed, the first run timed) measure times at least 25% apart
TIMING_CASES = ((0.25, 0.03, 3), (0.2, 0.01, 8))
FIRST_RUN_S = 0.1
TIMING_LOW, TIMING_HIGH, TIMING_SLACK = 0.9, 1.5, 0.004
MFU_CASES = 4


def _probe_timing(values):
    time_step, mfu = values.get("time_step"), values.get("mfu")
    ev = form.evidence_of({"time_step": time_step, "mfu": mfu})
    rng = _rng()
    if callable(time_step):
        ev["timing"] = []
        for compile_s, work_s, repeats in TIMING_CASES:
            args = (object(), int(rng.integers(1, 100)))
            step = _FakeStep(compile_s, work_s, args)
            record = {"compile": compile_s, "work": work_s, "repeats": repeats}
            try:
                record["output"] = form.evidence(_quiet(time_step, step, args, repeats))
            except Exception as exc:
                record["output"] = {"kind": "error", "error": _error(exc)}
            record.update(calls=step.calls, bad_args=step.bad_args)
            ev["timing"].append(record)
    if callable(mfu):
        ev["mfu_cases"] = []
        for _ in range(MFU_CASES):
            flops = int(rng.integers(10**9, 10**15))
            seconds, peak = float(rng.uniform(1e-3, 10)), float(rng.uniform(1e12, 1e16))
            try:
                out = form.evidence(_quiet(mfu, flops, seconds, peak))
            except Exception as exc:
                out = {"kind": "error", "error": _error(exc)}
            ev["mfu_cases"].append({"flops": flops, "seconds": seconds, "peak": peak, "output": out})
    return ev


def _q9(ev):
    form.expect_callable("time_step", ev["time_step"])
    form.expect_callable("mfu", ev["mfu"])
    for record in ev["timing"]:
        work, repeats, compile_s = record["work"], record["repeats"], record["compile"]
        call = (f"time_step(step, args, {repeats}) for a step that compiles in "
                f"{compile_s * 1e3:.0f} ms on its first call, runs {FIRST_RUN_S * 1e3:.0f} ms "
                f"longer the first time, and then takes {work * 1e3:.0f} ms of queued work per "
                "call")
        out = record["output"]
        if out["kind"] == "error":
            _fail(f"`{call}` raised {out['error']}; it should time any step it is given.")
        if out["kind"] != "number" or out.get("is_int"):
            _fail(f"`{call}` returned {form.describe(out)}; expected a Python float.")
        if record["bad_args"]:
            _fail(f"`{call}` did not call step(*args) with the arguments given.")
        if record["calls"] != repeats + 1:
            _fail(f"`{call}` called the step {record['calls']} times; expected {repeats + 1}: "
                  f"once to compile, then {repeats} timed calls.")
        seconds = out["value"]
        if seconds < TIMING_LOW * work:
            _fail(f"`{call}` measured {seconds * 1e3:.2f} ms per step; expected about "
                  f"{work * 1e3:.0f} ms. JAX returns before the work is done: block on the "
                  "result (jax.block_until_ready) before stopping the clock.")
        if seconds > TIMING_HIGH * work + TIMING_SLACK:
            # the nearest of the usual mistakes, if one is near (the cases keep them apart)
            mistakes = {
                work * 1e3: " That is in milliseconds; return seconds.",
                work * repeats: f" That is the time of all {repeats} calls: divide by repeats.",
                work + (compile_s + FIRST_RUN_S) / repeats:
                    " That includes the first call's compilation: call the step once before "
                    "starting the clock.",
                work + FIRST_RUN_S / repeats:
                    " That includes the first call's run: block on its result before starting "
                    "the clock."}
            near = min(mistakes, key=lambda v: abs(math.log(seconds / v)))
            hint = mistakes[near] if abs(math.log(seconds / near)) < math.log(1.25) else ""
            _fail(f"`{call}` measured {seconds * 1e3:.2f} ms per step; expected about "
                  f"{work * 1e3:.0f} ms.{hint}")
    for case in ev["mfu_cases"]:
        call = f"mfu({case['flops']}, {case['seconds']:.6g}, {case['peak']:.6g})"
        out = case["output"]
        if out["kind"] == "error":
            _fail(f"`{call}` raised {out['error']}; it should return a float.")
        if out["kind"] != "number":
            _fail(f"`{call}` returned {form.describe(out)}; expected a Python float.")
        wanted = case["flops"] / case["seconds"] / case["peak"]
        if not math.isclose(out["value"], wanted, rel_tol=1e-9):
            _fail(f"`{call}` is {out['value']:.6g}; expected {wanted:.6g}, the step's FLOPs "
                  "over its seconds over the peak FLOP/s.")


# =========================================================================== questions
def _freed(probe):
    """``probe``, run after the kernel gives back what it compiled so far (as in Lab 6)."""

    @functools.wraps(probe)
    def run(values):
        form.free_kernel_memory()
        return probe(values)

    return run


QUESTIONS = {
    # Part A
    "q1_tp_specs": form.question("tp_specs", _q1, _probe_specs("tp_specs")),
    "q2_tp_forward": form.question("tp_forward", _q2, _freed(_probe_tp_forward)),
    # Part B
    "q3_fsdp_specs": form.question("fsdp_specs", _q3, _probe_specs("fsdp_specs")),
    "q4_fsdp_step": form.question("fsdp_loss_and_grad", _q4, _freed(_probe_fsdp)),
    # Part C
    "q5_mixed_precision": form.question("mp_loss", _q5, _freed(_probe_mixed)),
    "q6_accumulation": form.question("accumulated_loss_and_grad", _q6,
                                     _freed(_probe_accumulation)),
    # Part D
    "q7_checkpoint": form.question("save_state restore_state", _q7, _freed(_probe_checkpoint)),
    # Part E
    "q8_step_flops": form.question("step_flops", _q8, _probe_flops),
    "q9_utilisation": form.question("time_step mfu", _q9, _probe_timing),
}
probe, verdict, check = form.entry_points(QUESTIONS)
JAXLAB_CHECKS = 1  # declares the probe/verdict contract `jaxlab grade` relies on
