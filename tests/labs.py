"""Paths and helpers shared by the test modules (imported as ``labs``, not from conftest:
tests/grade has a conftest of its own, and two modules named conftest shadow each other)."""

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
