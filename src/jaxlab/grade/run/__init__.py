"""Ways to grade many submissions with the engine: ``batch`` (a pool of worker processes on one
machine: ``jaxlab grade``), ``shard`` (fixed shards of one output folder, their manifests and
``jaxlab status``), ``report`` (``jaxlab report``: the class's files from every shard's
records), ``slurm`` (``jaxlab slurm``: a job array) and ``container`` (the one submission of a
Gradescope or ``otter grade`` container).

May import ``model``, ``engine`` and ``output``; nothing imports ``run`` but the CLI, the
package's lazy ``grade`` and the zip's entry point.
"""
