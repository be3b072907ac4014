"""Import direction inside the pack, read from the source with `ast` (nothing here imports the modules it checks).

- The engine (`carnator_core.judging`, `store`, `lookup`, `reuse`, `attention`, `kernels`) never imports the tools
  built on it (`carnator_core.client`, `queue`, `prompt_file`, `prompt_pairs`, `workflow_graph`, `demo`, `bench`).
- `carnator_core.kernels` imports nothing else of `carnator_core` but `process_state`: the attention math stands on its
  own.
- `carnator_core.process_state` imports nothing of `carnator_core`: every module can keep its process-wide objects
  there without an import cycle.
- `carnator_core.judging` (what judges a resume: probe thresholds, the calibration profile) imports nothing else of
  `carnator_core`: the store, reuse, the benchmarks and calibration all read it.
- Nothing but calibration itself and its command (`carnator_core.calibrate`) imports `carnator_core.calibration`: it
  sits on top of what it calibrates.
- The product imports no tool: nothing reachable by import from `nodes/` (but the demo nodes and the package's
  registration, `nodes/__init__.py`) reaches `carnator_core.bench` or `carnator_core.demo`. What the calibration weighs
  with (the yardstick, the quality measures, the plain-steps curve, the plot) lives in `carnator_core.judging`, and
  the demo's oracle reaches it through `judging.clip_oracles`, where the demo registers it.
- No import cycle, between modules or between folders (each top-level module counts as a folder of its own).
- Nothing under `carnator_core` imports ComfyUI: `nodes/` is the only place that does.
- What the pack imports at run time is what the README's install (`requirements.txt`) installs, and pyproject's
  dependencies list the same; only an optional extra's modules (triton, matplotlib) are left to the extras.

Every import counts, at module level or inside a function (lazy imports included); relative imports are
resolved against the importing module first.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "carnator_core"
NODES = REPO / "nodes"
ENGINE = ("judging", "store", "lookup", "reuse", "attention", "kernels")
TOOLS = ("carnator_core.client", "carnator_core.queue", "carnator_core.prompt_file", "carnator_core.prompt_pairs",
         "carnator_core.workflow_graph", "carnator_core.demo", "carnator_core.bench")
# ComfyUI's top-level modules and packages (its `nodes` is not the pack's nodes/ package)
COMFYUI = ("comfy", "comfy_api", "comfy_api_nodes", "comfy_config", "comfy_execution", "comfy_extras",
           "comfyui_version", "cuda_malloc", "execution", "folder_paths", "latent_preview", "node_helpers",
           "nodes", "server", "api_server", "app")


def _module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path) -> Iterator[tuple[int, str]]:
    """(line, absolute module name) for every module `path` imports; `from a import b` yields `a` and `a.b`."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            yield node.lineno, base
            for alias in node.names:
                yield node.lineno, f"{base}.{alias.name}"


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _sources(*folders: str) -> list[Path]:
    roots = [CORE / folder for folder in folders] if folders else [CORE]
    return sorted(path for root in roots for path in root.rglob("*.py"))


def _offences(paths: list[Path], forbidden: Callable[[str], bool]) -> list[str]:
    """One entry per offending import statement, naming the first forbidden module it reaches."""
    found: dict[str, str] = {}
    for path in paths:
        for line, name in _imported(path):
            if forbidden(name):
                found.setdefault(f"{path.relative_to(CORE.parent)}:{line}", name)
    return [f"{where} imports {name}" for where, name in found.items()]


@pytest.mark.parametrize("folder", ENGINE)
def test_engine_folders_hold_python_sources(folder: str) -> None:
    assert (CORE / folder / "__init__.py").is_file()


def test_the_reader_resolves_absolute_and_relative_imports() -> None:
    queue_imports = {name for _, name in _imported(CORE / "queue.py")}
    assert "carnator_core.client" in queue_imports
    kernel_imports = {name for _, name in _imported(CORE / "kernels" / "__init__.py")}
    assert {"carnator_core.kernels.dispatch", "carnator_core.kernels.layout.BlockLayout"} <= kernel_imports


def test_the_engine_never_imports_the_tools() -> None:
    assert _offences(_sources(*ENGINE), lambda name: _within(name, TOOLS)) == []


def test_the_kernels_import_nothing_else_of_carnator_core_but_process_state() -> None:
    def forbidden(name: str) -> bool:
        allowed = ("carnator_core.kernels", "carnator_core.process_state")
        return _within(name, ("carnator_core",)) and not _within(name, allowed) and name != "carnator_core"

    assert _offences(_sources("kernels"), forbidden) == []


def test_judging_imports_nothing_else_of_carnator_core() -> None:
    def forbidden(name: str) -> bool:
        return _within(name, ("carnator_core",)) and not _within(name, ("carnator_core.judging",))

    assert _offences(_sources("judging"), forbidden) == []


def test_only_calibration_and_its_command_import_calibration() -> None:
    below = [path for path in _sources() if path != CORE / "calibrate.py" and CORE / "calibration" not in path.parents]
    assert _offences(below, lambda name: _within(name, ("carnator_core.calibration",))) == []


def _module_of(name: str, modules: Collection[str]) -> str | None:
    """The module an imported name lives in: the name itself, or the nearest enclosing module (`a.b.f` -> `a.b`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _import_graph() -> dict[str, set[str]]:
    """Module -> the carnator_core modules it imports (a name that is no module counts as the module holding it)."""
    modules = {_module_name(path) for path in _sources()}

    return {_module_name(path): {_module_of(name, modules) for _, name in _imported(path)
                                 if _within(name, ("carnator_core",))}
            - {_module_name(path), "carnator_core"} for path in _sources()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = [stack.pop()]
            while component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _folder(module: str) -> str:
    """`carnator_core.reuse.probe` -> `reuse`; a top-level module is a folder of its own: `carnator_core.queue` ->
    `queue`."""
    return module.split(".")[1]


def test_the_cycle_finder_finds_a_cycle_and_only_it() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}) == [["a", "b", "c"]]


def test_no_module_imports_itself_through_others() -> None:
    assert _cycles(_import_graph()) == []


def test_no_folder_imports_itself_through_others() -> None:
    folders: dict[str, set[str]] = {}
    for module, imported in _import_graph().items():
        if module != "carnator_core":
            folders.setdefault(_folder(module), set()).update(
                _folder(other) for other in imported if _folder(other) != _folder(module))
    assert _cycles(folders) == []


PRODUCT_EXEMPT = ("nodes", "nodes.demo_nodes")  # the package's registration and the demo's own nodes
PRODUCT_FORBIDDEN = ("carnator_core.bench", "carnator_core.demo")


def _reached_from(starts: list[Path], exempt: tuple[str, ...] = ()) -> dict[str, str]:
    """Every pack module (`carnator_core.*`, `nodes.*`) that importing `starts` loads, each with the module that first
    imports it, so an offence names its way in; a package's `__init__` counts as loaded with any module under it. The
    `exempt` modules are reached, but what they import is not followed."""
    paths = {_module_name(path): path for path in _sources() + sorted(NODES.glob("*.py"))}

    reached: dict[str, str] = {}
    frontier = [(_module_name(path), "") for path in starts]
    while frontier:
        module, by = frontier.pop()
        if module in reached:
            continue
        reached[module] = by
        if module in exempt:
            continue
        parts = module.split(".")
        frontier += [(".".join(parts[:end]), module) for end in range(1, len(parts)) if ".".join(parts[:end]) in paths]
        for _, name in _imported(paths[module]):
            target = _module_of(name, paths) if _within(name, ("carnator_core", "nodes")) else None
            if target is not None and target != module:
                frontier.append((target, module))
    return reached


def _way_in(reached: dict[str, str], module: str) -> str:
    chain = [module]
    while reached.get(chain[-1]):
        chain.append(reached[chain[-1]])
    return " <- ".join(chain)


def test_the_reach_finder_follows_nodes_relative_and_function_level_imports() -> None:
    reached = _reached_from([NODES / "calibrate_node.py"])
    assert {"carnator_core.calibration.job", "carnator_core.calibration.server_runs"} <= reached.keys()
    assert "carnator_core.demo.clip_oracle" in _reached_from([NODES / "__init__.py"])


def test_the_product_imports_no_tool() -> None:
    starts = [path for path in sorted(NODES.glob("*.py")) if _module_name(path) not in PRODUCT_EXEMPT]
    reached = _reached_from(starts, PRODUCT_EXEMPT)
    assert sorted(_way_in(reached, module) for module in reached if _within(module, PRODUCT_FORBIDDEN)) == []


# Modules a reader can hold: the longest a module of these folders may be, in lines.
LONGEST = {"carnator_core/bench": 500, "nodes": 420}


@pytest.mark.parametrize("folder", sorted(LONGEST))
def test_modules_are_short_enough_to_hold(folder: str) -> None:
    lengths = {path.relative_to(REPO): len(path.read_text(encoding="utf-8").splitlines())
               for path in sorted((REPO / folder).rglob("*.py"))}
    assert {str(path): length for path, length in lengths.items() if length > LONGEST[folder]} == {}


def test_every_module_opens_with_a_line_that_says_what_it_holds() -> None:
    silent = [str(path.relative_to(REPO)) for path in _sources() + sorted(NODES.glob("*.py"))
              if path.stat().st_size and not ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))]
    assert silent == []


def test_process_state_imports_nothing_of_carnator_core() -> None:
    assert _offences([CORE / "process_state.py"], lambda name: _within(name, ("carnator_core",))) == []


def test_carnator_core_never_imports_comfyui() -> None:
    assert _offences(_sources(), lambda name: _within(name, COMFYUI)) == []


OPTIONAL_EXTRAS = {"triton": "gpu", "matplotlib": "plot"}  # module -> the pyproject extra that installs it


def _requirement_names(lines: list[str]) -> set[str]:
    names = (re.split(r"[<>=!~;\[ ]", line.split("#")[0].strip(), maxsplit=1)[0] for line in lines)
    return {name.lower().replace("_", "-") for name in names if name}


def test_requirements_txt_and_pyproject_list_the_same_dependencies() -> None:
    listed = [line.strip() for line in (REPO / "requirements.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert sorted(listed) == sorted(declared)


def test_every_module_the_pack_imports_is_installed_by_requirements_txt() -> None:
    required = _requirement_names((REPO / "requirements.txt").read_text().splitlines())
    distributions = importlib.metadata.packages_distributions()
    missing = []
    for path in _sources() + sorted((REPO / "nodes").rglob("*.py")):
        for line, name in _imported(path):
            top = name.split(".")[0]
            if not top or top in sys.stdlib_module_names or _within(top, COMFYUI + ("carnator_core",)):
                continue
            if top in OPTIONAL_EXTRAS:
                continue
            provided_by = {d.lower().replace("_", "-") for d in distributions.get(top, [top])}
            if not provided_by & required:
                missing.append(f"{path.relative_to(REPO)}:{line} imports {top}")
    assert sorted(set(missing)) == []
