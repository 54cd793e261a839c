"""Lab 3's claims about JAX and XLA (docs/claims.md, section lab3-parallelism): each check reads
what its measuring cell printed in the solution's run and asserts the relation the text states
(not exact figures, which move with the backend and the version)."""

import ast
import math
import re

NUMBER = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?"


def _after(text, label):
    """The rest of the first line that starts with ``label``."""
    match = re.search(r"^" + re.escape(label) + r"\s*(.*)$", text, re.M)
    assert match, f"no line starting with {label!r} in:\n{text}"
    return match.group(1).strip()


def _literal(text, label):
    """The Python literal printed after ``label``."""
    return ast.literal_eval(_after(text, label))


def _version(text):
    match = re.search(r"JAX (\d+)\.(\d+)", text)
    assert match, f"no JAX version printed in:\n{text}"
    return int(match.group(1)), int(match.group(2))


def devices_fixed_at_start(text):
    # "JAX fixes the number of devices when it starts": asking again is refused
    assert "RuntimeError" in _after(text, "asking for 4 CPU devices now:"), text
    assert _after(text, "CPU devices:") == "8", text


def default_device(text):
    # "An array created without further instructions lives on the default device (the first
    # one) ... not committed"
    assert re.search(r"A\.device = \w*Device\(id=0\)", text), text
    assert "SingleDeviceSharding" in _after(text, "A.sharding ="), text
    assert _after(text, "A.committed =") == "False", text


def committed(text):
    # "the new array is committed to it: ... mixing it with an array committed to other devices
    # is an error rather than a silent copy"; an uncommitted array is moved
    assert re.search(r"ones_on_1\.device = \w*Device\(id=1\)", text), text
    assert _after(text, "ones_on_1.committed =") == "True", text
    moved = _after(text, "(ones_on_1 + A).device =")
    assert re.match(r"(\w+:1|\w*Device\(id=1\))\b", moved), moved
    assert "ValueError" in _after(text, "ones_on_1 + an array committed to device 2:"), text


def make_mesh_default_explicit(text):
    # "Since JAX 0.9 (...) a new mesh's axes are explicit unless you say otherwise"
    types = _after(text, f"JAX {'.'.join(map(str, _version(text)))}")
    expected = "Explicit" if _version(text) >= (0, 9) else "Auto"
    found = re.findall(r"\b(Explicit|Auto|Manual)\b", types)
    assert found and set(found) == {expected}, types


def elementwise_keeps_sharding(text):
    # "the output keeps the input's sharding ... and the compiled program needs no communication"
    assert _after(text, "same sharding as A_sharded:") == "True", text
    assert _literal(text, "collectives:") == {}, text
    assert _after(text, "same sharding as A:") == "True", text


def column_sums_allreduce(text):
    # "the first four column sums are held by both devices 0 and 4, ... one all-reduce"
    assert _literal(text, "devices holding the same column sums:") == [[0, 4], [1, 5], [2, 6],
                                                                       [3, 7]], text
    assert _literal(text, "collectives:") == {"all-reduce": 1}, text


def unsharded_layer_default_device(text):
    # "None of these arrays was given a sharding, so they live on the default device, and so
    # does the layer's output"
    assert re.search(r"SingleDeviceSharding\(device=\w*Device\(id=0\)", text), text


def typeof_host_values(text):
    # "jax.typeof returns that type ... also for NumPy arrays and Python scalars"; "~" a weak
    # type that adapts to the dtype of the arrays it meets
    assert _after(text, "JAX-level type of a NumPy array:") == "int32[8]", text
    assert _after(text, "JAX-level type of a JAX array:") == "float32[4,16]", text
    assert _after(text, "JAX-level type of a Python float:") == "~float32[]", text
    assert _after(text, "bfloat16 array times that float:") == "bfloat16[2]", text


def auto_type_says_nothing(text):
    # "On a mesh with Auto axes the type says nothing about sharding: ... just float32[4,16]"
    assert _after(text, "JAX-level type of the argument during tracing:") == "float32[4,16]", text


def explicit_type_replicates_unnamed_axes(text):
    # "float32[8@x,4] ... Mesh axes that the type does not mention (here y) replicate the array"
    assert _after(text, "type of A_explicit:") == "float32[8@x,4]", text
    assert _literal(text, "devices holding the same block:") == [[0, 1, 2, 3], [4, 5, 6, 7]], text


def types_known_at_trace_time(text):
    # "the types printed above are known before anything runs"
    assert _after(text, "type of the product, from tracing alone:") == "int32[4@x,8@y]", text


def explicit_sum_collective(text):
    # "it still turns a jnp.sum into per-device sums plus a collective"
    assert _after(text, "type of the sum:") == "float32[]", text
    assert _literal(text, "collectives:") == {"all-reduce": 1}, text


def experimental_shard_map_deprecated(text):
    # "jax.experimental.shard_map, which JAX 0.8.0 deprecated"
    said = _after(text, f"JAX {'.'.join(map(str, _version(text)))}")
    assert said.startswith("removed") or (
        "DeprecationWarning" in said and "deprecated" in said), said


def shard_map_sees_one_block(text):
    # "The function inside shard_map only ever sees one block"; {V:x}: varying over x
    assert _after(text, "shape of the block on one device:") == "(8,)", text
    assert _after(text, "type of the block:") == "float32[8]{V:x}", text
    assert _after(text, "global shape:") == "(32,)", text


def partial_sums_vary(text):
    # "one partial sum per device, a value that still varies over x"
    assert _after(text, "type of the block's sum:") == "float32[1]{V:x}", text
    sums = [float(v) for v in re.findall(NUMBER, re.search(r"^\[([^\]]*)\]", text, re.M).group(1))]
    assert sums == [28.0, 92.0, 156.0, 220.0], sums


def psum_invariant(text):
    # "The result is the same on every device (its type no longer names x)"
    assert _after(text, "type after psum:") == "float32[]", text
    assert float(re.findall(NUMBER, text.strip().splitlines()[-1])[0]) == 496.0, text


def out_specs_checked(text):
    # "asked to return as replicated a value that still varies over x, it refuses"
    assert "ValueError" in _after(text, "partial sums returned with out_specs=P():"), text


def sharded_gradient_step(text):
    # "The same arithmetic, in eighths, plus one all-reduce of the whole gradient"
    match = re.search(r"a block of \((\d+), 1\) of \((\d+), 1\) on each of (\d+) devices", text)
    assert match, text
    rows, total_rows, n = map(int, match.groups())
    assert n == 8 and rows * n == total_rows, match.group(0)
    one = float(re.search(rf"one device: ({NUMBER}) FLOPs", text).group(1))
    each, count, whole = re.search(
        rf"sharded:\s+({NUMBER}) FLOPs per device x (\d+) devices = ({NUMBER})", text).groups()
    assert int(count) == n and math.isclose(float(whole), one, rel_tol=0.02), (one, whole)
    found = ast.literal_eval(re.search(r"collectives of the sharded gradient: (\{[^}]*\})",
                                       text).group(1))
    assert found == {"all-reduce": 1}, found
    reduced, gradient = re.search(r"all-reduced: ([\d,]+) bytes, the whole gradient is ([\d,]+)",
                                  text).groups()
    assert reduced == gradient, (reduced, gradient)


def accelerator_sizes(text):
    # "each of 8 GPUs does an eighth of 1.3e13 FLOPs and then all-reduces a 512 MiB gradient ...
    # At the CPU sizes (4.1e8 FLOPs)"
    sizes = {}
    for label in ("CPU sizes", "accelerator sizes"):
        flops, each, mib = re.search(rf"^{label} .*?: ({NUMBER}) FLOPs per call, ({NUMBER}) per "
                                     rf"device; all-reduce of ({NUMBER}) MiB", text, re.M).groups()
        assert math.isclose(float(flops), 8 * float(each), rel_tol=0.01), (flops, each)
        sizes[label] = float(flops), float(mib)
    assert math.isclose(sizes["accelerator sizes"][0], 1.3e13, rel_tol=0.04), sizes
    assert math.isclose(sizes["accelerator sizes"][1], 512, rel_tol=0.01), sizes
    assert math.isclose(sizes["CPU sizes"][0], 4.1e8, rel_tol=0.03), sizes


def peak_memory(text):
    # "a default Gradescope grading container has 768 MB; the last cell prints this kernel's peak"
    peak = float(re.search(rf"peak memory of this kernel: ({NUMBER}) MiB", text).group(1))
    assert peak < 768e6 / 2**20, f"{peak:.0f} MiB, past the 768 MB of a Gradescope container"


CLAIMS = {
    "lab3-devices-fixed-at-start": devices_fixed_at_start,
    "lab3-default-device": default_device,
    "lab3-committed": committed,
    "lab3-make-mesh-default-explicit": make_mesh_default_explicit,
    "lab3-elementwise-keeps-sharding": elementwise_keeps_sharding,
    "lab3-column-sums-allreduce": column_sums_allreduce,
    "lab3-unsharded-layer-default-device": unsharded_layer_default_device,
    "lab3-typeof-host-values": typeof_host_values,
    "lab3-auto-type-says-nothing": auto_type_says_nothing,
    "lab3-explicit-type-replicates-unnamed-axes": explicit_type_replicates_unnamed_axes,
    "lab3-types-known-at-trace-time": types_known_at_trace_time,
    "lab3-explicit-sum-collective": explicit_sum_collective,
    "lab3-experimental-shard-map-deprecated": experimental_shard_map_deprecated,
    "lab3-shard-map-sees-one-block": shard_map_sees_one_block,
    "lab3-partial-sums-vary": partial_sums_vary,
    "lab3-psum-invariant": psum_invariant,
    "lab3-out-specs-checked": out_specs_checked,
    "lab3-sharded-gradient-step": sharded_gradient_step,
    "lab3-accelerator-sizes": accelerator_sizes,
    "lab3-peak-memory": peak_memory,
}
