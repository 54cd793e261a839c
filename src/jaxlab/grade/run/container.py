"""Grade the one submission of a Gradescope or ``otter grade`` container with jaxlab's engine.

The autograder zip's ``run_autograder`` runs its ``run_otter.py``, which calls ``main`` here (the
engine ships inside the zip, under ``jaxlab_engine/``). Where otter's own entry point runs
the hidden checks inside the student's kernel, this one grades as ``jaxlab grade`` does (one
Worker, the same phases): the student's cells run in a kernel, the checks see only the plain
data the probes hand over, and verdicts, scores and tampering flags are decided here. It
writes what each caller reads back: ``results/results.json`` (Gradescope) and
``results/results.pkl`` (``otter grade``: a pickled ``GradingResults``).

Inside a container the container is the sandbox (no bubblewrap: Docker's default seccomp
profile allows no user namespaces). The container runs this as root; the kernel runs as
another user (``KERNEL_UID``), so it cannot rewrite this engine, the Python environment, the
checks or the results, read the hidden tests, or signal this process.
"""

import json
import os
import pathlib
import sys
import tempfile

from ..engine import process
from ..engine.autograder import read_autograder
from ..engine.kernel import user_can_run_python
from ..engine.submissions import collect
from ..model import Limits, Record, Settings
from ..output.results import results_of

# Gradescope's default container stops everything at 10 minutes: leave time to judge and write
CONTAINER_LIMITS = Limits(timeout=480, cell_timeout=300)
CONTAINER_STATUS = "sandboxed by the container"
# not nobody (65534): without user namespaces RLIMIT_NPROC counts a user's processes across
# every container of the host, and other images run things as nobody; needs no passwd entry
KERNEL_UID = 61_337


def drop_rights(root, uid=KERNEL_UID):
    """Prepare ``root`` for a kernel run as ``uid``: None if it can, else why not, in words.

    The grader's folders become root's alone; every folder above the Python environment gets
    o+x (pass through, not list: Gradescope's env is under /root, mode 0700).
    """
    if os.geteuid() != 0:
        return "the grader does not run as root"
    for sub in ("source", "submission", "results"):
        (root / sub).chmod(0o700 if sub != "results" else 0o755)
    from ..engine.sandbox import python_dirs
    for env in python_dirs():
        for d in [*reversed(env.parents), env]:
            if d.stat().st_mode & 0o001 == 0:
                try:
                    d.chmod(d.stat().st_mode | 0o001)
                except OSError as exc:
                    return f"{d} cannot be opened to the kernel's user ({exc.strerror})"
    why = user_can_run_python(uid)
    return f"user {uid} cannot run Python ({why})" if why else None


def grade(root="/autograder", *, limits=CONTAINER_LIMITS):
    """Grade ``root``/submission against ``root``/source; write ``root``/results; the Record."""
    root = pathlib.Path(root)
    source, results_dir = root / "source", root / "results"
    results_dir.mkdir(parents=True, exist_ok=True)
    process.set_subreaper()
    # the worker's own JAX (references) on the 8 simulated CPU devices the labs use; kernels
    # get none of these (kernel_env drops JAX_/XLA_ variables)
    os.environ.update(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
                      PJRT_NPROC="16", MALLOC_ARENA_MAX="2")
    from ..engine.worker import Worker  # after the environment above: it imports the checks (JAX)
    import dill  # noqa: F401 (imported before any student code runs, like everything else here)

    not_dropped = drop_rights(root)
    status = CONTAINER_STATUS + (f"; the notebook ran with the grader's rights: {not_dropped}"
                                 if not_dropped else "")

    ag = read_autograder(source)
    subs = [s for s in collect([root / "submission"]) if s.path.suffix == ".ipynb"] or \
        collect([root / "submission"])
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="jaxlab-container-"))
    scratch.chmod(0o711)
    record_path = scratch / "record.json"
    if len(subs) != 1:
        record = Record(file="submission", sha256="", catastrophic=True,
                        status=f"expected one notebook in the submission, found {len(subs)}")
    else:
        sub = subs[0]
        settings = Settings(autograder_root=str(source), fingerprint=ag.fingerprint(),
                            scratch=str(scratch), limits=limits, prestart=False,
                            claims_first=True,
                            kernel_uid=None if not_dropped else KERNEL_UID)
        worker = Worker(settings)
        try:
            worker.grade({"submission": str(sub.path), "file": sub.file, "sha256": sub.digest(),
                          "record": str(record_path), "more": False})
        finally:
            worker.close()
        record = Record.read(record_path)
    record.status = f"{record.status}; {status}"
    write_results(results_dir, record, ag)
    return record


def write_results(results_dir, record, ag):
    """results.json as otter writes it for Gradescope, with the status on top; results.pkl."""
    import dill  # otter's own pickler for results.pkl

    results = results_of(record, ag)
    output = results.to_gradescope_dict(ag.config)
    # the status (and any TAMPERING SUSPECTED) is what students and instructors see first
    output["output"] = f"grading_status: {record.status}\n\n" + output.get("output", "")
    (results_dir / "results.json").write_text(json.dumps(output, indent=4))
    with open(results_dir / "results.pkl", "wb") as f:
        dill.dump(results, f)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    record = grade(argv[0] if argv else "/autograder")
    print(f"jaxlab: {record.status}")
    for q, outcome in record.outcomes.items():
        print(f"  {q}: {outcome}")


if __name__ == "__main__":
    main()
