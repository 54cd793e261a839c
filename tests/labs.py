"""Paths and helpers shared by the test modules (imported as ``labs``, not from conftest:
tests/grade has a conftest of its own, and two modules named conftest shadow each other)."""

import importlib.util
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
LABS = ("lab3-parallelism", "lab4-shard-map", "lab5-scaling", "lab6-memory",
        "lab7-transformer")


def release_paths(lab):
    return {
        "master": ROOT / "assignments" / lab / f"{lab}.ipynb",
        "student": ROOT / "student" / lab / f"{lab}.ipynb",
        "solution": ROOT / "solutions" / lab / f"{lab}.ipynb",
        "autograder": ROOT / "autograder" / f"{lab}-autograder.zip",
    }


def run_python(code, timeout=300):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def claims_module(lab):
    """tests/claims/<lab>.py as a module (``CLAIMS``: {id: check}; ``STUDENT_KERNEL``: the ids
    measured in a student's kernel), or None when the lab has none (docs/claims.md)."""
    path = ROOT / "tests" / "claims" / f"{lab}.py"
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location(f"claims_{lab.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
