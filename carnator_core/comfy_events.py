"""Follow prompts through ComfyUI's websocket: per-node wall times and sampler progress.

Why: /history says what a prompt produced, not how long each node took, and the command-line tools need
both the sampler's own time (the benchmark compares configurations by the nodes that differ between them,
not by shared text encoding or file saving) and live step progress (the demo prints it). The websocket
client is aiohttp's, which ComfyUI itself depends on, run on a background thread so callers stay synchronous.
"""

from __future__ import annotations

import asyncio
import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from carnator_core.comfy_client import ComfyClient, ComfyError


@dataclass
class PromptRun:
    """One executed prompt: its /history entry, seconds per executed (not cached) node, and total seconds."""

    prompt_id: str
    history: dict
    node_seconds: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    def seconds_except(self, shared: frozenset[str] | set[str]) -> float:
        """Wall time of the executed nodes not in `shared`."""
        return sum(t for node, t in self.node_seconds.items() if node not in shared)


class PromptEvents:
    """A websocket connection carrying the events of the prompts that `client` queues (same client id)."""

    def __init__(self, client: ComfyClient) -> None:
        self.client = client
        self._events: queue.Queue[tuple[float, dict] | None] = queue.Queue()
        self._connected = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ws = None
        self._thread = threading.Thread(target=self._read, name="carnator-comfy-events", daemon=True)

    def __enter__(self) -> PromptEvents:
        self._thread.start()
        if not self._connected.wait(30) or self._error is not None:
            raise ComfyError(f"cannot open ComfyUI's websocket at {self.client.url}/ws: {self._error}")
        return self

    def __exit__(self, *exc) -> None:
        if self._loop is not None and self._ws is not None and not self._loop.is_closed():
            asyncio.run_coroutine_threadsafe(self._ws.close(), self._loop)
        self._thread.join(timeout=10)

    def _read(self) -> None:
        try:
            asyncio.run(self._listen())
        except BaseException as error:  # noqa: BLE001 (reported to the caller's thread)
            self._error = error
            self._connected.set()
        finally:
            self._events.put(None)

    async def _listen(self) -> None:
        import aiohttp

        url = self.client.url.replace("http://", "ws://", 1) + f"/ws?clientId={self.client.client_id}"
        async with aiohttp.ClientSession() as session, session.ws_connect(url, heartbeat=30) as ws:
            self._loop, self._ws = asyncio.get_running_loop(), ws
            self._connected.set()
            async for message in ws:
                if message.type == aiohttp.WSMsgType.TEXT:
                    self._events.put((time.perf_counter(), json.loads(message.data)))
                elif message.type in (aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR):
                    break

    def run(self, graph: dict, timeout: float = 3600.0,
            on_progress: Callable[[str, int, int], None] | None = None) -> PromptRun:
        """Queue `graph`, follow it to the end, and return its history and node times.

        `on_progress(node, step, total)` is called for every progress event (sampler steps). A failed
        prompt raises ComfyError with the node and the reason.
        """
        prompt_id = self.client.queue(graph)
        deadline = time.monotonic() + timeout
        started: float | None = None
        current: tuple[str, float] | None = None
        node_seconds: dict[str, float] = {}
        while True:
            try:
                item = self._events.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise ComfyError(f"prompt {prompt_id} did not finish within {timeout:.0f} s") from None
            if item is None:
                raise ComfyError(f"ComfyUI closed the websocket while prompt {prompt_id} ran")
            at, message = item
            kind, data = message.get("type"), message.get("data") or {}
            if data.get("prompt_id") != prompt_id:
                continue
            if kind == "execution_start":
                started = at
            elif kind == "executing":
                if current is not None:
                    node_seconds[current[0]] = node_seconds.get(current[0], 0.0) + at - current[1]
                current = (data["node"], at) if data.get("node") is not None else None
            elif kind == "progress" and on_progress is not None:
                on_progress(str(data.get("node")), int(data.get("value", 0)), int(data.get("max", 0)))
            elif kind in ("execution_success", "execution_error", "execution_interrupted"):
                if current is not None:
                    node_seconds[current[0]] = node_seconds.get(current[0], 0.0) + at - current[1]
                history = self.client.wait(prompt_id, timeout=max(1.0, deadline - time.monotonic()))
                return PromptRun(prompt_id, history, node_seconds, at - (started if started is not None else at))
