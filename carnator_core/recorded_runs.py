"""Benchmark results as data: the JSON behind every published table, with the conditions its run had.

A published figure is only as good as the run it came from, so each stored result names its command, the code
(commit), the host, frontend and torch versions, the machine, and how much CPU other processes took while it ran:
that last decides whether its times may be published at all (`RunConditions.alone`). The tables are generated from
these files (`python -m carnator_core.bench report`).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shlex
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO_DIR = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_DIR / "docs" / "results"
# Other processes' CPU time over the run's wall time (cores they kept busy on average) above which the run shared the
# machine: its times then measure the neighbours as much as the code, and are not published.
OTHERS_CPU_LIMIT = 0.05
RECORD_NAME = re.compile(r"[a-z0-9][a-z0-9-]*")
NO_COMFYUI = "none"  # the ComfyUI version of a benchmark that runs no ComfyUI (attention, store, lookup)


@dataclass(frozen=True)
class CpuUse:
    """CPU seconds busy on the whole machine (/proc/stat) and in this process and its reaped children, at a moment."""

    machine_seconds: float | None  # None where the system does not say (no /proc/stat)
    own_seconds: float
    wall: float
    load: tuple[float, float, float]

    @classmethod
    def now(cls) -> CpuUse:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        except OSError:
            busy = None
        else:  # user nice system idle iowait irq softirq steal (guest is counted in user)
            busy = (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")
        own = os.times()
        return cls(machine_seconds=busy,
                   own_seconds=own.user + own.system + own.children_user + own.children_system,
                   wall=time.monotonic(), load=os.getloadavg())


@dataclass(frozen=True)
class RunConditions:
    """What a stored result ran on and beside: enough to rerun it and to know whether its times are its own."""

    command: str
    commit: str
    uncommitted_changes: bool
    comfyui_version: str
    frontend_version: str | None
    torch_version: str
    cores: int
    torch_threads: int  # the benchmark server's; 0: torch's default, every core
    gpu: str | None
    load_before: tuple[float, float, float]
    load_after: tuple[float, float, float]
    wall_seconds: float
    others_cpu_cores: float | None  # other processes' CPU seconds over the run's wall seconds; None: unknown
    alone: bool  # whether others stayed under OTHERS_CPU_LIMIT: only then are the run's times published
    timed: bool = True  # False: the benchmark measures no time (calls and quality only), so sharing moves nothing

    @classmethod
    def measured(cls, command: str, comfyui: str, torch_threads: int, before: CpuUse, after: CpuUse, *,
                 timed: bool = True) -> RunConditions:
        """The conditions of a run on ComfyUI version `comfyui` (NO_COMFYUI where it ran none) that started at
        `before` and ended at `after`, its server stopped and reaped (so the server's CPU time counts as this
        process's own, not as another's)."""
        import torch

        wall = max(after.wall - before.wall, 1e-9)
        others = None if before.machine_seconds is None or after.machine_seconds is None else \
            max(0.0, after.machine_seconds - before.machine_seconds - (after.own_seconds - before.own_seconds)) / wall
        return cls(command=command, commit=_git("rev-parse", "HEAD") or "unknown",
                   # the stored results themselves are not the code that produced them
                   uncommitted_changes=bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                                 f":(exclude){RESULTS_DIR.relative_to(REPO_DIR).as_posix()}")),
                   comfyui_version=comfyui,
                   frontend_version=None if comfyui == NO_COMFYUI else _installed("comfyui-frontend-package"),
                   torch_version=torch.__version__, cores=len(os.sched_getaffinity(0)), torch_threads=torch_threads,
                   gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                   load_before=tuple(round(x, 2) for x in before.load),
                   load_after=tuple(round(x, 2) for x in after.load), wall_seconds=round(wall, 1),
                   others_cpu_cores=None if others is None else round(others, 3),
                   alone=others is not None and others <= OTHERS_CPU_LIMIT, timed=timed)

    @property
    def beside(self) -> str:
        """What else used the machine's CPU during the run, in words."""
        if self.others_cpu_cores is None:
            return "this system does not say what else used the CPU during the run"
        return f"other processes used {self.others_cpu_cores:.2f} of the {self.cores} cores during the run"

    @property
    def why_no_time(self) -> str | None:
        """Why this run's times are not published, None when they are."""
        return None if self.alone else f"not shown: {self.beside}"


def command_line(command: str, argv: list[str]) -> str:
    """The command (`carnator_core.bench workload`, `carnator_core.calibrate`) as a user types it from the repository
    root."""
    return shlex.join(["python", "-m", *command.split(), *argv])


def comfyui_version(comfy: Path) -> str:
    match = re.search(r"[0-9][0-9.]*", _read(comfy / "comfyui_version.py"))
    return match.group(0) if match else "unknown"


def record_name(name: str) -> str:
    """`--record NAME`, checked before the run rather than after it: lowercase letters, digits and dashes."""
    if not RECORD_NAME.fullmatch(name):
        raise argparse.ArgumentTypeError(f"{name!r}: lowercase letters, digits and dashes")
    return name


def add_record_option(parser: argparse.ArgumentParser, stored: str = "the run's JSON") -> None:
    """`--record NAME`, the one way every benchmark stores what a published table is generated from."""
    parser.add_argument("--record", metavar="NAME", type=record_name,
                        help=f"also store {stored}, with the conditions it ran under, as docs/results/NAME.json: the "
                             "source of the published table NAME (`python -m carnator_core.bench report`)")


class Recording:
    """A run that may be stored (`--record NAME`): its conditions are measured from the moment it is made to the
    moment it is stored, so make it just before the work and store it just after."""

    def __init__(self, name: str | None, command: str, argv: list[str]) -> None:
        self.name, self.command, self.argv = name, command, argv
        self.before = CpuUse.now()

    def store(self, payload: dict[str, Any], *, comfyui: str = NO_COMFYUI, torch_threads: int = 0,
              timed: bool = True) -> Path | None:
        """Write docs/results/NAME.json (None where the run was not asked to be recorded). `timed=False` for a
        benchmark that publishes no time: its conditions then say so rather than whether it ran alone."""
        if self.name is None:
            return None
        conditions = RunConditions.measured(command_line(self.command, self.argv), comfyui, torch_threads,
                                            self.before, CpuUse.now(), timed=timed)
        return write_result(self.name, conditions, payload)


def write_result(name: str, conditions: RunConditions, payload: dict[str, Any]) -> Path:
    """Store `payload` (a benchmark's JSON) as the source of table `name`: docs/results/NAME.json."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    partial = path.with_suffix(".json.partial")  # replaced whole: an interrupted run never leaves half a result
    partial.write_text(json.dumps({"run": asdict(conditions), **payload}, indent=1) + "\n")
    partial.replace(path)
    return path


def read_result(name: str, results_dir: Path = RESULTS_DIR) -> tuple[RunConditions, dict[str, Any]]:
    """A stored result: its run's conditions and the benchmark's JSON."""
    payload = json.loads((results_dir / f"{name}.json").read_text())
    run = payload.pop("run")
    conditions = RunConditions(**{**run, "load_before": tuple(run["load_before"]),
                                  "load_after": tuple(run["load_after"])})
    return conditions, payload


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=REPO_DIR, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _installed(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
