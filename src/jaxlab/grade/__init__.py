"""``jaxlab grade``: Docker-free batch grading of otter submissions; see docs/grading.md."""

from .batch import grade

__all__ = ["grade"]
