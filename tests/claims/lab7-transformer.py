"""Lab 7's claims (docs/claims.md, section lab7-transformer): each check reads what the cell
tagged ``claim:<id>`` printed in the solution's run and asserts the relation the text states."""

import re


def _number(pattern, text, kind=float):
    match = re.search(pattern, text)
    assert match, f"no {pattern!r} in:\n{text}"
    return kind(match.group(1).replace(",", ""))


def _loop_line(text, section, place):
    """The '<place>, per layer: ...' line printed under ``section`` by show_collectives."""
    block = text.split(section, 1)
    assert len(block) == 2, f"no section {section!r} in:\n{text}"
    lines = block[1].splitlines()[1:]
    for line in lines:
        if not line.startswith("  "):
            break
        if line.strip().startswith(place):
            return line
    return ""


def _count(line, kind, over):
    """(number, bytes) of ``kind`` over ``over`` in a show_collectives line, (0, 0) if none."""
    match = re.search(rf"(\d+) {kind} over {re.escape(over)} \(([\d,]+) B\)", line)
    return (int(match.group(1)), int(match.group(2).replace(",", ""))) if match else (0, 0)


def axis_types(text):
    assert "default axis types: (Explicit, Explicit)" in text, text
    assert re.search(r"Explicit: jax.typeof\(x\) = float32\[\d+@data,\d+\]", text), text
    line = next(l for l in text.splitlines() if "with_sharding_constraint on Explicit" in l)
    assert "ValueError" in line and "Auto axes" in line and "reshard" in line, line
    assert re.search(r"reshard\(x, P\('data', 'model'\)\)\) = float32\[\d+@data,\d+@model\]",
                     text), text
    auto = next(l for l in text.splitlines() if l.startswith("Auto:"))
    assert "@" not in auto.split(" and ")[0] and "P('data'" in auto, auto


def tp_collectives(text):
    forward = _loop_line(text, "forward pass (tp_forward, compiled):", "forward loop")
    assert _count(forward, "all-reduce", "'model'")[0] == 2, forward
    step = "training step (jax.value_and_grad of the loss through tp_forward):"
    fwd = _loop_line(text, step, "forward loop")
    bwd = _loop_line(text, step, "backward loop")
    outside = _loop_line(text, step, "outside the loops")
    n_fwd, bytes_fwd = _count(fwd, "all-reduce", "'model'")
    n_bwd, bytes_bwd = _count(bwd, "all-reduce", "'model'")
    assert n_fwd == 2 and n_bwd >= 2, (fwd, bwd)
    # attention's three input gradients and the MLP's one: twice the forward's two activations
    assert bytes_bwd == 2 * bytes_fwd, (bytes_fwd, bytes_bwd)
    assert _count(bwd, "all-reduce", "'data'")[0] == 1, bwd
    assert _count(outside, "all-reduce", "'data'")[0] >= 1, outside


def _memory(text):
    rows = dict(re.findall(r"^  (replicated|TP|FSDP × TP, no remat|FSDP × TP, remat)\s+"
                           r"[\d.]+\s+[\d.]+\s+([\d.]+)$", text, re.M))
    assert len(rows) == 4, text
    return {k: float(v) for k, v in rows.items()}


def fsdp_memory(text):
    total = _memory(text)
    assert total["FSDP × TP, no remat"] > total["TP"], total  # FSDP without remat saves nothing
    assert total["FSDP × TP, remat"] < total["TP"] < total["replicated"], total


def fsdp_gathers(text):
    plain = "FSDP × TP, no remat (compiled):"
    remat = "FSDP × TP, remat (compiled):"
    assert _count(_loop_line(text, plain, "forward loop"), "all-gather", "'data'")[0] == 6, text
    assert _count(_loop_line(text, plain, "backward loop"), "all-gather", "'data'")[0] == 0, text
    assert _count(_loop_line(text, remat, "forward loop"), "all-gather", "'data'")[0] == 6, text
    assert _count(_loop_line(text, remat, "backward loop"), "all-gather", "'data'")[0] == 6, text


def fsdp_gradient_reduction(text):
    line = next(l for l in text.splitlines() if l.startswith("gradient reduction over 'data'"))
    sizes = [int(n) for n in re.search(r"per layer: \[([\d, ]*)\] B", line).group(1).split(",")]
    whole = _number(r"tensor-parallel layout: ([\d,]+) B", line, int)
    assert sizes == [whole], line  # one all-reduce of the whole tensor-parallel gradient
    remat = text.split("FSDP × TP, remat (compiled):", 1)[1]
    assert "reduce-scatter" not in remat, remat


def bf16_format(text):
    assert "7 stored significand bits + 1 implied = 8 bits, 2.41 decimal digits" in text, text
    assert _number(r"(?m)^bfloat16: .*largest ([\d.e+]+)", text) > 3e38
    assert _number(r"(?m)^float16: .*largest ([\d.]+)", text) == 65504
    assert "a gradient of 1e-8: float16 0, bfloat16 1e-08" in text, text
    assert "1 + 0.001 in bfloat16: 1.0" in text, text


def bf16_gradients(text):
    apart = _number(r"\(([\d.]+)% apart\)", text)
    median = _number(r"median ([\d.]+)%", text)
    largest = _number(r"largest ([\d.]+)% \(", text)
    assert apart < 2 and "gradients: ['float32']" in text, text
    assert 0.05 < median <= largest < 10, (median, largest)  # visible, and within Task 5's 10%


def bf16_memory(text):
    full = _number(r"float32\s+step: temporaries ([\d.]+) MiB", text)
    mixed = _number(r"mixed\s+step: temporaries ([\d.]+) MiB", text)
    assert mixed >= 0.9 * full, (full, mixed)  # products returned in float32: no saving


def accumulation_memory(text):
    full = _number(r"one piece: ([\d.]+) MiB", text)
    micro = _number(r"in 8 microbatches: ([\d.]+) MiB", text)
    assert micro < 0.5 * full, (full, micro)


def checkpoint_blocks(text):
    lines = [l for l in text.splitlines() if l.startswith("saved layers/")]
    assert len(lines) == 2, text
    for line in lines:
        chunks = re.search(r"chunks (\([\d, ]+\))", line).group(1)
        block = re.search(r"one device's block (\([\d, ]+\))", line).group(1)
        assert chunks == block and "sharding recorded (None," in line, line


def flops_formula(text):
    line = next(l for l in text.splitlines() if l.startswith("step_flops(cfg"))
    values = re.findall(r"(?:= |: )([\d,]{4,})", line)
    assert len(values) == 3 and len(set(values)) == 1, line  # formula, 6N + 12LBS²D, traced


def cost_analysis_loop(text):
    rows = re.findall(r"^(\d+) layer\(s\): step_flops ([\d,]+), cost_analysis ([\d,]+)$", text,
                      re.M)
    assert len(rows) >= 3, text
    model = [int(m.replace(",", "")) for _, m, _ in rows]
    counted = [int(c.replace(",", "")) for _, _, c in rows]
    assert max(counted) <= 1.01 * min(counted), counted  # the loop's body counted once
    assert model == sorted(model) and model[-1] > 4 * model[0], model
    assert abs(counted[0] - model[0]) <= 0.05 * model[0], (counted[0], model[0])


def restore_continues(text):
    assert re.search(r"restored at step \d+ on a \{'data': 2, 'model': 2\} mesh", text), text
    assert "laid out P(None, 'data', 'model')" in text, text  # the moments sharded like w1
    first, last, resumed = (float(x) for x in re.search(
        r"loss ([\d.]+) → ([\d.]+) on 4 × 2; the resumed run ends at ([\d.]+)", text).groups())
    gap = _number(r"largest gap between the two second halves: ([\d.e+-]+)", text)
    assert last < first / 2 and gap < 1e-2 and abs(resumed - last) < 1e-2, (first, last, gap)


def mfu(text):
    peak = _number(r"host peak, measured: ([\d.]+) GFLOP/s", text)
    share = _number(r"MFU ([\d.]+)%", text)
    assert peak > 0 and 0 < share <= 100, (peak, share)
    assert "median" in text and "of 5 measurements" in text, text


def hardware_flops(text):
    model = _number(r"model FLOPs ([\d,]+);", text, lambda s: int(s))
    runs = _number(r"products the program runs ([\d,]+)", text, lambda s: int(s))
    assert model < runs < 4 / 3 * model + 1, (model, runs)  # remat's second forward pass
    mfu_, hfu = _number(r"MFU ([\d.]+)%", text), _number(r"HFU ([\d.]+)%", text)
    assert hfu > mfu_, (mfu_, hfu)


CLAIMS = {
    "lab7-axis-types": axis_types,
    "lab7-tp-collectives": tp_collectives,
    "lab7-fsdp-memory": fsdp_memory,
    "lab7-fsdp-gathers": fsdp_gathers,
    "lab7-fsdp-gradient-reduction": fsdp_gradient_reduction,
    "lab7-bf16-format": bf16_format,
    "lab7-bf16-gradients": bf16_gradients,
    "lab7-bf16-memory": bf16_memory,
    "lab7-accumulation-memory": accumulation_memory,
    "lab7-checkpoint-blocks": checkpoint_blocks,
    "lab7-flops-formula": flops_formula,
    "lab7-cost-analysis-loop": cost_analysis_loop,
    "lab7-restore-continues": restore_continues,
    "lab7-mfu": mfu,
    "lab7-hardware-flops": hardware_flops,
}
