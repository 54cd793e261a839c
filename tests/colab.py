"""A Colab-like runtime for tests: a Python environment without otter-grader and a kernel whose
shell reports Colab, as otter detects it (``str(get_ipython())`` contains ``google.colab``).

The environment is a venv at ``.venv-colab`` (built once, reused; pip's cache makes the JAX
install quick). The kernel is ipykernel with ``IPKernelApp.kernel_class`` pointing at a stand-in
``google.colab._kernel.Kernel`` whose shell class lives in ``google.colab._shell``, the module
Colab's own shell comes from.
"""

import json
import pathlib
import subprocess
import sys

import nbformat

from labs import ROOT, release_paths

VENV = ROOT / ".venv-colab"
# What a fresh Colab-like runtime has that the labs use; otter-grader deliberately absent.
PACKAGES = ("jax==0.10.2", "jaxlib==0.10.2", "numpy", "matplotlib", "rich", "tqdm", "ipykernel",
            "orbax-checkpoint")  # Colab ships Orbax (Lab 7)
ANSWER_MARK = "### Your code here"

FAKE_COLAB = {
    "google/colab/__init__.py": "",
    # JAX's debugger imports google.colab.output whenever google.colab is loaded
    "google/colab/output.py": "def eval_js(script, ignore_result=False):\n    return None\n",
    "google/colab/_shell.py": (
        "from ipykernel.zmqshell import ZMQInteractiveShell\n\n\n"
        "class Shell(ZMQInteractiveShell):\n    pass\n"),
    "google/colab/_kernel.py": (
        "from ipykernel.ipkernel import IPythonKernel\nfrom traitlets import Type\n\n"
        "from ._shell import Shell\n\n\n"
        "class Kernel(IPythonKernel):\n    shell_class = Type(Shell)\n"),
}


def venv_python():
    """The no-otter venv's python, built when missing or made from another package list."""
    python = VENV / "bin" / "python"
    stamp = VENV / "jaxlab-packages.txt"
    wanted = "\n".join(PACKAGES)
    if not (python.exists() and stamp.exists() and stamp.read_text() == wanted):
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *PACKAGES], check=True)
        stamp.write_text(wanted)
    return python


def remove_otter(python):
    """Uninstall otter-grader (a previous run's setup cell installed it); True when absent."""
    subprocess.run([str(python), "-m", "pip", "uninstall", "-q", "-y", "otter-grader"],
                   capture_output=True)
    probe = subprocess.run([str(python), "-c", "import otter"], capture_output=True)
    return probe.returncode != 0


def colab_kernel(python, where):
    """A KernelManager for a Colab-like kernel running ``python``; support files go in ``where``."""
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    fake = where / "fake-colab"
    for rel, text in FAKE_COLAB.items():
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text(text)
    spec = where / "kernels" / "colab-like"
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}",
                 "--IPKernelApp.kernel_class=google.colab._kernel.Kernel"],
        "display_name": "Colab-like", "language": "python",
        "env": {"PYTHONPATH": str(fake), "PJRT_NPROC": "16", "MPLBACKEND": "Agg"}}))
    ksm = KernelSpecManager(kernel_dirs=[str(where / "kernels")])
    return KernelManager(kernel_spec_manager=ksm, kernel_name="colab-like")


def run_notebook(nb, folder, km, timeout=600):
    """Execute ``nb`` saved alone in ``folder`` with kernel manager ``km``, errors recorded."""
    from nbclient import NotebookClient

    name = folder / "notebook.ipynb"
    nbformat.write(nb, name)
    try:
        NotebookClient(nb, km=km, timeout=timeout, allow_errors=True,
                       resources={"metadata": {"path": str(folder)}}).execute()
    finally:
        # nbclient shuts down only a kernel manager it made itself: without this each run left
        # its kernel behind (~450 MiB and a few % of a core each, 12 of them by the end of a run)
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    return nb


def with_solution_answers(lab):
    """The student notebook with each answer cell replaced by the solution's, cell for cell."""
    student = nbformat.read(release_paths(lab)["student"], as_version=4)
    solution = nbformat.read(release_paths(lab)["solution"], as_version=4)
    answers = [c.source for c in solution.cells if c.source.startswith(ANSWER_MARK)]
    cells = [c for c in student.cells if c.source.startswith(ANSWER_MARK)]
    assert len(answers) == len(cells) > 0
    for cell, answer in zip(cells, answers):
        cell.source = answer
    return student


def output_text(cell):
    parts = []
    for out in cell.get("outputs", []):
        parts.append(out.get("text", ""))
        parts.append(out.get("data", {}).get("text/plain", ""))
        if out.get("output_type") == "error":
            parts.append(f"{out['ename']}: {out['evalue']}")
    return "".join("".join(p) if isinstance(p, list) else p for p in parts)


def errors(nb):
    return [(i, f"{o['ename']}: {o['evalue']}") for i, c in enumerate(nb.cells)
            for o in c.get("outputs", []) if o.get("output_type") == "error"]


def check_outputs(nb):
    """{question: output text} of every ``grader.check("q")`` cell."""
    import re

    found = {}
    for cell in nb.cells:
        m = re.fullmatch(r'grader\.check\("(\w+)"\)', cell.source.strip())
        if cell.cell_type == "code" and m:
            found[m.group(1)] = output_text(cell)
    return found


def colabify(nb):
    """``nb`` as Colab saves it on File > Download > .ipynb: Colab's notebook and cell metadata,
    its own cell ids, execution info on code cells, folded form cells."""
    import hashlib

    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    nb.metadata["colab"] = {"provenance": [], "gpuType": "T4", "toc_visible": True}
    nb.metadata["accelerator"] = "GPU"
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    nb.metadata["language_info"] = {"name": "python"}
    for i, cell in enumerate(nb.cells):
        cell["id"] = hashlib.sha1(f"colab{i}".encode()).hexdigest()[:12]
        if cell.cell_type == "code":
            cell.metadata["colab"] = {"base_uri": "https://localhost:8080/"}
            cell.metadata["outputId"] = f"{i:08x}-0000-4000-8000-000000000000"
            cell.metadata["executionInfo"] = {
                "status": "ok", "timestamp": 1763856000000 + i, "user_tz": 0,
                "elapsed": 120, "user": {"displayName": "Student", "userId": "1"}}
        if cell.source.startswith("#@title"):
            cell.metadata["cellView"] = "form"
    nbformat.validate(nb)
    return nb


def read(path):
    return nbformat.read(pathlib.Path(path), as_version=4)
