"""``jaxlab release``: build student/, solutions/ and autograder/ from the masters.

Wraps ``otter assign``, then makes its output reproducible (stable cell ids, stable zip entry
order and dates, a stable zip name), executes the solution notebook with outputs, and refuses
to write a release whose solution does not score full marks under ``otter run``.
"""

import ast
import base64
import copy
import hashlib
import json
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from importlib import resources

import nbformat
import yaml

from .standalone import colab_url_of, make_standalone, public_files

ZIP_DATE = (1980, 1, 1, 0, 0, 0)
SUPPORT_PREFIX = "jaxlab_"


class ReleaseError(Exception):
    """A release could not be built; the message says why."""


def assignment_names(root):
    return sorted(p.name for p in (pathlib.Path(root) / "assignments").iterdir()
                  if (p / f"{p.name}.ipynb").is_file())


def release(*, root=".", names=None, check=False, colab_url=None, log=print):
    """Build (or with ``check``, compare) the releases of ``names`` (default: every master).

    ``colab_url``: BASE_URL for an "Open in Colab" badge pointing at
    ``BASE_URL/<lab>/<lab>.ipynb``; None keeps what the committed student notebook has (a badge
    or none), "" removes it. Returns True when everything was built, or with ``check`` when
    everything is current.
    """
    root = pathlib.Path(root).resolve()
    ok = True
    for name in names or assignment_names(root):
        try:
            if check:
                stale = stale_files(root=root, name=name, colab_url=colab_url)
                for path in stale:
                    log(f"{name}: stale: {path}")
                ok &= not stale
                if not stale:
                    log(f"{name}: releases are current")
            else:
                build(root=root, name=name, colab_url=colab_url, log=log)
        except ReleaseError as exc:
            log(f"{name}: {exc}")
            ok = False
    return ok


# --------------------------------------------------------------------------- building
def _assign_config(master):
    nb = nbformat.read(master, as_version=4)
    first = nb.cells[0]
    if first.cell_type != "raw" or "ASSIGNMENT CONFIG" not in first.source.splitlines()[0]:
        raise ReleaseError(f"{master} does not start with an ASSIGNMENT CONFIG raw cell")
    return yaml.safe_load(first.source.split("\n", 1)[1])


# What students see on Gradescope, in otter's own configuration (otter_config.json): every
# question's result and the checks' message, at submission. otter's defaults hide the result of
# every test file holding a hidden case ("visibility": "hidden", never shown); `show_hidden`
# shows them once grades are published, and `show_all_public` at submission when every case is
# public. jaxlab's checks write their messages for students, so its grader reports their cases as
# public under `show_all_public` (output/results.py). A master's own `generate:` keys win: to show
# the reasons only after publishing, give it `generate: {show_all_public: false}` (README).
RESULTS_SHOWN = {"show_hidden": True, "show_all_public": True}


def _with_results_shown(master):
    """The staged master's ASSIGNMENT CONFIG with ``RESULTS_SHOWN`` under its own ``generate``."""
    nb = nbformat.read(master, as_version=4)
    head, text = nb.cells[0].source.split("\n", 1)
    config = yaml.safe_load(text)
    generate = config.get("generate")
    if generate is False:
        return
    config["generate"] = {**RESULTS_SHOWN, **(generate if isinstance(generate, dict) else {})}
    nb.cells[0].source = head + "\n" + yaml.safe_dump(config, sort_keys=False, allow_unicode=True)
    nbformat.write(nb, master)


def _stage(root, name, workdir):
    """Copy the master and the support modules it names into ``workdir``."""
    src = root / "assignments" / name
    master = src / f"{name}.ipynb"
    config = _assign_config(master)
    if config.get("name") != name:
        raise ReleaseError(f"the ASSIGNMENT CONFIG name is {config.get('name')!r}, not {name!r}")
    _check_pair(master)
    stage = workdir / "master"
    shutil.copytree(src, stage, ignore=shutil.ignore_patterns(f"{name}.py", ".ipynb_checkpoints",
                                                              "__pycache__"))
    for support in config.get("files", []) + config.get("autograder_files", []):
        if support.startswith(SUPPORT_PREFIX) and not (stage / support).exists():
            module = support[len(SUPPORT_PREFIX):]
            text = resources.files("jaxlab.checks").joinpath(module).read_text()
            (stage / support).write_text(text)
    if config.get("environment") and not (stage / config["environment"]).exists():
        text = resources.files("jaxlab.release").joinpath("environment.yml").read_text()
        (stage / config["environment"]).write_text(text)
    _with_results_shown(stage / f"{name}.ipynb")
    return stage / f"{name}.ipynb"


def _check_pair(master):
    """The jupytext text twin of a master (if any) must hold the same cells."""
    import jupytext

    twin = master.with_suffix(".py")
    if not twin.exists():
        return
    a, b = jupytext.read(master), jupytext.read(twin)
    strip = lambda nb: [(c.cell_type, c.source.strip()) for c in nb.cells]  # noqa: E731
    if strip(a) != strip(b):
        raise ReleaseError(f"{master.name} and {twin.name} differ: run "
                           f"`jupytext --sync {master}` to pair them again")


def _assign(master, dist):
    """Run otter assign in a child process (it changes directories and logs noisily)."""
    proc = subprocess.run(
        [sys.executable, "-m", "otter", "assign", "--no-run-tests", str(master), str(dist)],
        capture_output=True, text=True)
    if proc.returncode != 0:
        raise ReleaseError("otter assign failed:\n" + (proc.stderr or proc.stdout)[-3000:])


def normalise_notebook(nb):
    """Give cells ids derived from their place and content, and drop volatile metadata."""
    for i, cell in enumerate(nb.cells):
        digest = hashlib.sha1(f"{i}\0{cell.cell_type}\0{cell.source}".encode()).hexdigest()
        cell["id"] = digest[:12]
        if cell.cell_type == "code":
            cell.metadata.pop("execution", None)
    nb.metadata.pop("jupytext", None)
    return nb


# otter assign's autograder notebook (published as solutions/) keeps otter's markers, and a
# cell that ends with its `""" # BEGIN PROMPT ... """ # END PROMPT` block shows that string as
# its output. otter has no function that removes them (its own only strip solutions for
# students), so solutions/ gets these rules, which are otter's marker syntax
# (otter.assign.solutions): marker lines and prompt blocks go, `# SOLUTION` suffixes go.
_MARKER_LINE = re.compile(r"\s*#\s*(BEGIN|END) SOLUTION( NO PROMPT)?\s*$")
_MARKER_SUFFIX = re.compile(r"\s*# SOLUTION( NO PROMPT)?\s*$")


def without_otter_markers(nb):
    """The solution notebook as a reader wants it: the solutions' code without otter's markers."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        kept, in_prompt = [], False
        for line in cell.source.split("\n"):
            if line.rstrip().endswith("# BEGIN PROMPT"):
                in_prompt = True
            elif line.rstrip().endswith("# END PROMPT"):
                in_prompt = False
            elif not in_prompt and not _MARKER_LINE.match(line):
                kept.append(_MARKER_SUFFIX.sub("", line))
        cell.source = "\n".join(kept).rstrip("\n")
    return nb


def write_notebook(nb, path):
    nbformat.validate(nb)
    pathlib.Path(path).write_text(nbformat.writes(nb) + "\n")


ENGINE_DIR = "jaxlab_engine"  # in the zip: jaxlab's grading engine, run by run_otter.py
RUN_ENGINE = f'''"""The autograder's entry point (run_autograder runs it in Gradescope's and otter grade's
containers): jaxlab's grading engine, shipped beside this file in {ENGINE_DIR}/, grades
/autograder/submission. The student's cells run in a kernel; the hidden checks run here, on
the plain data that kernel hands over, so nothing the notebook patches can change a verdict.
(`otter run -a` does not use this file: it grades in-process, trusting the notebook.)
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "{ENGINE_DIR}"))

from jaxlab.grade.run.container import main  # noqa: E402

if __name__ == "__main__":
    main(sys.argv[1:] or ["/autograder"])  # (another folder laid out the same: for tests)
'''


CONTAINER_MODULE = "jaxlab.grade.run.container"


def engine_modules(start=CONTAINER_MODULE):
    """The files of this package that ``start`` imports, directly or not (its relative and
    ``jaxlab.`` imports, module level or inside functions), with every package ``__init__`` on
    their way: what the container needs, and nothing of the batch, Slurm or the report.
    A package ``__init__``'s own functions are not followed: they are lazy conveniences for
    API callers (``jaxlab.grade.grade``), which the container never calls."""
    package = pathlib.Path(__file__).resolve().parents[1]

    def path_of(module):
        base = package.parent.joinpath(*module.split("."))
        return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")

    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        path = path_of(module)
        if path in seen or not path.exists():
            continue
        seen.add(path)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages on its way
        here = parts if path.name == "__init__.py" else parts[:-1]
        tree = ast.parse(path.read_text())
        nodes = tree.body if path.name == "__init__.py" else ast.walk(tree)
        for node in nodes:
            if isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                target = ".".join([*base, *(node.module or "").split(".")]).strip(".")
                if target.split(".")[0] == "jaxlab":
                    todo.append(target)
                    todo += [f"{target}.{a.name}" for a in node.names]  # `from . import x`
            elif isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.split(".")[0] == "jaxlab"]
    return sorted(seen)


def engine_entries():
    """{zip name: bytes} of the grading engine (what the container imports) and its entry
    point. The labs' hidden checks travel as files/jaxlab_<lab>.py, as before."""
    root = pathlib.Path(__file__).resolve().parents[2]
    entries = {f"{ENGINE_DIR}/{path.relative_to(root).as_posix()}": path.read_bytes()
               for path in engine_modules()}
    entries["run_otter.py"] = RUN_ENGINE.encode()
    return entries


def write_stable_zip(src_zip, dest, extra=None):
    """Copy a zip with sorted entries, fixed dates and permissions; ``extra`` ({name: bytes})
    adds or replaces entries."""
    with zipfile.ZipFile(src_zip) as zin:
        entries = {i.filename: zin.read(i) for i in zin.infolist() if not i.is_dir()}
    entries = sorted({**entries, **(extra or {})}.items())
    tmp = pathlib.Path(dest).with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for filename, data in entries:
            info = zipfile.ZipInfo(filename, ZIP_DATE)
            info.compress_type = zipfile.ZIP_DEFLATED
            executable = filename in ("run_autograder", "setup.sh")
            info.external_attr = (0o100755 if executable else 0o100644) << 16
            zout.writestr(info, data)
    tmp.replace(dest)


def committed_colab_url(root, name):
    """The badge BASE_URL of the committed student notebook of ``name``, or None."""
    path = pathlib.Path(root) / "student" / name / f"{name}.ipynb"
    if not path.exists():
        return None
    try:
        nb = nbformat.read(path, as_version=4)
    except (ValueError, OSError) as exc:  # NotJSONError is a ValueError: e.g. a merge conflict
        raise ReleaseError(
            f"student/{name}/{name}.ipynb cannot be read ({type(exc).__name__}), so its Colab "
            "badge cannot be kept: rebuild with --colab-url BASE_URL (or --colab-url '' for "
            "no badge)") from None
    return colab_url_of(nb, path.name)


def _resolve_colab_url(root, name, colab_url):
    return committed_colab_url(root, name) if colab_url is None else (colab_url or None)


def _generate(root, name, workdir, *, colab_url=None):
    """otter assign output for ``name`` in ``workdir``, normalised: (student dir, zip, solution).

    The student dir holds only the notebook: its setup cell carries the public tests and the
    support files otter would have put beside it.
    """
    master = _stage(root, name, workdir)
    dist = workdir / "dist"
    _assign(master, dist)
    student = dist / "student"
    notebook = f"{name}.ipynb"
    support = {}
    for path in sorted(student.iterdir()):
        if path.name != notebook:
            if not path.is_file():
                raise ReleaseError(f"otter assign put a folder {path.name} in student/")
            support[path.name] = path.read_text()
            path.unlink()
    nb_path = student / notebook
    nb = nbformat.read(nb_path, as_version=4)
    files = public_files(nb, support)
    write_notebook(normalise_notebook(make_standalone(nb, notebook, files, colab_url=colab_url)),
                   nb_path)
    zips = list((dist / "autograder").glob("*.zip"))
    if len(zips) != 1:
        raise ReleaseError(f"otter assign made {len(zips)} autograder zips")
    stable = workdir / f"{name}-autograder.zip"
    write_stable_zip(zips[0], stable, extra=engine_entries())
    solution = nbformat.read(dist / "autograder" / notebook, as_version=4)
    solution = normalise_notebook(make_standalone(without_otter_markers(solution), notebook,
                                                  files))
    return student, stable, solution


SKIP_TAG = "skip-execution"  # nbclient's default skip_cells_with_tag


def _execute(nb, cwd, timeout=900):
    """Execute ``nb`` in ``cwd``, all but its export cell: there it would zip the blank student
    notebook lying in ``cwd`` and grade it again, which says nothing and takes a while."""
    from nbclient import NotebookClient

    export = [c for c in nb.cells if c.cell_type == "code" and "grader.export(" in c.source]
    for cell in export:
        cell.metadata.setdefault("tags", []).append(SKIP_TAG)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={
        "metadata": {"path": str(cwd)}}).execute()
    for cell in export:
        cell.metadata["tags"].remove(SKIP_TAG)
        if not cell.metadata["tags"]:
            del cell.metadata["tags"]
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.metadata.pop("execution", None)
    return nb


# Output that changes from one execution of an unchanged notebook to the next. Each pattern is
# replaced by a placeholder before comparing a fresh solution with the committed one.
VOLATILE_OUTPUT = (
    # otter ends each passed check's HTML with an emoji picked at random
    (re.compile(r"(passed! )[^<\s]+(</p>)"), r"\1<emoji>\2"),
    # tqdm's elapsed, remaining and rate: "[00:06<00:00, 17.48it/s]", or "1.04s/it" when slow
    # (before the timings: their rule would take "1.04s" of a slow rate, seen on a loaded machine)
    (re.compile(r"\[[\d:]+<[\d:?]+, *[\d.?]+ ?(?:it/s|s/it)\]"), "[<tqdm>]"),
    # the kernel's process id in the file names jax.ad_checkpoint.print_saved_residuals gives
    # ("/tmp/ipykernel_7247/2575921947.py:2:11"; the second number is the cell's hash: it stays)
    (re.compile(r"(/ipykernel_)\d+(/)"), r"\1<pid>\2"),
    # timings the lab prints ("38.1 ms per call", "speedup:   0.76x")
    (re.compile(r"\d+(?:\.\d+)?(?=(?: ?(?:ms|us|µs|ns|s)\b)|x\b)"), "<number>"),
    # rates and utilisation computed from a timing (Lab 7: "5.56 GFLOP/s, MFU 1.39%")
    (re.compile(r"\d+(?:\.\d+)?(?= ?[kMGTP]?FLOP/s\b)"), "<number>"),
    (re.compile(r"(?<=MFU )\d+(?:\.\d+)?(?=%)"), "<number>"),
)
_OVERWRITTEN = re.compile(r"[^\n]*\r(?!\n)")  # what a terminal shows: \r overwrites the line


def without_volatile_output(nb):
    """``nb``'s cells (type, source, outputs) as compared between executions: consecutive
    stream outputs merged (the kernel splits them by timing), carriage returns applied (tqdm
    redraws its bar), and the VOLATILE_OUTPUT parts replaced."""
    def scrub(text):
        text = "".join(text) if isinstance(text, list) else text
        for pattern, placeholder in VOLATILE_OUTPUT:
            text = pattern.sub(placeholder, text)
        return text

    cells = []
    for cell in nb.cells:
        outputs = []
        for out in copy.deepcopy(cell.get("outputs", [])):
            if "text" in out:
                out["text"] = "".join(out["text"]) if isinstance(out["text"], list) else out["text"]
            if outputs and out.get("output_type") == "stream" == outputs[-1].get("output_type") \
                    and out.get("name") == outputs[-1].get("name"):
                outputs[-1]["text"] += out["text"]
            else:
                outputs.append(out)
        for out in outputs:
            if "text" in out:
                out["text"] = scrub(_OVERWRITTEN.sub("", out["text"]))
            for mime in ("text/plain", "text/html"):
                if mime in out.get("data", {}):
                    out["data"][mime] = scrub(out["data"][mime])
        cells.append((cell.cell_type, cell.source, json.dumps(outputs, sort_keys=True)))
    return cells


# Executed output compared as a reader sees it. Sums over simulated CPU devices do not add in a
# fixed order, so the last bits of a printed float and a few pixels of a plot change between
# executions of an unchanged notebook (Lab 4 printed 11.9203 then 11.920298).
OUTPUT_RTOL = 1e-4  # printed numbers this close (relatively) count as equal
IMAGE_TOL = 0.1  # RMS over 0-255 pixel values; two executions of Lab 3's loss curve: 0.004
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def texts_agree(a, b, rtol=OUTPUT_RTOL):
    """The same text around its numbers, and numbers equal within ``rtol``."""
    if a == b:
        return True
    if _NUMBER.split(a) != _NUMBER.split(b):
        return False
    xs, ys = _NUMBER.findall(a), _NUMBER.findall(b)
    return all(abs(float(x) - float(y)) <= rtol * max(abs(float(x)), abs(float(y)))
               for x, y in zip(xs, ys))


def images_agree(a, b, tol=IMAGE_TOL):
    """Two base64 PNGs within ``tol`` RMS of each other (matplotlib's image comparison)."""
    if a == b:
        return True
    from matplotlib.testing.compare import compare_images
    from matplotlib.testing.exceptions import ImageComparisonFailure

    with tempfile.TemporaryDirectory(prefix="jaxlab-png-") as tmp:
        paths = [pathlib.Path(tmp) / f"{i}.png" for i in (0, 1)]
        for path, data in zip(paths, (a, b)):
            path.write_bytes(base64.b64decode(data))
        try:
            return compare_images(str(paths[0]), str(paths[1]), tol=tol) is None
        except ImageComparisonFailure:  # e.g. another size
            return False


def _agree(a, b, key=None):
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_agree(a[k], b[k], k) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_agree(x, y, key) for x, y in zip(a, b))
    if isinstance(a, str) and isinstance(b, str):
        return images_agree(a, b) if key == "image/png" else texts_agree(a, b)
    return a == b


def outputs_agree(committed, fresh):
    """Whether two executions of a notebook show the same: the same cells and sources, output
    equal after the VOLATILE_OUTPUT rules, numbers within OUTPUT_RTOL, images within IMAGE_TOL."""
    a, b = without_volatile_output(committed), without_volatile_output(fresh)
    return len(a) == len(b) and all(
        (ta, sa) == (tb, sb) and _agree(json.loads(oa), json.loads(ob))
        for (ta, sa, oa), (tb, sb, ob) in zip(a, b))


def otter_run(notebook, autograder, workdir):
    """Grade ``notebook`` with ``otter run``; returns the tests of its results.json."""
    out = pathlib.Path(tempfile.mkdtemp(dir=workdir))
    proc = subprocess.run([sys.executable, "-m", "otter", "run", "--no-logo", "-a",
                           str(autograder), "-o", str(out), str(notebook)],
                          capture_output=True, text=True)
    results = out / "results.json"
    if not results.exists():
        raise ReleaseError("otter run produced no results:\n" + (proc.stderr or proc.stdout)[-3000:])
    return json.loads(results.read_text())["tests"]


def question_scores(tests):
    """{question: (score, possible)} from otter's results tests."""
    return {t["name"]: (t["score"], t["max_score"]) for t in tests if "max_score" in t}


def build(*, root, name, colab_url=None, log=print):
    """Build and write the three releases of assignment ``name`` (``colab_url``: see release)."""
    root = pathlib.Path(root)
    colab_url = _resolve_colab_url(root, name, colab_url)
    with tempfile.TemporaryDirectory(prefix=f"jaxlab-{name}-") as tmp:
        workdir = pathlib.Path(tmp)
        log(f"{name}: otter assign" + (f" (Colab badge: {colab_url})" if colab_url else ""))
        student, zip_path, solution = _generate(root, name, workdir, colab_url=colab_url)
        log(f"{name}: executing the solution notebook")
        run_dir = workdir / "run"
        shutil.copytree(student, run_dir)
        _execute(solution, run_dir)
        solved = run_dir / f"{name}.ipynb"
        write_notebook(solution, solved)
        log(f"{name}: grading the solution with otter run")
        scores = question_scores(otter_run(solved, zip_path, workdir))
        short = {q: s for q, s in scores.items() if s[0] != s[1]}
        if not scores or short:
            raise ReleaseError(f"the solution does not score full marks: {short or 'no scores'}")
        total = sum(p for _, p in scores.values())
        log(f"{name}: solution scores {total:g}/{total:g} on {len(scores)} questions")
        sol_dir = root / "solutions" / name
        committed = sol_dir / f"{name}.ipynb"
        keep = _readable(committed) and outputs_agree(nbformat.read(committed, as_version=4),
                                                      solution)
        if keep:
            kept = workdir / "kept.ipynb"
            shutil.copy(committed, kept)
            solved = kept
            log(f"{name}: the executed solution differs from the committed one only in "
                "volatile output (emoji, timings, last digits, pixels): kept the committed file")
        _install(student, root / "student" / name)
        _install(student, sol_dir)
        shutil.copy(solved, sol_dir / f"{name}.ipynb")
        (root / "autograder").mkdir(exist_ok=True)
        shutil.copy(zip_path, root / "autograder" / f"{name}-autograder.zip")
    log(f"{name}: wrote student/{name}/, solutions/{name}/, autograder/{name}-autograder.zip")


def _readable(path):
    """Whether ``path`` is a notebook (not missing, not left broken by a merge conflict)."""
    try:
        nbformat.read(path, as_version=4)
        return True
    except (ValueError, OSError):
        return False


def _install(src, dest):
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(src, dest)


# --------------------------------------------------------------------------- checking
def _sources(path):
    nb = nbformat.read(path, as_version=4)
    return [(c.cell_type, c.source) for c in nb.cells]


def stale_files(*, root, name, colab_url=None, built=None):
    """Committed release files that differ from what the master builds now.

    The build uses the committed student notebook's Colab badge URL unless ``colab_url`` says
    otherwise, so a course that publishes with a badge stays current. ``built``: a
    ``(student dir, zip, solution)`` that ``_generate`` already made from the same master and
    badge URL (tests share one build among their checks); without it one is made here.
    """
    root = pathlib.Path(root)
    if built is None:
        colab_url = _resolve_colab_url(root, name, colab_url)
        with tempfile.TemporaryDirectory(prefix=f"jaxlab-{name}-") as tmp:
            return _differences(root, name, _generate(root, name, pathlib.Path(tmp),
                                                      colab_url=colab_url))
    return _differences(root, name, built)


def _differences(root, name, built):
    """The committed files of ``name`` under ``root`` that differ from ``built``."""
    student, zip_path, solution = built
    stale = []
    built = {p.relative_to(student): p.read_bytes() for p in student.rglob("*") if p.is_file()}
    committed_dir = root / "student" / name
    committed = {p.relative_to(committed_dir): p.read_bytes()
                 for p in committed_dir.rglob("*") if p.is_file()} if committed_dir.exists() else {}
    for rel in sorted(set(built) | set(committed)):
        if built.get(rel) != committed.get(rel):
            stale.append(f"student/{name}/{rel}")
    committed_zip = root / "autograder" / f"{name}-autograder.zip"
    if not committed_zip.exists() or committed_zip.read_bytes() != zip_path.read_bytes():
        stale.append(f"autograder/{name}-autograder.zip")
    # Besides its notebook, solutions/<lab>/ holds exactly the student's files; anything
    # else there (an export zip, .OTTER_LOG from running the notebook in place) is stale.
    solution_dir = root / "solutions" / name
    for path in sorted(solution_dir.rglob("*")) if solution_dir.exists() else []:
        rel = path.relative_to(solution_dir)
        if path.is_file() and rel.as_posix() != f"{name}.ipynb" and (
                built.get(rel) != path.read_bytes()):
            stale.append(f"solutions/{name}/{rel.as_posix()}")
    committed_solution = solution_dir / f"{name}.ipynb"
    if not _readable(committed_solution) or _sources(committed_solution) != [
            (c.cell_type, c.source) for c in solution.cells]:
        stale.append(f"solutions/{name}/{name}.ipynb")
    return stale
