"""Issue 10's attacks on the grading machine, each as a notebook cell that sets ``ok``.

A submission is the solution with one cell after an answer that tries one attack and spoils
the answer unless it worked (the fixture's ``y_mean`` by default; scripts/grade_demo.py spoils
Lab 3's Task 1). Paths of the machine (the instructor's home, the
autograder, the batch's folders, the grader's pid) are written into the cell, as a student who
knew them would. Shared by tests/grade/test_sandbox.py and scripts/grade_demo.py.
"""

import nbformat

from nbedit import answer_cell

ATTACKS = {
    # a service on the grading machine's loopback hands a token to whoever connects
    "network": """\
import socket
with socket.create_connection(("127.0.0.1", {listener_port}), timeout=5) as s:
    ok = s.recv(100) == b"network-token"
""",
    # a private file in the instructor's home
    "instructor_home": """\
with open({secret!r}) as f:
    ok = "instructor-secret-key" in f.read()
""",
    # the hidden checks: in the autograder zip, its extracted copy, or this package's source
    "hidden_checks": """\
import glob, importlib.util, os, zipfile
found = []
try:
    with zipfile.ZipFile({autograder!r}) as z:
        found += [n for n in z.namelist() if "def verdict" in z.read(n).decode(errors="ignore")]
except OSError:
    pass
for pattern in ("/tmp/*/autograder/files/jaxlab_*.py", "/tmp/*/*/jaxlab_*.py",
                "/tmp/*/*/*/reveal/*/jaxlab_*.py"):
    for path in glob.glob(pattern):
        with open(path) as f:
            found += [path] if "def verdict" in f.read() else []
spec = importlib.util.find_spec("jaxlab")
if spec and spec.submodule_search_locations:
    for path in glob.glob(os.path.join(list(spec.submodule_search_locations)[0], "checks", "*.py")):
        with open(path) as f:
            found += [path] if "def verdict" in f.read() else []
ok = bool(found)
""",
    # another student's submission in the same batch
    "other_submissions": """\
with open({subs!r} + "/control.ipynb") as f:
    ok = '"cells"' in f.read()
""",
    # a file dropped into the grade folder the instructor reads
    "grade_folder": """\
with open({out!r} + "/.jaxlab/pwned-by-student.txt", "w") as f:
    f.write("written from a kernel")
ok = True
""",
    # an entry in the compilation cache later kernels load code from
    "compile_cache": """\
import os
cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or {cache!r}
if not os.path.isdir(cache):
    raise FileNotFoundError(cache)
with open(cache + "/pwned-cache-entry", "wb") as f:
    f.write(b"code another kernel would load")
ok = True
""",
    # the grader's own processes: a known pid (the batch's, or its parent's) and every jaxlab
    # grading process found in /proc
    "signal_grader": """\
import os, signal
hit = []
try:
    os.kill({grader_pid}, signal.SIGCONT)
    hit.append({grader_pid})
except OSError:
    pass
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{{pid}}/cmdline", "rb") as f:
            cmdline = f.read()
            if b"jaxlab.grade.engine.worker" in cmdline or b"jaxlab\\x00grade" in cmdline:
                os.kill(int(pid), signal.SIGCONT)
                hit.append(int(pid))
    except OSError:
        pass
ok = bool(hit)
""",
}

CELL = """\
ok = False
try:
{body}
except Exception as exc:
    print("attempt failed:", type(exc).__name__, exc)
if not ok:  # the answer stays right only if the attack worked
    {spoil}
"""
SPOIL_Y_MEAN = "y_mean = -1.0"


def attack_cell(name, targets, spoil=SPOIL_Y_MEAN):
    body = ATTACKS[name].format(**{k: str(v) if not isinstance(v, int) else v
                                   for k, v in targets.items()})
    return CELL.format(body="\n".join("    " + line for line in body.splitlines()), spoil=spoil)


def attack_notebook(nb, name, targets, after=None, spoil=SPOIL_Y_MEAN):
    """``nb`` with the attack's cell after cell ``after`` (default: the ``y_mean`` answer)."""
    at = answer_cell(nb, "y_mean") if after is None else after
    nb.cells.insert(at + 1, nbformat.v4.new_code_cell(attack_cell(name, targets, spoil)))
    return nb
