"""ComfyUI's HTTP and websocket API for Carnator's tools, and a headless server to run it on.

`ComfyClient` queues prompts, follows their websocket events to the end (per-node wall times, sampler
progress, `carnator.status` reports, how the prompt ended, a lost server) and reads /history and
/object_info. It speaks only the public API, so carnator_core still never imports ComfyUI, and it uses
aiohttp, which every ComfyUI installation has. The client is synchronous: its one aiohttp session runs
on an event loop of its own, on a background thread, so it never touches its caller's event loop (a test
process may hold ComfyUI's) and keeps answering the websocket's heartbeat while the caller computes.

`HeadlessServer` (and `headless_server`, its `with` form) starts ComfyUI with this pack as a loopback subprocess
on a base directory of its own; the demo, the benchmarks and the tests start theirs with it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from carnator_core.comfyui_location import find_comfyui

PACK_DIR = Path(__file__).resolve().parents[1]
ENDS = ("execution_success", "execution_error", "execution_interrupted")


class ComfyError(RuntimeError):
    """The server is unreachable, refused a request, or a prompt failed; the message says which and why."""


class RequestRefused(ComfyError):
    """ComfyUI answered with an HTTP error, e.g. a prompt that failed validation (the message names the nodes)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class ExecutionFailed(ComfyError):
    """A prompt raised in a node or was interrupted; `details` is ComfyUI's event data (with the traceback)."""

    def __init__(self, prompt_id: str, reason: str, details: dict) -> None:
        super().__init__(f"prompt {prompt_id} failed: {reason}")
        self.prompt_id, self.reason, self.details = prompt_id, reason, details


class ServerLost(ComfyError):
    """The server closed the websocket or stopped answering: nothing more can run on it."""


def _server_seconds(data: dict) -> float | None:
    """The server's stamp on a status event (`execution_start`, `execution_success`, ...), in seconds; None without."""
    stamp = data.get("timestamp")
    return stamp / 1000 if isinstance(stamp, int | float) and not isinstance(stamp, bool) else None


def failure(kind: str, data: dict) -> str | None:
    """How an end event (or a /history status message) says a prompt failed; None for any other event."""
    if kind == "execution_error":
        return (f"node {data.get('node_id')} ({data.get('node_type')}) raised {data.get('exception_type')}: "
                f"{str(data.get('exception_message', '')).strip()}")
    if kind == "execution_interrupted":
        return f"interrupted at node {data.get('node_id')} ({data.get('node_type')})"
    return None


@dataclass
class PromptRun:
    """One prompt followed to its end: its events, seconds per executed (not cached) node, total seconds.

    Times are the events' arrival times, except that nothing counts as later than the prompt's end as the server
    stamped it. Events can arrive well after they were sent: ComfyUI collects garbage right after a prompt, holding
    the interpreter for a few hundred milliseconds, and the last node's end (the next node's `executing`) may still be
    unsent then. The server's own stamps (`timestamp`, in its milliseconds, on its status events) give its clock's
    offset from this one: the smallest arrival-minus-stamp of the prompt's stamped events.

    `history` is its /history entry where it was read (ComfyClient.run reads it).
    """

    prompt_id: str
    events: list[dict] = field(default_factory=list)
    node_seconds: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    history: dict = field(default_factory=dict)
    _started: float | None = field(default=None, repr=False)
    _current: tuple[str, float] | None = field(default=None, repr=False)
    _spans: list[tuple[str, float, float]] = field(default_factory=list, repr=False)  # (node, from, to) as received
    _offset: float | None = field(default=None, repr=False)  # arrival minus server stamp, smallest so far

    def add(self, at: float, event: dict) -> bool:
        """Take one of this prompt's events, received at perf_counter time `at`; True when it ended the prompt."""
        self.events.append(event)
        kind, data = event.get("type"), event.get("data") or {}
        stamp = _server_seconds(data)
        if stamp is not None:
            self._offset = at - stamp if self._offset is None else min(self._offset, at - stamp)
        if kind == "execution_start":
            self._started = at
        elif kind == "executing" or kind in ENDS:
            if self._current is not None:
                self._spans.append((*self._current, at))
            self._current = (data["node"], at) if kind == "executing" and data.get("node") is not None else None
        if kind in ENDS:
            end = at if stamp is None or self._offset is None else min(at, stamp + self._offset)
            for node, since, until in self._spans:
                self.node_seconds[node] = self.node_seconds.get(node, 0.0) + max(0.0, min(until, end) - since)
            self.seconds = max(0.0, end - (self._started if self._started is not None else end))
            return True
        return False

    @property
    def error(self) -> str | None:
        """How the prompt failed (node, exception, message), None when it ran to the end."""
        last = self.events[-1] if self.events else {}
        return failure(str(last.get("type")), last.get("data") or {})

    @property
    def executed(self) -> bool:
        """Whether any node ran (False when ComfyUI served the whole prompt from its cache)."""
        return bool(self.node_seconds)

    @property
    def statuses(self) -> list[dict]:
        """The `carnator.status` reports sent while it ran, one per Carnator sampling run."""
        return [event["data"] for event in self.events if event.get("type") == "carnator.status"]

    @property
    def reports(self) -> list[dict]:
        """The Carnator reports in its history entry (CarnatorReport nodes' UI output)."""
        reports = []
        for output in (self.history.get("outputs") or {}).values():
            for blob in output.get("carnator_report", []):
                try:
                    reports.extend(json.loads(blob))
                except (TypeError, ValueError):
                    continue
        return reports

    def seconds_except(self, shared: frozenset[str] | set[str]) -> float:
        """Wall time of the executed nodes not in `shared`."""
        return sum(t for node, t in self.node_seconds.items() if node not in shared)


class ComfyClient:
    """Queue prompts, follow them on the websocket, read their history; close() (or `with`) when done."""

    def __init__(self, url: str, timeout: float = 30.0, server_pid: int | None = None, user: str | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.user = user  # a --multi-user server's user every request names (ComfyUI's comfy-user header)
        self.client_id = uuid.uuid4().hex
        self.server_pid = server_pid  # set when this process started the server (benchmarks read its CPU time)
        self._events: queue.Queue[tuple[float, dict] | None] = queue.Queue()
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="carnator-comfy-client", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession = self._call(self._open_session())

    def __enter__(self) -> ComfyClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the websocket and the session and stop the client's event loop."""
        if self._loop.is_closed():
            return
        try:
            self._call(self._close_session())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()

    # ------------------------------------------------------------------ HTTP
    def alive(self) -> bool:
        try:
            self._request("/system_stats")
            return True
        except ComfyError:
            return False

    def object_info(self) -> dict:
        return self._request("/object_info")

    def comfyui_version(self) -> str:
        """The server's ComfyUI version, as its /system_stats says ("unknown" where an old server does not)."""
        return str(self._request("/system_stats").get("system", {}).get("comfyui_version", "unknown"))

    def queue(self, graph: dict, client_id: str | None = None) -> str:
        """Submit an API-format prompt; its events go to `client_id`'s websocket (default this client's).

        A prompt that fails validation raises RequestRefused naming the nodes and why.
        """
        answer = self._request("/prompt", {"prompt": graph, "client_id": client_id or self.client_id})
        return answer["prompt_id"]

    def history(self, prompt_id: str) -> dict | None:
        return (self._request(f"/history/{urllib.parse.quote(prompt_id)}") or {}).get(prompt_id)

    def wait(self, prompt_id: str, timeout: float = 3600.0, poll: float = 0.2) -> dict:
        """The prompt's history entry once it finished (polling /history); ExecutionFailed if it failed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.history(prompt_id)
            status = (entry or {}).get("status") or {}
            if status.get("completed") is not None:
                if status.get("status_str") != "success":
                    reason, details = find_failure(status.get("messages", [])) or (status.get("status_str"), {})
                    raise ExecutionFailed(prompt_id, str(reason), details)
                return entry
            time.sleep(poll)
        raise ComfyError(f"prompt {prompt_id} did not finish within {timeout:.0f} s")

    def api(self, path: str, payload: dict | None = None) -> Any:
        """A JSON route of the server (GET, or POST with `payload`), such as Carnator's /carnator/store/... routes."""
        return self._request(path, payload)

    def view(self, filename: str, subfolder: str = "", kind: str = "output") -> bytes:
        """The bytes of a file a node saved (SaveLatent, PreviewImage), as /history names it, through /view."""
        query = urllib.parse.urlencode({"filename": filename, "subfolder": subfolder, "type": kind})
        return self._call(self._fetch(f"/view?{query}", None, raw=True))

    # ------------------------------------------------------------------ websocket
    def listen(self) -> None:
        """Open the websocket (once): the events of prompts queued from now on reach `follow`."""
        if self._ws is None:
            self._ws = self._call(self._connect())

    def follow(self, prompt_id: str, timeout: float = 3600.0,
               on_progress: Callable[[str, int, int], None] | None = None) -> PromptRun:
        """Follow a prompt queued after `listen` to its end event; a failed prompt is returned, its `error` set.

        `on_progress(node, step, total)` is called for every progress event (sampler steps). A closed
        websocket raises ServerLost, running past `timeout` ComfyError.
        """
        deadline = time.monotonic() + timeout
        run = PromptRun(prompt_id)
        while True:
            try:
                item = self._events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise ComfyError(f"prompt {prompt_id} did not finish within {timeout:.0f} s") from None
            if item is None:
                self._events.put(None)  # every later follow sees it too
                raise ServerLost(f"ComfyUI closed the websocket while prompt {prompt_id} ran")
            at, event = item
            data = event.get("data")
            if not isinstance(data, dict) or data.get("prompt_id") != prompt_id:
                continue
            if event.get("type") == "progress" and on_progress is not None:
                on_progress(str(data.get("node")), int(data.get("value", 0)), int(data.get("max", 0)))
            if run.add(at, event):
                return run

    def run(self, graph: dict, timeout: float = 3600.0,
            on_progress: Callable[[str, int, int], None] | None = None) -> PromptRun:
        """Queue `graph`, follow it to the end and read its history; ExecutionFailed names the node and why."""
        self.listen()
        run = self.follow(self.queue(graph), timeout, on_progress)
        if run.error is not None:
            raise ExecutionFailed(run.prompt_id, run.error, run.events[-1].get("data") or {})
        run.history = self.wait(run.prompt_id, timeout=max(1.0, timeout - run.seconds))
        return run

    # ------------------------------------------------------------------ on the client's loop
    def _call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(self.timeout + 5)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ComfyError(f"ComfyUI at {self.url} did not answer within {self.timeout:.0f} s") from None

    def _request(self, path: str, payload: dict | None = None) -> Any:
        return self._call(self._fetch(path, payload))

    async def _open_session(self) -> aiohttp.ClientSession:
        headers = {"comfy-user": self.user} if self.user is not None else None
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout), headers=headers)

    async def _close_session(self) -> None:
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)  # a failed reader ended as a lost server
        await self._session.close()

    async def _fetch(self, path: str, payload: dict | None, raw: bool = False) -> Any:
        try:
            async with self._session.request("POST" if payload is not None else "GET", self.url + path,
                                             json=payload) as response:
                body = await response.read()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
            raise ComfyError(f"cannot reach ComfyUI at {self.url}: {error or 'timed out'}") from None
        if response.status >= 400:
            raise RequestRefused(f"{path}: HTTP {response.status}: {_explain(body.decode(errors='replace'))}",
                                 response.status)
        if raw:
            return body
        try:
            return json.loads(body or b"null")
        except ValueError:
            raise ComfyError(f"{self.url}{path} did not answer JSON; is it a ComfyUI server?") from None

    async def _connect(self) -> aiohttp.ClientWebSocketResponse:
        url = self.url.replace("http", "ws", 1) + f"/ws?clientId={self.client_id}"
        try:
            ws = await self._session.ws_connect(url, heartbeat=30)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError) as error:
            raise ComfyError(f"cannot open ComfyUI's websocket at {url}: {error or 'timed out'}") from None
        self._reader = asyncio.get_running_loop().create_task(self._read(ws))
        return ws

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Queue every JSON event with the time it arrived; binary frames (previews) are skipped."""
        try:
            async for message in ws:
                if message.type == aiohttp.WSMsgType.TEXT:
                    self._events.put((time.perf_counter(), json.loads(message.data)))
                elif message.type == aiohttp.WSMsgType.ERROR:
                    break
        finally:
            self._events.put(None)


def refusal(error: dict, node_errors: dict) -> str:
    """What a validation refusal says: the error and each node's errors, with their details."""

    def said(entry: dict) -> str:
        return ": ".join(str(part) for part in (entry.get("message"), entry.get("details")) if part)

    parts = [said(error)] + [f"node {node_id} ({node.get('class_type')}): {said(entry)}"
                             for node_id, node in node_errors.items() for entry in node.get("errors", [])]
    return "; ".join(part for part in parts if part)


def _explain(body: str) -> str:
    """The readable part of an HTTP error's body: ComfyUI's error JSON as `refusal` says it, else the text."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500]
    if not isinstance(data, dict) or not isinstance(data.get("error"), dict):
        return body[:500]
    return refusal(data["error"], data.get("node_errors") or {}) or body[:500]


def find_failure(messages: list) -> tuple[str, dict] | None:
    """(reason, event data) of the first failure among (kind, data) status messages, None when none failed."""
    for kind, data in messages:
        reason = failure(kind, data)
        if reason is not None:
            return reason, data
    return None


def free_port(preferred: int | None = None) -> int:
    """`preferred` when it is free, else any free loopback port."""
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return probe.getsockname()[1]
    raise ComfyError("no free port on 127.0.0.1")


def server_command(comfy: Path, base_dir: Path, port: int, extra_args: tuple[str, ...] = ()) -> list[str]:
    """ComfyUI's command line for a headless loopback server on `base_dir` (an in-memory database)."""
    return [sys.executable, str(comfy / "main.py"), "--listen", "127.0.0.1", "--port", str(port),
            "--base-directory", str(base_dir), "--database-url", "sqlite:///:memory:", *extra_args]


BASE_SUBDIRS = ("custom_nodes", "models/diffusion_models", "input", "output", "temp", "user")
PACK_LINK = "carnator"  # this pack's folder name under custom_nodes


def prepare_base_dir(base_dir: Path) -> Path:
    """Lay out a ComfyUI base directory (`--base-directory`): its folders, with this pack linked in as
    custom_nodes/carnator. Existing folders and links are kept, so a caller may add models or other packs first."""
    for sub in BASE_SUBDIRS:
        (base_dir / sub).mkdir(parents=True, exist_ok=True)
    link = base_dir / "custom_nodes" / PACK_LINK
    if not link.exists():
        link.symlink_to(PACK_DIR, target_is_directory=True)
    return base_dir


class HeadlessServer:
    """A headless ComfyUI subprocess with this pack on `base_dir`; `client` speaks to it.

    Construction lays out the base directory (`prepare_base_dir`) and starts the process without waiting for it;
    `wait_ready` waits until it answers. `comfy` is the ComfyUI checkout (default `find_comfyui()`); `extra_args`
    go to its command line, with --cpu added where there is no GPU. The server runs in its base directory, in a
    session of its own: `stop` (or leaving a `with` block) ends its whole process group, SIGTERM then SIGKILL. Its
    stdout and stderr go to `log_path` (default base_dir/comfyui.log), which `log` reads back. `env` adds to or
    overrides this process's environment for the server.
    """

    def __init__(self, base_dir: Path, *, port: int | None = None, log_path: Path | None = None,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 comfy: Path | None = None) -> None:
        comfy = comfy or find_comfyui()
        self.base_dir = prepare_base_dir(Path(base_dir))
        self.port = free_port(port)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path or self.base_dir / "comfyui.log"
        if "--cpu" not in extra_args and not _gpu_available():
            extra_args = (*extra_args, "--cpu")
        command = server_command(comfy, self.base_dir.resolve(), self.port, extra_args)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, cwd=self.base_dir, env={**os.environ, **(env or {})}, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self.client = ComfyClient(self.url, server_pid=self.process.pid)

    def __enter__(self) -> HeadlessServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def running(self) -> bool:
        """Whether the server process has not exited (it may still be starting)."""
        return self.process.poll() is None

    def log(self) -> str:
        """Everything the server has written to stdout and stderr so far."""
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 180.0) -> HeadlessServer:
        """Block until the server answers; if it exits or stays silent for `timeout` s, stop it and raise
        ComfyError with the end of its log."""
        deadline = time.monotonic() + timeout
        while not self.client.alive():
            if not self.running or time.monotonic() > deadline:
                what = (f"exited with code {self.process.returncode}" if not self.running
                        else f"did not answer on {self.url} within {timeout:.0f} s")
                self.stop()
                raise ComfyError(f"ComfyUI {what} (log {self.log_path}):\n{self.log()[-6000:]}")
            time.sleep(0.25)
        return self

    def stop(self, timeout: float = 20.0) -> None:
        """End the server's process group (SIGTERM, then SIGKILL after `timeout` s) and close the client."""
        if self.running:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.client.close()


def _gpu_available() -> bool:
    import torch  # only here: the API client itself must start fast

    return torch.cuda.is_available()


@contextmanager
def headless_server(base_dir: Path, port: int | None = None, log_path: Path | None = None,
                    extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Iterator[ComfyClient]:
    """A started `HeadlessServer` (see there) for the `with` block; yields its client, stops it on exit."""
    with HeadlessServer(base_dir, port=port, log_path=log_path, extra_args=extra_args, env=env) as server:
        yield server.wait_ready().client
