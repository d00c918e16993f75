"""The package's import graph: no cycles, and dependencies that point one way; and one module, the
planner, that asks the stage table what runs.

Layers, top to bottom: the main job (``demo``); the package's lazy ``__init__``; the API (``nn``
and ``layers``; then ``api`` and ``checkpoint``; then ``parallel`` and ``mailbox``); the plan
(``planner``, the one module that decides what runs); the stage table (``registry``); the kernels
(``pallas``, ``bridge``); the base (``config``, ``configs``, ``params``, ``reference``). Every edge
points to a lower layer; only the kernels and the base import within their own layer. An edge is
any import of a module of the package: a statement at the top of a module or inside a function, a
``"module:function"`` or module-path string (what ``registry.STAGES``, ``planner`` and the lazy
``moe_front_jax.__init__`` import by ``importlib``).
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Repository folder -> installed package (pyproject.toml's package-dir).
FOLDERS = {"moe_front_jax": "moe_front_jax", "pallas": "moe_front_jax.pallas",
           "bridge": "moe_front_jax.bridge"}
MODULE_STRING = re.compile(r"^(moe_front_jax(?:\.\w+)+)(?::\w+)?$")
LAYERS = (  # top to bottom; a module's layer is the first whose prefixes it matches
    ("main job", ("moe_front_jax.demo",), False),
    ("package", ("moe_front_jax",), False),
    ("module", ("moe_front_jax.nn", "moe_front_jax.layers"), False),
    ("entry points", ("moe_front_jax.api", "moe_front_jax.checkpoint"), False),
    ("collectives and mailbox", ("moe_front_jax.parallel", "moe_front_jax.mailbox"), False),
    ("plan", ("moe_front_jax.planner",), False),
    ("stage table", ("moe_front_jax.registry",), False),
    ("kernels", ("moe_front_jax.pallas", "moe_front_jax.bridge"), True),
    ("base", ("moe_front_jax.config", "moe_front_jax.configs", "moe_front_jax.params",
              "moe_front_jax.reference"), True),
)
"""(name, module prefixes, whether modules of the layer may import each other)."""


def layer(module: str) -> int:
    """The index in ``LAYERS`` of ``module``'s layer (the package itself is the second)."""
    if module == "moe_front_jax":
        return 1
    for index, (_, prefixes, _) in enumerate(LAYERS):
        if index == 1:
            continue
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    raise AssertionError(f"{module} is in no layer of LAYERS")


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def resolve(name: str, known: dict[str, Path]) -> str | None:
    """The package module ``name`` refers to: itself, or the module that defines it (an attribute of
    a package's ``__init__``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def edges(known: dict[str, Path]) -> dict[str, set[str]]:
    graph = {name: set() for name in known}
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                    + ([base] if base else []))
                targets = [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                match = MODULE_STRING.match(node.value)
                targets = [match.group(1)] if match else []
            for target in targets:
                module = resolve(target, known)
                if module is not None and module != name:
                    graph[name].add(module)
    return graph


def runtime_strings() -> dict[str, set[str]]:
    """The importlib targets built at run time: ``registry.STAGES`` and the lazy public names."""
    import moe_front_jax
    from moe_front_jax import registry

    targets = {"moe_front_jax.registry": set(), "moe_front_jax": set()}
    for stage in registry.STAGES.values():
        for value in (stage.reference, stage.kernel, stage.auto, stage.covers, stage.selects):
            if value and ":" in value:
                targets["moe_front_jax.registry"].add(value.split(":")[0])
    for name, module in moe_front_jax._PUBLIC.items():
        targets["moe_front_jax"].add(module or f"moe_front_jax.{name}")
    return targets


@pytest.fixture(scope="module")
def graph():
    known = modules()
    graph = edges(known)
    for source, targets in runtime_strings().items():
        for target in targets:
            assert resolve(target, known) == target, f"{source} names {target}, not a module"
            graph[source].add(target)
    return graph


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_walk_sees_every_kind_of_edge(graph):
    # A static import, an import inside a function, and registry's importlib strings.
    assert "moe_front_jax.registry" in graph["moe_front_jax.api"]
    assert "moe_front_jax.bridge.peer_mailbox" in graph["moe_front_jax.planner"]
    assert "moe_front_jax.pallas.route" in graph["moe_front_jax.registry"]
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle(graph):
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """The edges of ``graph`` that point up a layer, or across one that keeps its modules apart."""
    return sorted(
        (source, target) for source, targets in graph.items() for target in targets
        if layer(target) < layer(source)
        or (layer(target) == layer(source) and not LAYERS[layer(source)][2])
    )


def test_every_edge_points_down_a_layer(graph):
    wrong = upward(graph)
    assert not wrong, f"imports that point up or across a layer: {wrong}"


def test_the_layer_rule_sees_an_upward_edge():
    assert upward({"moe_front_jax.pallas.route": {"moe_front_jax.planner"}})
    assert upward({"moe_front_jax.parallel": {"moe_front_jax.api"}})
    assert upward({"moe_front_jax.mailbox": {"moe_front_jax.parallel"}})
    assert upward({"moe_front_jax.registry": {"moe_front_jax.planner"}})
    assert not upward({"moe_front_jax.pallas.route": {"moe_front_jax.pallas.gemm.schedule"},
                       "moe_front_jax.api": {"moe_front_jax.planner", "moe_front_jax.params"}})


def deciders(sources: dict[str, str]) -> list[str]:
    """The modules (name -> source) that call ``registry.choose`` or ``registry.run``: the calls
    that decide which implementation runs a stage."""
    found = []
    for name, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("choose", "run")
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "registry"):
                found.append(name)
                break
    return sorted(found)


def test_only_the_planner_decides_what_runs():
    sources = {name: path.read_text() for name, path in modules().items()}
    assert deciders(sources) == ["moe_front_jax.planner"]
    assert deciders({"a": "registry.run('route', 'auto')", "b": "planner.run(plan, env)"}) == ["a"]
