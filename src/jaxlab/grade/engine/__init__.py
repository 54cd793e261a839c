"""The engine: grade one submission. A trusted worker process (``worker``) runs the student's
cells in one kernel (``kernel``, inside a bubblewrap ``sandbox``, its ``cgroup`` and ``process``
tree watched by a ``session``), then the grader's probe and claim ``cells``, and the ``judge``
scores the evidence they left; ``autograder`` and ``submissions`` read the inputs, ``warmup``
writes the compilation cache the kernels read.

May import ``jaxlab.grade.model`` and ``jaxlab.checks.form``; never ``output`` or ``run``.
"""
