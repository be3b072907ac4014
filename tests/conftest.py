"""Fixtures: a real ComfyUI host (in-process and headless server) with the pack and tiny models loaded.

- `comfyui_path`          the ComfyUI checkout (fails, never skips, when there is none)
- `comfy`                 session-wide InProcessComfy (ComfyUI as a library on CPU, pack loaded)
- `tiny_models`           family -> TinyModel(spec, path, name) for "wan", "hunyuan_video", "ltxv"
- `current_model`         factory: family -> TinyModel for "wan22", "hunyuan_video15", "ltxav" (newer hosts' models),
                          written on first use; skips the test where the host lacks the model's config class
- `new_base_dir`          factory: a fresh ComfyUI base directory with pack + tiny models linked in
- `comfy_server`          one headless server per test module (the product's HeadlessServer; drive it through
                          its `client`, the product's ComfyClient); a module marked `shared_server` gets the
                          worker's `shared_server` instead, its default store emptied after the module
- `comfy_server_factory`  start servers per test (e.g. two one after another on one base dir)
- `redis_server`          one loopback redis-server for the session; `redis_url` empties it for each test
- `redis_factory`         start more redis-servers (password, persistence, maxmemory) for one test
- `torch_threads_kept`    (every test) torch's thread count as the test found it
- `fresh_process_state`   Carnator's process-wide objects (`carnator_core.process_state`) dropped before and after the
                          test; call it to drop them mid-test too

At pytest start ComfyUI's args are set (CPU, torch's attention, a throwaway base dir), so a test that imports ComfyUI
modules directly gets the same host as the `comfy` fixture; prefer the fixture, which also loads the pack.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.comfy_host import (
    ComfyNotFound,
    ComfyServer,
    InProcessComfy,
    ServerFactory,
    configure_comfy_args,
    find_comfyui,
    make_base_dir,
)
from support.redis_host import RedisNotFound, RedisServer
from support.tiny_models import CURRENT_SPECS, SPECS, TinyModelSpec, host_lacks, write_tiny_model

from carnator_core import process_state
from carnator_core.client import ExecutionFailed
from carnator_core.store.reuse_store import ReuseStore

_INPROCESS_BASE = pytest.StashKey[Path]()


def _share_the_cores() -> None:
    """In an xdist worker, torch takes the worker's share of the cores, and the processes the tests start inherit it
    (OMP_NUM_THREADS): torch's default in every worker, all the cores, oversubscribes them, and its waiting threads
    spin, slowing every worker. A thread count the caller set is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def pytest_configure(config: pytest.Config) -> None:
    _share_the_cores()
    try:
        comfy_path = find_comfyui()
    except ComfyNotFound:
        return  # the comfyui_path fixture fails every test that needs ComfyUI, with the reason
    base = make_base_dir(Path(tempfile.mkdtemp(prefix="carnator-comfy-")))
    configure_comfy_args(comfy_path, base)
    config.stash[_INPROCESS_BASE] = base


def pytest_unconfigure(config: pytest.Config) -> None:
    base = config.stash.get(_INPROCESS_BASE, None)
    if base is not None:
        shutil.rmtree(base, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Modules holding a test marked `slow` run first, each module's tests still together and in order: CI's workers
    take a file at a time, so the longest files start early and the workers finish together."""
    slow = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    """A prompt that failed on a server says only which node raised what; the report adds the node's traceback."""
    report = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if isinstance(error, ExecutionFailed) and error.details.get("traceback"):
        report.sections.append(("ComfyUI traceback", "".join(error.details["traceback"])))
    return report


@dataclass(frozen=True)
class TinyModel:
    spec: TinyModelSpec
    path: Path

    @property
    def name(self) -> str:
        """The name UNETLoader takes (file name inside models/diffusion_models)."""
        return self.path.name


@pytest.fixture(scope="session")
def comfyui_path() -> Path:
    try:
        return find_comfyui()
    except ComfyNotFound as error:
        reason = str(error)
    pytest.fail(reason, pytrace=False)


@pytest.fixture(scope="session")
def comfy(comfyui_path: Path, pytestconfig: pytest.Config) -> InProcessComfy:
    return InProcessComfy(comfyui_path, pytestconfig.stash[_INPROCESS_BASE])


@pytest.fixture(scope="session")
def tiny_models(comfy: InProcessComfy) -> dict[str, TinyModel]:
    """Written once into the in-process base dir; other base dirs link to the same files."""
    directory = comfy.base_dir / "models" / "diffusion_models"
    return {family: TinyModel(spec, write_tiny_model(family, directory)) for family, spec in SPECS.items()}


@pytest.fixture(scope="session")
def current_model(comfy: InProcessComfy) -> Callable[[str], TinyModel]:
    """Only the tests of these models pay for writing them, each model once per session."""
    directory = comfy.base_dir / "models" / "diffusion_models"
    written: dict[str, TinyModel] = {}

    def model(family: str) -> TinyModel:
        spec = CURRENT_SPECS[family]
        reason = host_lacks(spec)
        if reason:
            pytest.skip(reason)
        if family not in written:
            written[family] = TinyModel(spec, write_tiny_model(family, directory))
        return written[family]

    return model


@pytest.fixture(scope="session")
def new_base_dir(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, TinyModel]) -> Callable[[], Path]:
    counter = itertools.count()
    model_files = {family: model.path for family, model in tiny_models.items()}
    return lambda: make_base_dir(tmp_path_factory.mktemp(f"comfy_base{next(counter)}"), model_files)


@pytest.fixture(scope="session")
def shared_server(comfyui_path: Path, new_base_dir: Callable[[], Path]) -> Iterator[ComfyServer]:
    """One headless server for the worker's modules marked `shared_server` (see `comfy_server`)."""
    factory = ServerFactory(comfyui_path, new_base_dir)
    try:
        yield factory()
    finally:
        factory.stop_all()


@pytest.fixture(scope="module")
def comfy_server(request: pytest.FixtureRequest, comfyui_path: Path,
                 new_base_dir: Callable[[], Path]) -> Iterator[ComfyServer]:
    """The module's headless server: one of its own, or, in a module marked `shared_server` (one that only reads from
    the server, or writes only stores of its own names and cleans up after itself), the worker's shared server, whose
    default store is emptied when the module is done."""
    if request.node.get_closest_marker("shared_server") is not None:
        server = request.getfixturevalue("shared_server")
        try:
            yield server
        finally:
            default_store = ReuseStore(str(server.base_dir / "user" / "carnator" / "store"))
            default_store.clear()
            default_store.close()
        return
    factory = ServerFactory(comfyui_path, new_base_dir)
    try:
        yield factory()
    finally:
        factory.stop_all()


@pytest.fixture
def comfy_server_factory(comfyui_path: Path, new_base_dir: Callable[[], Path]) -> Iterator[ServerFactory]:
    factory = ServerFactory(comfyui_path, new_base_dir)
    try:
        yield factory
    finally:
        factory.stop_all()


def _start_redis(directory: Path, **options) -> RedisServer:
    try:
        return RedisServer(directory, **options)
    except RedisNotFound as error:
        reason = str(error)
    pytest.fail(reason, pytrace=False)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = _start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of an empty database on the session's redis-server."""
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def redis_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., RedisServer]]:
    started: list[RedisServer] = []

    def start(**options) -> RedisServer:
        started.append(_start_redis(tmp_path_factory.mktemp("redis"), **options))
        return started[-1]

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture(autouse=True)
def torch_threads_kept() -> Iterator[None]:
    """Every test leaves torch's thread count as it found it: a benchmark's `main` sets it for its process, and what
    runs after it in the same worker (FlexAttention's compilation among them) must not depend on the order."""
    import torch

    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@pytest.fixture
def fresh_process_state() -> Iterator[Callable[[], None]]:
    """The test starts from, and leaves, a fresh process's Carnator state (the memos, once-only log notes, kernel
    guard, writer, stores... `process_state` holds); the test may call the reset it gets mid-way."""
    process_state.reset()
    try:
        yield process_state.reset
    finally:
        process_state.reset()
