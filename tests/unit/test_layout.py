"""Import direction inside the pack, read from the source with `ast` (nothing here imports the modules it checks).

- The engine (`carnator_core.store`, `lookup`, `reuse`, `attention`, `kernels`) never imports the tools built on
  it (`carnator_core.client`, `queue`, `demo`, `bench`).
- `carnator_core.kernels` imports nothing else of `carnator_core` but `process_state`: the attention math stands on its
  own.
- `carnator_core.process_state` imports nothing of `carnator_core`: every module can keep its process-wide objects
  there without an import cycle.
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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "carnator_core"
ENGINE = ("store", "lookup", "reuse", "attention", "kernels")
TOOLS = ("carnator_core.client", "carnator_core.queue", "carnator_core.prompt_file", "carnator_core.demo",
         "carnator_core.bench")
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
