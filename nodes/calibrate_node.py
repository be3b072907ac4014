"""The graph editor's calibration: a node that calibrates the graph it is in, beside the queue."""

from __future__ import annotations

import re
import time
from pathlib import Path

import folder_paths
from comfy.cli_args import args as comfy_args
from comfy_api.latest import io

from carnator_core import process_state
from carnator_core.calibration.background import BackgroundCalibration, CalibrationBusy
from carnator_core.calibration.job import CalibrationPlan
from carnator_core.calibration.workflow import CalibrationWorkflow
from carnator_core.client import ComfyClient, ComfyError
from carnator_core.judging.quality_target import QualityTarget
from carnator_core.prompt_file import PromptFileError, prompt_lines
from carnator_core.prompt_pairs import parse_pairs
from carnator_core.queue import Workflow, WorkflowError

from .host import prompt_server

EVENT = "carnator.calibration"  # the websocket event the store panel follows
OUTPUT_FOLDER = ("carnator", "calibration")  # under ComfyUI's output directory


def _publish(state: dict) -> None:
    server = prompt_server()
    if server is not None:
        server.send_sync(EVENT, state)


def calibration() -> BackgroundCalibration:
    """The server's one background calibration, which the node starts and the routes show and stop
    (`process_state`)."""
    return process_state.one("background calibration", lambda: BackgroundCalibration(notify=_publish))


def own_url() -> str:
    """This server's URL as seen from itself (a server listening on every address answers on loopback)."""
    server = prompt_server()
    address, port = getattr(server, "address", None), getattr(server, "port", None)
    if port is None:
        raise ValueError("Carnator Calibrate runs only inside a ComfyUI server (it queues the calibration's runs)")
    if comfy_args.tls_keyfile:
        raise ValueError("Carnator Calibrate cannot queue to a server that speaks TLS; run `python -m "
                         "carnator_core.calibrate --server URL` beside it instead")
    address = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(address or "", address)
    return f"http://[{address}]:{port}" if ":" in address else f"http://{address}:{port}"


def _folder_name(name: str, digest: str) -> str:
    return f"{re.sub(r'[^A-Za-z0-9._-]+', '-', name).strip('-.')[:60] or 'calibration'}-{digest[:8]}"


class CarnatorCalibrate(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        target = QualityTarget()
        return io.Schema(
            node_id="CarnatorCalibrate",
            display_name="Carnator Calibrate",
            category="Carnator/calibration",
            description="Calibrates Carnator's reuse thresholds on this graph's own model and sampler settings. Add "
                        "it to a graph with one sampler (or stages one after another: the first is calibrated) and "
                        "queue once: the graph runs as usual, and the calibration's runs (per pair: both prompts "
                        "plain, then the new one resumed at five depths) queue behind it. Progress shows on the node "
                        "and in the Carnator panel, which can stop it; queueing again "
                        "resumes. When done, the fitted profile is filed in the store the reuse node reads; where its "
                        "held-back pairs support it, it is put in force and that node's thresholds left at their "
                        "defaults (auto) judge by it. The node says in one line whether it is in force, why, and "
                        "about how many pairs would settle it, and per mode whether reuse beats just lowering the "
                        "steps on this model, with its 90 % interval: weighed on your stream of prompts (prompts) as "
                        "the engine runs it, else on the pairs.",
            is_output_node=True,
            not_idempotent=True,
            inputs=[
                io.String.Input("pairs", multiline=True, default="",
                                tooltip="One pair per line: an earlier prompt and the new prompt that follows it, "
                                        "separated by => (e.g. 'a red fox in snow => a red fox in fresh snow'). Use "
                                        "the edits you make: rewordings, changed details. Empty: pairs from the "
                                        "store's own history (successive prompts of one model and seed)."),
                io.Int.Input("max_pairs", default=CalibrationPlan.max_pairs, min=1, max=200,
                             tooltip="Most pairs calibrated on. Each costs about four and a half plain runs, and up to about "
                                     "three more with fewer_steps on."),
                io.Float.Input("psnr_db", default=target.psnr_db, min=10.0, max=80.0, step=0.5,
                               tooltip="A resume counts as good when its clip is at least this close (PSNR, dB) "
                                       "to the clip the new prompt gets without reuse, same seed."),
                io.Float.Input("ssim", default=target.ssim, min=0.0, max=1.0, step=0.01,
                               tooltip="...and at least this similar to it (SSIM)."),
                io.Float.Input("precision", default=target.precision, min=0.5, max=1.0, step=0.01,
                               tooltip="Share of the resumes the fitted thresholds accept that must be good; "
                                       "the fit then accepts as many good resumes as it can."),
                io.String.Input("name", default="",
                                tooltip="The profile's name in the store panel and in reports. Empty: the model "
                                        "file's name."),
                io.String.Input("text_node", default="",
                                tooltip="Id of the node holding the prompt text, where the graph has several. "
                                        "Empty: found from the sampler's positive conditioning."),
                io.Boolean.Input("fewer_steps", default=True, optional=True,
                                 tooltip="Also sample plain at fewer steps (bisected, at most four counts) and both modes "
                                         "at the knee, and say per mode whether reuse beats just lowering the steps "
                                         "on this model, and what to run. Off: up to about three plain runs less per "
                                         "pair, no stream, and no such verdict."),
                io.String.Input("prompts", multiline=True, default="", optional=True,
                                tooltip="Your own stream, one prompt per line in the order you queue them, to weigh "
                                        "reuse on: each sampled plain, then in balanced and in fast as the engine "
                                        "runs them, then plain at bisected step counts (at most five plain runs per "
                                        "prompt), then both modes again at the knee (the fewest plain steps as good "
                                        "as full plain). The verdict per mode reads 'saves 1.30x (1.10-1.50x)', "
                                        "'lower the steps instead' or 'not settled', with its 90 % interval, and "
                                        "the last line the steps and mode to run. With pairs empty, "
                                        "the stream alone: no thresholds are fitted. Empty: the pairs (each weighed "
                                        "as a two-prompt stream) or the store's history give the verdict."),
            ],
            hidden=[io.Hidden.prompt],
            outputs=[io.String.Output(display_name="status")],
        )

    @classmethod
    def validate_inputs(cls, pairs: str, **_) -> bool | str:
        try:
            parse_pairs(prompt_lines(pairs), "pairs")
        except PromptFileError as error:
            return str(error)
        return True

    @classmethod
    def execute(cls, pairs: str, max_pairs: int, psnr_db: float, ssim: float, precision: float, name: str,
                text_node: str, fewer_steps: bool = True, prompts: str = "") -> io.NodeOutput:
        graph = getattr(cls.hidden, "prompt", None)
        if not isinstance(graph, dict):
            raise ValueError("Carnator Calibrate: no graph to calibrate (queue it from the graph editor or /prompt)")
        try:
            stream = prompt_lines(prompts) or None
            given = parse_pairs(prompt_lines(pairs), "pairs") if pairs.strip() else [] if stream else None
            url = own_url()
            with ComfyClient(url) as client:
                workflow = CalibrationWorkflow.prepare(Workflow(graph, text_node.strip() or None),
                                                       client.object_info())
        except (PromptFileError, WorkflowError, ComfyError) as error:
            raise ValueError(f"Carnator Calibrate: {error}") from None
        name = name.strip() or workflow.model_name() or "calibration"
        out = Path(folder_paths.get_output_directory(), *OUTPUT_FOLDER, _folder_name(name, workflow.digest()))
        plan = CalibrationPlan(workflow=workflow, pairs=given, out=out, name=name, max_pairs=max_pairs,
                               target=QualityTarget(psnr_db=psnr_db, ssim=ssim, precision=precision),
                               fewer_steps=fewer_steps, prompts=stream)
        try:
            calibration().start(url, plan)
        except CalibrationBusy as error:
            return cls._said(f"Not started: {error}")
        count = min(len(given), max_pairs) if given is not None else 0
        source = f"{count} pair{'s' * (count != 1)}" if given else "pairs from the store's history"
        if stream:
            source = f"a stream of {len(stream)} prompts" + (f" and {source}" if given else "")
        return cls._said(f"Calibrating {name!r} on {source} ({time.strftime('%H:%M')}): the runs queue behind this "
                         f"prompt; progress and a Stop button in the Carnator panel. Results in {out}.")

    @staticmethod
    def _said(text: str) -> io.NodeOutput:
        return io.NodeOutput(text, ui={"text": [text]})
