"""Run reports: kept per prompt for the CarnatorReport node and sent to the frontend as `carnator.status`."""

from __future__ import annotations

import logging
import threading
from typing import Any

from comfy_execution.utils import get_executing_context

from carnator_core import process_state
from carnator_core.reuse.report import RunReport

from .fault_boundary import CarnatorFault, carnator_code
from .host import prompt_server
from .user_scope import multi_user

log = logging.getLogger("carnator")

_lock = threading.Lock()
_KEEP_PROMPTS = 64


def _reports() -> dict[str, list[dict[str, Any]]]:
    """prompt_id -> reports of its sampling runs, the latest `_KEEP_PROMPTS` prompts' (`process_state`)."""
    return process_state.one("run reports", dict)


def publish(run_report: RunReport) -> None:
    """Tag a run report with its prompt and node, keep it, log it, and send it to the frontend; a report that cannot
    be published is logged, never a failed prompt."""
    try:
        with carnator_code("publishing the run's report"):
            _publish(run_report)
    except CarnatorFault as fault:
        fault.log_once("the run's report is not shown")


def _publish(run_report: RunReport) -> None:
    context = get_executing_context()
    report = dict(run_report.as_dict(), prompt_id=context.prompt_id if context else None,
                  node=context.node_id if context else None)
    with _lock:
        reports = _reports()
        reports.setdefault(report["prompt_id"] or "", []).append(report)
        while len(reports) > _KEEP_PROMPTS:
            reports.pop(next(iter(reports)))
    log.info("Carnator: %s", run_report.headline())
    server = prompt_server()
    if server is None:
        return
    # to the client that queued the prompt, as ComfyUI sends its own progress; a prompt queued without one is
    # broadcast, except under --multi-user, where a report (its prompt and its donor's) is its user's alone
    client = getattr(server, "client_id", None)
    if client is not None or not multi_user():
        server.send_sync("carnator.status", report, client)


def reports_for(prompt_id: str | None) -> list[dict[str, Any]]:
    with _lock:
        return list(_reports().get(prompt_id or "", []))
