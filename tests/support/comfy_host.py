"""A real ComfyUI as the test host: in-process (library on CPU) and as a headless server subprocess.

Both load the Carnator pack through ComfyUI's own custom-node loader from a throwaway base directory
(`models/`, `custom_nodes/`, `user/`, `output/` ...) in which the repository is symlinked as
`custom_nodes/carnator` next to the test-only `tests/support/harness_pack`, so no test touches the
checkout's own folders. Nothing of the host is mocked. The server is the product's own
`carnator_core.client.HeadlessServer`, driven through its `ComfyClient`; `ComfyServer` only starts it the
tests' way and adds raw `get`/`post` for the route tests. Both hosts return the client's `PromptRun`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import inspect
import json
import logging
import os
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from aiohttp.test_utils import make_mocked_request

from carnator_core.client import HeadlessServer, PromptRun, find_failure, free_port, prepare_base_dir, refusal
from carnator_core.comfyui_location import ComfyNotFound as ComfyNotFound  # the tests name them from here
from carnator_core.comfyui_location import find_comfyui as find_comfyui
from carnator_core.workflow_graph import complete

REPO_ROOT = Path(__file__).resolve().parents[2]
HARNESS_PACK = REPO_ROOT / "tests" / "support" / "harness_pack"
PACK_NAME = "carnator"
HARNESS_PACK_NAME = "carnator_harness"


class PromptFailed(RuntimeError):
    """A prompt was rejected by validation or raised while executing; the message says where and why."""


def make_base_dir(base: Path, model_files: dict[str, Path] | None = None) -> Path:
    """Lay out a ComfyUI base directory as the product's server does (`prepare_base_dir`: folders and the pack),
    with the harness pack and `model_files` symlinked in."""
    prepare_base_dir(base)
    link = base / "custom_nodes" / HARNESS_PACK_NAME
    if not link.exists():
        link.symlink_to(HARNESS_PACK, target_is_directory=True)
    for path in (model_files or {}).values():
        link = base / "models" / "diffusion_models" / path.name
        if not link.exists():
            link.symlink_to(path)
    return base


def configure_comfy_args(comfy_path: Path, base_dir: Path) -> None:
    """Put ComfyUI first on sys.path and set its CLI args (CPU, base directory) before the rest of it is imported.

    ComfyUI reads its args once, at import, into process-global state; conftest calls this at pytest start so
    every test that imports ComfyUI, in whatever order, gets the same CPU host on the same throwaway base dir.
    """
    if str(comfy_path) not in sys.path:
        sys.path.insert(0, str(comfy_path))
    import comfy.options  # noqa: F401  (must precede cli_args: it decides whether sys.argv is parsed)
    from comfy.cli_args import args

    if not any(Path(p).resolve().is_relative_to(comfy_path) for p in sys.modules["comfy"].__path__):
        raise RuntimeError(f"'comfy' was imported from {list(sys.modules['comfy'].__path__)}, not from {comfy_path}")
    args.cpu = True
    args.base_directory = str(base_dir)
    args.disable_auto_launch = True
    # torch's scaled-dot-product attention, which ComfyUI runs on GPUs; on a CPU it picks the sub-quadratic kind, which
    # asks psutil for free memory in every attention call (a graph break under torch.compile). The headless servers
    # the tests start keep the CPU default.
    args.use_pytorch_cross_attention = True


def pack_module(name: str):
    """A module of the pack as ComfyUI's loader imported it (custom_nodes.<pack>.nodes.<name>)."""
    return next(module for key, module in sys.modules.items() if key.endswith(f"carnator.nodes.{name}"))


@contextlib.contextmanager
def captured_logs(level: int = logging.WARNING) -> Iterator[list[str]]:
    """Collect log lines emitted meanwhile; ComfyUI's loader reports a failed pack only through logging."""
    lines: list[str] = []

    class _Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    handler = _Collect(level)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        yield lines
    finally:
        root.removeHandler(handler)


def _execution_error(reason: str, details: dict) -> PromptFailed:
    """A failed prompt as the tests show it: node, exception and message, then the node's traceback."""
    return PromptFailed(f"{reason}\n{''.join(details.get('traceback') or [])}")


@dataclass
class NodeResult:
    """What one node call returned: its outputs (indexable like the node's output tuple) and its UI dict."""

    outputs: tuple
    ui: dict | None = None

    def __getitem__(self, index: int) -> Any:
        return self.outputs[index]


@dataclass
class InProcessRun(PromptRun):
    """A prompt the in-process host executed: the client's `PromptRun` (its `events` are ComfyUI's status messages,
    execution_start to execution_success; its `history` holds the UI outputs per node, as /history has them) plus
    what only an in-process host can give, every node's outputs. Websocket-only events (executing, progress,
    carnator.status) are what `InProcessComfy.drain_events` returns."""

    node_outputs: dict[str, list] = field(default_factory=dict, repr=False)

    def output(self, node_id: str, index: int = 0) -> Any:
        """Output `index` of node `node_id` (first list item, as a node downstream would receive it)."""
        return self.node_outputs[node_id][index][0]


class InProcessComfy:
    """ComfyUI imported as a library on CPU, with the pack loaded by `nodes.load_custom_node`.

    ComfyUI keeps global state (args, folder paths, node registry), so there is one per test session.
    """

    def __init__(self, comfy_path: Path, base_dir: Path):
        self.comfy_path = comfy_path
        self.base_dir = base_dir
        self._import_host()
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.server = self._server.PromptServer(self.loop)
        self._init_nodes()
        self.server.add_routes()
        self.executor = self._execution.PromptExecutor(self.server, cache_type=self._execution.CacheType.CLASSIC,
                                                       **self._cache_arguments())

    def _cache_arguments(self) -> dict:
        """PromptExecutor's cache settings as main.py passes them, where the host takes them (RAM headroom is read
        on every prompt by hosts that have `cache_args`)."""
        parameters = inspect.signature(self._execution.PromptExecutor).parameters
        if "cache_args" not in parameters:
            return {}
        return {"cache_args": {"lru": 0, "ram": 0.0, "ram_inactive": 0.0}}

    def _cached_output(self, node_id: str) -> list | None:
        """A node's outputs from the executor's output cache (a coroutine and a CacheEntry on newer hosts)."""
        value = self.executor.caches.outputs.get(node_id)
        if inspect.isawaitable(value):
            value = self.loop.run_until_complete(value)
        return getattr(value, "outputs", value)

    def _import_host(self) -> None:
        configure_comfy_args(self.comfy_path, self.base_dir)
        import folder_paths

        if Path(folder_paths.base_path) != self.base_dir:
            raise RuntimeError(
                f"ComfyUI's folder_paths was imported with base {folder_paths.base_path} before the in-process host "
                f"was set up on {self.base_dir}: import ComfyUI in tests only after configure_comfy_args / the `comfy` fixture"
            )
        # ComfyUI's top-level modules, by name (the repo's nodes/ must not shadow them), in main.py's order:
        # `utils` (a package) before `nodes`, which puts comfy/ (holding a utils.py) first on sys.path.
        importlib.import_module("utils.extra_config")
        import comfy.model_management as mm

        execution, server, nodes = (importlib.import_module(name) for name in ("execution", "server", "nodes"))
        if not Path(nodes.__file__).resolve().is_relative_to(self.comfy_path):
            raise RuntimeError(f"'nodes' resolved to {nodes.__file__}, not ComfyUI's nodes.py")
        if mm.cpu_state != mm.CPUState.CPU:
            raise RuntimeError("in-process ComfyUI is not on CPU (comfy.model_management was imported before args.cpu)")
        self._execution, self._nodes, self._server, self.folder_paths = execution, nodes, server, folder_paths

    def _init_nodes(self) -> None:
        import hook_breaker_ac10a0

        nodes = self._nodes
        hook_breaker_ac10a0.save_functions()
        try:
            self.loop.run_until_complete(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
        finally:
            hook_breaker_ac10a0.restore_functions()
        self.builtin_node_ids = frozenset(nodes.NODE_CLASS_MAPPINGS)
        for name in (PACK_NAME, HARNESS_PACK_NAME):
            self.load_custom_node(self.base_dir / "custom_nodes" / name)

    def load_custom_node(self, module_path: Path) -> None:
        """Load a node pack through ComfyUI's loader; raise with the loader's log if it refuses it."""
        with captured_logs() as logs:
            loaded = self.loop.run_until_complete(
                self._nodes.load_custom_node(str(module_path), ignore=self.builtin_node_ids, module_parent="custom_nodes")
            )
        if not loaded:
            raise RuntimeError(f"ComfyUI failed to load {module_path}:\n" + "\n".join(logs))

    @property
    def node_classes(self) -> dict[str, type]:
        """ComfyUI's registry of node classes (NODE_CLASS_MAPPINGS)."""
        return self._nodes.NODE_CLASS_MAPPINGS

    def pack_node_ids(self, pack: str = PACK_NAME) -> list[str]:
        """Ids of the nodes that `pack` (a custom_nodes folder name) registered."""
        module = f"custom_nodes.{pack}"
        return sorted(i for i, c in self.node_classes.items() if getattr(c, "RELATIVE_PYTHON_MODULE", None) == module)

    def run_prompt(self, prompt: dict, client_id: str | None = None) -> InProcessRun:
        """Validate and execute an API-format prompt with ComfyUI's PromptExecutor, as the server's worker does."""
        execution = self._execution
        prompt_id = str(uuid.uuid4())
        valid, error, outputs, node_errors = self.loop.run_until_complete(execution.validate_prompt(prompt_id, prompt, None))
        if not valid:
            raise PromptFailed(refusal(error, node_errors))
        extra_data = {"client_id": client_id} if client_id else {}
        try:
            self.executor.execute(prompt, prompt_id, extra_data, outputs)
        finally:
            asyncio.set_event_loop(self.loop)  # executor.execute runs asyncio.run, which unsets the current loop
        messages = list(self.executor.status_messages)
        if not self.executor.success:
            found = find_failure(messages)
            if found is None:
                raise PromptFailed(f"execution failed without an execution_error message: {messages}")
            raise _execution_error(*found)
        history = {"outputs": dict(self.executor.history_result["outputs"]),
                   "status": {"status_str": "success", "completed": True, "messages": messages}}
        return InProcessRun(prompt_id, events=[{"type": kind, "data": data} for kind, data in messages],
                            history=history,
                            node_outputs={node_id: self._cached_output(node_id) for node_id in prompt})

    def object_info(self, *class_types: str) -> dict:
        """What the server's /object_info answers for `class_types` (ComfyUI's own /object_info/{node_class} route
        handler, called in process): each node's inputs with their defaults and ranges, its outputs."""
        handler = next(route.handler for route in self.server.routes if getattr(route, "method", None) == "GET"
                       and getattr(route, "path", None) == "/object_info/{node_class}")
        info: dict = {}
        for class_type in class_types:
            request = make_mocked_request("GET", f"/object_info/{class_type}", match_info={"node_class": class_type})
            info.update(json.loads(self.loop.run_until_complete(handler(request)).body))
        return info

    def complete(self, graph: dict) -> dict:
        """`graph` with every required input it leaves out set to the node's default from /object_info, as the
        demo and the benchmarks queue theirs (`carnator_core.workflow_graph.complete`)."""
        return complete(graph, self.object_info(*{node["class_type"] for node in graph.values()}))

    def call_node(self, class_type: str, **inputs: Any) -> NodeResult:
        """Call one registered node directly (no graph, no validation, no hidden inputs)."""
        cls = self.node_classes[class_type]
        if hasattr(cls, "GET_SCHEMA"):  # V3 node: classmethod execute returning NodeOutput
            result = cls.execute(**inputs)
            if asyncio.iscoroutine(result):
                result = self.loop.run_until_complete(result)
            ui = result.ui if result.ui is None or isinstance(result.ui, dict) else result.ui.as_dict()
            return NodeResult(tuple(result.args), ui)
        result = getattr(cls(), cls.FUNCTION)(**inputs)
        if asyncio.iscoroutine(result):
            result = self.loop.run_until_complete(result)
        if isinstance(result, dict):
            return NodeResult(tuple(result.get("result", ())), result.get("ui"))
        return NodeResult(tuple(result))

    def drain_events(self) -> list[tuple[str, Any, str | None]]:
        """Events sent through `PromptServer.instance.send_sync` since the last drain: (event, data, client id)."""
        self.loop.run_until_complete(asyncio.sleep(0))
        events = []
        while not self.server.messages.empty():
            events.append(self.server.messages.get_nowait())
        return events

    def unload_models(self) -> None:
        """Drop loaded models and cached node outputs, so the next prompt starts cold."""
        import comfy.model_management

        comfy.model_management.unload_all_models()
        self.executor.reset()


class ComfyServer(HeadlessServer):
    """The product's headless server (`HeadlessServer`: `client`, `log`, `wait_ready`, `stop` ...) as the tests start
    it: on CPU with one torch thread, its log named by its port (two servers may run one after another on one base
    directory). Adds raw `get`/`post` (responses as they come, for the route tests), and `complete`."""

    def __init__(self, comfy_path: Path, base_dir: Path, extra_args: tuple[str, ...] = (), env: dict | None = None):
        port = free_port()
        super().__init__(base_dir, port=port, log_path=base_dir / f"server-{port}.log", extra_args=("--cpu", *extra_args),
                         env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})},
                         comfy=comfy_path)
        self._object_info: dict | None = None

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        return requests.get(f"{self.url}{path}", timeout=kwargs.pop("timeout", 30), **kwargs)

    def post(self, path: str, **kwargs: Any) -> requests.Response:
        return requests.post(f"{self.url}{path}", timeout=kwargs.pop("timeout", 30), **kwargs)

    def object_info(self) -> dict:
        """The server's /object_info, read once."""
        if self._object_info is None:
            self._object_info = self.client.object_info()
        return self._object_info

    def complete(self, graph: dict) -> dict:
        """`graph` with every required input it leaves out set to the node's default from the server's /object_info,
        as the demo and the benchmarks queue theirs (`carnator_core.workflow_graph.complete`)."""
        return complete(graph, self.object_info())


class ServerFactory:
    """Starts servers (several, one after another, possibly on one base dir) and stops them all at teardown.

    A server that exited by itself meanwhile has the end of its log printed at teardown (a test that lost it
    sees only the client's ServerLost)."""

    def __init__(self, comfy_path: Path, new_base_dir: Callable[[], Path]):
        self.comfy_path = comfy_path
        self.new_base_dir = new_base_dir
        self.started: list[ComfyServer] = []

    def start(self, base_dir: Path | None = None, extra_args: tuple[str, ...] = (), env: dict | None = None) -> ComfyServer:
        """A server starting up (not waited for: `wait_ready` it, e.g. after starting its peers)."""
        server = ComfyServer(self.comfy_path, base_dir or self.new_base_dir(), extra_args, env)
        self.started.append(server)
        return server

    def __call__(
        self, base_dir: Path | None = None, extra_args: tuple[str, ...] = (), env: dict | None = None,
        timeout: float = 120.0,
    ) -> ComfyServer:
        """A started server, ready."""
        return self.start(base_dir, extra_args, env).wait_ready(timeout)

    def stop_all(self) -> None:
        for server in reversed(self.started):
            if not server.running and server.process.returncode not in (0, -signal.SIGTERM, -signal.SIGKILL):
                print(f"ComfyUI server {server.url} exited with code {server.process.returncode}; its log ends:\n"
                      f"{server.log()[-6000:]}")
            server.stop()
