"""The grade package's folders show its design: model <- engine, output <- run, and no cycle."""

import ast
import pathlib

import pytest

import jaxlab.grade
from jaxlab.release import engine_modules

GRADE = pathlib.Path(jaxlab.grade.__file__).parent
# what each part may import of jaxlab.grade (the package docstrings say the same)
ALLOWED = {"model": set(), "engine": {"model"}, "output": {"model"},
           "run": {"model", "engine", "output"}}


def _modules():
    for path in sorted(GRADE.rglob("*.py")):
        parts = ["jaxlab", "grade", *path.relative_to(GRADE).with_suffix("").parts]
        package = parts[:-1] if parts[-1] != "__init__" else parts[:-1]
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, package


def _imports(path, package, top_level_only=False):
    """jaxlab modules ``path`` imports (``from x import y`` counts y when it is a module)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            if target.startswith("jaxlab"):
                found.add(target)
                found |= {f"{target}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("jaxlab")}
    names = {n for n, _, _ in _modules()} | {"jaxlab.checks.form", "jaxlab.checks"}
    return {f for f in found if f in names}


def _part(module):
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["jaxlab", "grade"] else None


@pytest.mark.parametrize("name,path,package", list(_modules()), ids=lambda v: str(v)[:60])
def test_each_part_imports_only_the_parts_below_it(name, path, package):
    part = _part(name)
    if part is None:  # jaxlab.grade itself: its lazy `grade` is the public API
        return
    used = {_part(m) for m in _imports(path, package)} - {None, part}
    assert used <= ALLOWED[part], f"{name} imports {sorted(used - ALLOWED[part])}"
    if part != "engine":
        assert not any(m.startswith("jaxlab.checks") for m in _imports(path, package))


def test_no_import_cycle_between_modules():
    graph = {name: {m for m in _imports(path, package, top_level_only=True) if m != name}
             for name, path, package in _modules()}
    state = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", " -> ".join([*trail, node])
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*trail, node])
        state[node] = "done"

    for node in sorted(graph):
        visit(node, [])


def test_the_zip_ships_only_what_the_container_imports():
    shipped = {p.relative_to(GRADE).as_posix() for p in engine_modules() if GRADE in p.parents}
    assert "run/container.py" in shipped and "engine/worker.py" in shipped
    # the batch, Slurm, the report and what only they use stay out of the container
    for module in ("run/batch.py", "run/slurm.py", "run/report.py", "output/page.py",
                   "output/plot.py", "engine/warmup.py"):
        assert module not in shipped


@pytest.mark.parametrize("name", [n for n, _, _ in _modules()])
def test_every_module_imports(name):
    """A relative import that climbs too few levels names a package that does not exist (seen:
    ``from ..checks.form`` in engine/worker.py after the move, which killed every worker while the
    layering checks, which only see names that exist, passed)."""
    import importlib

    importlib.import_module(name)
