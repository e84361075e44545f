"""The layers are a DAG: the model (`sim`) imports nothing above it, the policy
core has no clock, `calibrate` builds on `validate` and never the other way,
the command line (`llmsim`) is imported by nothing, and no package imports
another in a loop. Every import is read from the source, those inside
functions included; a function-level import is allowed only for an optional
dependency loaded lazily."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("sim", "calibrate", "validate", "llmsim")
# optional dependencies a function may import lazily (each with its reason at the import)
LAZY_OK = ("ray", "torch", "vllm", "openai", "httpx2")
# the layer order: a package may import only packages before it
ORDER = {"sim": 0, "validate": 1, "calibrate": 2, "llmsim": 3}
CLOCKS = ("simpy", "asyncio", "aiohttp", "time", "datetime")


def _modules():
    for pkg in PACKAGES:
        for d, _, files in os.walk(os.path.join(ROOT, pkg)):
            for f in files:
                if f.endswith(".py"):
                    path = os.path.join(d, f)
                    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                    yield rel.removesuffix(".__init__"), path


def _imports(mod: str, path: str):
    """(imported module, in a function?) for every import of the file."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_pkg = path.endswith("__init__.py")
    parents = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[child] = node

    def in_function(node):
        while node in parents:
            node = parents[node]
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                return True
        return False

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                yield a.name, in_function(node)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:
                    for a in node.names:
                        yield f"{name}.{a.name}", in_function(node)
                    continue
            else:
                name = node.module
            yield name, in_function(node)


ALL = {m: list(_imports(m, p)) for m, p in _modules()}


def test_the_modules_are_found():
    assert {"sim.engine.scheduler", "sim.policy.proxy", "llmsim.cli", "validate.proxy", "calibrate.fit"} <= set(ALL)


@pytest.mark.parametrize("mod", sorted(ALL))
def test_a_package_imports_only_layers_below_it(mod):
    own = mod.split(".")[0]
    bad = [name for name, _ in ALL[mod]
           if name.split(".")[0] in ORDER and ORDER[name.split(".")[0]] > ORDER[own]]
    assert not bad, f"{mod} imports {bad} from a layer above {own}"


@pytest.mark.parametrize("mod", sorted(m for m in ALL if m.startswith("sim.policy")))
def test_the_policy_core_has_no_clock(mod):
    bad = [name for name, _ in ALL[mod] if name.split(".")[0] in CLOCKS]
    assert not bad, f"{mod} imports {bad}: the policy core is driven by events with timestamps, not a clock"


@pytest.mark.parametrize("mod", sorted(ALL))
def test_function_level_imports_are_lazy_optional_dependencies(mod):
    bad = [name for name, in_fn in ALL[mod] if in_fn and name.split(".")[0] not in LAZY_OK]
    assert not bad, f"{mod} imports {bad} inside a function; import at module level"


def test_no_cycle_between_modules():
    """Module-level imports among the project's modules form a DAG."""
    graph = {m: set() for m in ALL}
    for m, imps in ALL.items():
        for name, in_fn in imps:
            target = name
            while target and target not in ALL:
                target = target.rpartition(".")[0]
            if target and target != m and not in_fn:
                graph[m].add(target)
    # a package's __init__ importing its own submodules is not a cycle with them
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in graph[m]:
            if n.startswith(m + "."):
                continue
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_command_line_is_imported_by_nothing():
    bad = [(m, name) for m, imps in ALL.items() if not m.startswith("llmsim")
           for name, _ in imps if name.split(".")[0] == "llmsim"]
    assert not bad


SIMPY_PRIVATE = ("_queue", "_now", "_eid", "_ok", "_defused", "_value")
CLOCK = "sim.clock"     # the one module that may touch them (its docstring says why, pyproject.toml pins SimPy)


def _private_uses(path: str):
    """(line, name) of every SimPy private attribute the file reads or sets:
    as an attribute (`x._now`) or by name (`hasattr(x, "_defused")`)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in SIMPY_PRIVATE:
            yield node.lineno, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in SIMPY_PRIVATE):
            yield node.lineno, node.args[1].value


def test_the_clock_alone_touches_simpys_private_attributes():
    paths = dict(_modules())
    assert {n for _, n in _private_uses(paths[CLOCK])} == set(SIMPY_PRIVATE)    # the rule sees them
    bad = [f"{m}:{line} {name}" for m, path in sorted(paths.items()) if m != CLOCK
           for line, name in _private_uses(path)]
    assert not bad, "SimPy's private attributes outside sim/clock.py: " + ", ".join(bad)
