"""What grading writes, from records to files; nothing here grades or runs anything.

``results``: one submission as otter writes it (summary, Gradescope JSON, CSV row); ``tally``:
per-question outcomes for the class; ``plot``: score_distribution.png; ``page``: report.html;
``classreport``: the class's three files at once. May import ``jaxlab.grade.model`` and otter;
never ``engine`` or ``run``.
"""
