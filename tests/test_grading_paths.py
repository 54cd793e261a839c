"""Each lab graded the two ways an instructor grades it without Docker, on one set of
submissions per lab: `otter run` with the shipped zip (one notebook at a time, in-process, as
instructors try a notebook) and `jaxlab grade` (one batch, sandboxed). Each path grades each
submission once; every test below reads those results.

The set, per lab:

* a notebook downloaded from Colab (Colab's metadata, renamed "… (1).ipynb" as a second
  download is) whose answer to one question passes its public check and fails its hidden one:
  full marks but that question (and those that use its result). Renamed, otter's init cell fails
  and otter runs every test at the end on the final globals; a grader that used the public tests
  the setup cell carries would give the point;
* the blank student notebook: zero on every question, and a readable message for each;
* Lab 3 also: two samples of corpus answers (several questions each, none affecting another;
  one under the master's name, one renamed) must score what the answer harness gave each answer
  (the harness is what grades the corpus in test_answers.py); and, under `jaxlab grade` only (it
  would take the machine's memory in-process), a memory hog in q3's answer costs only q3.
"""

import dataclasses
import importlib
import json
import os
import pathlib
import shutil

import nbformat
import pandas as pd
import pytest
import yaml

from jaxlab import corpus as harness
import colab
from labs import LABS, ROOT, release_paths
from jaxlab import release
from jaxlab.grade.engine.autograder import open_autograder

pytestmark = pytest.mark.slow  # kernels, sandboxes or services: not in make test-quick

# An answer that passes its public check and fails its hidden one (from the answer corpus), the
# questions it costs, and its code.
WELL_FORMED_WRONG = {
    # the block function reads the notebook's own W and b, not its arguments: right on the
    # notebook's inputs (the public check), wrong on the hidden check's new W and b
    "lab3-parallelism": ("q7_dp_manual", {"q7_dp_manual"},
                         'line = jax.make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,), '
                         'devices=devices)\n'
                         'layer_manual = jax.shard_map(lambda xb, Wb, bb: layer(xb, W, b), '
                         'mesh=line, in_specs=(P("batch"), P(), P()), out_specs=P("batch"))\n'
                         'out_man = layer_manual(x, W, b)\n'),
    # four entries per device: the notebook's 32 entries (the public check), not the hidden 96
    "lab4-shard-map": ("q2_global_sum", {"q2_global_sum"},
                       'global_sum = jax.shard_map(lambda b: lax.psum(b[0] + b[1] + b[2] + b[3], '
                       '"i"), mesh=mesh, in_specs=P("i"), out_specs=P())\n'),
    # a training script that hands each process 128 rows: right on the notebook's 256 rows (the
    # public check), wrong on the hidden check's 320
    "lab5-scaling": ("q9_multi_process", {"q9_multi_process"},
                     next(a["code"] for a in yaml.safe_load(
                         (ROOT / "tests/answers/lab5-scaling/q9_multi_process.yaml").read_text()
                     )["wrong"] if a["name"] == "hard_coded_share")),
    # a search for the critical batch with a strict comparison: right on the notebook's chips
    # (the public check), wrong where compute and memory times tie exactly (the hidden check)
    "lab6-memory": ("q9_roofline", {"q9_roofline"},
                    next(a["code"] for a in yaml.safe_load(
                        (ROOT / "tests/answers/lab6-memory/q9_roofline.yaml").read_text()
                    )["wrong"] if a["name"] == "strict_comparison_in_a_search")),
    # the forward pass's FLOPs only, not the training step's 3x
    "lab7-transformer": ("q8_step_flops", {"q8_step_flops"},
                         "def step_flops(cfg, batch, seq):\n"
                         "    D, F, V, L = cfg.d_model, cfg.d_ff, cfg.vocab, cfg.n_layers\n"
                         "    per_layer = 2 * batch * seq * (4 * D * D + 2 * D * F) "
                         "+ 4 * batch * seq * seq * D\n"
                         "    return L * per_layer + 2 * batch * seq * D * V\n"),
}
# Wrong answers added to the same download, each with the questions it costs and words its
# message must hold: Lab 7 q5's loss handed back in bfloat16 crosses from the kernel to the
# trusted check as evidence (jaxlab grade), where a bfloat16 array once arrived as raw bytes,
# failed with "could not convert string to float: b'j@'" and was reported as tampering.
EXTRA_WRONG = {
    "lab7-transformer": [("q5_mixed_precision", "loss_returned_in_bfloat16",
                          {"q5_mixed_precision"}, "bfloat16")],
}
SAMPLES_LAB = "lab3-parallelism"
SAMPLES = {  # file -> (question, correct or wrong, corpus answer)
    f"{SAMPLES_LAB}.ipynb": [
        ("q1_device_put", "correct", "bare-spec-under-set-mesh"),
        ("q3_partition_specs", "wrong", "counts-distinct-blocks"),
        ("q5_dp_auto", "correct", "numpy-grid-mesh-and-none-specs"),
        ("q6_dp_explicit", "wrong", "not-jitted"),
        ("q7_dp_manual", "correct", "partial-decorator-four-devices"),
        ("q9_timing", "wrong", "no-blocking"),
    ],
    "Lab3 submission (renamed).ipynb": [
        ("q2_inspect", "correct", "set-comprehension-over-shards"),
        ("q4_propagation", "wrong", "specs-swapped"),
        ("q7_dp_manual", "wrong", "no-shard-map"),
        ("q8_sharded_training", "correct", "two-d-mesh-both-axes"),
    ],
}
HOG = "\nhog = []\nwhile True:\n    hog.append(bytearray(b'x' * 50 * 2**20))\n"
HOG_FILE, HOG_QUESTION = "hog.ipynb", "q3_partition_specs"
BLANK = "blank.ipynb"


def _questions(lab):
    return list(importlib.import_module(f"jaxlab.checks.{lab.split('-')[0]}").QUESTIONS)


def _colab_download_with_one_wrong_answer(lab):
    question, _, code = WELL_FORMED_WRONG[lab]
    by_id = {a.id: a for a in harness.load_answers(lab)}
    answers = [(question, code)] + [
        (q, by_id[f"{lab}/{q}/wrong/{name}"].code) for q, name, _, _ in EXTRA_WRONG.get(lab, ())]
    nb = colab.colabify(colab.read(release_paths(lab)["solution"]))
    for q, answer in answers:
        check = next(i for i, c in enumerate(nb.cells)
                     if c.source.strip() == f'grader.check("{q}")')
        nb.cells[check - 1].source = colab.ANSWER_MARK + "\n" + answer
    return nb


def _with_hog(lab):
    nb = nbformat.read(release_paths(lab)["solution"], as_version=4)
    answer = next(i for i, c in enumerate(nb.cells)
                  if c.source.strip() == f'grader.check("{HOG_QUESTION}")') - 1
    nb.cells[answer].source += HOG
    return nb, answer


@dataclasses.dataclass
class Graded:
    lab: str
    expected: dict  # file -> {question: points expected}
    otter: dict  # file -> otter run's results tests (not the hog)
    df: pd.DataFrame  # jaxlab grade's final_grades.csv, by file
    out: pathlib.Path
    hog_cell: int | None = None


# Two labs go through both paths in make test: the samples lab and Lab 7 (the heaviest grading
# and the bfloat16 answer); all five with JAXLAB_PATH_LABS=all (about 6 more minutes). What
# this file tests is the engine's (jaxlab grade scores as otter run does, each path's message
# and status), not each lab's checks, which the corpus grades; every lab's zip grades its
# solution with otter run in `jaxlab release`, and test_container grades the Lab 4 zip.
PATH_LABS = LABS if os.environ.get("JAXLAB_PATH_LABS") == "all" else \
    (SAMPLES_LAB, "lab7-transformer")


@pytest.fixture(scope="module", params=PATH_LABS)
def graded_paths(request, tmp_path_factory, graded):
    lab = request.param
    if lab not in WELL_FORMED_WRONG:
        pytest.fail(f"give {lab} an answer in WELL_FORMED_WRONG that passes its public check "
                    "and fails its hidden one")
    tmp = tmp_path_factory.mktemp(f"paths-{lab}")
    subs = tmp / "submissions"
    subs.mkdir()
    zip_path = release_paths(lab)["autograder"]
    points = dict(open_autograder(zip_path, tmp / "autograder").points)
    expected = {}
    _, lose, _ = WELL_FORMED_WRONG[lab]
    lose = set(lose).union(*(extra[2] for extra in EXTRA_WRONG.get(lab, ())))
    download = f"{lab} (1).ipynb"
    nbformat.write(_colab_download_with_one_wrong_answer(lab), subs / download)
    expected[download] = {q: 0.0 if q in lose else p for q, p in points.items()}
    shutil.copy(release_paths(lab)["student"], subs / BLANK)
    expected[BLANK] = {q: 0.0 for q in points}
    hog_cell = None
    if lab == SAMPLES_LAB:
        by_id = {a.id: a for a in harness.load_answers(lab)}
        rel = harness.Release(lab)
        for filename, entries in SAMPLES.items():
            answers = [by_id[f"{lab}/{q}/{kind}/{name}"] for q, kind, name in entries]
            assert not any(a.other_questions_lose for a in answers), "samples must not interact"
            verdicts = {a.question: graded(a).own for a in answers}
            for a in answers:  # each sample exercises both verdicts
                assert (verdicts[a.question]["score"] == verdicts[a.question]["possible"]) == \
                    a.correct, a.id
            nbformat.write(rel.notebook_with(answers), subs / filename)
            expected[filename] = {q: verdicts[q]["score"] if q in verdicts else p
                                  for q, p in points.items()}
        nb, hog_cell = _with_hog(lab)
        nbformat.write(nb, tmp / HOG_FILE)  # beside the others: jaxlab grade only
    otter = {path.name: release.otter_run(path, zip_path, tmp) for path in sorted(subs.iterdir())}
    if hog_cell is not None:
        shutil.copy(tmp / HOG_FILE, subs / HOG_FILE)
        expected[HOG_FILE] = {q: 0.0 if q == HOG_QUESTION else p for q, p in points.items()}
    from jaxlab.grade import grade

    out = tmp / "grades"
    assert grade(paths=[str(subs)], output_dir=str(out), autograder=str(zip_path), show=False,
                 workers=2, memory_mb=2500, sandbox="require")
    df = pd.read_csv(out / "final_grades.csv").set_index("file")
    return Graded(lab, expected, otter, df, out, hog_cell)


def test_otter_run_grades_every_question_of_each_submission_as_expected(graded_paths):
    g = graded_paths
    for file, tests in g.otter.items():
        scores = release.question_scores(tests)
        assert sorted(scores) == sorted(_questions(g.lab)), file
        assert {q: s for q, (s, _) in scores.items()} == g.expected[file], file


def test_jaxlab_grade_scores_each_submission_as_otter_run_and_as_expected(graded_paths):
    g = graded_paths
    assert sorted(g.df.index.drop("points-per-question")) == sorted(g.expected)
    for file, expected in g.expected.items():
        row = g.df.loc[file]
        status = row["grading_status"]
        assert status.startswith("Completed") and "TAMPERING" not in status, (file, status)
        got = {q: float(row[q]) for q in expected}
        assert got == expected, (file, status)
        if file in g.otter:
            theirs = {q: s for q, (s, _) in release.question_scores(g.otter[file]).items()}
            assert got == theirs, file


def test_an_extra_wrong_answer_loses_its_question_with_its_reason_not_as_tampering(graded_paths):
    g = graded_paths
    download = f"{g.lab} (1).ipynb"
    for question, _, _, words in EXTRA_WRONG.get(g.lab, ()):
        results = json.loads((g.out / "gradescope-results" / f"{g.lab} (1).json").read_text())
        (test,) = [t for t in results["tests"] if t["name"] == question]
        assert test["score"] == 0 and words in test["output"], test["output"]
        assert "GRADER ERROR" not in g.df.loc[download, "grading_status"]


def test_blank_notebook_gets_a_readable_message_per_question(graded_paths):
    for test in graded_paths.otter[BLANK]:
        if "max_score" not in test:
            continue
        output = test["output"]
        assert "AssertionError: `" in output, output
        assert "not defined yet" in output or "is empty" in output, output
        assert "Traceback" not in output


@pytest.mark.parametrize("graded_paths", [SAMPLES_LAB], indirect=True)
def test_a_memory_hog_in_one_answer_costs_only_its_question(graded_paths):
    g = graded_paths
    status = g.df.loc[HOG_FILE, "grading_status"]
    assert f"cell {g.hog_cell} skipped in a second run" in status and "memory use" in status
    records = [json.loads(p.read_text()) for p in (g.out / ".jaxlab" / "records").glob("*.json")]
    (record,) = [r for r in records if r["file"] == HOG_FILE]
    assert record["skipped"]["cell"] == g.hog_cell
    assert record["skipped"]["reason"]["kind"] == "memory"
