"""The package's modules import each other without a cycle (issue 14): the layers read bottom to top,
config -> model -> cache -> runtime -> serving -> tools. Every import counts, function-local ones too."""

from __future__ import annotations

import ast
import importlib.util
import pkgutil
from pathlib import Path

import kvbook


def package_modules() -> dict[str, Path]:
    """Every module of kvbook (packages too, as their __init__.py) -> its source file."""
    modules = {"kvbook": Path(kvbook.__file__)}
    for info in pkgutil.walk_packages(kvbook.__path__, prefix="kvbook."):
        spec = importlib.util.find_spec(info.name)
        modules[info.name] = Path(spec.origin)
    return modules


def _resolve(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of `from <level dots><name> import ...` written in `module`."""
    if level == 0:
        return name or ""
    parts = module.split(".")
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (at module level or inside functions)."""
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(name, is_package, node.level, node.module)
                # `from package import module` imports the module; `from module import name` the module
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:  # `import kvbook.model.x.y` -> the longest known module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None. Depth-first search, colouring nodes."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"a2"}, "a2": {"b"}, "b": {"a2"}}) == ["a2", "b", "a2"]


def test_import_graph_sees_relative_and_local_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "top.py").write_text("def f():\n    from .sub import leaf\n")
    (pkg / "sub" / "leaf.py").write_text("from ..top import f\n")
    modules = {"pkg": pkg / "__init__.py", "pkg.sub": pkg / "sub" / "__init__.py", "pkg.top": pkg / "top.py",
               "pkg.sub.leaf": pkg / "sub" / "leaf.py"}
    graph = import_graph(modules)
    assert graph["pkg.top"] == {"pkg.sub.leaf"} and graph["pkg.sub.leaf"] == {"pkg.top"}
    assert find_cycle(graph) == ["pkg.sub.leaf", "pkg.top", "pkg.sub.leaf"]


def test_no_import_cycle():
    modules = package_modules()
    assert len(modules) > 20
    cycle = find_cycle(import_graph(modules))
    assert cycle is None, "import cycle between kvbook modules: " + " -> ".join(cycle)


def _functions_calling(path: Path, wanted) -> set[str]:
    """The names of the functions in a source file that contain a call for which wanted(call) is true."""
    found = set()
    for function in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            if any(isinstance(node, ast.Call) and wanted(node) for node in ast.walk(function)):
                found.add(function.name)
    return found


def _calls_attribute(name: str):
    return lambda call: isinstance(call.func, ast.Attribute) and call.func.attr == name


def _calls_name(name: str):
    return lambda call: isinstance(call.func, ast.Name) and call.func.id == name


def test_one_execution_path_runs_the_model():
    # the runtime and the server run the model in one place per kind of pass, all in the engine (the model runner):
    # prefill, a decode step (its inputs from kvbook.runtime.inputs.prepare_decode), a pass without a cache, and
    # the fixed-shape step that a CUDA graph records; every generation reaches them through the scheduler's step
    modules = package_modules()
    calls = {}
    for name, path in modules.items():
        if name.startswith(("kvbook.runtime", "kvbook.serving")):
            for function in _functions_calling(path, _calls_attribute("model")):
                calls.setdefault(name, set()).add(function)
    assert calls == {"kvbook.runtime.engine": {"prefill", "decode", "recompute"},
                     "kvbook.runtime.cuda_graph": {"_forward"}}
    prepared = {name: _functions_calling(path, _calls_name("prepare_decode")) for name, path in modules.items()}
    assert {name: f for name, f in prepared.items() if f} == {"kvbook.runtime.engine": {"decode"}}
    steps = {name: _functions_calling(path, _calls_attribute("step")) for name, path in modules.items()
             if name.startswith("kvbook.runtime")}
    # Engine.stream and Engine.generate are the scheduler's loop for one sequence
    assert "_run_alone" in steps["kvbook.runtime.engine"]
    engine_path = modules["kvbook.runtime.engine"]
    assert _functions_calling(engine_path, _calls_attribute("_run_alone")) == {"stream", "generate"}


def test_the_model_never_asks_what_kind_of_cache_it_got():
    for name, path in package_modules().items():
        if name.startswith("kvbook.model"):
            checks = [ast.unparse(node) for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                      if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                      and node.func.id == "isinstance" and "Cache" in ast.unparse(node.args[1])]
            assert not checks, f"{name} dispatches on the cache's type: {checks}"
