"""Lab 5's claims about JAX and XLA (docs/claims.md, section lab5-scaling), checked on what the
tagged cells of the solution's run printed. Each check parses the numbers and asserts the
relation the text states."""

import ast
import re

# `print_collectives` prints a header ending with ':' (or ': no collective'), then one line per
# kind of collective: `  COUNT OP over AXES: RESULT`, RESULT a type or `K arrays ...`
COLLECTIVE = re.compile(r"^\s+(\d+) ([a-z-]+) over (.+?): (.*)$")


def sections(text):
    """header -> [(op, axes, arrays one op moves, count)] for each print_collectives block."""
    found, current = {}, None
    for line in text.splitlines():
        m = COLLECTIVE.match(line)
        if m and current is not None:
            arrays = re.match(r"(\d+) arrays", m.group(4))
            found[current].append((m.group(2), m.group(3), int(arrays.group(1)) if arrays else 1,
                                   int(m.group(1))))
        elif line.rstrip().endswith(":") or line.rstrip().endswith(": no collective"):
            current = line.rstrip().removesuffix(" no collective").removesuffix(":")
            found[current] = []
        else:
            current = None
    return found


def section(text, start):
    blocks = [v for k, v in sections(text).items() if k.startswith(start)]
    assert blocks, f"no collectives printed under {start!r} in:\n{text}"
    return blocks[0]


def count(block, op, over=None):
    """How many ops of kind ``op`` (over axes starting with ``over``) a block lists."""
    return sum(n for o, axes, _, n in block if o == op and (over is None or axes.startswith(over)))


def arrays(block, op, over):
    return sum(k * n for o, axes, k, n in block if o == op and axes.startswith(over))


def line_value(text, prefix):
    found = [ln[len(prefix):].strip() for ln in text.splitlines() if ln.startswith(prefix)]
    assert found, f"no line starting {prefix!r} in:\n{text}"
    return found[0]


def typeof_split(text):
    # "P('x', None): float32[8@x,8], 2 blocks, each on [4] device(s)"
    rows = re.findall(r"(?:P|PartitionSpec)\((.*?)\): (float32\[[^\]]*\]), (\d+) blocks, each on "
                      r"\[([\d, ]+)\]", text)
    got = {spec: (typ, int(blocks), holders) for spec, typ, blocks, holders in rows}
    assert got["'x', 'y'"] == ("float32[8@x,8@y]", 8, "1"), got
    assert got["'x', None"] == ("float32[8@x,8]", 2, "4"), got  # copies over y
    assert got["None, 'y'"] == ("float32[8,8@y]", 4, "2"), got  # copies over x


def out_sharding(text):
    assert "ShardingTypeError" in text, text
    assert line_value(text, "with out_sharding:") == "float32[8@x,4]"
    block = section(text, "jnp.dot(a, b, out_sharding")
    assert [(op, axes, n) for op, axes, _, n in block] == [("all-reduce", "'y'", 1)], block


def megatron_forward(text):
    assert line_value(text, "output:") == "float32[32@data,8]"
    assert line_value(text, "same as one device:") == "True"
    block = section(text, "forward_2d(params_2d, x_2d), compiled")
    assert [(op, axes, n) for op, axes, _, n in block] == [("all-reduce", "'model'", 1)], block
    assert re.search(r"all-reduce over 'model': f32\[8,8\]", text), text


def megatron_backward(text):
    assert line_value(text, "same gradient:") == "True"
    assert line_value(text, "W1's gradient:") == "float32[16,64@model]"
    forward = section(text, "loss_2d (the forward pass)")
    assert count(forward, "all-reduce", "'model'") == 1 and \
        count(forward, "all-reduce", "'data'") == 1 and len(forward) == 2, forward
    params = section(text, "jax.grad(loss_2d), for the parameters")
    assert count(params, "all-reduce", "'model'") == 1, params  # the forward's, nothing more
    assert arrays(params, "all-reduce", "'data'") >= 4, params  # every gradient over data
    assert count(params, "all-gather") == 0, params
    with_x = section(text, "jax.grad for the parameters and x")
    assert count(with_x, "all-reduce", "'model'") == 2, with_x  # + Megatron's f, backward
    assert arrays(with_x, "all-reduce", "'data'") >= 4 and count(with_x, "all-gather") == 0


def stage_blocks(text):
    held = dict(re.findall(r"device (\d+) holds layers (\[[\d, ]+\])", text))
    assert {int(k): ast.literal_eval(v) for k, v in held.items()} == \
        {k: [2 * k, 2 * k + 1] for k in range(8)}, held


def pipeline_forward(text):
    assert line_value(text, "equals the sequential model:") == "True"
    traced = re.search(r"ppermute equations in the traced program: (\d+) \(the schedule has "
                       r"M \+ L - 1 = (\d+) steps\)", text)
    assert traced and traced.group(1) == traced.group(2) == "15", text
    block = section(text, "pipeline_forward, compiled")
    # the last step's send feeds nothing: M + L - 2 hand-overs run
    assert count(block, "collective-permute", "'stage', each device to the one 1 after") == 14
    assert count(block, "all-reduce", "'stage'") == 1 and count(block, "all-gather") == 0, block
    assert sum(n for *_, n in block) == 15, block


def pipeline_backward(text):
    assert line_value(text, "same gradient:") == "True"
    assert re.search(r"gradient of W_stack: float32\[16,24,24\] (?:P|PartitionSpec)\('stage',?\)", text)
    block = section(text, "jax.grad(pipeline_loss), compiled")
    on = count(block, "collective-permute", "'stage', each device to the one 1 after")
    back = count(block, "collective-permute", "'stage', each device to the one 1 before")
    assert on == back == 14, block  # a second pipeline running the other way
    assert count(block, "all-gather") == 0, block


def all_to_all_transpose(text):
    assert line_value(text, "after is the transpose of before:") == "True"


def moe_collectives(text):
    assert line_value(text, "equals the dense layer:") == "True"
    dropped = re.search(r"dropped tokens: (\d+) \(by the task's definitions: (\d+)\)", text)
    assert dropped and dropped.group(1) == dropped.group(2), text
    assert line_value(text, "each kept token's gate is its router probability:") == "True"
    forward = section(text, "moe_layer (forward)")
    assert [(op, axes, n) for op, axes, _, n in forward] == [("all-to-all", "'expert'", 2)]
    grad = section(text, "its gradient for all four inputs")
    assert count(grad, "all-to-all", "'expert'") == 4, grad  # the transposes carry gradients
    assert count(grad, "all-reduce", "'expert'") == 1 and len(grad) == 2, grad  # the router's


def moe_flops(text):
    rows = re.findall(r"E = (\d+): +([\d,]+) FLOPs per device with capacity 2; +([\d,]+) with "
                      r"capacity 16 / E", text)
    fixed = {int(e): int(a.replace(",", "")) for e, a, _ in rows}
    shrinking = {int(e): int(b.replace(",", "")) for e, _, b in rows}
    one = int(re.search(r"one expert for each of the 8 tokens: +([\d,]+) FLOPs",
                        text).group(1).replace(",", ""))
    assert sorted(fixed) == [2, 4, 8], rows
    assert fixed[2] < fixed[4] < fixed[8] and fixed[8] >= 3 * fixed[2], fixed  # grows with E
    assert max(shrinking.values()) <= 1.1 * min(shrinking.values()), shrinking  # nearly flat
    assert min(shrinking.values()) > one and fixed[8] > one, (shrinking, one)


def process_arrays(text):
    for me in (0, 1):
        assert f"process {me} of 2: devices" in text and "8 in all" in text, text
        assert f"process {me}: np.asarray(x) fails" in text, text
        assert re.search(rf"process {me} of 2: .*CPU collectives by default: 'gloo'", text)
        gathered = line_value(text, f"process {me}: x gathered, first column:")
        assert ast.literal_eval(gathered) == [0, 1, 2, 3, 10, 11, 12, 13], gathered
        flipped = line_value(text, f"process {me}: on a mesh with process 1's devices first, "
                             "gathered:")
        assert ast.literal_eval(flipped) == [10, 11, 12, 13, 0, 1, 2, 3], flipped
    sums = re.findall(r"column sums of all 8 rows: (\[.*\])", text)
    assert len(sums) == 2 and sums[0] == sums[1] == "[52.0, 52.0]", sums


CLAIMS = {
    "lab5-typeof-split": typeof_split,
    "lab5-out-sharding": out_sharding,
    "lab5-megatron-forward": megatron_forward,
    "lab5-megatron-backward": megatron_backward,
    "lab5-stage-blocks": stage_blocks,
    "lab5-pipeline-forward": pipeline_forward,
    "lab5-pipeline-backward": pipeline_backward,
    "lab5-all-to-all-transpose": all_to_all_transpose,
    "lab5-moe-collectives": moe_collectives,
    "lab5-moe-flops": moe_flops,
    "lab5-process-arrays": process_arrays,
}
