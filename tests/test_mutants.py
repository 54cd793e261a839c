"""`jaxlab mutants`: its operators on small cells, its comparison of evidence, its decisions
file, how it classes a survivor and a mutant stopped by its limit (a stand-in harness, no
kernel), its report and listing, and (slow) one question of a lab analysed with the real checks
in the corpus's kernel."""

import pathlib

import numpy as np
import pytest

from jaxlab.mutants import analysis, operators as ops

ROOT = pathlib.Path(__file__).resolve().parent.parent


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


# --------------------------------------------------------------------------- mistakes students make
# (issue 45) each operator on a small cell; ``scope`` is the notebook's code before the cell
SCOPE = ('mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)\n'
         'mesh_auto = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)\n'
         'mesh_same = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)\n'
         'mesh_seq = jax.make_mesh((8,), ("seq",))\n'
         'rows = NamedSharding(mesh, P("data"))\ncolumns = NamedSharding(mesh, P(None, "model"))\n',)


def test_another_mesh_of_the_notebook_is_passed_where_one_is_used():
    cell = ('x = jax.device_put(a, NamedSharding(mesh, P("data")))\n'
            'f = jax.shard_map(g, mesh=mesh, in_specs=P("data"), out_specs=P())\n'
            'y = jax.device_put(b, rows)\n')
    found = {m.after for m in ops.mutants(cell, ["wrong-mesh"], SCOPE)}
    # a mesh with the axes used, not the one built by the same call, nor one without the axes
    assert found == {"NamedSharding(... mesh_auto ...)", "shard_map(... mesh=mesh_auto ...)",
                     "device_put(... columns ...)"}
    assert not ops.mutants(cell, ["wrong-mesh"])  # no other mesh in scope: nothing to pass
    # a replicated spec names no axis: any other mesh places the array without an error
    replicated = 'w = jax.device_put(c, NamedSharding(mesh, P()))\n'
    assert {m.after for m in ops.mutants(replicated, ["wrong-mesh"], SCOPE)} == {
        "NamedSharding(... mesh_auto ...)", "NamedSharding(... mesh_seq ...)"}


def test_one_mesh_axis_for_another_and_two_operands_specs_exchanged():
    assert changes('s = P("data", None)', "mesh-axis") == set()  # no mesh in scope: no axis
    found = {m.after for m in ops.mutants('s = P("data", None)\nt = P(("data", "model"))\n',
                                          ["mesh-axis"], SCOPE)}
    assert found == {'P("model", None)'}  # an axis the spec holds already is not put twice
    cell = 'f = jax.shard_map(g, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P())\n'
    assert {m.after for m in ops.mutants(cell, ["swap-specs"])} == {
        'in_specs=(P(), P("data"), P("data"))', 'in_specs=(P("data"), P("data"), P())'}


def test_keywords_are_dropped_or_flipped_where_the_call_does_not_need_them():
    cell = ('g = lax.all_gather(x, "i", tiled=True)\n'
            'y = jnp.einsum("ij,jk->ik", a, b, preferred_element_type=jnp.float32)\n'
            'f = jax.jit(h, static_argnums=(1,), donate_argnums=0)\n'
            's = lax.psum(x, axis_name="i")\nv = jax.vmap(k, axis_name="i")\n')
    found = changes(cell, "keyword")
    assert {("tiled=True", "(dropped)"), ("tiled=True", "tiled=False"),
            ("preferred_element_type=jnp.float32", "(dropped)"),
            ("static_argnums=(1,)", "(dropped)"), ("donate_argnums=0", "(dropped)"),
            ('axis_name="i"', "(dropped)")} == found
    (vmap,) = [m for m in ops.mutants(cell, ["keyword"]) if m.before == 'axis_name="i"']
    assert "jax.vmap(k)" in vmap.code and 'lax.psum(x, axis_name="i")' in vmap.code


def _ring(mutant):
    namespace = {}
    exec(mutant.code.replace("y = lax.ppermute(x, \"i\", ", "perm = (").replace(
        "lax.ppermute(", "("), namespace)
    return [tuple(p) for p in namespace["perm"]]


def test_a_ring_is_left_open_at_its_wrap_around_pair_or_one_pair_turned():
    literal = ops.mutants('y = lax.ppermute(x, "i", [(0, 1), (1, 2), (2, 3), (3, 0)])\n',
                          ["ring-fault"])
    assert [m.after for m in literal] == ["perm=[(0, 1), (1, 2), (2, 3)]",
                                          "perm=[(1, 0), (1, 2), (2, 3), (3, 0)]"]
    comprehension = ops.mutants(
        'n = 4\ny = lax.ppermute(x, "i", [(k, (k - 1) % n) for k in range(n)])\n', ["ring-fault"])
    assert [_ring(m) for m in comprehension] == [
        [(1, 0), (2, 1), (3, 2)], [(3, 0), (1, 0), (2, 1), (3, 2)]]
    chain = ops.mutants('to_next = [(s, s + 1) for s in range(3)]\n'
                        'y = lax.ppermute(x, "i", to_next)\n', ["ring-fault"])
    assert [m.after for m in chain] == ["perm=__mutant_turn_pair(to_next)"]  # no wrap to drop
    # Lab 4's shift: partial(lax.ppermute, ...), for this operator and the older ring one
    shift = 'shift = partial(lax.ppermute, axis_name="i", perm=[(k, (k + 1) % 4) for k in range(4)])\n'
    assert len(ops.mutants(shift, ["ring-fault"])) == 2 and len(ops.mutants(shift, ["ppermute"])) == 2


def _shard_mapped(cell, names, mesh):
    """Run ``cell`` (its functions ``shard_map``ped on ``mesh``): the values of ``names``, then
    its namespace."""
    from functools import partial

    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import PartitionSpec as P

    namespace = {"jax": jax, "jnp": jnp, "lax": lax, "P": P, "partial": partial, "mesh": mesh,
                 "np": np}
    exec(cell, namespace)
    return [np.asarray(namespace[n]) for n in names] + [namespace]


def test_the_same_values_moved_another_way():
    import jax
    from jax.sharding import AxisType

    mesh = jax.make_mesh((4,), ("i",), axis_types=(AxisType.Auto,), devices=jax.devices()[:4])
    cell = ('@partial(jax.shard_map, mesh=mesh, in_specs=P(None, "i"), out_specs=P("i"))\n'
            'def rs(x):\n    return lax.psum_scatter(x, "i", scatter_dimension=0, tiled=True)\n\n'
            '@partial(jax.shard_map, mesh=mesh, in_specs=P("i"), out_specs=P("i"))\n'
            'def ring(x):\n    return lax.ppermute(x, "i", [(k, (k + 1) % 4) for k in range(3)])\n\n'
            '@partial(jax.shard_map, mesh=mesh, in_specs=(P(), P("i")), out_specs=P())\n'
            'def update(w, xs):\n'
            '    def loss(w):\n        return lax.psum(jnp.sum(w * xs), "i")\n'
            '    value, grads = jax.value_and_grad(loss)(w)\n'
            '    return w - 0.1 * grads\n\n'
            'a = rs(np.arange(32.0).reshape(8, 4))\nb = ring(np.arange(8.0))\n'
            'c = update(np.ones(2, np.float32), np.arange(8.0).reshape(4, 2))\n')
    *expected, _ = _shard_mapped(cell, "abc", mesh)
    found = {m.after: m for m in ops.mutants(cell, ["communication"])}
    own = found['__mutant_own_block(lax.psum(x, "i"), "i", 0, True)']
    gathered = found['__mutant_gathered_permute(x, "i", [(k, (k + 1) % 4) for k in range(3)])']
    for mutant, name, used, instead in ((own, "rs", "psum", "reduce_scatter"),
                                        (gathered, "ring", "all_gather", "ppermute")):
        a, b, namespace = _shard_mapped(mutant.code, "ab", mesh)
        np.testing.assert_array_equal(a, expected[0])  # the same values ...
        np.testing.assert_array_equal(b, expected[1])
        x = np.arange(32.0).reshape(8, 4) if name == "rs" else np.arange(8.0)
        program = str(jax.make_jaxpr(namespace[name])(x))  # ... by another collective
        assert used in program and instead not in program, program
    twice = [m for m in found.values() if "pmean(_g, 'i')" in m.after]
    assert len(twice) == 1 and "psum(_g, 'i')" in " ".join(found)
    # the gradient, already summed over the devices, averaged again: the same value here
    np.testing.assert_allclose(_shard_mapped(twice[0].code, "c", mesh)[0], expected[2])
    assert str(jax.make_jaxpr(_shard_mapped(twice[0].code, "c", mesh)[1]["update"])(
        np.ones(2, np.float32), np.arange(8.0).reshape(4, 2))).count("psum") > \
        str(jax.make_jaxpr(_shard_mapped(cell, "c", mesh)[1]["update"])(
            np.ones(2, np.float32), np.arange(8.0).reshape(4, 2))).count("psum")


def test_a_cast_is_removed_or_inserted_where_precision_matters():
    cell = ('def f(a, b, xs, params, grads):\n'
            '    acc = jnp.zeros(4, dtype=jnp.float32)\n'
            '    for x in xs:\n        acc += x @ b\n'
            '    h, _ = lax.scan(body, a.astype(jnp.bfloat16), xs)\n'
            '    w = jax.nn.softmax(h)\n'
            '    new_params = jax.tree.map(lambda p, g: p - g, params, grads)\n'
            '    return new_params, w\n')
    found = changes(cell, "cast")
    assert {("a.astype(jnp.bfloat16)", "a"), ("dtype=jnp.float32", "(dropped)"),
            ("acc += x @ b", "acc = __mutant_cast(acc + (x @ b), 'bfloat16')"),
            ("jax.nn.softmax(h)", "jax.nn.softmax(__mutant_cast(h, 'bfloat16'))")} <= found
    afters = {after for _, after in found}
    # float32 too, where the cell computes in bfloat16 (a product meant in bfloat16)
    assert any("'float32'" in a for a in afters) and any("scan(body, __mutant_cast(" in a
                                                         for a in afters)
    assert any(a.startswith("new_params = __mutant_cast(") for a in afters)
    assert not any("'float32'" in a for _, a in changes("acc += x @ b\n", "cast"))
    assert changes("n += 1\n", "cast") == set()  # a counter has no precision to lose
    (cast,) = [m for m in ops.mutants("acc = 0.0\nacc += x\n", ["cast"])]
    namespace = {"x": np.float32(1 / 3)}
    exec(cast.code, namespace)
    assert str(namespace["acc"].dtype) == "bfloat16"
    update = 'def adam_update(p, g):\n    return p - g, g\n'
    assert changes(update, "cast") == {("return p - g, g",
                                        "return __mutant_cast((p - g, g), 'bfloat16')")}


def test_an_argument_left_out_of_an_api_call():
    cell = ('def restore_state(path, target):\n'
            '    return ocp.StandardCheckpointer().restore(path, target)\n\n'
            'x_local, y_local = data["x"][mine], data["y"][mine]\n'
            'x = jax.make_array_from_process_local_data(rows, x_local)\n'
            'z = jax.device_put(a, rows)\n'
            'def scaled(v, factor=2):\n    return v * factor\n\n'
            'u = scaled(a, 3)\nw = jnp.where(a > 0, a, 0.0)\nj = jax.jit(f)\n')
    found = changes(cell, "drop-arg")
    assert found == {
        ("ocp.StandardCheckpointer().restore(path, target)",
         "ocp.StandardCheckpointer().restore(path)"),
        ('data["x"][mine]', 'data["x"]'),  # the whole data where this process's share is asked
        ("jax.device_put(a, rows)", "jax.device_put(a)"),
        ("scaled(a, 3)", "scaled(a)")}  # where's and jit's defaults select another form


def test_old_mutants_keep_their_keys_where_a_new_operator_makes_the_same_program():
    cell = "y = jax.device_put(x, s)\nz = f(y.astype(jnp.float32))\n"
    everything = ops.mutants(cell)
    older = ops.mutants(cell, [o for o in ops.OPERATORS if o in ops.ESTABLISHED])
    assert {m.key for m in older} <= {m.key for m in everything}
    assert len({ops._normal(m.code) for m in everything}) == len(everything)


def test_every_operator_says_what_it_does_in_the_help():
    from click.testing import CliRunner

    from jaxlab.cli import main

    result = CliRunner().invoke(main, ["mutants", "--help"])
    assert result.exit_code == 0
    help_text = " ".join(result.output.split())
    for name, what in ops.describe().items():
        assert what and f"{name}: {' '.join(what.split()[:4])}" in help_text, name


def test_list_prints_the_mutants_without_grading_them(capsys):
    from jaxlab import mutants

    pairs = mutants.listing("lab4-shard-map", root=ROOT, questions=["q5_matmul_reducescatter"],
                            operators=["communication", "keyword"])
    out = capsys.readouterr().out.splitlines()
    assert len(pairs) == 3 and len(out) == 3 + 3
    assert out[-1] == "per operator: keyword 2, communication 1"
    assert any("__mutant_own_block(lax.psum(lhs_block @ rhs_block" in line for line in out)


# --------------------------------------------------------------------------- classes
class _Harness:
    """A stand-in for the corpus harness: each grade() takes the next of ``replies`` (a
    Verdict-like object, or an exception to raise)."""

    def __init__(self, replies):
        self.replies, self.timeouts = list(replies), []

    def grade(self, answer, *, only=None, evidence_seed=None, timeout=300):
        self.timeouts.append(timeout)
        reply = self.replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply


class _Runner:
    def __init__(self, replies, dies=()):
        self.harness, self.dies, self.restarts = _Harness(replies), list(dies), 0

    def alive(self):
        return not (self.dies and self.dies.pop(0))

    def restart(self):
        self.restarts += 1


class _Verdict:
    def __init__(self, full_marks, evidence=None, message="expected 3, found 4"):
        self.full_marks, self.evidence, self.message = full_marks, evidence, message

    def failure_messages(self):
        return [] if self.full_marks else [self.message]


def _classify(replies, decisions=None, dies=(), reference=None):
    runner = _Runner(replies, dies)
    mutant = ops.mutants("y = x + 1\n", ["arithmetic"])[0]
    outcome = analysis._classify(runner, "lab", "q1", mutant, 20, reference or {"v": 1.0},
                                 frozenset(), decisions or analysis.Decisions({}, {}))
    return outcome, runner


def test_a_mutant_stopped_by_its_limit_is_run_again_with_three_times_the_limit():
    from jaxlab import corpus

    timeout = corpus.KernelError("timed out after 20s running: ...")
    outcome, runner = _classify([timeout, timeout])
    assert outcome.status == "limit" and outcome.limit == 60
    assert runner.harness.timeouts == [20, 60]
    assert outcome.detail == "ran past its 20 s limit; run again, ran past its 60 s limit"
    # on a busy machine: it finishes with more time, and the check's message decides
    outcome, runner = _classify([timeout, _Verdict(False)])
    assert (outcome.status, outcome.detail) == ("killed", "expected 3, found 4")
    assert outcome.rerun == "first it ran past its 20 s limit; with 60 s it finished"
    # ... or it keeps full marks: a survivor like any other, probed with the longer limit
    outcome, runner = _classify([timeout, _Verdict(True), _Verdict(True, {"v": 1.0})])
    assert outcome.status == "undecided" and runner.harness.timeouts == [20, 60, 60]
    assert outcome.rerun
    # a kernel killed twice is a kill by a limit too (the kernel is started again each time)
    outcome, runner = _classify([corpus.KernelError("x"), corpus.KernelError("x")],
                                dies=[True, True])
    assert outcome.status == "limit" and runner.restarts == 2
    assert outcome.detail.startswith("killed the kernel (limit 20 s)")


def test_a_free_entry_frees_values_but_decides_no_mutant():
    decisions = analysis.Decisions({}, {"q1": [{"evidence": "logs", "text": "t", "why": "w"}]})
    reference = {"logs": "step 0", "v": 1.0, "program": {"top": ["psum"]}}
    # differs only in the free evidence: not a gap, and undecided until decided by key
    outcome, _ = _classify([_Verdict(True), _Verdict(True, {**reference, "logs": "step 1"})],
                           decisions, reference=reference)
    assert outcome.status == "undecided" and len(outcome.why) == 1
    assert outcome.why[0].startswith("it differs only in evidence the text leaves free (logs:")
    # its method differs too: that is said first
    other = {**reference, "logs": "step 1", "program": {"top": ["all_gather"]}}
    outcome, _ = _classify([_Verdict(True), _Verdict(True, other)], decisions,
                           reference=reference)
    assert outcome.status == "undecided" and outcome.why[0].startswith(
        "its method differs from the solution's (program/top/0: 'psum' -> 'all_gather')")
    # a value outside the free evidence is a gap; a decision by key makes it equivalent
    outcome, _ = _classify([_Verdict(True), _Verdict(True, {**reference, "v": 2.0})],
                           decisions, reference=reference)
    assert outcome.status == "gap"
    mutant = ops.mutants("y = x + 1\n", ["arithmetic"])[0]
    decisions.equivalent["q1", mutant.key] = {"key": mutant.key, "change": "", "text": "t",
                                              "why": "w"}
    outcome, _ = _classify([_Verdict(True), _Verdict(True, other)], decisions,
                           reference=reference)
    assert outcome.status == "equivalent"
    # with the same evidence: undecided, and said so
    outcome, _ = _classify([_Verdict(True), _Verdict(True, {"v": 1.0})])
    assert outcome.why == ("the same evidence as the solution on the seeded inputs: no check "
                           "and no probe tells it apart",)


def test_free_patterns_never_hide_a_method():
    reference = {"source": "a", "fresh": {"source": "x"}}
    other = {"source": "b", "fresh": {"source": "y"}}
    behaviour, method = analysis.differences(reference, other, free=[("*",), ("fresh", "*")])
    assert behaviour == [] and len(method) == 2


def test_the_report_counts_kills_by_a_limit_apart_and_says_why_each_survivor_is_undecided():
    from jaxlab.mutants import report

    mutant = ops.mutants("y = x + 1\n", ["arithmetic"])[0]
    outcomes = [analysis.Outcome("q1", mutant, "killed", 2.0, "expected 3"),
                analysis.Outcome("q1", mutant, "limit", 80.0, "ran past its 20 s limit; run "
                                 "again, ran past its 60 s limit", limit=60),
                analysis.Outcome("q1", mutant, "undecided", 3.0, "the same evidence",
                                 why=("the same evidence as the solution",),
                                 rerun="first it ran past its 20 s limit; with 60 s it finished")]
    result = analysis.Analysis("lab", outcomes, 100.0, 10.0, [])
    text = report.markdown(result, "jaxlab mutants lab")
    assert "| question | mutants | killed by a check | killed by a limit | equivalent | gaps | " \
           "undecided | score | time |" in text
    assert "| q1 | 3 | 1 | 1 | 0 | 0 | 1 | 66.7% | 1 min 25 s |" in text
    assert "| **all** | 3 | 1 | 1 | 0 | 0 | 1 | 66.7% | 1 min 40 s |" in text
    assert "## Killed by a limit (1)" in text and "run again, ran past its 60 s limit" in text
    assert "  - undecided: the same evidence as the solution\n" \
           "  - first it ran past its 20 s limit; with 60 s it finished" in text
    # the decisions to fill in follow the undecided, before the kills by a limit
    assert text.index("## Undecided") < text.index("```yaml") < text.index("## Killed by a limit")


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


# --------------------------------------------------------------------------- message kinds
def kind(text, operator="arithmetic", before="a * b", after="a / b", graded=("step_flops",),
         **kwargs):
    from jaxlab.mutants import messages

    return messages.classify(text, operator=operator, before=before, after=after,
                             graded=graded, **kwargs)[0]


def test_otters_framing_is_not_what_the_student_is_told():
    from jaxlab.mutants import messages

    raw = ("❌ Test case failed\nError at line 3 in test q1_vmap_collective:\n  jaxlab_lab4.che"
           "ck('q1_vmap_collective', f=f)\nAssertionError: `f` has the wrong values: expected "
           "3.0, found 4.0")
    exception, text = messages.student_text(raw)
    assert (exception, text) == ("AssertionError", "`f` has the wrong values: expected 3.0, "
                                                   "found 4.0")
    # the test's own line names jaxlab_lab4: otter's framing, the same for every message
    assert kind(text, graded=("f",)) == "fault"
    assert messages.student_text("❌ Test case failed\nError at line 2 in test q8:\n  x = 1\n"
                                 "KeyError: output") == ("KeyError", "output")


def test_a_cell_that_raised_is_the_students_exception_or_a_generic_not_defined():
    not_defined = ("`A_sharded` is not defined yet (it holds None): write your answer in the "
                   "cell under '### Your code here' and run it.")
    graded = ("A_sharded",)
    # the pattern: the mutant's cell raised, and the message lost the exception
    assert kind(not_defined, "swap-args", graded=graded,
                raised=("TypeError: device_put() got an unexpected sharding",)) == "generic"
    assert kind(not_defined, "drop-statement", graded=graded) == "generic"
    # nothing raised and the name was set: the message blames an answer that is there
    assert kind(not_defined, "spec", graded=graded) == "misleading"
    # the engine's wording since issue 44: the student's own exception and line
    assert kind("`A_sharded` was never set: the cell that assigns it raised TypeError: "
                "device_put() got multiple values at line 2 (`A_sharded = ...`). Fix that and "
                "run the cell again; then run this check.", "swap-args",
                graded=graded) == "exception"
    assert kind("`loss_2d(params, batch) on new data (48 examples)` on new data raised "
                "ValueError: shapes (48, 16) and (8, 16) are incompatible", "transpose",
                graded=("loss_2d",)) == "exception"
    assert kind("`zero_step` could not be traced with jax.make_jaxpr: ValueError: in_specs "
                "has 2 entries", "specs", graded=("zero_step",)) == "exception"


def test_internals_and_timeouts_are_kinds_of_their_own():
    assert kind("Your answer could not be checked (KeyError: 'output').") == "internals"
    assert kind("output", exception="KeyError") == "internals"  # escaped the check
    assert kind("Traceback (most recent call last):\n  File \"/x/jaxlab_lab5.py\", line 3, in "
                "check") == "internals"
    assert kind("`step_flops` is {'kind': 'array', 'shape': [3]}; expected an int") == \
        "internals"
    assert kind("GRADER ERROR (not the student's): the check of q8 raised KeyError") == \
        "internals"
    assert kind("stopped after 20 s or killed the kernel") == "timeout"
    assert kind("ran past its 20 s limit; run again, ran past its 60 s limit",
                limit=True) == "timeout"
    assert kind("`train_script` got stuck on new data (96 rows): after 30 s, both processes "
                "had stopped using the CPU", graded=("train_script",)) == "timeout"


def test_a_type_message_is_misleading_for_a_mutant_that_changed_a_value():
    # the Lab 7 q8: the formula is wrong, the message blames the type
    text = ("`step_flops(cfg, batch=4, seq=16) with vocab 50, d_model 32, d_ff 64, 2 layers` "
            "returned the number 5.94761e+09 of type float; expected a Python int.")
    assert kind(text, "arithmetic", "2 * tokens * n_params", "2 * tokens / n_params") == \
        "misleading"
    # ... and names the fault where the mutant changed the type
    assert kind(text, "conversion", "int(flops)", "flops") == "fault"
    assert kind(text, "arithmetic", "flops // 2", "flops / 2") == "fault"
    assert kind("`critical_batch(1e+14, 2e+12, chip)` returned None; expected an int.",
                "drop-statement", "return b", "(removed)", graded=("critical_batch",)) == \
        "generic"
    assert kind("`f` should be a function; it is the number 3.", "constant",
                graded=("f",)) == "misleading"


def test_a_message_names_the_fault_with_a_word_of_the_mutants_family():
    values = ("`tp_forward(params, tokens, mesh, n_heads) for 3 layers` has the wrong values: "
              "expected the single-device forward, but they differ by 0.31.")
    graded = ("tp_forward",)
    assert kind(values, "constant", graded=graded) == "fault"
    # the same words for a collective changed: correct, but not about what changed ("mesh"
    # in the call's arguments is no word of the fault)
    assert kind(values, "collective", "lax.psum(x, 'model')", "lax.pmean(x, 'model')",
                graded=graded) == "generic"
    assert kind(values, "spec", "P('model')", "P(None)", graded=graded) == "generic"
    assert kind("`update(params, xs, ys)` sums the per-device gradients with psum; expected "
                "their mean over the batch axis", "collective", "lax.pmean(g, 'batch')",
                "lax.psum(g, 'batch')", graded=("update",)) == "fault"
    assert kind("`x_auto` is replicated on every device of the 8-device mesh; expected it "
                "split along the batch axis (dimension 0) across the mesh axis 'data' (spec "
                "P('data'))", "spec", "P('data')", "P(None)", graded=("x_auto",)) == "fault"
    assert kind("`train_step` is not wrapped in jax.jit; expected one compiled program per "
                "step", "jit", "@jax.jit", "(decorator removed)",
                graded=("train_step",)) == "fault"
    # Lab 3 q1 (graded end to end): the sharding left out of device_put
    assert kind("`A_sharded` is not placed on a mesh: it lives on a single device (device 0); "
                "expected it on the devices of a mesh. Place it with jax.device_put(..., "
                "NamedSharding(mesh, P(...))).", "drop-arg", "jax.device_put(A, sharding)",
                "jax.device_put(A)", graded=("A_sharded",)) == "fault"
    # an identifier the mutant changed, named in the message
    assert kind("`gather_all(x)` should return every shard; expected all_to_all's output "
                "instead", "communication", "lax.all_to_all(x, 'd', 0, 0)", "lax.all_gather(x, "
                "'d')", graded=("gather_all",)) == "fault"
    # ... but not one the call under test only spells out (Lab 4 q1, psum -> all_gather)
    assert kind("`normalized_convolution under jax.vmap(normalized_convolution, in_axes=(0, "
                "None), axis_name='p') on examples of length 7` returned an array of shape (5, "
                "5, 5); expected (5, 5).", "collective", 'lax.psum(output, axis_name="p")',
                'lax.all_gather(output, "p")', graded=("normalized_convolution",)) == "generic"
    # no graded variable named, or nothing expected: generic
    assert kind("psum adds up the per-device mean losses. Average them with jax.lax.pmean",
                "collective", graded=("loss_fn",)) == "generic"
    assert kind("`tp_forward` is slow", "constant", graded=graded) == "generic"


def test_every_operator_has_a_family_of_fault_words():
    from jaxlab.mutants import messages

    assert set(messages.OPERATOR_FAMILY) == set(ops.OPERATORS)
    assert set(messages.OPERATOR_FAMILY.values()) <= set(messages.FAMILIES)


def _killed(question="q1", status="killed", messages=(), detail="d", raised=()):
    mutant = ops.mutants("y = x + 1\n", ["arithmetic"])[0]
    return analysis.Outcome(question, mutant, status, 1.0, detail, messages=messages,
                            raised=raised)


def test_a_killed_mutant_keeps_every_failing_case_and_the_cells_that_raised():
    class Verdict:
        full_marks, evidence = False, None
        own = {"cases": [{"hidden": False, "passed": False, "message": "public says"},
                         {"hidden": True, "passed": True, "message": "✅ Test case passed"},
                         {"hidden": True, "passed": False, "message": "hidden says"}]}
        cell_errors = [(7, "TypeError: bad")]

        def failure_messages(self):
            return ["public says", "hidden says"]

    outcome, _ = _classify([Verdict()])
    assert outcome.status == "killed" and outcome.detail == "public says"
    assert outcome.messages == ((False, "public says"), (True, "hidden says"))
    assert outcome.raised == ("TypeError: bad",)
    # a verdict that only has its messages: each the hidden case's
    outcome, _ = _classify([_Verdict(False)])
    assert outcome.messages == ((True, "expected 3, found 4"),)


def test_the_report_counts_the_messages_by_kind_and_samples_each_kind():
    from jaxlab.mutants import messages, report

    framed = "❌ Test case failed\nError at line 3 in test q1:\n  check()\nAssertionError: "
    outcomes = [
        _killed(messages=((True, framed + "`y` has the wrong values: expected 3, found 4"),
                          (False, framed + "`y` is not defined yet (it holds None)")),
                raised=("TypeError: x",)),
        _killed(messages=((True, framed + "`y` returned the number 2 of type float; expected "
                                          "a Python int."),)),
        _killed("q2", "limit", detail="ran past its 20 s limit; run again, ran past its 60 s "
                                      "limit"),
        _killed("q2", "killed", detail="grading failed: KernelError"),
        analysis.Outcome("q2", _killed().mutant, "undecided", 1.0, "the same evidence")]
    result = analysis.Analysis("lab", outcomes, 10.0, 1.0, [], {"q1": ["y"], "q2": ["z"]})
    found = messages.of_analysis(result)
    assert [(m.question, m.hidden, m.kind) for m in found] == [
        ("q1", True, "fault"), ("q1", False, "generic"), ("q1", True, "misleading"),
        ("q2", True, "timeout"), ("q2", True, "internals")]
    text = report.markdown(result, "jaxlab mutants lab")
    assert "## Messages of the killed mutants (5)" in text
    assert ("| question | killed mutants | messages (hidden / public) | names the fault | "
            "student's exception | generic | timeout | misleading | internals |") in text
    assert "| q1 | 2 | 3 (2 / 1) | 1 | 0 | 1 | 0 | 1 | 0 |" in text
    assert "| q2 | 2 | 2 (2 / 0) | 0 | 0 | 0 | 1 | 0 | 1 |" in text
    assert "| **all** | 4 | 5 (4 / 1) | 1 | 0 | 1 | 1 | 1 | 1 |" in text
    assert "| all, public cases |  | 1 (0 / 1) | 0 | 0 | 1 | 0 | 0 | 0 |" in text
    assert "### Misleading: 1 of 1, drawn with seed 44" in text
    assert "  - rule: a type message ('expected a Python int') for a mutant by arithmetic, " \
           "which changes a value, not its type" in text
    assert "kinds: names the fault (hidden), generic (public)" in text
    # the sample: at most SAMPLE_SIZE a kind, the same draw every time, in the report's order
    many = [messages.Message("q", "op", "c", True, f"m{i}", "generic") for i in range(30)]
    drawn = messages.sample(many, "generic")
    assert len(drawn) == messages.SAMPLE_SIZE and drawn == messages.sample(many, "generic")
    assert drawn == sorted(drawn, key=many.index)


def test_the_terminal_prints_the_counts_per_kind():
    import io

    from rich.console import Console

    from jaxlab.mutants import report

    framed = "AssertionError: `y` has the wrong values: expected 3"
    result = analysis.Analysis("lab", [_killed(messages=((True, framed),))], 1.0, 1.0, [],
                               {"q1": ["y"]})
    out = io.StringIO()
    report.terminal(result, Console(file=out, width=200))
    assert "messages of the killed mutants (1): names the fault 1, student's exception 0, " \
           "generic 0, timeout 0, misleading 0, internals 0" in out.getvalue()


# --------------------------------------------------------------------------- the tool, for real
@pytest.mark.slow
def test_one_question_analysed_with_the_shipped_checks_kills_or_decides_every_mutant(graded):
    """`jaxlab mutants` on Lab 6's q9, in the corpus's own kernel: every mutant is graded by
    the shipped checks, and the issue's known kinds are killed (a comparison made strict, a
    guard removed, a plain Python number turned into a NumPy one)."""
    from jaxlab import corpus
    from jaxlab.mutants import report

    lab, question = "lab6-memory", "q9_roofline"
    graded(corpus.load_answers(lab)[0])  # starts the lab's kernel (the corpus shares it)
    harness = graded.harnesses[lab]
    result = analysis.analyse(lab, questions=[question], harness=harness)
    assert len(result.outcomes) >= 30 and {o.question for o in result.outcomes} == {question}
    assert result.of("gap") == [] and result.of("undecided") == [], [
        (o.mutant.change, o.detail) for o in result.of("gap") + result.of("undecided")]
    # every kill keeps what the student reads, and the report sorts it by kind
    assert all(o.messages for o in result.of("killed"))
    assert "## Messages of the killed mutants" in report.markdown(result, "jaxlab mutants")
    killed = {o.mutant.change: o.detail for o in result.of("killed")}
    assert "raised ZeroDivisionError" in killed["slope <= 0  ->  slope < 0"]
    assert "expected None" in killed["if slope <= 0: return None  ->  (removed)"]
    assert "expected an int" in killed["math.ceil(peak * D * F / slope)  ->  "
                                       "np.ceil(peak * D * F / slope)"]
    # the kernel holds the solution again: the corpus goes on from there
    assert harness.run_tests([question])[question]["score"] == \
        harness.solution_results[question]["score"]
