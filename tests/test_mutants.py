"""`jaxlab mutants`: its operators on small cells, its comparison of evidence, its decisions
file, and (slow) one question of a lab analysed with the real checks in the corpus's kernel."""

import numpy as np
import pytest

from jaxlab.mutants import analysis, operators as ops


def changes(source, operator):
    return {(m.before, m.after) for m in ops.mutants(source, [operator])}


# --------------------------------------------------------------------------- operators
def test_a_comparison_is_made_strict_and_a_guard_removed():
    cell = "def f(s):\n    if s <= 0:\n        return None\n    return 1 / s\n"
    assert ("s <= 0", "s < 0") in changes(cell, "comparison")
    (guard,) = ops.mutants(cell, ["guard"])
    assert guard.after == "(removed)" and "if" not in guard.code and guard.line == 2
    namespace = {}
    exec(guard.code, namespace)
    with pytest.raises(ZeroDivisionError):
        namespace["f"](0)


def test_a_range_is_off_by_one_at_its_end():
    found = {after for _, after in changes("for i in range(1, n):\n    s += i\n", "range")}
    assert found == {"range(1, (n) + 1)", "range(1, (n) - 1)"}
    assert changes("for i in range(8):\n    s += i\n", "range") == set()


def test_a_returned_number_loses_its_python_type():
    cell = "def f(x):\n    return float(np.sum(x)), int(x.size)\n"
    found = changes(cell, "conversion")
    assert ("float(np.sum(x))", "np.sum(x)") in found and ("int(x.size)", "x.size") in found


def test_partition_spec_entries_are_swapped_dropped_and_replaced_by_none():
    found = {after for _, after in changes('s = P("data", "model")', "spec")}
    assert found == {'P("model", "data")', 'P("model")', 'P("data")', 'P(None, "model")',
                     'P("data", None)'}


def test_sharding_collectives_and_rings_have_their_conceptual_mutants():
    cell = ('mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)\n'
            'y = lax.psum(x, "model")\n'
            'z = lax.ppermute(y, "data", perm=[(i, (i + 1) % 4) for i in range(4)])\n'
            'w = lax.psum_scatter(z, "data", scatter_dimension=0, tiled=True)\n')
    assert ('jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)',
            'jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)') \
        in changes(cell, "mesh")
    assert ("AxisType.Explicit", "AxisType.Auto") in changes(cell, "axis-type")
    collective = {after for _, after in changes(cell, "collective")}
    assert {'lax.pmean(x, "model")', 'lax.all_gather(x, "model")', 'lax.psum(z, "data")'} \
        <= collective
    assert ('psum(..., "model")', "psum(..., 'data')") in changes(cell, "axis-name")
    rings = [m for m in ops.mutants(cell, ["ppermute"])]
    assert len(rings) == 2
    for ring, expected in zip(rings, ([(1, 0), (2, 1), (3, 2), (0, 3)],
                                      [(0, 2), (1, 3), (2, 0), (3, 1)])):
        assert ring.before == "perm=[(i, (i + 1) % 4) for i in range(4)]"
        assert [tuple(p) for p in eval(ring.after.split("perm=", 1)[1])] == expected
        assert ring.after in ring.code


def test_jit_and_checkpoint_are_removed_and_the_policy_changed():
    cell = ("@jax.jit\ndef f(x):\n    return x\n\n"
            "g = jax.checkpoint(h, policy=jax.checkpoint_policies.save_only_these_names('a'))\n")
    jit = ops.mutants(cell, ["jit"])
    assert len(jit) == 1 and "@jax.jit" not in jit[0].code
    assert (jit[0].before, jit[0].after, jit[0].line) == ("@jax.jit", "(decorator removed)", 1)
    found = {m.after: m for m in ops.mutants(cell, ["checkpoint"])}
    assert "h" in found and "(no policy)" in found
    assert "jax.checkpoint(h)" in found["(no policy)"].code
    dots = found["policy=jax.checkpoint_policies.dots_saveable"]
    assert "jax.checkpoint(h, policy=jax.checkpoint_policies.dots_saveable)" in dots.code


def test_the_unrolled_scan_computes_what_lax_scan_does():
    import jax.numpy as jnp

    cell = ("def body(c, x):\n    return c + x, c * x\n\n"
            "carry, ys = lax.scan(body, 1.0, jnp.arange(5.0))\n")
    (mutant,) = ops.mutants(cell, ["scan"])
    namespace = {"jnp": jnp, "lax": __import__("jax").lax}
    exec(cell, namespace)
    expected = namespace["carry"], namespace["ys"]
    exec(mutant.code, namespace)
    assert "lax.scan" not in mutant.code.split("carry, ys =")[1]
    np.testing.assert_allclose(namespace["carry"], expected[0])
    np.testing.assert_allclose(namespace["ys"], expected[1])


def test_a_script_held_in_a_string_is_mutated_inside_and_stays_a_string():
    cell = ('script = r"""\nimport sys\nn = int(sys.argv[1])\nm = n + 1\n'
            'k = n * 2\n"""\n')
    found = ops.mutants(cell, ["arithmetic"])
    assert {m.after for m in found} == {"n - 1", "n / 2"}
    for m in found:
        namespace = {}
        exec(m.code, namespace)
        assert isinstance(namespace["script"], str) and m.after in namespace["script"]
        assert m.line == 4 + (m.after == "n / 2")


def test_mutants_are_distinct_programs_and_keys_survive_edits_elsewhere():
    cell = "a = x + y\nb = a * 2\n"
    found = ops.mutants(cell)
    assert len({m.code for m in found}) == len(found)
    assert all(ops._normal(m.code) != ops._normal(cell) for m in found)
    edited = ops.mutants("# a comment\nz = 0\n" + cell)
    keys = {m.key: m.change for m in edited}
    assert all(keys.get(m.key) == m.change for m in found)


def test_an_unknown_operator_is_refused():
    with pytest.raises(ValueError, match="unknown mutation operators"):
        ops.mutants("x = 1", ["no-such-thing"])


# --------------------------------------------------------------------------- evidence
def test_values_beyond_the_tolerance_are_behaviour_and_programs_are_method():
    base = {"fresh": [{"output": {"kind": "array", "value": np.ones(3, np.float32),
                                  "dtype": "float32"}}],
            "program": {"top": ["jit"]}, "name": "<function f at 0x7f00aa11bb22>"}
    noise = {**base, "fresh": [{"output": {**base["fresh"][0]["output"],
                                           "value": np.ones(3, np.float32) + 1e-7}}],
             "name": "<function f at 0x7f00cc33dd44>"}
    assert analysis.differences(base, noise) == ([], [])
    changed = {**base, "fresh": [{"output": {**base["fresh"][0]["output"],
                                             "value": np.ones(3, np.float32) * 1.01}}]}
    behaviour, method = analysis.differences(base, changed)
    assert len(behaviour) == 1 and behaviour[0].startswith("fresh/0/output/value") and not method
    unjitted = {**base, "program": {"top": ["mul"]}}
    assert analysis.differences(base, unjitted)[0] == []
    assert analysis.differences(base, unjitted)[1] == ["program/top/0: 'jit' -> 'mul'"]
    retyped = {**base, "fresh": [{"output": {**base["fresh"][0]["output"],
                                             "dtype": "bfloat16"}}]}
    assert analysis.differences(base, retyped)[0] == [
        "fresh/0/output/dtype: 'float32' -> 'bfloat16'"]


def test_what_two_runs_of_the_solution_disagree_on_is_left_out():
    first = {"seconds": 0.0123, "value": 1.0}
    second = {"seconds": 0.0456, "value": 1.0}
    volatile = analysis.volatile_paths(first, second)
    assert volatile == {("seconds",)}
    mutant = {"seconds": 0.9, "value": 2.0}
    assert analysis.differences(first, mutant, volatile)[0] == ["value: 1.0 -> 2.0"]


def test_the_decisions_file_takes_equivalents_and_free_evidence_with_their_sentence(tmp_path):
    path = tmp_path / "lab.yaml"
    path.write_text("q1:\n  equivalent:\n  - key: spec-0123abcd\n"
                    "    change: 'P(\"x\")  ->  P(\"x\", None)'\n"
                    "    text: 'split it along the rows'\n    why: a trailing None adds nothing\n"
                    "  free:\n  - evidence: timing_runs/*/calls\n"
                    "    text: 'average over several calls, at most 100'\n"
                    "    why: how many is the student's choice\n")
    decisions = analysis.load_decisions(path)
    assert decisions.equivalent[("q1", "spec-0123abcd")]["why"] == "a trailing None adds nothing"
    assert decisions.free_paths("q1") == [("timing_runs", "*", "calls")]
    first = {"timing_runs": [{"calls": 11, "seconds": 1.0}]}
    other = {"timing_runs": [{"calls": 12, "seconds": 1.0}]}
    assert analysis.differences(first, other, free=decisions.free_paths("q1")) == ([], [])
    assert analysis.differences(first, other)[0] == ["timing_runs/0/calls: 11 -> 12"]
    path.write_text("q1:\n  accepted:\n  - key: spec-0123abcd\n")
    with pytest.raises(ValueError, match="unknown sections"):
        analysis.load_decisions(path)
    path.write_text("q1:\n  equivalent:\n  - key: spec-0123abcd\n")
    with pytest.raises(ValueError, match="missing"):
        analysis.load_decisions(path)
    assert analysis.load_decisions(tmp_path / "absent.yaml").equivalent == {}


def test_independent_assignments_are_not_swapped_but_dependent_ones_are():
    cell = "a = x + 1\nb = y * 2\nc = a + b\n"
    swaps = {m.before for m in ops.mutants(cell, ["swap-statements"])}
    assert swaps == {"b = y * 2; c = a + b"}


def test_math_and_numpy_trade_places():
    assert changes("n = math.ceil(x / y)", "math-numpy") == {("math.ceil(x / y)",
                                                              "np.ceil(x / y)")}


def test_what_a_cell_only_prints_is_not_mutated():
    found = ops.mutants('t = f(x) * 2\nprint(f"{t * 1e3:.1f} ms", t / 2)\n')
    assert found and all(m.line == 1 for m in found)


# --------------------------------------------------------------------------- the tool, for real
@pytest.mark.slow
def test_one_question_analysed_with_the_shipped_checks_kills_or_decides_every_mutant(graded):
    """`jaxlab mutants` on Lab 6's q9, in the corpus's own kernel: every mutant is graded by
    the shipped checks, and the issue's known kinds are killed (a comparison made strict, a
    guard removed, a plain Python number turned into a NumPy one)."""
    from jaxlab import corpus

    lab, question = "lab6-memory", "q9_roofline"
    graded(corpus.load_answers(lab)[0])  # starts the lab's kernel (the corpus shares it)
    harness = graded.harnesses[lab]
    result = analysis.analyse(lab, questions=[question], harness=harness)
    assert len(result.outcomes) >= 30 and {o.question for o in result.outcomes} == {question}
    assert result.of("gap") == [] and result.of("undecided") == [], [
        (o.mutant.change, o.detail) for o in result.of("gap") + result.of("undecided")]
    killed = {o.mutant.change: o.detail for o in result.of("killed")}
    assert "raised ZeroDivisionError" in killed["slope <= 0  ->  slope < 0"]
    assert "expected None" in killed["if slope <= 0: return None  ->  (removed)"]
    assert "expected an int" in killed["math.ceil(peak * D * F / slope)  ->  "
                                       "np.ceil(peak * D * F / slope)"]
    # the kernel holds the solution again: the corpus goes on from there
    assert harness.run_tests([question])[question]["score"] == \
        harness.solution_results[question]["score"]
