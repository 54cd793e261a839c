"""Lab 4's claims about JAX and XLA (docs/claims.md, section lab4-shard-map): each check reads
what its measuring cell printed in the solution's run and asserts the relation the text states
(not exact figures, which move with the backend and the version). The collectives come from the
notebook's `print_collectives` (the compiled program's text), memory from `memory_analysis()`."""

import re

# `print_collectives`: "label: N collective(s), B bytes in all" (or ": no collective"), then one
# line per kind: "  N x OP returning WHAT (B bytes)[, each device to the next]"
HEAD = re.compile(r"^(\S.*?): (?:(\d+) collective\(s\), ([\d,]+) bytes in all|no collective)$",
                  re.M)
KIND = re.compile(r"^\s+(\d+) x (\S+) returning (.+?) \(([\d,]+) bytes\)(.*)$")


def _int(text):
    return int(text.replace(",", ""))


def collectives(text):
    """label -> list of (count, operation, result, bytes of one, how it moves)."""
    found, label = {}, None
    for line in text.splitlines():
        head, kind = HEAD.match(line), KIND.match(line)
        if head:
            label = head.group(1)
            found[label] = []
        elif kind and label is not None:
            n, op, what, size, moves = kind.groups()
            found[label].append((int(n), op, what, _int(size), moves.strip(", ")))
        elif line.strip():
            label = None
    return found


def _one(found, start):
    labels = [label for label in found if label.startswith(start)]
    assert len(labels) == 1, f"no single block of collectives starting {start!r}: {list(found)}"
    return found[labels[0]]


def count(kinds, op):
    return sum(n for n, o, *_ in kinds if o == op)


def total(kinds, op=None):
    return sum(n * size for n, o, _, size, _ in kinds if op is None or o == op)


def _number(text, pattern):
    match = re.search(pattern, text, re.M)
    assert match, f"{pattern!r} not found in:\n{text}"
    return _int(match.group(1))


def unbound_axis(text):
    # "called on its own it fails with 'unbound axis name'"
    assert "NameError" in text and "unbound axis name" in text, text


def block_shape(text):
    # "Inside shard_map each device holds a block of shape (1, 5) ... {V:p} says that the block
    # varies over the mesh axis 'p'"
    assert re.search(r"inside shard_map: float32\[1,5\]\{V:p\}", text), text


def one_scalar_sum(text):
    # Task 2's demo: the sum equals jnp.sum, and the one collective adds one scalar per device
    first = text.splitlines()[0].split()
    assert float(first[0]) == float(first[1]), text
    kinds = _one(collectives(text), "global_sum(v)")
    assert [(n, op, what, size) for n, op, what, size, _ in kinds] == \
        [(1, "all-reduce", "f32[]", 4)], kinds


def allgather_holds_rhs(text):
    # "every device briefly holds all of rhs": one all-gather returning all of rhs, and the
    # compiled program's scratch holds at least that much
    kinds = _one(collectives(text), "matmul_allgather(lhs, rhs)")
    rhs = _number(text, r"all of rhs: ([\d,]+) bytes")
    assert [(n, op, size) for n, op, _, size, _ in kinds] == [(1, "all-gather", rhs)], kinds
    assert _number(text, r"scratch of one device: ([\d,]+) bytes") >= rhs, text


def ring_permutes(text):
    # "After 8 steps every device has seen every block": 7 blocks of rhs arrive, one
    # collective-permute at a time, no all-gather; on these CPU devices no transfer is
    # asynchronous; the ring's scratch is below the all_gather's (all of rhs)
    kinds = _one(collectives(text), "matmul_allgather_overlapped(lhs, rhs)")
    assert [(n, op) for n, op, *_ in kinds] == [(7, "collective-permute")], kinds
    rhs = _number(text, r"all of rhs: ([\d,]+)\)")
    assert kinds[0][3] * 8 == rhs, (kinds, rhs)  # each moves one of the 8 blocks of rhs
    assert kinds[0][4] in ("each device to the next", "each device to the previous"), kinds
    ring = _number(text, r"^scratch of one device: ([\d,]+) bytes")
    gathered = _number(text, r"scratch of one device with Task 3's all_gather: ([\d,]+) bytes")
    assert ring < gathered and gathered >= rhs, text


def psum_scatter_bytes(text):
    # "psum_scatter adds them up and gives each device only its block of rows of the sum":
    # the reduce-scatter returns one eighth of what psum's all-reduce returns
    found = collectives(text)
    mine = _one(found, "matmul_psumscatter(lhs_by_cols, rhs)")
    summed = _one(found, "the partial products added up with psum")
    assert [(n, op) for n, op, *_ in mine] == [(1, "reduce-scatter")], mine
    assert [(n, op) for n, op, *_ in summed] == [(1, "all-reduce")], summed
    assert summed[0][3] == 8 * mine[0][3], (mine, summed)


def ring_partial_sums(text):
    # Task 6: 7 partial sums, each one device's block of the result, and nothing else moves
    kinds = _one(collectives(text), "matmul_psumscatter_overlapped(lhs_by_cols, rhs)")
    assert [(n, op, what) for n, op, what, *_ in kinds] == [(7, "collective-permute",
                                                            "f32[4,16]")], kinds


def bidi_both_directions(text):
    # "sending one half up the ring and the other down uses both directions: the same bytes in
    # all, half of them each way"
    kinds = _one(collectives(text), "matmul_allgather_overlapped_bidi(lhs, rhs)")
    ways = {moves: (n, size) for n, op, _, size, moves in kinds if op == "collective-permute"}
    assert len(kinds) == 2 and {op for _, op, *_ in kinds} == {"collective-permute"}, kinds
    assert ways.get("each device to the next") == ways.get("each device to the previous") \
        == (7, 256), kinds
    assert total(kinds) == 7 * 512, kinds  # the one-way ring's 7 blocks of 512 bytes


def grad_trap(text):
    # "with check_vma=True ... 8 times the true gradient on 8 devices; with check_vma=False the
    # recipe gives the true gradient"; the implicit cast shows as pvary in the traced program
    ratios = {m.group(1): (float(m.group(2)), float(m.group(3))) for m in re.finditer(
        r"check_vma=(True|False): local gradients, then pmean: ([\d.]+) to ([\d.]+) times", text)}
    assert set(ratios) == {"True", "False"}, text
    assert all(abs(r - 8) < 1e-2 for r in ratios["True"]), ratios
    assert all(abs(r - 1) < 1e-3 for r in ratios["False"]), ratios
    assert re.search(r"check_vma=True.*\d+ pvary", text), text
    assert not re.search(r"check_vma=False.*pvary", text), text


def dp_collectives(text):
    # "to get the loss of the whole batch the devices exchange one scalar ... a training step
    # all-reduces the whole gradient, as large as the model (670 KB here)"
    assert "same gradient: True" in text, text
    found = collectives(text)
    loss = _one(found, "loss_dp, compiled")
    grad = _one(found, "jax.grad(loss_dp), compiled")
    assert [(n, op, size) for n, op, _, size, _ in loss] == [(1, "all-reduce", 4)], loss
    params = _number(text, r"the parameters: ([\d,]+) bytes")
    assert {op for _, op, *_ in grad} == {"all-reduce"} and total(grad) == params, (grad, params)
    assert 660_000 < params < 680_000, params  # "670 KB here"


def fsdp_collectives(text):
    # "Collectives are now needed in three places": the loss gathers each of the 12 parameters and
    # combines the losses; the gradient adds one psum_scatter (reduce-scatter) per parameter
    assert "same gradient: True" in text, text
    found = collectives(text)
    loss = _one(found, "loss_fsdp, compiled")
    grad = _one(found, "jax.grad(loss_fsdp), compiled")
    assert count(loss, "all-gather") == 12 and count(loss, "all-reduce") == 1, loss
    assert count(grad, "all-gather") == 12 and count(grad, "reduce-scatter") == 12, grad
    assert count(grad, "all-reduce") == 0, grad


def fsdp_memory(text):
    # "each device stores only its shard of every parameter and of every gradient ... At these
    # sizes the compiled loss holds all six [gathered weights] at once, so the loss alone needs
    # more memory per device than data parallelism's; its gradient ... needs less"
    rows = {m.group(1): tuple(_int(n) for n in m.group(2).split())
            for m in re.finditer(r"^(loss_dp|loss_fsdp|grad of loss_dp|grad of loss_fsdp)\s+"
                                 r"([\d,]+\s+[\d,]+\s+[\d,]+)$", text, re.M)}
    assert len(rows) == 4, text
    gathered = _number(text, r"all six layers' W and b, gathered: ([\d,]+) bytes")
    dp, fsdp = rows["loss_dp"], rows["loss_fsdp"]
    gdp, gfsdp = rows["grad of loss_dp"], rows["grad of loss_fsdp"]
    assert fsdp[0] < dp[0] and gfsdp[1] < gdp[1], rows  # sharded parameters and gradients
    assert fsdp[2] >= gathered > dp[2], rows  # every gathered weight alive at once
    assert sum(fsdp) > sum(dp) and sum(gfsdp) < sum(gdp), rows


def fsdp_policy(text):
    # "In a Python loop over the layers, as here, the gathers again are in the traced program,
    # but the compiled gradient keeps every gathered weight anyway: it needs the same scratch
    # memory with the policy as without it. (With JAX 0.10.2, XLA even merges the gathers again
    # with the forward pass's, so the compiled program has the same all-gathers too ...) Nor does
    # XLA gather again by itself."
    rows = {m.group(1): tuple(map(_int, m.group(2, 3, 4))) for m in re.finditer(
        r"gradient of loss_fsdp (as written|in jax.checkpoint with the policy): (\d+) all_gather "
        r"traced, (\d+) all-gather compiled, scratch ([\d,]+) bytes", text)}
    assert len(rows) == 2, text
    plain, policy = rows["as written"], rows["in jax.checkpoint with the policy"]
    assert policy[0] > plain[0] == plain[1] == 12, rows  # re-gathers traced; none by itself
    assert abs(policy[2] - plain[2]) <= 0.01 * plain[2], rows  # the same scratch (JAX 0.12: -0.1%)
    if re.search(r"^JAX 0\.10\.", text, re.M):
        assert policy[1] == plain[1], rows  # merged with the forward pass's gathers


def fsdp_scan_policy(text):
    # "In a lax.scan over stacked layers, whose body runs once per layer, the policy does pay
    # off": the backward loop gathers again, and the scratch shrinks
    rows = {m.group(1): (int(m.group(2)), _int(m.group(3))) for m in re.finditer(
        r"layers in a lax.scan, (without a policy|with the policy): (\d+) all-gather\(s\) in the "
        r"compiled gradient, scratch ([\d,]+) bytes", text)}
    assert len(rows) == 2, text
    plain, policy = rows["without a policy"], rows["with the policy"]
    assert policy[0] > plain[0] and policy[1] < plain[1], rows


def tp_collectives(text):
    # "every layer is a local matrix product followed by psum_scatter ... jax.jit then adds the
    # communication it needs (an all-reduce ...) ... the backward pass gathers, layer by layer,
    # the gradient of the activations (never a weight)"
    assert "same gradient: True" in text, text
    found = collectives(text)
    loss = _one(found, "loss_tp, compiled")
    grad = _one(found, "jax.grad(loss_tp), compiled")
    assert count(loss, "reduce-scatter") == 6 and count(loss, "all-gather") == 0, loss
    assert count(loss, "all-reduce") >= 1, loss
    assert count(grad, "reduce-scatter") == 6 and count(grad, "all-gather") == 6, grad
    batch = 32  # an activation's gradient has the batch's rows; a weight has 128 or 784
    gathered = [what for n, op, what, *_ in grad if op == "all-gather"]
    assert all(re.fullmatch(rf"f32\[{batch},\d+\]", w) for w in gathered), gathered


def trap_converges(text):
    # "gradient descent on it converges for every learning rate below 2 / λ ... 8 * LEARNING_RATE
    # = 0.04 is far below"
    bound = float(re.search(r"below 2 / [\d.]+ = ([\d.]+)", text).group(1))
    eight = float(re.search(r"8 \* LEARNING_RATE = ([\d.]+)", text).group(1))
    assert eight == 0.04 and eight < bound / 10, text


def peak_memory(text):
    # "this lab peaks well below [a 768 MB grading container]"
    peak = _number(text, r"peak memory of this kernel: (\d+) MiB")
    assert peak < 700, text


CLAIMS = {
    "lab4-unbound-axis": unbound_axis,
    "lab4-block-shape": block_shape,
    "lab4-one-scalar-sum": one_scalar_sum,
    "lab4-allgather-holds-rhs": allgather_holds_rhs,
    "lab4-ring-permutes": ring_permutes,
    "lab4-psum-scatter-bytes": psum_scatter_bytes,
    "lab4-ring-partial-sums": ring_partial_sums,
    "lab4-bidi-both-directions": bidi_both_directions,
    "lab4-grad-trap": grad_trap,
    "lab4-dp-collectives": dp_collectives,
    "lab4-fsdp-collectives": fsdp_collectives,
    "lab4-fsdp-memory": fsdp_memory,
    "lab4-fsdp-policy": fsdp_policy,
    "lab4-fsdp-scan-policy": fsdp_scan_policy,
    "lab4-tp-collectives": tp_collectives,
    "lab4-trap-converges": trap_converges,
    "lab4-peak-memory": peak_memory,
}
