"""Recording: what a finished request leaves in the store for later requests.

During sampling the recorder only copies the few checkpoint states it needs to CPU fp16
(a copy per checkpoint step, nothing on other steps); from a GPU the copies go to pinned
memory without waiting for the device, so the sampler keeps queueing work, and the run
waits for them once, when it builds the entry after sampling. Writing the entry happens on
a background thread, so recording neither changes the output nor sits on the sampling
path. An aborted run is simply never submitted.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from carnator_core import process_state
from carnator_core.lookup.embeddings import EmbeddingError
from carnator_core.lookup.prompt_vectors import prompt_vectors
from carnator_core.reuse.probe import downsample_guidance
from carnator_core.store.backend import StoreUnavailable
from carnator_core.store.entry import CheckpointRecord, EntryMeta
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.tensor_codec import encode_tensors
from carnator_core.store.tensor_names import (
    END_TENSOR,
    GUIDE_TENSOR,
    HISTORY_BLOB,
    INPUT_TENSOR,
    guidance_tensor,
    history_tensor,
    prediction_tensor,
    state_tensor,
)
from carnator_core.store.thumbnail import PreviewFrame

log = logging.getLogger("carnator.recorder")


@dataclass
class Checkpoint:
    step: int
    sigma: float
    x: torch.Tensor | None  # None at step 0: the state is the initial noise, identified by `start` instead
    x0: torch.Tensor
    guidance: torch.Tensor | None
    evaluated: bool = True  # False: x0 is a step cache's extrapolation (EasyCache skipped the step), not the model's
    start: str | None = None  # step 0: fingerprint of the state, matched against a later request's first state
    input: torch.Tensor | None = None  # step 0 of a run from an input: that input (`carnator_core.reuse.input_start`)
    guide: torch.Tensor | None = None  # step 0 of a run guided by an image in its conditioning: that image


@dataclass
class RunRecorder:
    """Collects checkpoints of one sampling run."""

    checkpoint_steps: set[int]
    checkpoints: dict[int, Checkpoint] = field(default_factory=dict)
    # (sigma, output) of a stage that ends with leftover noise: what a later request that skips the stage returns
    end: tuple[float, torch.Tensor] | None = None
    # the sampler's predictions of the steps before `history_until` (0: none kept), by step
    history_until: int = 0
    history: dict[int, torch.Tensor] = field(default_factory=dict)
    # the GPUs whose copies to pinned memory may still be in flight (`_stored`): `blobs` waits for them
    copying_from: set[torch.device] = field(default_factory=set)

    def wants(self, step: int) -> bool:
        return step in self.checkpoint_steps and step not in self.checkpoints

    def wants_prediction(self, step: int) -> bool:
        return step < self.history_until and step not in self.history

    def _stored(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """A CPU fp16 copy (the live tensors keep changing), as every recorded tensor is kept. From a GPU it lands in
        pinned memory without waiting for the device; `blobs` waits before reading it."""
        if tensor is None:
            return None
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor.to("cpu", torch.float16, copy=True)
        host = torch.empty(tensor.shape, dtype=torch.float16, pin_memory=True)
        host.copy_(tensor.to(torch.float16), non_blocking=True)
        self.copying_from.add(tensor.device)
        return host

    def capture_prediction(self, step: int, x0: torch.Tensor) -> None:
        self.history[step] = self._stored(x0)

    def capture(self, step: int, sigma: float, x: torch.Tensor, x0: torch.Tensor,
                guidance: torch.Tensor | None, evaluated: bool = True) -> None:
        """Keep a CPU fp16 copy of a checkpoint state (the live tensors keep changing)."""
        self.checkpoints[step] = Checkpoint(
            step=step, sigma=float(sigma), x=self._stored(x), x0=self._stored(x0),
            guidance=self._stored(_pooled_guidance(guidance)),
            evaluated=evaluated)

    def capture_start(self, sigma: float, start: str, x0: torch.Tensor, guidance: torch.Tensor | None,
                      from_input: tuple[torch.Tensor, torch.Tensor] | None = None,
                      guide: torch.Tensor | None = None) -> None:
        """Step 0: never resumed from, only compared at (`Decider._screen`). A run from pure noise is compared by
        requests that start from the same state, so the prediction is kept and the state only as its fingerprint (a
        latent's worth of bytes saved). A run from an input (`from_input`: its first state and the input) is compared
        by requests whose input is close to it, not equal: both are kept. So is the image a guided run's
        conditioning carried (`guide`)."""
        state, latent = from_input if from_input is not None else (None, None)
        self.checkpoints[0] = Checkpoint(step=0, sigma=float(sigma), x=self._stored(state), start=start,
                                         x0=self._stored(x0), guidance=self._stored(_pooled_guidance(guidance)),
                                         input=self._stored(latent), guide=self._stored(guide))

    def capture_end(self, sigma: float, output: torch.Tensor) -> None:
        """Keep the stage's output (what its sampler returned, leftover noise included) as a CPU fp16 copy."""
        self.end = (float(sigma), self._stored(output))

    def blobs(self) -> tuple[list[CheckpointRecord], dict[str, bytes]]:
        """Checkpoint metadata list and the safetensors blobs holding the tensors: `checkpoints`, step 0's record
        apart in `start` (what the step-0 screen reads of a donor), and the sampler's predictions in `history`."""
        for device in self.copying_from:  # whatever stream each copy was queued on (once per run, after sampling)
            torch.cuda.synchronize(device)
        self.copying_from.clear()
        tensors: dict[str, torch.Tensor] = {}
        start: dict[str, torch.Tensor] = {}
        listing = []
        for step in sorted(self.checkpoints):
            checkpoint = self.checkpoints[step]
            kept = start if step == 0 else tensors
            if checkpoint.x is not None:
                kept[state_tensor(step)] = checkpoint.x
            kept[prediction_tensor(step)] = checkpoint.x0
            if checkpoint.input is not None:
                kept[INPUT_TENSOR] = checkpoint.input
            if checkpoint.guide is not None:
                kept[GUIDE_TENSOR] = checkpoint.guide
            if checkpoint.guidance is not None:
                kept[guidance_tensor(step)] = checkpoint.guidance
            listing.append(CheckpointRecord(step=step, sigma=checkpoint.sigma, guidance=checkpoint.guidance is not None,
                                            evaluated=checkpoint.evaluated, start=checkpoint.start if step == 0 else None))
        if self.end is not None:
            tensors[END_TENSOR] = self.end[1]
        history = {history_tensor(step): prediction for step, prediction in self.history.items()}
        blobs = {name: encode_tensors(kept) for name, kept in
                 (("checkpoints", tensors), ("start", start), (HISTORY_BLOB, history)) if kept}
        return listing, blobs


def _pooled_guidance(guidance: torch.Tensor | None) -> torch.Tensor | None:
    return None if guidance is None else downsample_guidance(guidance.detach())


@dataclass
class PendingEntry:
    """An entry waiting to be written; `store=None` marks a flush point."""

    store: ReuseStore | None
    meta: EntryMeta | None
    blobs: dict[str, bytes]
    cond_vector: torch.Tensor | None
    on_written: Callable[[EntryMeta | None], None] | None = None
    text_vector: torch.Tensor | None = None  # the prompt's text vector when the lookup computed it; else embedded here
    thumbnail: PreviewFrame | None = None  # the entry's preview, encoded here: PNG compression is no sampler's work


class EntryWriter:
    """One daemon thread per process that writes entries in order, embedding prompts the lookup did not and encoding
    their previews."""

    def __init__(self) -> None:
        self._queue: queue.Queue[PendingEntry | None] = queue.Queue()  # None: the thread's last item (`close`)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="carnator-recorder", daemon=True)
                self._thread.start()

    def submit(self, pending: PendingEntry) -> None:
        self._ensure_thread()
        self._queue.put(pending)

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every entry submitted so far is written (lookups, tests, benchmarks); False where `timeout`
        passed first."""
        done = threading.Event()
        self.submit(PendingEntry(store=None, meta=None, blobs={}, cond_vector=None, on_written=lambda _: done.set()))
        return done.wait(timeout)

    def close(self, timeout: float = 60.0) -> None:
        """Write every entry submitted so far, then end the thread (`process_state.reset`, which drops the writer
        first, so nothing is submitted after)."""
        with self._lock:
            thread = self._thread
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            pending = self._queue.get()
            if pending is None:
                return
            try:
                if pending.store is None:
                    pending.on_written(None)
                    continue
                self._write(pending)
            except StoreUnavailable:
                pass  # dropped whole; the store logs each outage once
            except Exception:  # a failed write must never take the server down; the entry is dropped whole
                log.exception("Carnator: could not record entry %s", getattr(pending.meta, "entry_id", "?"))

    @staticmethod
    def _write(pending: PendingEntry) -> None:
        text = pending.text_vector
        if text is None and pending.meta.prompt.strip():
            try:
                text = prompt_vectors().vector(pending.meta.prompt)
            except EmbeddingError:
                pass  # recorded for conditioning matches alone; the embedder has said once why
        if pending.thumbnail is not None:
            try:
                pending.blobs["thumb"] = pending.thumbnail.png()
            except Exception:  # a preview that cannot be drawn costs the entry its thumbnail, nothing more
                log.exception("Carnator: no preview for entry %s", pending.meta.entry_id)
        pending.store.put(pending.meta, pending.blobs, IndexVectors(text=text, cond=pending.cond_vector))
        if pending.on_written is not None:
            pending.on_written(pending.meta)


def entry_writer() -> EntryWriter:
    """The process's one entry writer (`process_state`)."""
    return process_state.one("entry writer", EntryWriter)


LOOKUP_WAIT_S = 10.0  # the longest a lookup waits for this process's earlier entries (a store that writes slowly)


def await_earlier_entries() -> None:
    """Let a lookup see every run this process finished before it: a final queued right behind its draft finds the
    draft, written or not when the final starts. Bounded by `LOOKUP_WAIT_S`, after which the lookup goes on."""
    entry_writer().flush(LOOKUP_WAIT_S)
