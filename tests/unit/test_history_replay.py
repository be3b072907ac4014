"""A multistep sampler's history: recorded with the run, replayed to the resume step only where it retraces the
donor's trajectory from the run's own first state."""

from __future__ import annotations

import torch

from carnator_core.lookup.shortlist import Candidate
from carnator_core.reuse.history_replay import replay_for
from carnator_core.reuse.recording import RunRecorder
from carnator_core.reuse.start_difference import StartDifference
from carnator_core.reuse.targets import ProbeTarget, StartPrediction
from carnator_core.store.entry import EntryMeta, HardKey
from carnator_core.store.reuse_store import IndexVectors, ReuseStore
from carnator_core.store.tensor_codec import decode_tensors, encode_tensors
from carnator_core.store.tensor_names import HISTORY_BLOB

SHAPE = (1, 16, 2, 4, 4)
SIGMAS = [1.0 - step / 10 for step in range(11)]
KEY = HardKey("model", (2, 2, 2), "schedule")
START = "first-state"


def _predictions(steps: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {f"p_{step}": torch.randn(SHAPE, generator=generator).half() for step in range(steps)}


def _target(store: ReuseStore, history: dict[str, torch.Tensor] | None, step: int = 4,
            corrected: bool = False, donor_sigmas: list[float] = SIGMAS) -> ProbeTarget:
    """A donor checkpoint at `step` of a stored donor that kept `history`, screened at the first state `START`."""
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=KEY, prompt="donor", latent_shape=SHAPE,
                     noise_fingerprint="noise", total_steps=len(donor_sigmas) - 1, extra={"sigmas": donor_sigmas})
    blobs = {"checkpoints": encode_tensors({f"x_{step}": torch.zeros(SHAPE)})}
    if history is not None:
        blobs[HISTORY_BLOB] = encode_tensors(history)
    store.put(meta, blobs, IndexVectors(text=None, cond=torch.nn.functional.normalize(torch.ones(256), dim=0)))
    start = StartPrediction(meta=meta, sigma=1.0, state=START, x0=torch.zeros(SHAPE), guidance=None)
    return ProbeTarget(candidate=Candidate(entry_id=meta.entry_id, prompt="donor", score=1.0, cond_similarity=1.0,
                                                 text_similarity=None), meta=meta, step=step,
                       sigma=SIGMAS[step], x=torch.zeros(SHAPE), x0=torch.zeros(SHAPE), guidance=None, start=start,
                       corrected=corrected)


def test_the_recorder_keeps_the_predictions_before_its_deepest_checkpoint():
    recorder = RunRecorder(checkpoint_steps={3, 5}, history_until=5)
    for step in range(10):
        if recorder.wants_prediction(step):
            recorder.capture_prediction(step, torch.full(SHAPE, float(step)))
    _, blobs = recorder.blobs()
    history = decode_tensors(blobs[HISTORY_BLOB])
    assert sorted(history) == [f"p_{step}" for step in range(5)]
    assert history["p_2"].dtype == torch.float16 and torch.equal(history["p_2"].float(), torch.full(SHAPE, 2.0))


def test_a_run_from_the_donors_first_state_replays_its_predictions_in_order(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    history = _predictions(6)
    replay = replay_for(store, _target(store, history), START, SIGMAS, None)
    assert replay is not None
    assert replay.answer(SIGMAS[5]) is None  # past the resume step (4): the model's call
    for step in range(4):
        assert torch.equal(replay.answer(SIGMAS[step]), history[f"p_{step}"])
    assert replay.answer(SIGMAS[0]) is None  # each step once


def test_no_replay_from_another_first_state_or_an_incomplete_history(tmp_path):
    store = ReuseStore(str(tmp_path / "store"))
    assert replay_for(store, _target(store, _predictions(6)), "another-state", SIGMAS, None) is None
    assert replay_for(store, _target(store, _predictions(3)), START, SIGMAS, None) is None  # p_3 missing
    assert replay_for(store, _target(store, None), START, SIGMAS, None) is None  # recorded by a one-step sampler
    nan = {**_predictions(6), "p_1": torch.full(SHAPE, float("nan")).half()}
    assert replay_for(store, _target(store, nan), START, SIGMAS, None) is None


def test_a_corrected_target_replays_the_predictions_moved_by_the_difference(tmp_path):
    """From the request's own first state (another one than the donor's), as the correction assumes."""
    store = ReuseStore(str(tmp_path / "store"))
    history = _predictions(6)
    difference = StartDifference(sigma=1.0, x0=torch.full(SHAPE, 0.5), guidance=None, state=torch.ones(SHAPE))
    replay = replay_for(store, _target(store, history, corrected=True), "another-state", SIGMAS, difference)
    assert replay is not None
    assert torch.equal(replay.answer(SIGMAS[2]), history["p_2"].float() + 0.5)


def test_a_donor_of_another_schedule_is_resumed_without_its_history(tmp_path):
    """Its predictions were made at other sigmas: where the schedules part before the resume, nothing is replayed
    (the sampler restarts at the resume state); where they coincide up to it, the history is replayed."""
    store = ReuseStore(str(tmp_path / "store"))
    history = _predictions(6)
    parted = [1.0, 0.95, *SIGMAS[2:]]
    assert replay_for(store, _target(store, history, donor_sigmas=parted), START, SIGMAS, None) is None
    longer = [*SIGMAS[:5], 0.55, 0.3, 0.0]
    assert replay_for(store, _target(store, history, donor_sigmas=longer), START, SIGMAS, None) is not None
