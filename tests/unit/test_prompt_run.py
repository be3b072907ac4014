"""PromptRun's clock: node times from the events' arrival, never past the end the server stamped.

The events are shaped as ComfyUI sends them (`execution_start`, `execution_cached` and `execution_success` carry the
server's `timestamp` in milliseconds; `executing` names the node that starts).
"""

from __future__ import annotations

import pytest

from carnator_core.client import PromptRun

SERVER_START = 1_796_380_000_000  # ms on the server's clock
CLIENT_OFFSET = 1234.5  # the client's perf_counter minus the server's clock, in seconds
DELIVERY = 0.0004  # how long an event takes to arrive when nothing holds it up


def _arrival(server_ms: float, delay: float = 0.0) -> float:
    return (server_ms / 1000 + CLIENT_OFFSET) + DELIVERY + delay


def _follow(late_by: float) -> PromptRun:
    """A prompt whose text encoder runs 20 ms and sampler 1.5 s, then SaveLatent 1 ms; every event from the
    sampler's end on arrives `late_by` seconds late (the server's garbage collection held them)."""
    run = PromptRun("p")
    sent = [
        (0.0, {"type": "execution_start", "data": {"prompt_id": "p", "timestamp": SERVER_START}}, 0.0),
        (1.0, {"type": "execution_cached",
               "data": {"nodes": [], "prompt_id": "p", "timestamp": SERVER_START + 1}}, 0.0),
        (1.0, {"type": "executing", "data": {"node": "positive", "prompt_id": "p"}}, 0.0),
        (21.0, {"type": "executing", "data": {"node": "sampler", "prompt_id": "p"}}, 0.0),
        (1521.0, {"type": "executing", "data": {"node": "save_latent", "prompt_id": "p"}}, late_by),
        (1522.0, {"type": "execution_success", "data": {"prompt_id": "p", "timestamp": SERVER_START + 1522}}, late_by),
    ]
    for offset_ms, event, delay in sent:
        assert not run.add(_arrival(SERVER_START + offset_ms, delay), event) or event["type"] == "execution_success"
    return run


def test_on_time_events_time_every_node() -> None:
    run = _follow(late_by=0.0)
    assert run.node_seconds["positive"] == pytest.approx(0.020, abs=1e-6)
    assert run.node_seconds["sampler"] == pytest.approx(1.5, abs=1e-6)
    assert run.node_seconds["save_latent"] == pytest.approx(0.001, abs=1e-6)
    assert run.seconds == pytest.approx(1.522, abs=1e-6)
    assert run.seconds_except({"positive", "save_latent"}) == pytest.approx(1.5, abs=1e-6)


def test_events_held_up_after_the_prompt_do_not_lengthen_it() -> None:
    run = _follow(late_by=0.4)
    # the sampler's end arrived 0.4 s late; the server's stamp of the prompt's end bounds it within a millisecond
    assert run.node_seconds["sampler"] == pytest.approx(1.501, abs=1e-6)
    assert run.seconds == pytest.approx(1.522, abs=1e-6)
    assert run.seconds_except({"positive", "save_latent"}) == pytest.approx(1.501, abs=1e-6)


def test_without_server_stamps_arrival_times_are_used() -> None:
    run = PromptRun("p")
    run.add(10.0, {"type": "execution_start", "data": {"prompt_id": "p"}})
    run.add(10.1, {"type": "executing", "data": {"node": "sampler", "prompt_id": "p"}})
    assert run.add(12.1, {"type": "execution_success", "data": {"prompt_id": "p"}})
    assert run.node_seconds == {"sampler": pytest.approx(2.0)}
    assert run.seconds == pytest.approx(2.1)


def test_a_late_start_event_never_moves_the_end_earlier_than_it_was() -> None:
    """The offset is the smallest arrival-minus-stamp: a held-up `execution_start` cannot pull the end before the
    server's end, and a stamp that is not a number is ignored."""
    run = PromptRun("p")
    run.add(_arrival(SERVER_START, 0.3), {"type": "execution_start",
                                          "data": {"prompt_id": "p", "timestamp": SERVER_START}})
    run.add(_arrival(SERVER_START + 1), {"type": "execution_cached",
                                         "data": {"nodes": [], "prompt_id": "p", "timestamp": "soon"}})
    run.add(_arrival(SERVER_START + 1, 0.3), {"type": "executing", "data": {"node": "sampler", "prompt_id": "p"}})
    assert run.add(_arrival(SERVER_START + 1001), {"type": "execution_success",
                                                   "data": {"prompt_id": "p", "timestamp": SERVER_START + 1001}})
    assert run.node_seconds["sampler"] == pytest.approx(0.7, abs=1e-6)
    assert run.seconds == pytest.approx(0.701, abs=1e-6)
