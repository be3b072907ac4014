"""A stream calibration: is reuse worth it on the user's own prompts, in the user's order, as the engine runs them.

For each prompt in order, with the workflow's seed:

1. plain: the request's own full-step render, the reference every other run of the prompt is measured against;
2. each weighed mode (balanced, fast) through the engine exactly as a user of that mode has it: its own store, where
   every earlier prompt of the stream was recorded by that mode's own runs, its real screen, anchor and probe calls,
   and the rule that judges it. What it costs is the model calls its report counts.

Then plain at fewer steps on every prompt, at the step counts the plain-steps curve bisects to
(`judging.plain_steps_curve`: at most `MAX_LOWERED_COUNTS`, so a stream calibration costs at most five plain runs per
prompt), and each weighed mode again at the knee of that curve (the fewest plain steps as good as full plain), in
stores of its own: at most four mode runs per prompt. Each mode is weighed by the one yardstick
(`judging.yardstick`): the cheapest plain run as adherent, as close and as detailed, its calls over the mode's, with a
90 % interval over the prompts; the recommendation (`judging.recommendation`) names the cheapest steps and mode as
good as full plain.

Every finished run is appended to `DIR/stream_runs.jsonl` and every plain clip kept under `DIR/clips/`, so a stream
calibration stopped by anything resumes where it stopped when run again with the same arguments (each mode's store
stays on the server, holding the prompts that mode already ran).
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from carnator_core.calibration.clip import Clip, detail, quality
from carnator_core.calibration.equal_quality import fewer_steps_run
from carnator_core.calibration.saved_state import read_state, write_state
from carnator_core.calibration.server_runs import STORE_ROOT, CalibrationInterrupted, Progress, ServerRuns, model_calls
from carnator_core.calibration.workflow import CalibrationWorkflow
from carnator_core.client import ComfyClient, ComfyError, ExecutionFailed, RequestRefused
from carnator_core.judging.calibration_profile import WEIGHED_MODES, FewerStepsRun, ModeVerdict
from carnator_core.judging.plain_steps_curve import MAX_LOWERED_COUNTS, next_count
from carnator_core.judging.quality import PSNR_IDENTICAL, mse_from_psnr
from carnator_core.judging.recommendation import Recommendation, as_good_as_full, knee, recommend
from carnator_core.judging.yardstick import RequestOutcome, StreamQuality, curve_row, equal_quality, falls_short

PLAIN = "plain"


class NoStreamVerdict(RuntimeError):
    """The stream cannot give a verdict (one prompt, or steps that cannot be lowered); the message says why."""


@dataclass(frozen=True)
class StreamRun:
    """One run of the stream as `stream_runs.jsonl` keeps it: prompt `index` in run `run` (plain, a mode, or
    plain-<n>), its calls and its clip against the prompt's plain clip."""

    index: int
    prompt: str
    run: str
    model_calls: int
    psnr_db: float
    ssim: float
    detail: float
    adherence: float | None
    skipped_steps: int

    def outcome(self) -> RequestOutcome:
        return RequestOutcome(model_calls=self.model_calls, mse=mse_from_psnr(self.psnr_db), detail=self.detail,
                              adherence=self.adherence)


@dataclass(frozen=True)
class StreamVerdict:
    """What a stream calibration found: the plain runs at fewer steps by name, the verdict per mode, and a line where
    no mode resumed (then no verdict is claimed and no fewer-steps run was sampled)."""

    fewer_steps: dict[str, FewerStepsRun]
    verdicts: dict[str, ModeVerdict]
    note: str = ""
    recommended: Recommendation | None = None


@dataclass
class StreamCalibration:
    """A stream calibration's state on disk (`out`) and on the server (`client`); `run()` does what is left."""

    client: ComfyClient
    workflow: CalibrationWorkflow
    prompts: list[str]
    out: Path
    echo: Callable[[str], None] = print
    on_progress: Callable[[Progress], None] | None = None
    should_stop: Callable[[], bool] = lambda: False
    rows: list[StreamRun] = field(default_factory=list)
    fingerprints: dict[str, str | float] = field(default_factory=dict)
    runs: ServerRuns = field(init=False)

    def __post_init__(self) -> None:
        if len(self.prompts) < 2:
            raise NoStreamVerdict(f"a stream of {len(self.prompts)} prompt{'' if len(self.prompts) == 1 else 's'} "
                                  "has no earlier prompt to resume from: no verdict; give two or more prompts")
        if self.workflow.steps is None:
            raise NoStreamVerdict(f"the steps of this workflow cannot be lowered ({self.workflow.steps_note}): a "
                                  "stream calibration weighs reuse against lowering them, so it gives no verdict here")
        self.out.mkdir(parents=True, exist_ok=True)
        self.runs = ServerRuns(self.client, self.workflow, f"{self.key}-stream", self.echo, self.on_progress,
                               self.should_stop)
        rows = self.out / "stream_runs.jsonl"
        if rows.exists():
            kept = [StreamRun(**json.loads(line)) for line in rows.read_text().splitlines() if line]
            self.rows = [r for r in kept if r.index < len(self.prompts) and self.prompts[r.index] == r.prompt]
        state = read_state(self.out, self.workflow.digest(), bool(self.rows))
        self.fingerprints = state.get("fingerprints", {})

    @property
    def key(self) -> str:
        """Names this calibration's stores on the server: the output directory, the workflow and the prompts, so a
        stream resumed with the same arguments finds its modes' stores again and any other starts empty ones."""
        text = json.dumps([str(self.out.resolve()), self.workflow.digest(), self.prompts])
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def run(self) -> StreamVerdict:
        """Every run not yet done, then the verdict per mode; CalibrationInterrupted when the server goes away or
        `should_stop` says so (what finished is kept)."""
        steps = self.workflow.steps or 0
        self.runs.total = sum(not self._done(i, name) for i in range(len(self.prompts))
                              for name in (PLAIN, *WEIGHED_MODES)) + MAX_LOWERED_COUNTS * len(self.prompts)
        self.runs.done = 0
        try:
            return self._run(steps)
        except ComfyError as error:  # the server went away (ServerLost, unreachable); a prompt's failure is per run
            if isinstance(error, (ExecutionFailed, RequestRefused)):
                raise
            raise CalibrationInterrupted(str(error)) from None

    def _run(self, steps: int) -> StreamVerdict:
        for index, prompt in enumerate(self.prompts):
            self._prompt(index, prompt)
        if len(self._of(PLAIN)) < 2:
            raise NoStreamVerdict(f"only {len(self._of(PLAIN))} of the {len(self.prompts)} prompts sampled in every "
                                  "run (each failure's line says why): no verdict")
        resumed = {mode: [r for r in self._of(mode) if r.skipped_steps > 0] for mode in WEIGHED_MODES}
        if not any(resumed.values()):
            note = (f"no mode resumed any of the {len(self.prompts)} prompts: nothing in this stream is resumable here, "
                    "so no verdict is claimed and plain was not sampled at fewer steps")
            return StreamVerdict({}, {mode: self._verdict(mode, {}) for mode in WEIGHED_MODES}, note)
        self.runs.total = self.runs.done + sum(len(self.prompts) - len(self._rows(f"plain-{n}"))
                                               for n in self._lowered_counts()) + len(self.prompts) * max(
            0, MAX_LOWERED_COUNTS - len(self._lowered_counts()))
        for count in self._lowered_counts():  # a count an interrupted run began
            self._plain_at(count)
        while len(self._lowered_counts()) < MAX_LOWERED_COUNTS:
            count = next_count(steps, self._lowered_counts(), [self._judge(mode) for mode in WEIGHED_MODES
                                                               if resumed[mode]] + [self._judge_knee])
            if count is None:
                break
            self.echo(f"plain-steps curve: plain at {count} of {steps} steps on every prompt")
            self._plain_at(count)
        lowered = {n: self._of(f"plain-{n}") for n in self._lowered_counts()}
        fewer = {f"plain-{n}": fewer_steps_run(n, _outcomes(rows), [r.ssim for r in rows]) for n, rows in lowered.items()}
        at_knee = knee(_outcomes(self._of(PLAIN)), {n: _outcomes(rows) for n, rows in lowered.items()}, steps)
        if at_knee < steps:
            self.echo(f"knee of the plain-steps curve: plain at {at_knee} of {steps} steps is as good as full plain; "
                      f"{', '.join(WEIGHED_MODES)} at {at_knee} steps on every prompt")
            for index, prompt in enumerate(self.prompts):
                self._prompt(index, prompt, at_knee)
        return StreamVerdict(fewer, {mode: self._verdict(mode, lowered) for mode in WEIGHED_MODES},
                             recommended=self._recommended(lowered, steps))

    def _recommended(self, lowered: dict[int, list[StreamRun]], steps: int) -> Recommendation:
        """The cheapest of plain at every measured count and the modes at the workflow's steps and at the knee that
        is as good as full plain (`judging.recommendation`), over the prompts every run sampled."""
        plain = self._of(PLAIN)
        weighed = {r.index for r in plain}
        modes = {(steps, mode): _outcomes(self._of(mode)) for mode in WEIGHED_MODES}
        for name in {r.run for r in self.rows if "@" in r.run}:
            mode, count = name.split("@")
            rows = {r.index: r for r in self._rows(name)}
            if weighed <= set(rows):
                modes[int(count), mode] = _outcomes([rows[r.index] for r in plain])
        return recommend(_outcomes(plain), {n: _outcomes(rows) for n, rows in lowered.items()}, modes, steps)

    def curve(self) -> list[dict]:
        """Every plain run the stream weighs against, fewest steps first: its calls and the yardstick's measures."""
        counts = {**{n: self._of(f"plain-{n}") for n in self._lowered_counts()}, self.workflow.steps: self._of(PLAIN)}
        return [curve_row(n, _outcomes(counts[n])) for n in sorted(counts)]

    def mode_quality(self, mode: str) -> StreamQuality:
        return StreamQuality.of(_outcomes(self._of(mode)))

    def _verdict(self, mode: str, lowered: dict[int, list[StreamRun]]) -> ModeVerdict:
        runs, plain = self._of(mode), self._of(PLAIN)
        resumed = sum(r.skipped_steps > 0 for r in runs)
        quality = StreamQuality.of(_outcomes(runs))
        common = {"psnr_db": round(quality.psnr_db, 2), "ssim": round(statistics.median(r.ssim for r in runs), 4),
                  "resumed": resumed, "pairs": len(runs), "held_back": False, "steps": self.workflow.steps or 0,
                  "weighed_on": "stream", "detail": round(quality.detail, 4)}
        if not resumed:
            plain_calls = StreamQuality.of(_outcomes(plain)).model_calls
            return ModeVerdict(model_calls=round(quality.model_calls, 2), against=PLAIN,
                               against_calls=round(plain_calls, 2), calls=round(plain_calls / quality.model_calls, 3),
                               **common)
        weighed = equal_quality(_outcomes(runs), _outcomes(plain), {n: _outcomes(rows) for n, rows in lowered.items()},
                                self.workflow.steps or 0)
        return ModeVerdict(model_calls=round(weighed.model_calls, 2), against=weighed.against,
                           against_calls=round(weighed.against_calls, 2), calls=round(weighed.calls, 3),
                           interval=weighed.rounded_interval(), decided_by=weighed.decided_by,
                           steps_short=weighed.steps_short,
                           **common)

    def _judge_knee(self, count: int) -> bool:
        """Whether plain at `count` steps is as good as full plain (the knee's bracket)."""
        return as_good_as_full(_outcomes(self._of(f"plain-{count}")), _outcomes(self._of(PLAIN)))

    def _judge(self, mode: str) -> Callable[[int], bool]:
        return lambda n: falls_short(_outcomes(self._of(f"plain-{n}")), _outcomes(self._of(mode)),
                                     _outcomes(self._of(PLAIN))) is None

    def _rows(self, name: str) -> list[StreamRun]:
        """The rows of run `name`, one per prompt it ran on, in the stream's order."""
        latest = {r.index: r for r in self.rows if r.run == name}
        return [latest[i] for i in sorted(latest)]

    def _of(self, name: str) -> list[StreamRun]:
        """The rows of run `name` on the prompts weighed: those every run of the stream ran on (a prompt that failed
        to sample in one run is left out of all)."""
        names = (PLAIN, *WEIGHED_MODES, *(f"plain-{n}" for n in self._lowered_counts()))
        weighed = set.intersection(*({r.index for r in self._rows(n)} for n in names))
        return [r for r in self._rows(name) if r.index in weighed]

    def _done(self, index: int, name: str) -> bool:
        return any(r.index == index and r.run == name for r in self.rows)

    def _lowered_counts(self) -> list[int]:
        return sorted({int(r.run.removeprefix("plain-")) for r in self.rows if r.run.startswith("plain-")})

    def _store(self, name: str) -> str:
        """The store of run `name` on the server (a mode at the knee, `<mode>@<steps>`, has its own)."""
        return f"{STORE_ROOT}/{self.key}/{name.replace('@', '-at-')}"

    def _clip_path(self, index: int) -> Path:
        return self.out / "clips" / f"{index:03d}-plain.safetensors"

    def _plain(self, index: int, prompt: str) -> Clip:
        """The prompt's plain clip, sampled (and kept) unless it already is."""
        path = self._clip_path(index)
        if path.exists() and self._done(index, PLAIN):
            return Clip.load(path)
        clip, run = self._sample(index, prompt, PLAIN, self._store(PLAIN))
        clip.save(path)
        self._keep(StreamRun(index=index, prompt=prompt, run=PLAIN, model_calls=model_calls(run),
                             psnr_db=PSNR_IDENTICAL, ssim=1.0, detail=1.0, adherence=self.runs.adherence(prompt, clip),
                             skipped_steps=0))
        return clip

    def _prompt(self, index: int, prompt: str, at_steps: int | None = None) -> None:
        """The prompt's plain run and each weighed mode's (`at_steps`: the modes alone at that many steps, run
        `<mode>@<steps>` in a store of its own)."""
        names = {mode: mode if at_steps is None else f"{mode}@{at_steps}" for mode in WEIGHED_MODES}
        if all(self._done(index, name) for name in (PLAIN, *names.values())):
            return
        try:
            plain = self._plain(index, prompt)
        except (ExecutionFailed, RequestRefused) as error:
            self.echo(f"prompt {index + 1}: failed to sample plain ({error}); left out of the verdict")
            return
        for mode, name in names.items():
            if self._done(index, name):
                continue
            steps = {} if at_steps is None else {"steps": at_steps}
            try:
                clip, run = self._sample(index, prompt, name, self._store(name), mode=mode, record=True, **steps)
            except (ExecutionFailed, RequestRefused) as error:
                self.echo(f"prompt {index + 1}, {name}: failed to sample ({error}); left out of the verdict")
                continue
            reports = [r for r in run.statuses if r.get("probes") is not None]
            self._measured(index, prompt, name, clip, plain, model_calls(run),
                           sum(int(r.get("skipped_steps") or 0) for r in reports))
            try:
                location = self.runs.wait_recorded(run, len(self._rows(name)))
            except ExecutionFailed:
                self.echo(f"prompt {index + 1}: not recorded in {name}'s store in time; the stream goes on")
                continue
            self._learn_fingerprints(location)

    def _plain_at(self, count: int) -> None:
        for index, prompt in enumerate(self.prompts):
            name = f"plain-{count}"
            if self._done(index, name) or not self._done(index, PLAIN):
                continue
            try:
                clip, run = self._sample(index, prompt, name, self._store(PLAIN), steps=count)
            except (ExecutionFailed, RequestRefused) as error:
                self.echo(f"prompt {index + 1}, {name}: failed to sample ({error}); left out of the verdict")
                continue
            self._measured(index, prompt, name, clip, self._plain(index, prompt), model_calls(run), 0)

    def _measured(self, index: int, prompt: str, name: str, clip: Clip, plain: Clip, calls: int,
                  skipped: int) -> None:
        psnr, similarity = quality(clip, plain)
        self._keep(StreamRun(index=index, prompt=prompt, run=name, model_calls=calls, psnr_db=round(psnr, 3),
                             ssim=round(similarity, 5), detail=round(detail(clip, plain), 5),
                             adherence=self.runs.adherence(prompt, clip), skipped_steps=skipped))

    def _sample(self, index: int, prompt: str, name: str, store: str, **options):
        return self.runs.sample(f"prompt {index + 1}/{len(self.prompts)}", name, prompt, store, **options)

    def _keep(self, row: StreamRun) -> None:
        self.rows.append(row)
        with (self.out / "stream_runs.jsonl").open("a") as rows:
            rows.write(json.dumps(asdict(row)) + "\n")

    def _learn_fingerprints(self, location: str) -> None:
        if not self.fingerprints:
            self.fingerprints = self.runs.fingerprints(location)
            write_state(self.out, {"workflow": self.workflow.digest(), "fingerprints": self.fingerprints})


def _outcomes(rows: list[StreamRun]) -> list[RequestOutcome]:
    return [row.outcome() for row in rows]
