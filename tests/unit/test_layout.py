"""Import direction inside the pack, read from the source with `ast` (nothing here imports the modules it checks).

- The engine (`carnator_core.store`, `lookup`, `reuse`, `attention`, `kernels`) never imports the tools built on
  it (`carnator_core.client`, `queue`, `demo`, `bench`).
- `carnator_core.kernels` imports nothing else of `carnator_core`: the attention math stands on its own.
- Nothing under `carnator_core` imports ComfyUI: `nodes/` is the only place that does.

Every import counts, at module level or inside a function (lazy imports included); relative imports are
resolved against the importing module first.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "carnator_core"
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


def test_the_kernels_import_nothing_else_of_carnator_core() -> None:
    def forbidden(name: str) -> bool:
        return _within(name, ("carnator_core",)) and not _within(name, ("carnator_core.kernels",))

    assert _offences(_sources("kernels"), forbidden) == []


def test_carnator_core_never_imports_comfyui() -> None:
    assert _offences(_sources(), lambda name: _within(name, COMFYUI)) == []
