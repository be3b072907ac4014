"""Real `redis-server` processes for the tests: loopback only, a free port each, stopped by PID.

The binary comes from $CARNATOR_REDIS_SERVER, else PATH (Debian's `redis-server` package,
which `.ci/run` installs). Without it the tests that need Redis fail with that reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import redis

from support.comfy_host import free_port


class RedisNotFound(RuntimeError):
    pass


def find_redis_server() -> str:
    binary = os.environ.get("CARNATOR_REDIS_SERVER") or shutil.which("redis-server")
    if not binary or not os.access(binary, os.X_OK):
        raise RedisNotFound("redis-server not found: install Debian's redis-server (apt-get install redis-server) "
                            "or set CARNATOR_REDIS_SERVER to its path")
    return binary


class RedisServer:
    """One redis-server on 127.0.0.1; `persistent` makes every write durable, so a kill and restart keep the data."""

    def __init__(self, directory: Path, password: str | None = None, persistent: bool = False,
                 maxmemory: int = 0) -> None:
        self.binary = find_redis_server()
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.password = password
        self.persistent = persistent
        self.maxmemory = maxmemory
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        credentials = f":{self.password}@" if self.password else ""
        return f"redis://{credentials}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.directory),
                   "--save", "", "--daemonize", "no", "--loglevel", "warning",
                   "--logfile", str(self.directory / "redis.log"),
                   "--appendonly", "yes" if self.persistent else "no", "--appendfsync", "always"]
        if self.password:
            command += ["--requirepass", self.password]
        if self.maxmemory:
            command += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", "noeviction"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=self.password, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                return self
            except redis.BusyLoadingError:
                pass
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    log = (self.directory / "redis.log").read_text(errors="replace") if (
                        self.directory / "redis.log").exists() else ""
                    raise RuntimeError(f"redis-server did not start on port {self.port}:\n{log}") from None
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-whatever, as a crashed or unplugged one does."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_timeout=5)
