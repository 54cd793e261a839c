"""The committed releases are generated, current, reproducible and free of answers."""

import ast
import json
import pathlib
import re
import zipfile

import nbformat
import pytest

from jaxlab.corpus import python_of
from labs import LABS, ROOT, release_paths
from jaxlab import release


@pytest.mark.parametrize("lab", LABS)
@pytest.mark.slow
def test_committed_releases_are_current_and_rebuild_byte_for_byte(lab, release_build):
    """The committed student notebook and zip were built at another time, often on another
    machine: this build giving the same bytes is the release's reproducibility."""
    built = release_build(lab, release.committed_colab_url(ROOT, lab))
    assert release.stale_files(root=ROOT, name=lab, built=built) == [], (
        "the committed releases differ from the master: run `jaxlab release`")


def _split_master(master):
    """(solution code lines, every other line of the master) by otter's SOLUTION markers."""
    solution, given, inside = [], [], False
    for cell in nbformat.read(master, as_version=4).cells:
        for line in cell.source.splitlines():
            stripped = line.strip()
            if cell.cell_type == "code" and re.match(r"#\s*BEGIN SOLUTION", stripped):
                inside = True
            elif cell.cell_type == "code" and re.match(r"#\s*END SOLUTION", stripped):
                inside = False
            elif cell.cell_type == "code" and (inside or stripped.endswith("# SOLUTION")):
                solution.append(stripped.removesuffix("# SOLUTION").strip())
            else:
                given.append(line)
    return solution, "\n".join(given)


@pytest.mark.parametrize("lab", LABS)
def test_student_release_holds_no_solution_code_and_no_hidden_test(lab):
    paths = release_paths(lab)
    student_dir = paths["student"].parent
    assert [p.name for p in student_dir.iterdir()] == [paths["student"].name]
    text = "\n".join(p.read_text() for p in student_dir.iterdir())
    solution, given = _split_master(paths["master"])
    leaked = [line for line in solution if len(line) > 12 and line in text and line not in given]
    assert leaked == [], f"solution lines in student/: {leaked[:5]}"
    with zipfile.ZipFile(paths["autograder"]) as zf:
        hidden_checks = [n for n in zf.namelist() if n.startswith("files/jaxlab_lab")]
        hidden_tests = re.findall(r"hidden=True\)\ndef (test_\w+)",
                                  "\n".join(zf.read(n).decode() for n in zf.namelist()
                                            if n.startswith("tests/")))
    assert hidden_checks and hidden_tests
    for name in hidden_tests + [pathlib.Path(n).stem for n in hidden_checks]:
        assert name not in text, f"{name} leaked into student/"


@pytest.mark.parametrize("lab", LABS)
def test_solution_release_reads_without_otter_markers(lab):
    """solutions/ holds every solution line of the master, without otter's markers or prompts."""
    nb = nbformat.read(release_paths(lab)["solution"], as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    text = "\n".join(c.source for c in code)
    assert not re.search(r"# (BEGIN|END) (SOLUTION|PROMPT)|# SOLUTION\b", text)
    shown = [o for c in code for o in c.outputs
             if "BEGIN PROMPT" in str(o.get("data", {}).get("text/plain", ""))]
    assert shown == []
    solution, _ = _split_master(release_paths(lab)["master"])
    missing = [line for line in solution if line and line not in text]
    assert missing == [], f"solution lines missing from solutions/: {missing[:5]}"


def test_otter_markers_are_removed_by_otters_own_syntax():
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in (
        "a = f(x)  # SOLUTION\n# BEGIN SOLUTION NO PROMPT\nshow(a)\n# END SOLUTION",
        "# BEGIN SOLUTION\ng = 1\n# END SOLUTION\n\"\"\" # BEGIN PROMPT\ng = ...\n\"\"\" # END PROMPT",
        "print('# SOLUTION is a word here')")])
    assert [c.source for c in release.without_otter_markers(nb).cells] == [
        "a = f(x)\nshow(a)", "g = 1", "print('# SOLUTION is a word here')"]


@pytest.mark.parametrize("lab", LABS)
def test_autograder_zip_pins_the_grading_environment(lab):
    with zipfile.ZipFile(release_paths(lab)["autograder"]) as zf:
        env = zf.read("environment.yml").decode()
        assert all(i.date_time == release.ZIP_DATE for i in zf.infolist())
    for pin in ("python=3.11", "otter-grader[grading,plugins]==7.0.0", "jax==0.10.2",
                "jaxlib==0.10.2", "rich==", "tqdm==", "matplotlib=="):
        assert pin in env


@pytest.mark.parametrize("lab", LABS)
def test_master_and_its_jupytext_twin_hold_the_same_cells(lab):
    release._check_pair(release_paths(lab)["master"])


@pytest.mark.parametrize("lab", LABS)
def test_every_question_has_one_answer_cell_followed_by_its_check(lab):
    nb = nbformat.read(release_paths(lab)["student"], as_version=4)
    questions = json.loads(json.dumps(nb.metadata["otter"]["tests"])).keys()
    sources = [c.source for c in nb.cells]
    answer_cells = [i for i, s in enumerate(sources) if s.startswith("### Your code here")]
    checked = [re.fullmatch(r'grader\.check\("(\w+)"\)', sources[i + 1].strip()).group(1)
               for i in answer_cells]
    # otter stores the tests sorted by name (q10 before q2), so compare as sets
    assert len(checked) == len(set(checked))
    assert sorted(checked) == sorted(questions)


def _assigned_names(tree):
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.For)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@pytest.mark.parametrize("lab", LABS)
def test_no_cell_after_a_task_reassigns_its_graded_names(lab):
    """Grading reads the final globals, so a later reassignment would cost a correct answer."""
    import importlib

    checks = importlib.import_module(f"jaxlab.checks.{lab.split('-')[0]}")
    nb = nbformat.read(release_paths(lab)["solution"], as_version=4)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    for question, spec in checks.QUESTIONS.items():
        answer = next(i for i, s in enumerate(code) if f'grader.check("{question}")' in s) - 1
        for later in code[answer + 1:]:
            clash = _assigned_names(ast.parse(python_of(later))) & set(spec.names)
            assert not clash, f"a cell after {question} reassigns {clash}:\n{later[:200]}"


@pytest.mark.parametrize("lab", LABS)
def test_hidden_tests_read_only_their_own_questions_names(lab):
    import importlib

    checks = importlib.import_module(f"jaxlab.checks.{lab.split('-')[0]}")
    with zipfile.ZipFile(release_paths(lab)["autograder"]) as zf:
        files = {pathlib.Path(n).stem: zf.read(n).decode() for n in zf.namelist()
                 if n.startswith("tests/")}
    assert sorted(files) == sorted(checks.QUESTIONS)
    for question, source in files.items():
        for fn in ast.parse(source).body:
            if isinstance(fn, ast.FunctionDef):
                args = {a.arg for a in fn.args.args}
                assert args <= set(checks.QUESTIONS[question].names), (question, fn.name, args)


@pytest.mark.slow
def test_release_check_exits_non_zero_when_a_committed_release_is_stale(tmp_path):
    import shutil
    import subprocess
    import sys

    for part in ("assignments", "student", "solutions", "autograder"):
        shutil.copytree(ROOT / part, tmp_path / part)
    lab = LABS[0]
    cmd = [sys.executable, "-m", "jaxlab", "release", "--check", "--root", str(tmp_path), lab]
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    student = tmp_path / "student" / lab / f"{lab}.ipynb"
    student.write_text(student.read_text().replace("### Your code here", "### Your code", 1))
    export = tmp_path / "solutions" / lab / f"{lab}_2026_11_21T13_45_20_533285.zip"
    export.write_bytes(b"a student's export, left behind by running the notebook in place")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 1
    assert f"stale: student/{lab}/{lab}.ipynb" in proc.stdout
    assert f"stale: solutions/{lab}/{export.name}" in proc.stdout


# --------------------------------------------------------------------------- standalone notebook
def _setup_files(nb):
    """{path: text} the student notebook's setup cell writes, by running its payload part."""
    from jaxlab.release.standalone import MARKER

    source = next(c.source for c in nb.cells if c.source.startswith("#@title Setup"))
    payload = source[source.index("_install_public_checks({\n") + len("_install_public_checks("):
                     source.index("\n})\n") + 2]
    files = ast.literal_eval(payload)
    for path, text in files.items():
        first, rest = text.split("\n", 1)
        assert first.startswith("# Written by the setup cell of "), path
        files[path] = rest
    return files


@pytest.mark.parametrize("lab", LABS)
def test_setup_cell_carries_the_public_tests_and_form_helpers_from_their_sources(lab):
    import jaxlab.checks.form

    nb = nbformat.read(release_paths(lab)["student"], as_version=4)
    files = _setup_files(nb)
    assert files.pop("jaxlab_form.py") == pathlib.Path(jaxlab.checks.form.__file__).read_text()
    with zipfile.ZipFile(release_paths(lab)["autograder"]) as zf:
        shipped = {n: zf.read(n).decode() for n in zf.namelist() if n.startswith("tests/")}
    assert sorted(files) == sorted(shipped)
    for path, text in files.items():
        assert "hidden=False" in text and "hidden=True" not in text, path
        # each public case is the autograder's case, word for word
        for case in text.split("@test_case")[1:]:
            assert "@test_case" + case.rstrip() in shipped[path], path


BASE = "https://colab.research.google.com/github/course/labs/blob/main/student"


@pytest.mark.parametrize("lab", LABS)
@pytest.mark.slow
def test_colab_url_adds_a_badge(lab, release_build):
    """(Byte reproducibility with a badge: test_release_check_keeps_a_committed_badge_current.)"""
    from jaxlab.release.standalone import BADGE_IMAGE

    built = [(student / f"{lab}.ipynb").read_bytes() for student, _, _ in (
        release_build(lab), release_build(lab, BASE + "/"))]
    plain = nbformat.reads(built[0].decode(), as_version=4)
    badged = nbformat.reads(built[1].decode(), as_version=4)
    assert built[0] == release_paths(lab)["student"].read_bytes()  # no option: nothing changes
    assert badged.cells[0].source == (
        f"[![Open In Colab]({BADGE_IMAGE})]({BASE}/{lab}/{lab}.ipynb)")
    assert [c.source for c in badged.cells[1:]] == [c.source for c in plain.cells]


@pytest.mark.slow
def test_release_check_keeps_a_committed_badge_current(tmp_path, release_build):
    """A course that publishes with a badge: `release --check` (and `make test`) builds with the
    committed notebook's badge, so it passes (a second build with the badge, byte for byte);
    `--colab-url ''` would remove it."""
    import shutil

    for part in ("assignments", "student", "solutions", "autograder"):
        shutil.copytree(ROOT / part, tmp_path / part)
    lab = LABS[0]
    student, _, _ = release_build(lab, BASE)
    shutil.copy(student / f"{lab}.ipynb", tmp_path / "student" / lab / f"{lab}.ipynb")
    assert release.committed_colab_url(tmp_path, lab) == BASE
    assert release.stale_files(root=tmp_path, name=lab) == []
    assert release.stale_files(root=tmp_path, name=lab, colab_url="",
                               built=release_build(lab)) == [f"student/{lab}/{lab}.ipynb"]
    assert release.stale_files(root=tmp_path, name=lab, colab_url=BASE + "/other") == [
        f"student/{lab}/{lab}.ipynb"]


# --------------------------------------------------------------------------- volatile output
def test_volatile_normaliser_ignores_emoji_timings_pids_and_stream_splits_only():
    def nb_with(emoji, timing, bars):
        nb = nbformat.v4.new_notebook()
        cell = nbformat.v4.new_code_cell("x")
        cell.outputs = [nbformat.v4.new_output("execute_result", data={
            "text/html": f"<p><strong>q1</strong> passed! {emoji}</p>",
            "text/plain": "q1 results: All test cases passed!"}, execution_count=1)]
        cell.outputs += [nbformat.v4.new_output("stream", name="stdout", text=t) for t in timing]
        cell.outputs += [nbformat.v4.new_output("stream", name="stderr", text=t) for t in bars]
        nb.cells.append(cell)
        return release.without_volatile_output(nb)

    timing = "unsharded: {} ms per call\nspeedup:   {}x\nloss {}\n"
    bar = "\rtraining: {0}%|##| {0}/100 [00:0{1}<00:00, {1}.5it/s]"
    a = nb_with("\u2728", [timing.format("38.1", "0.76", "0.439")],
                [bar.format(50, 1), bar.format(100, 2) + "\n"])
    assert a == nb_with("\U0001f680", ["unsharded: 40.7 ms per call\n", "speedup:   0.81x\nloss 0.439\n"],
                        [bar.format(30, 3) + bar.format(100, 6) + "\n"])
    slow = "\rtraining: {0}%|##| {0}/100 [01:4{1}<00:00,  1.0{1}s/it]"  # a loaded machine
    assert a == nb_with("\u2728", [timing.format("38.1", "0.76", "0.439")],
                        [slow.format(50, 1), slow.format(100, 4) + "\n"])
    # the kernel's pid in a traced line's file name, but not the cell (its hash) or the line
    trace = "f32[2,4] output of tanh from /tmp/ipykernel_{}/{}.py:{}:11 (layer)\n"
    traced = nb_with("\u2728", [trace.format(7247, 2575921947, 2)], [])
    assert traced == nb_with("\u2728", [trace.format(19681, 2575921947, 2)], [])
    assert traced != nb_with("\u2728", [trace.format(7247, 1503587982, 2)], [])
    assert traced != nb_with("\u2728", [trace.format(7247, 2575921947, 3)], [])
    # a rate and a utilisation computed from a timing (Lab 7), but not the FLOPs counted
    rate = "{} FLOPs per step in {} ms: {} GFLOP/s, MFU {}% of the nominal peak\n"
    measured = nb_with("\u2728", [rate.format("328,359,936", "41.36", "7.94", "1.98")], [])
    assert measured == nb_with("\u2728", [rate.format("328,359,936", "59.04", "5.56", "1.39")], [])
    assert measured != nb_with("\u2728", [rate.format("328,359,937", "41.36", "7.94", "1.98")], [])
    # a result, not a time; a check that failed; a bar that stopped early
    assert a != nb_with("\u2728", [timing.format("38.1", "0.76", "0.440")], [bar.format(100, 2) + "\n"])
    assert a != nb_with("\u2728 failed", [timing.format("38.1", "0.76", "0.439")],
                        [bar.format(100, 2) + "\n"])
    assert a != nb_with("\u2728", [timing.format("38.1", "0.76", "0.439")], [bar.format(99, 2) + "\n"])


def _png(values):
    """A small PNG (base64) of a line plot, as a notebook's image/png output holds it."""
    import base64
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2), dpi=50)
    ax.plot(values)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def test_outputs_agree_as_a_reader_sees_them():
    def executed(text, png):
        nb = nbformat.v4.new_notebook()
        cell = nbformat.v4.new_code_cell("print(loss); plot()")
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=text),
                        nbformat.v4.new_output("display_data", data={"image/png": png})]
        nb.cells.append(cell)
        return nb

    curve = [1.0, 0.5, 0.3, 0.2]
    committed = executed("loss 11.9203, single-device 11.920298\n", _png(curve))
    # the last float32 digits of a reduction over devices, and a redrawn but identical plot
    assert release.outputs_agree(
        committed, executed("loss 11.920301, single-device 11.9203\n", _png(list(curve))))
    # another number, other words, another curve: a reader sees the change
    assert not release.outputs_agree(committed, executed("loss 11.93, single-device 11.9203\n",
                                                         _png(curve)))
    assert not release.outputs_agree(committed, executed("loss 11.9203, one device 11.9203\n",
                                                         _png(curve)))
    assert not release.outputs_agree(committed, executed(
        "loss 11.9203, single-device 11.920298\n", _png([1.0, 0.9, 0.3, 0.2])))


def test_texts_agree_within_the_named_tolerance_only():
    tol = release.OUTPUT_RTOL
    assert release.texts_agree("x = 1.0", f"x = {1 + tol / 2}")
    assert not release.texts_agree("x = 1.0", f"x = {1 + 3 * tol}")
    assert not release.texts_agree("x = 1.0", "x = 1.0 and more")
    assert not release.texts_agree("shape (8, 4)", "shape (8, 5)")


@pytest.mark.slow
def test_a_broken_committed_release_gets_a_message_not_a_traceback(tmp_path, release_build):
    """A merge conflict left in a committed student notebook: `release` and `release --check`
    say which file and what to do (exit 1); a broken solution notebook is simply stale."""
    import shutil
    import subprocess
    import sys

    for part in ("assignments", "student", "solutions", "autograder"):
        shutil.copytree(ROOT / part, tmp_path / part)
    lab = LABS[0]
    student = tmp_path / "student" / lab / f"{lab}.ipynb"
    student.write_text("<<<<<<< HEAD\n" + student.read_text())
    for extra in ([], ["--check"]):
        proc = subprocess.run([sys.executable, "-m", "jaxlab", "release", *extra, "--root",
                               str(tmp_path), lab], capture_output=True, text=True)
        assert proc.returncode == 1
        assert "Traceback" not in proc.stdout + proc.stderr
        assert f"student/{lab}/{lab}.ipynb cannot be read" in proc.stdout
        assert "--colab-url" in proc.stdout
    shutil.copy(ROOT / "student" / lab / f"{lab}.ipynb", student)
    solution = tmp_path / "solutions" / lab / f"{lab}.ipynb"
    solution.write_text("<<<<<<< HEAD\n" + solution.read_text())
    assert release.stale_files(root=tmp_path, name=lab, built=release_build(lab)) == [
        f"solutions/{lab}/{lab}.ipynb"]


@pytest.mark.parametrize("lab", LABS)
def test_every_zip_shows_each_questions_result_on_gradescope_at_submission(lab):
    with zipfile.ZipFile(release_paths(lab)["autograder"]) as zf:
        config = json.loads(zf.read("otter_config.json"))
    assert {k: config.get(k) for k in release.RESULTS_SHOWN} == release.RESULTS_SHOWN


@pytest.mark.parametrize("own, shown", [
    ("", release.RESULTS_SHOWN),
    ("generate:\n  show_all_public: false\n", {"show_hidden": True, "show_all_public": False}),
    ("generate:\n  show_hidden: false\n  show_all_public: false\n",
     {"show_hidden": False, "show_all_public": False}),
])
def test_a_masters_own_generate_keys_win_over_the_release_default(tmp_path, own, shown):
    import yaml

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_raw_cell("# ASSIGNMENT CONFIG\nname: x\n" + own)]
    nbformat.write(nb, tmp_path / "x.ipynb")
    release._with_results_shown(tmp_path / "x.ipynb")
    text = nbformat.read(tmp_path / "x.ipynb", as_version=4).cells[0].source
    assert text.startswith("# ASSIGNMENT CONFIG\n")
    config = yaml.safe_load(text.split("\n", 1)[1])
    assert config["name"] == "x" and {k: config["generate"][k] for k in shown} == shown
