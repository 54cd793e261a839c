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


@functools.cache
def _reference_step():
    """One jitted reference step for every probe: cases of the same sizes compile it once (until
    the kernel's compiled programs are given back)."""
    import jax

    return jax.jit(jax.value_and_grad(_loss), static_argnums=2)


def _reference_loss_and_grad(params, tokens, n_heads):
    """The lab's loss and gradient, float32, on one device, as NumPy."""
    import jax

    loss, grads = _reference_step()(params, tokens, n_heads)
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
# spelled with every entry, as the text spells them (a message shows them as they are here)
def _tp_spec(path):
    name = path[-1]
    if path[0] == "layers" and name in COLUMNS:
        return (None, None, "model")
    if path[0] == "layers" and name in ROWS:
        return (None, "model", None)
    return ()


def _fsdp_spec(path):
    name = path[-1]
    if path[0] == "layers" and name in COLUMNS:
        return (None, "data", "model")
    if path[0] == "layers" and name in ROWS:
        return (None, "model", "data")
    return {"embed": (None, "data"), "pos": (None, "data"), "unembed": ("data", None)}.get(
        name, ())


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
class SpecCase(NamedTuple):
    layers: int
    mlp: str  # "wider": d_ff > d_model; "narrower": d_ff < d_model (a rule read off shapes fails)


# fresh configs (other widths each time); the layouts follow from the names, not the shapes
SPEC_CASES = (SpecCase(layers=1, mlp="wider"), SpecCase(layers=3, mlp="narrower"))


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
        for layers, mlp in SPEC_CASES:
            cfg = _fresh_config(rng, n_layers=layers)
            cfg = cfg._replace(d_ff=2 * cfg.d_model if mlp == "wider" else cfg.d_model // 2)
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
PASS_THROUGH = {"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "copy",
                "copy_p", "sharding_constraint"}


def _walk(jaxpr, scans, steps, rounded_in=()):
    """Every equation of ``jaxpr`` and the jaxprs nested in it, with the scans (their lengths,
    outermost first) it runs inside."""
    # this jaxpr's values made by rounding a float32 value to bfloat16 (or sliced from one)
    rounded = set(rounded_in)
    origin = {}  # value -> the primitive that computed it, through reshapes and the like
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        made_by = (origin.get(id(eqn.invars[0])) if name in PASS_THROUGH and eqn.invars
                   else name)
        origin.update((id(v), made_by) for v in eqn.outvars)
        if name in PASS_THROUGH | {"slice", "dynamic_slice", "gather"} and eqn.invars and \
                id(eqn.invars[0]) in rounded:
            rounded.update(id(v) for v in eqn.outvars)
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
        if name == "convert_element_type":
            dtypes = (step["in_dtypes"][0], step["out_dtypes"][0])
            # (the backward pass rounds a product's float32 cotangent to its bfloat16 operand's
            # dtype and back: the rounded value a product made is no parameter's or activation's)
            if dtypes == ("float32", "bfloat16") and \
                    origin.get(id(eqn.invars[0])) != "dot_general":
                rounded.update(id(v) for v in eqn.outvars)
            # a float32 value rounded to bfloat16 and used again as float32 (say a norm's
            # weight): bfloat16 outside the products, with float32 dtypes all along after it
            step["round_trip"] = dtypes == ("bfloat16", "float32") and id(eqn.invars[0]) in rounded
        if name == "dot_general":
            pref = eqn.params.get("preferred_element_type")
            step["preferred"] = None if pref is None else str(np.dtype(pref))
        if name == "scan":
            step["length"] = int(eqn.params["length"])
            # outputs after these are stacked (JAX 0.12 keeps the count in its flat tree ft_out)
            step["carry"] = int(eqn.params["num_carry"] if "num_carry" in eqn.params
                                else len(eqn.params["ft_out"].unpack()[0]))
            step["reverse"] = bool(eqn.params.get("reverse", False))
            body = eqn.params["jaxpr"].jaxpr
            inputs = {id(v) for v in body.invars}
            # what each step computes and hands out stacked: in a forward (not reversed) scan
            # under differentiation, the residuals the backward pass keeps
            step["computed_ys"] = [[int(n) for n in getattr(v.aval, "shape", ())]
                                   for v in body.outvars[step["carry"]:] if id(v) not in inputs]
        steps.append(step)
        inner = scans + ([int(eqn.params["length"])] if name == "scan" else [])
        for sub in form._sub_jaxprs(eqn.params):
            sub = getattr(sub, "jaxpr", sub)
            # a nested jaxpr (checkpoint, scan, jit) receives the equation's operands in order
            passed = () if len(sub.invars) != len(eqn.invars) else [
                id(inner_v) for v, inner_v in zip(eqn.invars, sub.invars) if id(v) in rounded]
            _walk(sub, inner, steps, passed)


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


# a combined collective's result is a tuple with spaces: "%x = (f32[2], f32[4]) all-reduce("
COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%\S+ = .*? (all-reduce|all-gather|reduce-scatter|"
                        r"collective-permute|all-to-all)(?:-start)?\(", re.M)


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
                  ((B, S, cfg.d_model), ("data", None, None), 1,
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
# arguments + temporaries per device, against the tensor-parallel step's: less. Measured at the
# fresh cases' sizes: remat 0.52 and 0.69 (a policy keeping the products 0.61 and 0.75); no remat
# 1.08 and 1.25, every layer gathered before a remat'd scan 1.05 and 1.10
FSDP_MEMORY_RATIO = 1.0
FSDP_MEMORY_MESH = Q4_MESHES[0]  # the memory is compared on this mesh's case
TABLES = ("embed", "pos", "unembed")


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
        if (data, model) == FSDP_MEMORY_MESH:  # one tensor-parallel step to compare with
            case["tp"] = _compiled_facts(jax.jit(jax.value_and_grad(_loss), static_argnums=2),
                                         _shard(params, mesh, _tp_spec), data_tokens,
                                         cfg.n_heads)
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
    # a 0-d bfloat16 array may cross as shape (1,): its one number either way
    return float(np.asarray(loss["value"], np.float64).reshape(-1)[0]), grads


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
        _layers_gathered("fsdp_loss_and_grad", steps, cfg, case["words"], [cfg.n_layers])
        _tables_gathered("fsdp_loss_and_grad", steps, cfg, case["words"])
        _gathered_weights_not_kept("fsdp_loss_and_grad", steps, cfg, case["words"])
        compiled = case["compiled"]
        if "error" in compiled:
            _fail(f"`{call}` could not be compiled: {compiled['error']}")
        if not compiled["collectives"].get("all-gather"):
            _fail(f"compiled {case['words']}, `fsdp_loss_and_grad` has no all-gather: the "
                  "weights are never gathered over 'data', so they were not stored split over "
                  "it.")
        if "tp" not in case:
            continue
        mine = compiled["arguments"] + compiled["temp"]
        tp = case["tp"]["arguments"] + case["tp"]["temp"]
        if not mine < FSDP_MEMORY_RATIO * tp:
            _fail(f"compiled {case['words']}, `fsdp_loss_and_grad` needs {mine / 1024:,.1f} KiB "
                  f"per device (arguments {compiled['arguments'] / 1024:,.1f} + temporaries "
                  f"{compiled['temp'] / 1024:,.1f}), {mine / max(tp, 1):.0%} of the "
                  f"tensor-parallel step's {tp / 1024:,.1f} KiB (jax.value_and_grad(loss_fn) on "
                  "tp_specs parameters); expected less: each layer gathered inside the scan, "
                  "and gathered again in the backward pass.")


def _weight_shapes(cfg):
    D, F = cfg.d_model, cfg.d_ff
    return (((D, D), (None, "model"), 3, "wq, wk and wv"), ((D, D), ("model", None), 1, "wo"),
            ((D, F), (None, "model"), 1, "w1"), ((F, D), ("model", None), 1, "w2"))


def _layers_gathered(name, steps, cfg, words, scans):
    """Each layer's weights constrained to the tensor-parallel layout inside the scan over the
    layers (``scans``: the lengths of the scans it runs inside, outermost first)."""
    L = cfg.n_layers
    for shape, spec, count, names in _weight_shapes(cfg):
        found = _constraints(steps, shape, spec)
        inside = [s for s in found if s["scans"][:len(scans)] == scans]
        stacked = _constraints(steps, (L,) + shape, (None,) + spec)
        if len(inside) < count:
            how = (f"; it constrains the stacked weights {form.spec_repr([None, *spec])} "
                   "outside the scan instead, which gathers every layer at once"
                   if stacked else "")
            _fail(f"traced {words}, `{name}` does not constrain the layer's {names} (shape "
                  f"{shape}) to the tensor-parallel layout {form.spec_repr(list(spec))} inside "
                  f"the body of the scan over the {L} layers{how}; expected that constraint "
                  "(the gather, one layer at a time).")


def _tables_gathered(name, steps, cfg, words):
    """embed, pos and unembed each constrained to P() (replicated) somewhere."""
    V, D, S = cfg.vocab, cfg.d_model, cfg.seq
    shapes = {"embed": (V, D), "pos": (S, D), "unembed": (D, V)}
    for table in TABLES:
        shape = shapes[table]
        needed = sum(1 for t in TABLES if shapes[t] == shape)
        found = len(_constraints(steps, shape, ()))
        if table == "pos":  # the rows the tokens use, gathered after slicing, do as well
            found += len(_constraints(steps, (S - 1, D), ()))
        if found < needed:
            _fail(f"traced {words}, `{name}` does not constrain `{table}` (shape {shape}) to its "
                  "Part A layout, replicated (P()); expected the embedding, position and "
                  "unembedding tables gathered before they are used.")


def _gathered_weights_not_kept(name, steps, cfg, words):
    """No forward scan hands a value of a layer weight's shape that it computed (a gathered
    weight) to the backward pass: the body is rematerialized."""
    D, F = cfg.d_model, cfg.d_ff
    weights = {(D, D), (D, F), (F, D)}
    for s in steps:
        if s["prim"] != "scan" or s.get("reverse") or s["length"] != cfg.n_layers:
            continue
        kept = sorted({tuple(y) for y in s.get("computed_ys", []) if tuple(y) in weights})
        if kept:
            count = sum(1 for y in s["computed_ys"] if tuple(y) in weights)
            _fail(f"traced {words}, the scan over the layers in `{name}` hands {count} gathered "
                  f"weight(s) per layer (shapes {kept}) to the backward pass, which then holds "
                  "every layer's gathered weights at once; expected the scan's body under "
                  "jax.checkpoint (with no policy that keeps the gathered weights), so that the "
                  "backward pass gathers each layer again.")


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
        _float32_loss(call, case["output"]["items"][0],
                      "only the operands of the matrix products are bfloat16; the loss is "
                      "computed and returned in float32")
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
        _no_round_trip("mp_loss", steps, case["words"], "")


def _no_round_trip(name, steps, words, as_in):
    trips = [s for s in steps if s.get("round_trip")]
    if trips:
        _fail(f"traced {words}, `{name}` rounds a float32 value of shape "
              f"{tuple(trips[0]['out'][0])} to bfloat16 and then computes with it in float32 (a "
              "norm's weights, say, cast with the parameters); expected only the matrix "
              "products' operands in bfloat16, everything else float32 at full precision"
              f"{as_in}.")


def _float32_loss(call, ev, why):
    if ev.get("dtype", "float32") != "float32":
        _fail(f"`{call}` returns its loss as {ev['dtype']}; expected float32 ({why}).")


def _operands(step):
    return " by ".join(f"{d}{tuple(s)}" for d, s in zip(step["in_dtypes"], step["in"]))


# ---- q6: gradient accumulation
class Accumulation(NamedTuple):
    batch: int
    n_micro: int


# one batch size: the cases share one reference step
ACCUMULATION_CASES = (Accumulation(batch=12, n_micro=3), Accumulation(batch=12, n_micro=1))
ACCUMULATION_MEMORY = (64, 8)  # batch, microbatches
ACCUMULATION_MEMORY_CFG = Config(vocab=64, d_model=64, n_heads=4, d_ff=256, n_layers=2, seq=32)
ACCUMULATION_MEMORY_RATIO = 0.5


def _distinct_rows(rng, cfg, batch):
    """Tokens whose rows all differ, so that a row of a microbatch names its place in the batch."""
    while True:
        tokens = _fresh_tokens(rng, cfg, batch, cfg.seq)
        if len({row.tobytes() for row in tokens}) == batch:
            return tokens


@contextlib.contextmanager
def _rows_seen(fn):
    """While inside, the notebook's `loss_fn` that ``fn`` calls by name records the rows of
    `tokens` each call is given (at run time, one record per microbatch); yields the records."""
    import jax

    names = getattr(fn, "__globals__", None)
    original = names.get("loss_fn") if isinstance(names, dict) else None
    seen = []
    if not callable(original):
        yield seen
        return

    def loss_fn(params, tokens, *args, **kwargs):
        jax.debug.callback(lambda rows: seen.append(np.asarray(rows)), tokens)
        return original(params, tokens, *args, **kwargs)

    names["loss_fn"] = loss_fn
    try:
        yield seen
    finally:
        names["loss_fn"] = original


def _row_numbers(seen, tokens, size):
    """Each recorded microbatch of ``size`` rows as the numbers of its rows in ``tokens``."""
    index = {row.tobytes(): i for i, row in enumerate(np.asarray(tokens))}
    return [[index.get(row.tobytes(), -1) for row in rows] for rows in seen
            if rows.ndim == 2 and rows.shape[0] == size]


def _probe_accumulation(values):
    import jax
    import jax.numpy as jnp

    fn = values.get("accumulated_loss_and_grad")
    ev = form.evidence_of({"accumulated_loss_and_grad": fn})
    if not callable(fn):
        return ev
    rng = _rng()
    ev["fresh"] = []
    cfg = _fresh_config(_sizes(60), model=1, data=2)  # one config: its reference compiles once
    params = _fresh_params(rng, cfg)
    for batch, n_micro in ACCUMULATION_CASES:
        tokens = _distinct_rows(rng, cfg, batch)
        case = {"cfg": list(cfg), "batch": batch, "n_micro": n_micro,
                "words": f"{_cfg_words(cfg, batch)} in {_count(n_micro, 'microbatch')}"}
        loss, grads = _reference_loss_and_grad(params, tokens, cfg.n_heads)
        case["reference"] = {"loss": loss, "grads": grads}
        run = jax.jit(lambda p, t, h=cfg.n_heads, n=n_micro: fn(p, t, h, n))
        with _rows_seen(fn) as seen:
            result = _call_jit(run, params, tokens)
            _quiet(jax.effects_barrier)
        if "error" in result:
            case["error"] = result["error"]
        else:
            case["output"] = form.evidence(result["output"])
            case["trace"] = _trace(run, params, tokens)
            case["microbatches"] = _row_numbers(seen, tokens, batch // n_micro)
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
        _float32_loss(call, case["output"]["items"][0],
                      "as jax.value_and_grad(loss_fn) returns it: accumulate the sums in float32")
        flat = _grads_tree(call, grads, ref["grads"])
        for path, leaf in sorted(flat.items()):
            if leaf.get("dtype", "float32") != "float32":
                _fail(f"the gradient of params{_path_words(path)} from `{call}` is "
                      f"{leaf['dtype']}; expected float32, as jax.value_and_grad(loss_fn) "
                      "returns it (accumulate the sums in float32).")
        form.expect_close(call + "'s loss", loss, ref["loss"],
                          "the whole batch's loss_fn(params, tokens, n_heads)",
                          rtol=GRAD_RTOL, atol=GRAD_ATOL)
        _compare_grads(call, flat, ref["grads"],
                       "the whole batch's gradient of loss_fn in that parameter")
        steps = _steps_of("accumulated_loss_and_grad", case["trace"])
        n = case["n_micro"]
        loops = [s for s in steps if s["prim"] == "scan" and not s["scans"]
                 and s["length"] == n]
        cfg = Config(*case["cfg"])
        if not loops:
            lengths = sorted({s["length"] for s in steps if s["prim"] == "scan"
                              and not s["scans"]})
            layers = (f"; a length of {cfg.n_layers} is the scan over the {cfg.n_layers} "
                      "layers, inside the model" if cfg.n_layers in lengths else "")
            _fail(f"traced {case['words']}, `accumulated_loss_and_grad` has no lax.scan of "
                  f"length {n} (over the microbatches) at its top level (the scans there have "
                  f"lengths {lengths or 'none'}{layers}); expected one scan over the "
                  "microbatches.")
        D, F, L, V = cfg.d_model, cfg.d_ff, cfg.n_layers, cfg.vocab
        weights = {(L, D, D), (L, D, F), (L, F, D), (V, D), (D, V)}
        if all(any(len(shape) > 1 and shape[0] == n and tuple(shape[1:]) in weights
                   for shape in loop["out"][loop["carry"]:]) for loop in loops):
            _fail(f"traced {case['words']}, the scan over the microbatches in "
                  "`accumulated_loss_and_grad` returns every microbatch's gradient, stacked "
                  f"({n} of them), and they are averaged afterwards; expected the scan to carry "
                  "running sums, so that one microbatch's gradient is held at a time.")
        size = case["batch"] // n
        for rows in case.get("microbatches", []):
            first = rows[0]
            if rows != list(range(first, first + size)) or first % size:
                _fail(f"`{call}` gives loss_fn a microbatch of the rows {rows} of `tokens`; "
                      f"expected consecutive rows (the first microbatch rows 0 to {size - 1}, "
                      f"the next {size} to {2 * size - 1}, and so on).")
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


@contextlib.contextmanager
def _orbax_reads():
    """While inside, every array Orbax restores is recorded: its name in the checkpoint and the
    evidence of its layout as read (None: read into a NumPy array on the host)."""
    ocp = _orbax()
    handlers = [h for h in (ocp.type_handlers.ArrayHandler, ocp.type_handlers.NumpyHandler,
                            ocp.type_handlers.ScalarHandler)]
    originals = {h: h.__dict__.get("deserialize") for h in handlers}
    reads = []

    def watched(original):
        async def deserialize(self, infos, args=None):
            out = await original(self, infos, args)
            for info, x in zip(infos, out):
                reads.append([str(info.name), form.sharding_evidence(x.sharding)
                              if hasattr(x, "sharding") else None])
            return out
        return deserialize

    for h in handlers:
        if originals[h] is not None:
            h.deserialize = watched(originals[h])
    try:
        yield reads
    finally:
        for h in handlers:
            if originals[h] is not None:
                h.deserialize = originals[h]


def _written(ocp, path, state):
    """How the checkpoint at ``path`` holds each array: the sharding its metadata records, its
    chunks, and the block one device held of the array saved."""
    import jax

    with ocp.StandardCheckpointer() as checkpointer:
        meta = checkpointer.metadata(path)
    meta = getattr(meta, "item_metadata", meta)
    leaves = {}
    for keys, info in jax.tree_util.tree_flatten_with_path(
            dict(meta), is_leaf=lambda m: hasattr(m, "storage"))[0]:
        path_ = tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in keys)
        sharding = getattr(info, "sharding", None)
        spec = getattr(sharding, "partition_spec", None)
        leaves["/".join(map(str, path_))] = {
            "sharding": None if sharding is None else
            [form._spec_entry(e) for e in (spec or ())],
            "chunks": [int(n) for n in (getattr(info.storage, "chunk_shape", None) or ())]}
    blocks = {}
    for keys, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        path_ = "/".join(str(getattr(k, "key", k)) for k in keys)
        blocks[path_] = [int(n) for n in x.sharding.shard_shape(x.shape)]
    return {"leaves": leaves, "blocks": blocks}


def _probe_checkpoint(values):
    import jax
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
    # the layouts the student's own fsdp_specs gives (what their restore_state may build on)
    specs = getattr(restore, "__globals__", {}).get("fsdp_specs")
    if callable(specs):
        try:
            ev["their_fsdp_specs"] = _spec_tree_evidence(_quiet(specs, params))
        except Exception:
            pass
    with tempfile.TemporaryDirectory() as root:
        # the student's save: its metadata, then read back by Orbax itself onto one device
        path = os.path.join(root, "saved_by_you")
        try:
            _quiet(save, path, state)
        except Exception as exc:
            ev["saved"] = {"kind": "error", "error": _error(exc)}
        else:
            ev["listing"] = sorted(os.listdir(path)) if os.path.isdir(path) else None
            try:
                ev["written"] = _written(ocp, path, state)
            except Exception as exc:
                ev["written"] = {"error": f"{type(exc).__name__}"}
            one = NamedSharding(_mesh((1, 1), 1), P())
            target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one),
                                  abstract)
            try:
                with ocp.StandardCheckpointer() as checkpointer:
                    ev["saved"] = form.evidence(_quiet(checkpointer.restore, path, target))
            except Exception as exc:
                ev["saved"] = {"kind": "error", "error": f"{type(exc).__name__}"}
        # Orbax's own save, restored by the student's function onto other meshes
        path = os.path.join(root, "saved_by_orbax")
        with ocp.StandardCheckpointer() as checkpointer:
            _quiet(checkpointer.save, path, state)
            checkpointer.wait_until_finished()
        ev["restored"] = []
        for data, model, count in RESTORE_CASES:
            record = {"mesh": [data, model], "devices": count}
            with _orbax_reads() as reads:
                try:
                    out = _quiet(restore, path, abstract, _mesh((data, model), count))
                    record["output"] = form.evidence(jax.block_until_ready(out))
                except Exception as exc:
                    record["error"] = _error(exc)
            record["reads"] = reads
            ev["restored"].append(record)
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
    call = "save_state(path, state)"
    if saved["kind"] == "error" and "listing" not in ev:
        _fail(f"`{call}` raised {saved['error']} for a state of parameters in the fsdp_specs "
              "layout on a 4 × 2 mesh and a step.")
    written = ev.get("written", {})
    if "error" in written:
        listing = ev.get("listing")
        there = ("nothing at `path`" if listing is None else
                 f"at `path` the entries {listing}")
        _fail(f"after `{call}` returned, Orbax found no checkpoint at `path` ({there}); expected "
              "the state saved to the directory `path` itself (ocp.StandardCheckpointer().save"
              "(path, state)), complete when save_state returns (wait_until_finished).")
    found = set(written.get("leaves", {}))
    wanted = {"/".join(p) for p in reference}
    if found != wanted:
        _fail(f"the checkpoint `{call}` wrote holds {sorted(found)}; expected the whole state, "
              f"{sorted(wanted)} (the parameters and the step).")
    for key in sorted(wanted):
        if not key.startswith("params/"):
            continue
        leaf, block = written["leaves"][key], written["blocks"][key]
        chunks = leaf["chunks"]
        inside = len(chunks) == len(block) and all(c and b % c == 0
                                                   for c, b in zip(chunks, block))
        if leaf["sharding"] is None or not inside:
            how = ("no sharding recorded" if leaf["sharding"] is None else
                   f"the sharding {form.spec_repr(leaf['sharding'])}")
            _fail(f"the checkpoint `{call}` wrote holds state['params']"
                  f"{_path_words(tuple(key.split('/'))[1:])} in chunks of {tuple(chunks)} with "
                  f"{how}: it was saved from a copy on the host (jax.device_get or np.asarray, "
                  f"say); expected it saved as it is laid out, each device writing its own "
                  f"block {tuple(block)}, its sharding recorded: hand Orbax the sharded arrays.")
    if saved["kind"] == "error":
        _fail(f"a state saved with `{call}` could not be restored by Orbax's "
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
    theirs = ev.get("their_fsdp_specs", {})
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
                given = theirs.get("/".join(path[1:]), {})
                if path[0] == "params" and sharding.get("mesh_shape") == shape and \
                        given.get("kind") == "spec" and \
                        _canonical(given["entries"]) == _canonical(sharding.get("spec", [])):
                    _fail(f"`{call}`{_path_words(path)} is laid out "
                          f"{form.spec_repr(sharding['spec'])}, as your `fsdp_specs` lays it "
                          f"out; expected {form.spec_repr(list(wanted))}, as Part B's table "
                          "says: fix "
                          "`fsdp_specs` (Task 3), and restore_state, which builds on it, "
                          "follows.")
                _fail(f"`{call}`{_path_words(path)} is laid out "
                      f"{form.describe_sharding(sharding)}; expected {what}, "
                      f"{form.spec_repr(list(wanted))} on the {shape[0]} × {shape[1]} mesh "
                      "given.")
        for name, read in record["reads"]:
            path = tuple(name.split("."))
            if path[0] != "params" or len(path) < 2:
                continue
            wanted = _fsdp_spec(path[1:])
            if read is None or read.get("mesh_shape") != shape or \
                    _canonical(read.get("spec", ["?"])) != _canonical(list(wanted)):
                how = ("into a NumPy array on the host" if read is None else
                       form.describe_sharding(read))
                _fail(f"`{call}` has Orbax read state{_path_words(path)} {how}, and the "
                      "array is moved into its layout afterwards; expected a restore target "
                      f"whose shardings are that layout ({form.spec_repr(list(wanted))} on the "
                      "mesh given), so that each device reads just its blocks.")


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
        if out["kind"] != "number":
            _fail(f"`{call}` returned {form.describe(out)}; expected a Python int.")
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
            value = out["value"]
            shown = f"{int(value):,d}" if float(value).is_integer() else f"{value:,.6g}"
            _fail(f"`{call}` is {shown}; expected {wanted:,d}: 3 × (per layer "
                  "2·B·S·(4·D² + 2·D·F) + 2 · 2·B·S·S·D, and once 2·B·S·D·V)." + hint)
        if out.get("type") != "int":
            _fail(f"`{call}` is the right number, {wanted:,d}, but of type {out['type']}; "
                  "expected a Python int.")


# ---- q9: timing and MFU
_CLOCK = time.perf_counter  # the fake steps' own clock: the student's calls are counted apart
# names that read time.perf_counter in a function's code (a `from time import perf_counter`
# binds the function before the probe can count its calls; timeit's default_timer is it too)
PERF_COUNTER_NAMES = {"perf_counter", "perf_counter_ns", "default_timer"}


class _Done:
    """What a fake step returns: done at ``at`` (perf_counter); blocking waits until then."""

    def __init__(self, at):
        self.at = at

    def block_until_ready(self):
        time.sleep(max(0.0, self.at - _CLOCK()))
        return self

    def __array__(self, dtype=None, copy=None):
        self.block_until_ready()
        return np.zeros((), dtype or np.float32)

    def __float__(self):
        self.block_until_ready()
        return 0.0


class _FakeStep:
    """A step whose first call compiles for ``compile_s`` (the caller waits) and queues a
    slower first run (``work[0] + FIRST_RUN_S``, as a real first run allocates and warms up),
    and whose later calls queue ``work[i]`` of work each (in turn) behind the previous call's,
    as JAX dispatches them. It returns one result, or a tuple of two as the run's train_step."""

    def __init__(self, compile_s, work, args, result="array"):
        self.compile_s, self.work, self.args, self.result = compile_s, work, args, result
        self.calls, self.busy_until, self.bad_args = 0, 0.0, False

    def __call__(self, *args):
        if len(args) != len(self.args) or any(a is not b for a, b in zip(args, self.args)):
            self.bad_args = True
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.compile_s)
            work = self.work[0] + FIRST_RUN_S
        else:
            work = self.work[(self.calls - 2) % len(self.work)]
        self.busy_until = max(_CLOCK(), self.busy_until) + work
        done = _Done(self.busy_until)
        return (done, _Done(self.busy_until)) if self.result == "tuple" else done


class TimingCase(NamedTuple):
    compile: float  # seconds the first call takes before it returns
    work: tuple  # seconds of queued work of each timed call, in turn
    repeats: int
    result: str  # "array", or "tuple" as the run's train_step returns (state, loss)


# chosen so that the usual mistakes (milliseconds, no division by repeats, compilation timed,
# the first run timed, the fastest or the median call reported) measure times at least 25% from
# the mean and from each other
TIMING_CASES = (TimingCase(compile=0.25, work=(0.03,), repeats=3, result="array"),
                TimingCase(compile=0.2, work=(0.01, 0.01, 0.04), repeats=6, result="tuple"))
FIRST_RUN_S = 0.1
TIMING_LOW, TIMING_HIGH, TIMING_SLACK = 0.9, 1.5, 0.004
MFU_CASES = 4


def _code_names(code):
    """The global and attribute names a code object and the functions inside it read."""
    if code is None:
        return set()
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def _probe_timing(values):
    time_step, mfu = values.get("time_step"), values.get("mfu")
    ev = form.evidence_of({"time_step": time_step, "mfu": mfu})
    rng = _rng()
    if callable(time_step):
        ev["timing"] = []
        for compile_s, work, repeats, result in TIMING_CASES:
            args = (object(), int(rng.integers(1, 100)))
            step = _FakeStep(compile_s, work, args, result)
            record = {"compile": compile_s, "work": list(work), "repeats": repeats,
                      "result": result}
            counted = []
            time.perf_counter = lambda: counted.append(1) or _CLOCK()
            try:
                record["output"] = form.evidence(_quiet(time_step, step, args, repeats))
            except Exception as exc:
                record["output"] = {"kind": "error", "error": _error(exc)}
            finally:
                time.perf_counter = _CLOCK
            record["perf_counter_calls"] = len(counted)
            record.update(calls=step.calls, bad_args=step.bad_args)
            ev["timing"].append(record)
        ev["code_names"] = sorted(_code_names(getattr(time_step, "__code__", None)))
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
        timed = [work[i % len(work)] for i in range(repeats)]
        mean = sum(timed) / repeats
        each = (f"takes {work[0] * 1e3:.0f} ms of queued work per call" if len(set(work)) == 1
                else "whose calls take " + ", ".join(f"{w * 1e3:.0f}" for w in work[:-1]) +
                f" and {work[-1] * 1e3:.0f} ms of queued work in turn")
        returns = "returns a tuple, " if record["result"] == "tuple" else ""
        call = (f"time_step(step, args, {repeats}) for a step that compiles in "
                f"{compile_s * 1e3:.0f} ms on its first call, runs {FIRST_RUN_S * 1e3:.0f} ms "
                f"longer the first time, {returns}and then {each}")
        out = record["output"]
        if out["kind"] == "error":
            hint = (" The step returns a tuple, as the run's train_step returns (state, loss): "
                    "block on the whole result with jax.block_until_ready(out), which takes any "
                    "pytree." if record["result"] == "tuple" and "tuple" in out["error"] else "")
            _fail(f"`{call}` raised {out['error']}; it should time any step it is given.{hint}")
        if out["kind"] != "number" or out.get("is_int"):
            _fail(f"`{call}` returned {form.describe(out)}; expected a Python float.")
        if record["bad_args"]:
            _fail(f"`{call}` did not call step(*args) with the arguments given.")
        if record["calls"] != repeats + 1:
            _fail(f"`{call}` called the step {record['calls']} times; expected {repeats + 1}: "
                  f"once to compile, then {repeats} timed calls.")
        if record.get("perf_counter_calls", 2) < 2 and \
                not PERF_COUNTER_NAMES & set(ev.get("code_names", PERF_COUNTER_NAMES)):
            _fail(f"`{call}` called time.perf_counter() {record['perf_counter_calls']} "
                  "time(s) and reads no perf_counter; expected the clock the task names, "
                  "time.perf_counter(): a monotonic clock of the best resolution available, "
                  "where time.time() follows the system's wall clock, which can be set or "
                  "adjusted while you time.")
        seconds = out["value"]
        if TIMING_LOW * mean <= seconds <= TIMING_HIGH * mean + TIMING_SLACK:
            continue
        # the nearest of the usual mistakes, if one is near (the cases keep them apart)
        mistakes = {
            mean * 1e3: " That is in milliseconds; return seconds.",
            mean * repeats: f" That is the time of all {repeats} calls: divide by repeats.",
            mean + (compile_s + FIRST_RUN_S) / repeats:
                " That includes the first call's compilation: call the step once before "
                "starting the clock.",
            mean + FIRST_RUN_S / repeats:
                " That includes the first call's run: block on its result before starting "
                "the clock."}
        near = min(mistakes, key=lambda v: abs(math.log(max(seconds, 1e-12) / v)))
        hint = mistakes[near] if abs(math.log(max(seconds, 1e-12) / near)) < math.log(1.25) \
            else ""
        if seconds < 0.5 * min(timed):  # faster than any call: the work was not waited for
            hint = (" JAX returns before the work is done: block on the result "
                    "(jax.block_until_ready) before stopping the clock.")
        elif seconds < TIMING_LOW * mean:  # between the fastest call and the mean
            hint = (" That is less than the mean of the calls, as the fastest call" + (
                " or the median" if sorted(timed)[repeats // 2] < mean else "") +
                f" is; return the mean of the {repeats} calls (their total over repeats).")
        _fail(f"`{call}` measured {seconds * 1e3:.2f} ms per step; expected about "
              f"{mean * 1e3:.0f} ms, the mean of the {repeats} timed calls.{hint}")
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


# ---- q10: the composed step
Q10_MESHES = (MeshShape(data=2, model=4),)  # not the notebook's 4 x 2: the mesh given is used
Q10_MICRO = 2
STRUCTURAL_REMAT = STRUCTURAL | {"remat2", "checkpoint", "remat"}


def _probe_composed(values):
    import jax

    fn = values.get("composed_loss_and_grad")
    ev = form.evidence_of({"composed_loss_and_grad": fn})
    if not callable(fn):
        return ev
    rng = _rng()
    ev["fresh"] = []
    for k, (data, model) in enumerate(Q10_MESHES):
        form.free_kernel_memory()  # the previous case's programs (768 MB containers)
        sizes = _sizes(100 + k)
        cfg = _fresh_config(sizes, model=model, data=data, n_layers=int(sizes.integers(2, 4)))
        while cfg.d_ff == cfg.d_model:
            cfg = cfg._replace(d_ff=cfg.d_ff + model * data)
        # a batch other than n_micro ** 2 rows: microbatches reshaped with their two sizes
        # swapped then make a scan of another length (with 4 rows in 2 they were the same)
        batch = data * Q10_MICRO * 2
        params, tokens = _fresh_params(rng, cfg), _fresh_tokens(rng, cfg, batch, cfg.seq)
        mesh = _mesh((data, model))
        sharded = _shard(params, mesh, _fsdp_spec)
        data_tokens = _put(tokens, mesh, "data", None)
        run = jax.jit(lambda p, t, mesh=mesh, h=cfg.n_heads: fn(p, t, mesh, h, Q10_MICRO))
        case = {"mesh": [data, model], "cfg": list(cfg), "batch": batch, "n_micro": Q10_MICRO,
                "words": f"{_cfg_words(cfg, batch)} in {Q10_MICRO} microbatches, on a {data} × "
                         f"{model} mesh"}
        loss, grads = _reference_loss_and_grad(params, tokens, cfg.n_heads)
        case["reference"] = {"loss": loss, "grads": grads}
        result = _call_jit(run, sharded, data_tokens)
        if "error" in result:
            case["error"] = result["error"]
        else:
            case["output"] = form.evidence(result["output"])
            case["trace"] = _trace(run, sharded, data_tokens)
        ev["fresh"].append(case)
    return ev


def _q10(ev):
    name = "composed_loss_and_grad"
    form.expect_callable(name, ev[name])
    for case in ev["fresh"]:
        call = f"{name}(params, tokens, mesh, n_heads, n_micro) {case['words']}"
        if "error" in case:
            _fail(f"`{call}` under jax.jit raised {case['error']}; it should work for any "
                  "config, mesh and n_micro the task allows.")
        cfg, n, words = Config(*case["cfg"]), case["n_micro"], case["words"]
        ref = case["reference"]
        loss, grads = _pair(call, case["output"])
        _float32_loss(call, case["output"]["items"][0],
                      "only the operands of the matrix products are bfloat16")
        if loss != loss or abs(loss - ref["loss"]) > MP_LOSS_RTOL * abs(ref["loss"]):
            _fail(f"the loss `{call}` returned is {loss:.5g}; expected within "
                  f"{MP_LOSS_RTOL:.0%} of loss_fn's {ref['loss']:.5g}.")
        flat = _grads_tree(call, grads, ref["grads"])
        for path, expected in _leaves(ref["grads"]):
            leaf = flat[path]
            if leaf.get("dtype") != "float32":
                _fail(f"the gradient of params{_path_words(path)} from `{call}` is "
                      f"{form.describe(leaf)}; expected float32 (the master parameters stay "
                      "float32; cast them inside the function).")
            gap = np.linalg.norm(np.asarray(leaf["value"], np.float64) - expected)
            size = max(np.linalg.norm(expected), 1e-12)
            if not gap <= MP_GRAD_RELATIVE * size:
                _fail(f"the gradient of params{_path_words(path)} from `{call}` is "
                      f"{gap / size:.1%} away from loss_fn's (the norm of the difference over "
                      f"the norm of the float32 gradient); expected within "
                      f"{MP_GRAD_RELATIVE:.0%}.")
            wanted = _fsdp_spec(path)
            sharding = leaf.get("sharding", {})
            if _canonical(sharding.get("spec", ["?"])) != _canonical(list(wanted)):
                _fail(f"the gradient of params{_path_words(path)} from `{call}` is laid out "
                      f"{form.describe_sharding(sharding) if sharding else 'off the mesh'}; "
                      f"expected the fsdp_specs layout {form.spec_repr(list(wanted))}.")
        steps = _steps_of(name, case["trace"])
        _other_meshes(name, steps, case["mesh"], words)
        loops = [s for s in steps if s["prim"] == "scan" and not s["scans"]
                 and s["length"] == n]
        if not loops:
            lengths = sorted({s["length"] for s in steps if s["prim"] == "scan"
                              and not s["scans"]})
            _fail(f"traced {words}, `{name}` has no lax.scan of length {n} (over the "
                  f"microbatches) at its top level (the scans there have lengths "
                  f"{lengths or 'none'}); expected one scan over the microbatches, as in "
                  "Task 6.")
        D, F, L = cfg.d_model, cfg.d_ff, cfg.n_layers
        stacked = {(n, L, D, D), (n, L, D, F), (n, L, F, D)}
        if all(any(tuple(shape) in stacked for shape in loop["out"][loop["carry"]:])
               for loop in loops):
            _fail(f"traced {words}, the scan over the microbatches in `{name}` returns every "
                  "microbatch's gradient, stacked, and they are averaged afterwards; expected "
                  "the scan to carry running sums, as in Task 6.")
        _layers_gathered(name, steps, cfg, words, [n, L])
        _tables_gathered(name, steps, cfg, words)
        _gathered_weights_not_kept(name, steps, cfg, words)
        dots = [s for s in steps if s["prim"] == "dot_general"]
        for s in dots:
            if s["in_dtypes"] == ["float32", "float32"]:
                _fail(f"traced {words}, `{name}` multiplies {_operands(s)}; expected every "
                      "matrix product of the model to take bfloat16 operands, as in Task 5.")
        low = [s for s in dots if s["in_dtypes"] == ["bfloat16", "bfloat16"]]
        for s in low:
            if s.get("preferred") != "float32" or s["out_dtypes"] != ["float32"]:
                _fail(f"traced {words}, `{name}` multiplies {_operands(s)} into "
                      f"{s['out_dtypes'][0]}{tuple(s['out'][0])}; expected it accumulated and "
                      "returned in float32 (preferred_element_type=jnp.float32).")
        runs = sum(math.prod(s["scans"]) for s in low)
        if runs < n * (8 * L + 1):
            _fail(f"traced {words}, `{name}` runs {runs} bfloat16 matrix product(s); expected "
                  f"at least the model's 8 per layer and the unembedding for each of the {n} "
                  f"microbatches, {n * (8 * L + 1)} in all.")
        bad = [s for s in steps if s["prim"] not in STRUCTURAL_REMAT
               and "bfloat16" in s["out_dtypes"]]
        if bad:
            _fail(f"traced {words}, `{name}` computes `{bad[0]['prim']}` in bfloat16 (shape "
                  f"{tuple(bad[0]['out'][0])}); expected everything but the matrix products' "
                  "operands to stay float32, as in Task 5.")
        _no_round_trip(name, steps, words, ", as in Task 5")


# =========================================================================== questions
def _freed(probe):
    """``probe``, run after the kernel gives back what it compiled so far (as in Lab 6)."""

    @functools.wraps(probe)
    def run(values):
        form.free_kernel_memory()
        return probe(values)

    return run


# the notebook's own names that a question's public check reads besides its graded ones (its
# inputs and references; no cell after the question reassigns them)
NOTEBOOK = {
    "q1": " params",
    "q2": " forward cfg mesh params tokens",
    "q3": " params",
    "q4": " loss_fn cfg mesh params tokens",
    "q5": " loss_fn cfg params tokens",
    "q6": " loss_fn cfg params tokens",
    "q7": " cfg devices mesh params",
    "q8": " loss_fn cfg params tokens",
    "q10": " loss_fn cfg mesh params tokens",
}
QUESTIONS = {
    # Part A
    "q1_tp_specs": form.question("tp_specs" + NOTEBOOK["q1"], _q1, _probe_specs("tp_specs")),
    "q2_tp_forward": form.question("tp_forward" + NOTEBOOK["q2"], _q2,
                                   _freed(_probe_tp_forward)),
    # Part B
    "q3_fsdp_specs": form.question("fsdp_specs" + NOTEBOOK["q3"], _q3,
                                   _probe_specs("fsdp_specs")),
    "q4_fsdp_step": form.question("fsdp_loss_and_grad" + NOTEBOOK["q4"], _q4,
                                  _freed(_probe_fsdp)),
    # Part C
    "q5_mixed_precision": form.question("mp_loss" + NOTEBOOK["q5"], _q5, _freed(_probe_mixed)),
    "q6_accumulation": form.question("accumulated_loss_and_grad" + NOTEBOOK["q6"], _q6,
                                     _freed(_probe_accumulation)),
    # Part D
    "q7_checkpoint": form.question("save_state restore_state" + NOTEBOOK["q7"], _q7,
                                   _freed(_probe_checkpoint)),
    # Part E
    "q8_step_flops": form.question("step_flops" + NOTEBOOK["q8"], _q8, _probe_flops),
    "q9_utilisation": form.question("time_step mfu", _q9, _probe_timing),
    # Part F
    "q10_composed_step": form.question("composed_loss_and_grad" + NOTEBOOK["q10"], _q10,
                                       _freed(_probe_composed)),
}
probe, verdict, check = form.entry_points(QUESTIONS)
JAXLAB_CHECKS = 1  # declares the probe/verdict contract `jaxlab grade` relies on
