"""Lab 6's checks: what the answer corpus cannot show.

The corpus (tests/answers/lab6-memory) grades student-like answers through the real zip; this
file checks the checks' own machinery: how a traced program is read, that the sharded products
the verdict compiles are the notebook's, that the cost rules read off the compiled program are
the table's, that the fresh draws of Parts B-D keep float rounding well inside the tolerances
and hit every case they must, and that the Adam variants the messages name are really apart.
"""

import ast
import math
import pathlib

import jax
import jax.numpy as jnp
import nbformat
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import NamedSharding, PartitionSpec as P

from labs import ROOT, release_paths
from jaxlab.checks import form, lab6

RNG = np.random.default_rng(20261125)


# --------------------------------------------------------------------------- reading programs
def test_program_reader_counts_scan_steps_nesting_and_what_made_a_named_value():
    def loss(params, x):
        @jax.checkpoint
        def body(h, W):
            z = checkpoint_name(jnp.einsum("bd,df->bf", h, W), "hidden")  # a dot inside a jit
            return jnp.tanh(z), None

        return jnp.sum(lax.scan(body, x, params)[0])

    program = lab6._program(jax.make_jaxpr(loss)(jnp.ones((5, 4, 4)), jnp.ones((3, 4))))
    steps = program["steps"]
    scan = next(i for i, s in enumerate(steps) if s["prim"] == "scan")
    remat = next(i for i, s in enumerate(steps) if s["prim"] in lab6.REMAT)
    named = next(s for s in steps if s["prim"] == "name")
    assert steps[scan]["length"] == 5 and steps[scan]["nested"][0] <= remat < \
        steps[scan]["nested"][1]
    assert named["name"] == "hidden" and named["made_by"] == ["dot_general"]
    assert named["times"] == 5 and named["out"] == [[3, 4]]
    assert lab6._remat_scan("loss", program, 5)  # the remat inside the scan is found
    with pytest.raises(AssertionError, match="does not loop over its 7 layers"):
        lab6._remat_scan("loss", program, 7)


def test_residuals_are_read_from_print_saved_residuals():
    def loss(W, x):
        return jnp.sum(jnp.tanh(x @ W))

    rows = lab6._residuals(loss, jnp.ones((4, 6)), jnp.ones((3, 4)))["residuals"]
    assert {"dtype": "f32", "shape": [3, 6], "source": rows[-1]["source"]} in rows
    assert any(r["source"].startswith("from the argument") for r in rows)


# --------------------------------------------------------------------------- Part D's programs
def _function_source(tree, name):
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    return ast.unparse(node.body[-1])  # the dict of programs it returns


def test_the_verdict_compiles_the_notebooks_case_programs():
    notebook = "\n".join(c.source for c in __import__("nbformat").read(
        release_paths("lab6-memory")["master"], as_version=4).cells if c.cell_type == "code"
        and "def case_programs" in c.source)
    checks = open(lab6.__file__).read()
    assert _function_source(ast.parse(notebook), "case_programs") == \
        _function_source(ast.parse(checks), "_case_programs")


@pytest.mark.parametrize("I, J, K, n", lab6.COST_CASES)
def test_the_tables_rules_match_the_compiled_collectives(I, J, K, n):
    expected = {1: ("none", 0), 2: ("all-gather", (n - 1) / n * 4 * J * K),
                3: ("all-reduce", 2 * (n - 1) / n * 4 * I * K),
                4: ("reduce-scatter", (n - 1) / n * 4 * I * K)}
    for case, (kind, sent) in expected.items():
        flops, collectives = lab6._compiled_case(case, I, J, K, n)
        found = collectives[0] if collectives else ("none", [])
        # cost_analysis also counts one addition per element of an all-reduce's result
        additions = math.prod(found[1]) if found[0] == "all-reduce" else 0
        assert math.isclose(flops - additions, 2 * I * J * K / n, rel_tol=lab6.FLOPS_RTOL)
        assert found[0] == kind and len(collectives) <= 1
        assert math.isclose(lab6._collective_bytes(*found, n), sent)


# --------------------------------------------------------------------------- fresh draws
def test_roofline_draws_cover_every_bound_and_batch_case_away_from_ties():
    def time_fn(flops, hbm, comm, chip):
        return lab6._roofline(flops, hbm, comm, chip)[:2]

    bounds, batches = set(), []
    for _ in range(30):
        ev = lab6._probe_roofline({"roofline_time": time_fn,
                                   "critical_batch": lambda D, F, c: lab6._critical(D, F, c)[0]})
        lab6.verdict("q9_roofline", ev)
        bounds |= {out["items"][1]["value"] for *_, out in ev["fresh"]["time"]}
        assert any(comm == 0 for _, _, comm, _, _ in ev["fresh"]["time"])
        drawn, exact_cases = (ev["fresh"]["batch"][:len(lab6.BATCH_KINDS)],
                              ev["fresh"]["batch"][len(lab6.BATCH_KINDS):])
        for D, F, chip, _ in drawn:
            batch, exact = lab6._critical(D, F, chip)
            batches.append(batch)
            assert exact is None or abs(exact - round(exact)) >= lab6.TIE_MARGIN * exact
        # the boundaries themselves, exactly: a knee on an integer (compute time == memory
        # time there, in float arithmetic too), a zero denominator, a denominator below 1
        for kind, (D, F, chip, _) in zip(lab6.EXACT_KINDS, exact_cases, strict=True):
            batch, exact = lab6._critical(D, F, chip)
            peak, bandwidth = chip["flop_per_s"], chip["hbm_bytes_per_s"]
            if kind == "knee":
                assert exact == batch > 1
                assert 2 * batch * D * F / peak == 2 * (batch * D + D * F + batch * F) / bandwidth
            elif kind == "zero":
                assert batch is None and D * F * bandwidth - peak * (D + F) == 0
            else:
                assert batch == 1 and 0 < D * F * bandwidth - peak * (D + F) <= 1
    assert bounds == set(lab6.BOUNDS)
    assert None in batches and 1 in batches and max(b or 0 for b in batches) > 100
    assert [b is None for b in batches[:len(lab6.BATCH_KINDS)]] == [
        kind == "never" for kind in lab6.BATCH_KINDS]


def _sharded_adam_in_float32(W, batches):
    """The ZeRO step as the devices compute it: 8 partial gradients summed in float32."""
    f32 = np.float32
    W = W.astype(f32)
    m, v = np.zeros_like(W), np.zeros_like(W)
    for t, (x, y) in enumerate(batches, start=1):
        partial_grads = []
        for xs, ys in zip(np.split(x, 8), np.split(y, 8)):
            pred = np.tanh(xs @ W)
            partial_grads.append(xs.T @ (f32(2) * (pred - ys) / f32(len(xs)) * (1 - pred ** 2)))
        g = (np.sum(partial_grads, axis=0) / f32(8)).astype(f32)
        m = (f32(lab6.B1) * m + f32(1 - lab6.B1) * g).astype(f32)
        v = (f32(lab6.B2) * v + f32(1 - lab6.B2) * g * g).astype(f32)
        W = (W - f32(lab6.LR) * (m / f32(1 - lab6.B1 ** t))
             / (np.sqrt(v / f32(1 - lab6.B2 ** t)) + f32(lab6.EPS))).astype(f32)
    return W, m, v


def test_zero_draws_keep_float32_rounding_well_inside_the_tolerances():
    worst = [0.0, 0.0, 0.0]
    for _ in range(150):
        for d_in, d_out, batch in ((8, 3, 8), (40, 11, 24)):
            W, batches = lab6._fresh_zero(RNG, d_in, d_out, batch)
            reference, smallest = lab6._zero_reference(W, batches)
            assert smallest > lab6.ZERO_GRAD_MARGIN
            found = _sharded_adam_in_float32(W, batches)
            for i, (f, r, atol) in enumerate(zip(found, reference, (
                    lab6.ZERO_ATOL, lab6.ZERO_MOMENT_ATOL, lab6.ZERO_MOMENT_ATOL))):
                worst[i] = max(worst[i], float(np.max(np.abs(f - r) / (atol + lab6.ZERO_RTOL
                                                                       * np.abs(r)))))
    assert max(worst) < 0.1, worst  # at most a tenth of the tolerance


def test_adam_variants_named_in_messages_are_far_from_adam_on_the_fresh_draws():
    for large_eps in (False, True):
        hyper = lab6._hyper(RNG, large_eps=large_eps)
        param = RNG.uniform(-0.1, 0.1, 6)
        grad = lab6._gradient_draw(RNG, 6)
        right = lab6._adam(param, grad, 0 * param, 0 * param, 1, **hyper)[0]
        for variant, _ in lab6.ADAM_VARIANTS:
            if "eps_inside" in variant and not large_eps:
                continue  # eps of 1e-8 inside or outside the root: the same numbers
            wrong = lab6._adam(param, grad, 0 * param, 0 * param, 1, **hyper, **variant)[0]
            assert not np.allclose(wrong, right, rtol=lab6.ADAM_RTOL, atol=lab6.ADAM_ATOL)


def test_float32_attention_stays_well_inside_the_tolerances_of_both_kinds_of_draws():
    @jax.jit
    def attention(q, k, v):
        s = jnp.where(jnp.tri(q.shape[0], dtype=bool), q @ k.T / jnp.sqrt(q.shape[1]), -jnp.inf)
        return jax.nn.softmax(s, axis=-1) @ v

    worst = {False: 0.0, True: 0.0}
    for S, d in [(40, 40), (40, 3)] * 20:  # the largest sizes drawn: rounding grows with them
        for large in (False, True):
            q, k, v = lab6._attention_draw(RNG, S, d, large=large)
            if large:
                top = np.max(np.abs(q.astype(np.float64) @ k.T)) / np.sqrt(d)
                assert math.isclose(top, lab6.ATTENTION_LARGE, rel_tol=1e-3)
            rtol, atol = (lab6.LARGE_RTOL, lab6.LARGE_ATOL) if large else (lab6.RTOL, lab6.ATOL)
            gap = np.abs(np.asarray(attention(q, k, v), np.float64)
                         - lab6._attention_reference(q, k, v))
            worst[large] = max(worst[large], float(np.max(
                gap / (atol + rtol * np.abs(lab6._attention_reference(q, k, v))))))
    assert max(worst.values()) < 0.2, worst


# --------------------------------------------------------------------------- messages
@jax.jit
def _maximum_before_the_mask(q, k, v):
    """The corpus's wrong answer: each query's maximum over every key, then the mask."""
    s = q @ k.T / jnp.sqrt(q.shape[1])
    s = jnp.where(jnp.tri(q.shape[0], dtype=bool), s, -jnp.inf) - s.max(axis=1, keepdims=True)
    w = jnp.exp(s)
    return (w / w.sum(axis=1, keepdims=True)) @ v


def test_a_maximum_before_the_mask_is_named_whatever_the_large_scores_drawn():
    """On some large random draws that answer is only imprecise (exp lands in float32's
    subnormals) and the message there cannot name the mistake; the rising draw always can, and
    the verdict reads it first. Found: such a large draw, then q5's verdict on it."""
    (S, d, _), = [c for c in lab6.ATTENTION_CASES if c.large is True]
    (rS, rd, _), = [c for c in lab6.ATTENTION_CASES if c.large == lab6.RISING]
    names = "apply the causal mask before taking it"
    for _ in range(400):
        large = lab6._attention_case(_maximum_before_the_mask,
                                     *lab6._attention_draw(RNG, S, d, True), "large")
        try:
            lab6._attention_result("attention(q, k, v)", {**large, "large": True})
        except AssertionError as e:
            if names not in str(e):
                break
    else:
        pytest.fail("no large draw in 400 where the message misses the mistake (about 3% do)")
    rising = lab6._attention_case(_maximum_before_the_mask,
                                  *lab6._attention_draw(RNG, rS, rd, lab6.RISING), "rising")
    ev = {"attention": form.evidence(_maximum_before_the_mask),
          "fresh": [{**large, "large": True}, {**rising, "large": lab6.RISING}]}
    with pytest.raises(AssertionError, match=names):
        lab6.verdict("q5_attention_reference", ev)


def test_ring_check_accepts_only_the_texts_ring_and_names_a_ring_that_shifts_by_two():
    mesh = lab6._mesh(lab6.RING_AXIS)
    two = [(j, (j + 2) % 8) for j in range(8)]
    assert lab6._is_ring([(j, (j + 1) % 8) for j in range(8)])
    assert not lab6._is_ring([(j, (j - 1) % 8) for j in range(8)])  # "device j sends to j + 1"
    assert not lab6._is_ring(two) and not lab6._is_ring([(j, j + 1) for j in range(7)])
    fn = jax.shard_map(lambda q, k, v: lax.ppermute(k, "seq", two) + q + v, mesh=mesh,
                       in_specs=P("seq"), out_specs=P("seq"))
    program = lab6._program(jax.make_jaxpr(fn)(*[jnp.ones((24, 5))] * 3))
    moves = [s for s in program["steps"] if s["prim"] == "ppermute"]
    assert moves[0]["perm"] == [list(p) for p in two]


def test_q8_verdict_names_the_compiled_collective_for_a_made_up_kind():
    ev = {"matmul_costs": form.evidence(print),
          "fresh": [{"case": 3, "I": 16, "J": 512, "K": 24, "n": 8,
                     "result": form.evidence((2 * 16 * 512 * 24 / 8, 0.0, "psum"))}]}
    with pytest.raises(AssertionError, match="expected 'all-reduce'"):
        lab6.verdict("q8_matmul_costs", ev)


def test_q8_verdict_compiles_the_notebooks_own_case_programs():
    """The verdict reads FLOPs and collectives from the lab's programs, which it builds itself (the
    checks cannot import the notebook): its ``_case_programs`` must return what the master's
    ``case_programs`` returns, program for program."""
    def returned(tree, name):
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
        return ast.dump(next(n for n in ast.walk(fn) if isinstance(n, ast.Return)).value)

    nb = nbformat.read(release_paths("lab6-memory")["master"], as_version=4)
    cell = next(c.source for c in nb.cells if "def case_programs(" in c.source)
    checks = ast.parse(pathlib.Path(lab6.__file__).read_text())
    assert returned(ast.parse(cell), "case_programs") == returned(checks, "_case_programs")


def test_q8_verdict_takes_the_all_reduces_additions_off_cost_analysis():
    I, J, K, n = 16, 512, 24, 8
    product = 2 * I * J * K / n
    for flops, passes in ((product, True), (product + I * K, False)):
        ev = {"matmul_costs": form.evidence(print),
              "fresh": [{"case": 3, "I": I, "J": J, "K": K, "n": n, "result": form.evidence(
                  (flops, 2 * (n - 1) / n * 4 * I * K, "all-reduce"))}]}
        if passes:
            lab6.verdict("q8_matmul_costs", ev)
        else:
            with pytest.raises(AssertionError, match=f"of which {I * K} are the all-reduce's"):
                lab6.verdict("q8_matmul_costs", ev)


def test_the_state_must_live_on_mesh_data_itself():
    W = jnp.ones((16, 3))
    explicit = lab6._mesh("data", axis_type="Explicit")
    auto = lab6._mesh("data")
    assert lab6._on_mesh_data([jax.device_put(W, NamedSharding(explicit, P("data")))]) == [True]
    assert lab6._on_mesh_data([jax.device_put(W, NamedSharding(auto, P("data"))), W]) == \
        [False, False]


# --------------------------------------------------------------------------- docs/claims.md
def _claims():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "claims_lab6", ROOT / "tests" / "claims" / "lab6-memory.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CLAIMS


@pytest.mark.parametrize("claim, printed", [
    # what the text said before the audit, printed as the measuring cell would print it
    ("lab6-layer-residuals", "f32[4,4] from the argument W\nf32[2,4] from the argument x\n"
                             "f32[2,4] output of tanh from <cell>:2:11 (layer)\n"
                             "    e:f32[2,4] = sub 1.0:f32[] b\n"),
    ("lab6-block-remat-flops", "store everything            f32[12,32,64]   1.08    6.33\n"
                               "jax.checkpoint, no policy   f32[12,32,64]   0.30    8.43\n"
                               "one product of a block, (32, 64) @ (64, 256): 1.05 MFLOPs\n"),
    ("lab6-mask-order", "mask -inf, the seen block first: l = nan\n"
                        "mask -inf, the masked block first: l = nan\n"
                        "mask -1e+30, the seen block first: l = 1.2231\n"
                        "mask -1e+30, the masked block first: l = 1.2231\nexact: l = 1.2231\n"),
    ("lab6-auto-product-choice",
     "A (512, 1024), C (512, 64): [('f32[512,64]', 'all-reduce')]; an all-gather of A would "
     "send 1.750 MiB, an all-reduce of C 0.219 MiB\n"
     "A (512, 64), C (512, 1024): [('f32[512,64]', 'all-gather')]; an all-gather of A would "
     "send 0.109 MiB, an all-reduce of C 3.500 MiB\n"
     "A (512, 256), C (512, 192): [('f32[512,256]', 'all-gather')]; an all-gather of A would "
     "send 0.438 MiB, an all-reduce of C 0.656 MiB\n"),
    ("lab6-ring-sync-on-cpu", "collective-permute in the compiled program: 0  as -start/-done "
                              "pairs: 2\n"),
    ("lab6-zero-memory-communication",
     "ZeRO:       arguments  0.80 MiB per device, temporary 10.00 MiB, collectives "
     "[('f32[1024,512]', 'all-gather'), ('f32[1024,512]', 'all-gather'), ('f32[128,512]', "
     "'reduce-scatter')], MiB sent [1.75, 1.75, 1.75] = 5.250\n"
     "replicated: arguments  6.05 MiB per device, temporary  2.00 MiB, collectives "
     "[('f32[512,1024]', 'all-reduce')], MiB sent [3.5] = 3.500\n"),
])
def test_claim_checks_reject_what_the_text_used_to_say(claim, printed):
    with pytest.raises(AssertionError):
        _claims()[claim](printed)
