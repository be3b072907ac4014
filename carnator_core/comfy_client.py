"""A small client for ComfyUI's HTTP/websocket API, and a headless server launcher.

Used by the command-line tools (demo run, workload benchmark, queue runner). It speaks to
ComfyUI only over its public API, so carnator_core still never imports ComfyUI.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

PACK_DIR = Path(__file__).resolve().parents[1]


class ComfyError(RuntimeError):
    """The server is unreachable, refused a prompt, or a prompt failed; the message says which and why."""


def find_comfyui() -> Path:
    """$COMFYUI_PATH, else the ComfyUI tree this pack sits in (custom_nodes/), else ~/ComfyUI."""
    configured = os.environ.get("COMFYUI_PATH")
    if configured:  # an explicit setting that is wrong is an error, not a cue to look elsewhere
        path = Path(configured).expanduser()
        if (path / "main.py").is_file() and (path / "comfy").is_dir():
            return path.resolve()
        raise ComfyError(f"COMFYUI_PATH={configured} is not a ComfyUI checkout (no main.py and comfy/ there)")
    candidates = []
    if PACK_DIR.parent.name == "custom_nodes":
        candidates.append(PACK_DIR.parent.parent)
    candidates.append(Path.home() / "ComfyUI")
    for path in candidates:
        if (path / "main.py").is_file() and (path / "comfy").is_dir():
            return path.resolve()
    raise ComfyError("no ComfyUI checkout found: set COMFYUI_PATH to your ComfyUI directory "
                     f"(looked at {', '.join(str(p) for p in candidates)})")


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


class ComfyClient:
    """Queue prompts, follow them, read their history."""

    def __init__(self, url: str, timeout: float = 30.0, server_pid: int | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.client_id = uuid.uuid4().hex
        self.server_pid = server_pid  # set when this process started the server (benchmarks read its CPU time)

    def _request(self, path: str, payload: dict | None = None) -> Any:
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"Content-Type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as error:
            body = error.read().decode(errors="replace")
            raise ComfyError(f"{path}: HTTP {error.code}: {_explain(body)}") from error
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:
            raise ComfyError(f"cannot reach ComfyUI at {self.url}: {error}") from error

    def alive(self) -> bool:
        try:
            self._request("/system_stats")
            return True
        except ComfyError:
            return False

    def object_info(self) -> dict:
        return self._request("/object_info")

    def queue(self, prompt: dict) -> str:
        """Submit an API-format prompt; validation errors raise ComfyError naming the nodes."""
        answer = self._request("/prompt", {"prompt": prompt, "client_id": self.client_id})
        return answer["prompt_id"]

    def history(self, prompt_id: str) -> dict | None:
        return (self._request(f"/history/{urllib.parse.quote(prompt_id)}") or {}).get(prompt_id)

    def wait(self, prompt_id: str, timeout: float = 3600.0, poll: float = 0.2,
             on_progress: Callable[[str], None] | None = None) -> dict:
        """The prompt's history entry once it finished; ComfyError if it failed or timed out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.history(prompt_id)
            if entry is not None and entry.get("status", {}).get("completed") is not None:
                status = entry["status"]
                if status.get("status_str") != "success":
                    raise ComfyError(f"prompt {prompt_id} failed: {_status_error(status)}")
                return entry
            if on_progress is not None:
                on_progress(prompt_id)
            time.sleep(poll)
        raise ComfyError(f"prompt {prompt_id} did not finish within {timeout:.0f} s")

    def run(self, prompt: dict, timeout: float = 3600.0) -> dict:
        return self.wait(self.queue(prompt), timeout)


def _explain(body: str) -> str:
    """The readable part of ComfyUI's /prompt validation error JSON."""
    try:
        data = json.loads(body)
    except ValueError:
        return body[:500]
    parts = [data.get("error", {}).get("message", "")] if isinstance(data.get("error"), dict) else []
    for node_id, node in (data.get("node_errors") or {}).items():
        for error in node.get("errors", []):
            parts.append(f"node {node_id} ({node.get('class_type')}): {error.get('message')} {error.get('details', '')}")
    return "; ".join(p for p in parts if p) or body[:500]


def _status_error(status: dict) -> str:
    for kind, data in status.get("messages", []):
        if kind == "execution_error":
            return f"node {data.get('node_id')} ({data.get('node_type')}): {data.get('exception_message', '').strip()}"
        if kind == "execution_interrupted":
            return "interrupted"
    return status.get("status_str", "unknown error")


def carnator_reports(entry: dict) -> list[dict]:
    """Carnator reports found in a history entry (CarnatorReport nodes' UI output)."""
    reports = []
    for output in (entry.get("outputs") or {}).values():
        for blob in output.get("carnator_report", []):
            try:
                reports.extend(json.loads(blob))
            except (TypeError, ValueError):
                continue
    return reports


@contextmanager
def headless_server(base_dir: Path, port: int | None = None, log_path: Path | None = None,
                    extra_args: tuple[str, ...] = ()) -> Iterator[ComfyClient]:
    """A headless ComfyUI (CPU unless a GPU is there) with this pack, stopped by its PID on exit."""
    comfy = find_comfyui()
    for sub in ("custom_nodes", "models/diffusion_models", "input", "output", "temp", "user"):
        (base_dir / sub).mkdir(parents=True, exist_ok=True)
    link = base_dir / "custom_nodes" / "carnator"
    if not link.exists():
        link.symlink_to(PACK_DIR, target_is_directory=True)
    port = free_port(port)
    log_path = log_path or base_dir / "comfyui.log"
    command = [sys.executable, "main.py", "--listen", "127.0.0.1", "--port", str(port), "--base-directory",
               str(base_dir), "--database-url", "sqlite:///:memory:", *extra_args]
    import torch  # only here: the API client itself must start fast

    if not torch.cuda.is_available() and "--cpu" not in extra_args:
        command.append("--cpu")
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, cwd=comfy, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    client = ComfyClient(f"http://127.0.0.1:{port}", server_pid=process.pid)
    try:
        deadline = time.monotonic() + 180
        while not client.alive():
            if process.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise ComfyError(f"ComfyUI did not start (log {log_path}):\n{tail}")
            time.sleep(0.5)
        yield client
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
