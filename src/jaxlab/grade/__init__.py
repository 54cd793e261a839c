"""``jaxlab grade``: Docker-free grading of otter submissions; see docs/architecture.md.

Four parts, each importing only those listed before it:

* ``model``   the contracts every part passes around (settings, limits, a submission's record);
* ``engine``  grades one submission: its cells in a sandboxed kernel, its answers judged here;
* ``output``  writes what grading produced (otter's CSV, summaries, plot, report.html);
* ``run``     ways to grade many: a pool of workers, shards, Slurm, one container.

``grade`` (the batch, ``run.batch.grade``) is imported on first use, so that a container that
ships only the engine can import ``jaxlab.grade.run.container`` without the batch's packages.
"""

__all__ = ["grade"]


def __getattr__(name):
    if name == "grade":
        from .run.batch import grade
        return grade
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
