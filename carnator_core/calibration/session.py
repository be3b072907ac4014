"""One calibration through ComfyUI's queue: per pair the plain runs and forced resumes, measured, then the fit.

For each pair (earlier prompt, new prompt, the workflow's seed), in a store of the pair's own:

1. the earlier prompt, sampled plain and recorded: the donor;
2. the new prompt, sampled plain: the clip a resume is measured against;
3. the new prompt resumed from the donor at each depth, forced (`verification` "forced N%"): the report gives the
   signals the engine judged (the step-0 screen and the probe at the resume state), the clip its quality;
Then, once the fit is done (`calibration.job`), for every pair: the new prompt sampled plain at fewer steps
(`plain_at`, same seed, sampler and scheduler, at the counts the plain-steps curve bisects to) and in each weighed mode
at the knee of that curve (`modes_at`, through the engine, from the pair's donor), each clip scored against the full
plain one as the resumes are: what lowering the steps buys, and what reuse buys there.

Every finished resume is appended to `DIR/resumes.jsonl`, every plain run's calls and quality (the full one's and
the fewer-steps ones') to `DIR/plain_runs.jsonl`, every mode run at the knee to `DIR/knee_runs.jsonl`, and every
plain clip kept under `DIR/pairs/`, so a
calibration stopped by anything (the server going down, Ctrl-C) resumes where it stopped when run again with the
same arguments. A pair whose prompt fails to sample (a node error, an interruption) is skipped and listed in
`DIR/skipped.json`; the next run of the command tries it again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from carnator_core.calibration.clip import Clip, detail, quality
from carnator_core.calibration.fit import Resume
from carnator_core.calibration.saved_state import read_state, write_state
from carnator_core.calibration.server_runs import (
    STORE_ROOT,
    CalibrationInterrupted,
    Progress,
    ServerRuns,
    model_calls,
    store_location,
)
from carnator_core.calibration.workflow import CalibrationWorkflow
from carnator_core.client import ComfyClient, ComfyError, ExecutionFailed, PromptRun, RequestRefused
from carnator_core.judging.calibration_profile import WEIGHED_MODES
from carnator_core.judging.quality import PSNR_IDENTICAL, mse_from_psnr
from carnator_core.judging.yardstick import RequestOutcome
from carnator_core.prompt_pairs import Pair
from carnator_core.reuse.decision import ProbeRecord


@dataclass
class Measured:
    """One forced resume as `resumes.jsonl` keeps it: the fit's `Resume` and what else the report said."""

    resume: Resume
    requested_depth: float  # the forced depth asked for (`resume.depth` is the checkpoint's, nearest below it)
    earlier: str
    new: str
    skipped_steps: int
    total_steps: int
    seconds: float
    # a packed latent's probe: each part's structure agreement (video, then audio), of which `resume.structure` is
    # the lowest; None for one latent
    part_structures: list[float] | None = None
    model_calls: int | None = None  # the run's, every stage's reuse node's together (None: rows that lack them)
    detail: float = 1.0  # the detail its clip keeps against plain (`clip.detail`; rows that lack it: 1)
    adherence: float | None = None  # the oracle's adherence score of its clip (None: no oracle, or rows that lack it)

    def as_dict(self) -> dict:
        return {**asdict(self.resume), "requested_depth": self.requested_depth, "earlier": self.earlier,
                "new": self.new, "skipped_steps": self.skipped_steps, "detail": self.detail,
                "adherence": self.adherence,
                "total_steps": self.total_steps, "seconds": self.seconds, "model_calls": self.model_calls,
                **({"part_structures": self.part_structures} if self.part_structures is not None else {})}

    @classmethod
    def from_dict(cls, data: dict) -> Measured:
        names = Resume.__dataclass_fields__
        return cls(resume=Resume(**{name: data[name] for name in names if name in data}),
                   requested_depth=float(data["requested_depth"]), earlier=data["earlier"],
                   new=data["new"], skipped_steps=int(data["skipped_steps"]), total_steps=int(data["total_steps"]),
                   seconds=float(data["seconds"]), part_structures=data.get("part_structures"),
                   model_calls=data.get("model_calls"), detail=float(data.get("detail", 1.0)),
                   adherence=data.get("adherence"))


@dataclass(frozen=True)
class PlainRun:
    """A plain run of a pair's new prompt as `plain_runs.jsonl` keeps it: at the graph's steps (the reference, its
    quality that of an identical clip) or at fewer, its model calls and its clip against the full plain one."""

    pair: int
    earlier: str
    new: str
    steps: int
    model_calls: int
    psnr_db: float
    ssim: float
    detail: float = 1.0  # the detail its clip keeps against the full plain one (rows that lack it: 1)
    adherence: float | None = None  # the oracle's adherence score of its clip (None: no oracle, or rows that lack it)


@dataclass(frozen=True)
class KneeRun:
    """A pair's new prompt in a weighed mode at the knee's steps, through the engine from the pair's donor, as
    `knee_runs.jsonl` keeps it: its calls and its clip against the full plain one."""

    pair: int
    earlier: str
    new: str
    mode: str
    steps: int
    model_calls: int
    skipped_steps: int
    psnr_db: float
    ssim: float
    detail: float
    adherence: float | None

    def outcome(self) -> RequestOutcome:
        return RequestOutcome(model_calls=self.model_calls, mse=mse_from_psnr(self.psnr_db), detail=self.detail,
                              adherence=self.adherence)


@dataclass
class Session:
    """A calibration's state on disk (`out`) and on the server (`client`); `run()` does what is left."""

    client: ComfyClient
    workflow: CalibrationWorkflow
    pairs: list[Pair]
    depths: list[float]
    out: Path
    echo: Callable[[str], None] = print
    on_progress: Callable[[Progress], None] | None = None  # called after every run
    should_stop: Callable[[], bool] = lambda: False  # asked before every run: True stops the calibration there
    measured: list[Measured] = field(default_factory=list)
    plain_runs: list[PlainRun] = field(default_factory=list)
    knee_runs: list[KneeRun] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    # the model and schedule fingerprints and the guidance scale the runs were made with
    fingerprints: dict[str, str | float] = field(default_factory=dict)
    runs: ServerRuns = field(init=False)

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self.runs = ServerRuns(self.client, self.workflow, self.key, self.echo, self.on_progress, self.should_stop)
        rows = self.out / "resumes.jsonl"
        if rows.exists():
            self.measured = [Measured.from_dict(json.loads(line)) for line in rows.read_text().splitlines() if line]
        plain_rows = self.out / "plain_runs.jsonl"
        if plain_rows.exists():
            self.plain_runs = [PlainRun(**json.loads(line)) for line in plain_rows.read_text().splitlines() if line]
        knee_rows = self.out / "knee_runs.jsonl"
        if knee_rows.exists():
            self.knee_runs = [KneeRun(**json.loads(line)) for line in knee_rows.read_text().splitlines() if line]
        state = read_state(self.out, self.workflow.digest(), bool(self.measured))
        # a pair skipped before is tried again: what failed it (a node error, an interruption) may be gone
        self.fingerprints = state.get("fingerprints", {})

    @property
    def key(self) -> str:
        """Names this calibration's stores on the server: the same output directory finds them again, also when
        the calibration is resumed with more pairs (each pair's store is named by its prompts too)."""
        return hashlib.sha256(str(self.out.resolve()).encode()).hexdigest()[:12]

    def _store(self, index: int, pair: Pair) -> str:
        prompts = hashlib.sha256(json.dumps(asdict(pair)).encode()).hexdigest()[:8]
        return f"{STORE_ROOT}/{self.key}/pair-{index:03d}-{prompts}"

    def _of_these_pairs(self, measured: Measured | PlainRun | KneeRun) -> bool:
        index = measured.resume.pair if isinstance(measured, Measured) else measured.pair
        return index < len(self.pairs) and (measured.earlier, measured.new) == (self.pairs[index].earlier,
                                                                                self.pairs[index].new)

    def _save_state(self) -> None:
        write_state(self.out, {"workflow": self.workflow.digest(), "fingerprints": self.fingerprints,
                               "skipped": self.skipped})
        (self.out / "skipped.json").write_text(json.dumps(self.skipped, indent=2))

    def _done(self, index: int, depth: float) -> bool:
        return any(m.resume.pair == index and abs(m.requested_depth - depth) < 1e-9 and self._of_these_pairs(m)
                   for m in self.measured)

    def _plain_done(self, index: int, steps: int) -> bool:
        return any(r.pair == index and r.steps == steps and self._of_these_pairs(r) for r in self.plain_runs)

    def _knee_done(self, index: int, mode: str, steps: int) -> bool:
        return any(r.pair == index and r.mode == mode and r.steps == steps and self._of_these_pairs(r)
                   for r in self.knee_runs)

    def _left(self, index: int) -> int:
        """The runs left of pair `index`: its resumes not done, and (a pair with anything left whose plain clip is
        not kept) the donor and the plain run."""
        left = sum(not self._done(index, d) for d in self.depths)
        return left + 2 * (left > 0 and not self._plain_path(index).exists())

    def run(self) -> list[Measured]:
        """Every pair not yet done, then every measured resume of these pairs (those of an earlier run with more or
        fewer pairs in the same directory are kept on disk, not fitted); CalibrationInterrupted when the server goes
        away. `these_plain_runs` gives the plain runs of these pairs."""
        self.runs.total = sum(self._left(i) for i in range(len(self.pairs)))
        self.runs.done = 0
        try:
            for index, pair in enumerate(self.pairs):
                if not self._left(index):
                    continue
                self._pair(index, pair)
        except ComfyError as error:  # the server went away (ServerLost, unreachable); a prompt's failure is per pair
            if isinstance(error, (ExecutionFailed, RequestRefused)):
                raise
            self._save_state()
            raise CalibrationInterrupted(str(error)) from None
        except CalibrationInterrupted:  # `should_stop`
            self._save_state()
            raise
        self._save_state()
        return [m for m in self.measured if self._of_these_pairs(m)]

    def these_plain_runs(self) -> list[PlainRun]:
        """The plain runs of these pairs, the latest of each pair and step count."""
        latest = {(r.pair, r.steps): r for r in self.plain_runs if self._of_these_pairs(r)}
        return list(latest.values())

    def these_knee_runs(self) -> list[KneeRun]:
        """The mode runs at the knee of these pairs, the latest of each pair, mode and step count."""
        latest = {(r.pair, r.mode, r.steps): r for r in self.knee_runs if self._of_these_pairs(r)}
        return list(latest.values())

    def expect(self, runs: int) -> None:
        """Count `runs` more in the progress line's total."""
        self.runs.total = self.runs.done + runs

    def plain_at(self, steps: int) -> None:
        """Every pair's new prompt sampled plain at `steps` (those with a plain clip kept, not yet done)."""
        for index, pair in enumerate(self.pairs):
            if self._plain_done(index, steps) or not self._plain_path(index).exists():
                continue
            try:
                clip, run = self._sample(index, pair.new, self._store(index, pair), f"plain-{steps}", steps=steps)
            except (ExecutionFailed, RequestRefused) as error:
                self.echo(f"pair {index + 1}, plain at {steps} steps: failed to sample ({error}); left out")
                continue
            plain = Clip.load(self._plain_path(index))
            psnr, similarity = quality(clip, plain)
            self._keep_plain_run(PlainRun(pair=index, earlier=pair.earlier, new=pair.new, steps=steps,
                                          model_calls=model_calls(run), psnr_db=psnr, ssim=similarity,
                                          detail=detail(clip, plain), adherence=self.runs.adherence(pair.new, clip)))

    def modes_at(self, steps: int) -> None:
        """Every pair's new prompt in each weighed mode at `steps`, through the engine from the pair's donor
        (recording nothing, so that every pair's store holds its donor alone)."""
        for index, pair in enumerate(self.pairs):
            if not self._plain_path(index).exists():
                continue
            plain = Clip.load(self._plain_path(index))
            for mode in WEIGHED_MODES:
                if self._knee_done(index, mode, steps):
                    continue
                try:
                    clip, run = self._sample(index, pair.new, self._store(index, pair), f"{mode}@{steps}", mode=mode,
                                             steps=steps)
                except (ExecutionFailed, RequestRefused) as error:
                    self.echo(f"pair {index + 1}, {mode} at {steps} steps: failed to sample ({error}); left out")
                    continue
                psnr, similarity = quality(clip, plain)
                reports = [r for r in run.statuses if r.get("probes") is not None]
                self._keep_knee_run(KneeRun(
                    pair=index, earlier=pair.earlier, new=pair.new, mode=mode, steps=steps,
                    model_calls=model_calls(run), skipped_steps=sum(int(r.get("skipped_steps") or 0) for r in reports),
                    psnr_db=psnr, ssim=similarity, detail=detail(clip, plain),
                    adherence=self.runs.adherence(pair.new, clip)))

    def _pair(self, index: int, pair: Pair) -> None:
        store = self._store(index, pair)
        plain_path = self._plain_path(index)
        try:
            location = self._donor(index, pair, store)
            if plain_path.exists():
                plain = Clip.load(plain_path)
            else:
                plain, run = self._sample(index, pair.new, store, "plain")
                self._keep_plain_run(PlainRun(pair=index, earlier=pair.earlier, new=pair.new,
                                              steps=self.workflow.steps or 0, model_calls=model_calls(run),
                                              psnr_db=PSNR_IDENTICAL, ssim=1.0,
                                              adherence=self.runs.adherence(pair.new, plain)))
                plain.save(plain_path)
        except (ExecutionFailed, RequestRefused) as error:
            self.skipped[str(index)] = f"{pair.earlier!r} -> {pair.new!r}: {error}"
            self.echo(f"pair {index + 1}: skipped, a prompt failed to sample: {error}")
            self._save_state()
            return
        self._learn_fingerprints(location)
        plain_adherence = self.runs.adherence(pair.new, plain)
        for depth in self.depths:
            if self._done(index, depth):
                continue
            verification = f"forced {round(depth * 100)}%"
            try:
                clip, run = self._sample(index, pair.new, store, verification, verification=verification)
            except (ExecutionFailed, RequestRefused) as error:
                self.echo(f"pair {index + 1}, {verification}: failed to sample ({error}); left out")
                continue
            measured = self._measure(index, depth, pair, clip, plain, run, plain_adherence)
            if measured is None:
                continue
            self.measured.append(measured)
            with (self.out / "resumes.jsonl").open("a") as rows:
                rows.write(json.dumps(measured.as_dict()) + "\n")

    def _keep_plain_run(self, run: PlainRun) -> None:
        self.plain_runs.append(run)
        with (self.out / "plain_runs.jsonl").open("a") as rows:
            rows.write(json.dumps(asdict(run)) + "\n")

    def _keep_knee_run(self, run: KneeRun) -> None:
        self.knee_runs.append(run)
        with (self.out / "knee_runs.jsonl").open("a") as rows:
            rows.write(json.dumps(asdict(run)) + "\n")

    def _plain_path(self, index: int) -> Path:
        return self.out / "pairs" / f"{index:03d}-plain.safetensors"

    def _donor(self, index: int, pair: Pair, store: str) -> str:
        """The earlier prompt recorded in the pair's store (unless it already is); the store's location."""
        location = self.runs.served(store)
        if location is None or self.runs.entries(location) < 1:
            _, run = self._sample(index, pair.earlier, store, "donor", record=True)
            location = self.runs.wait_recorded(run, 1)
        return location

    def _sample(self, index: int, prompt: str, store: str, label: str, **options) -> tuple[Clip, PromptRun]:
        return self.runs.sample(f"pair {index + 1}/{len(self.pairs)}", label, prompt, store, **options)

    def _learn_fingerprints(self, location: str) -> None:
        if self.fingerprints:
            return
        self.fingerprints = self.runs.fingerprints(location)
        if self.fingerprints:
            self._save_state()

    def _measure(self, index: int, depth: float, pair: Pair, clip: Clip, plain: Clip, run,
                 plain_adherence: float | None):
        reports = [r for r in run.statuses if r.get("probes") is not None and r.get("node") == self.workflow.sampler]
        report = reports[0] if reports else {}
        probes = report.get("probes") or []
        screen = next((p for p in probes if p.get("step") == 0 and p.get("confirms_deeper")), None)
        probe = next((p for p in probes if not p.get("confirms_deeper")), None)
        if probe is None or not report.get("skipped_steps"):
            self.echo(f"pair {index + 1}, depth {depth:.0%}: no resume ({report.get('reason') or 'no report'}); "
                      "left out")
            return None
        psnr, similarity = quality(clip, plain)
        adherence = self.runs.adherence(pair.new, clip)
        oracle_kept = None if adherence is None else bool(adherence >= plain_adherence - 1e-9)
        resume = Resume(pair=index, depth=float(probe["depth"]),
                        screen_structure=None if screen is None else structure_signal(screen),
                        screen_guidance=None if screen is None else screen.get("guidance_cosine"),
                        structure=structure_signal(probe), guidance=probe.get("guidance_cosine"),
                        psnr_db=psnr, ssim=similarity, oracle_kept=oracle_kept)
        others = probe.get("other_parts_agreement")
        return Measured(resume=resume, requested_depth=depth, earlier=pair.earlier, new=pair.new,
                        skipped_steps=int(report["skipped_steps"]), total_steps=int(report.get("total_steps") or 0),
                        seconds=float(run.seconds),
                        part_structures=[float(probe["structure_agreement"]), *others] if others else None,
                        model_calls=model_calls(run), detail=detail(clip, plain),
                        adherence=adherence)

    @staticmethod
    def store_location(client: ComfyClient, workflow: CalibrationWorkflow) -> str:
        """The location of the store the workflow's reuse node reads, opened on the server (so its routes serve it)."""
        return store_location(client.run(workflow.store_graph()).history)



def structure_signal(probe: dict) -> float:
    """A reported probe's structure signal as the bar judges it (`ProbeSignals.weakest_structure`): the weakest
    part's (a packed latent's video and audio each), and the conditional branches' where the screen judged them, so
    that the fit calibrates the bar every part must pass on what it is compared with."""
    return ProbeRecord.from_dict(probe).signals.weakest_structure
