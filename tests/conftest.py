import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LABS = ("lab3-parallelism", "lab4-shard-map")

# The checks rebuild shardings on 8 devices; set before JAX starts in this process.
os.environ.setdefault("PJRT_NPROC", "16")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


def release_paths(lab):
    return {
        "master": ROOT / "assignments" / lab / f"{lab}.ipynb",
        "student": ROOT / "student" / lab / f"{lab}.ipynb",
        "solution": ROOT / "solutions" / lab / f"{lab}.ipynb",
        "autograder": ROOT / "autograder" / f"{lab}-autograder.zip",
    }


@pytest.fixture(scope="session")
def lab3():
    return release_paths("lab3-parallelism")


def run_python(code, timeout=300):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
