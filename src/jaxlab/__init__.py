"""Release and grading tooling for the JAX parallelism labs."""

__version__ = "0.1.0"
