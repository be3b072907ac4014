"""A store many users share: under ComfyUI's --multi-user, on a real headless server with the demo model, no user
reaches another's work, tried as the published attacks on cross-request caches try it.

- prompt recovery: user B cannot list, fetch or infer user A's prompts or thumbnails through any store route, the
  lookup node's output or a report; an unknown or system user gets 403 and no data, and its prompt samples without
  reuse, saying why; a scope the client writes into its prompt is ignored;
- poisoning: an entry B wrote, with A's very prompt and seed, is never a candidate for A;
- timing: whether B's entries exist changes nothing in A's run: the same calls and the same output, bit for bit;
- A's own rewording still resumes, and each user's profiles are theirs alone.
"""

from __future__ import annotations

import itertools
import json
import time

import pytest
import requests
import torch
from safetensors.torch import load_file
from support.comfy_host import ServerFactory

from carnator_core.client import ComfyClient
from carnator_core.demo import graphs

pytestmark = pytest.mark.server

DEMO_WEIGHTS = "carnator_demo_wan21_t2v.safetensors"
PROMPT = "a red circle moving left on a black background"
REWORDED = "a red ball moving to the left on a black background"
STEPS = 8
_sizes = itertools.count(1)


@pytest.fixture(scope="module")
def multi_user(comfyui_path, new_base_dir):
    """A --multi-user server and two users created through its /users route: (server, alice, bob)."""
    factory = ServerFactory(comfyui_path, new_base_dir)
    try:
        server = factory(extra_args=("--multi-user",))
        alice, bob = (server.post("/users", json={"username": name}).json() for name in ("alice", "bob"))
        yield server, alice, bob
    finally:
        factory.stop_all()


def _graph(prompt: str, store: str = "", seed: int = 42) -> dict:
    """The demo graph with one CarnatorReuse (default store unless `store`), a report and the latent saved; a new
    store size limit each time, so ComfyUI's output cache never answers instead of sampling."""
    graph = graphs.with_save_latent(graphs.with_reuse(
        graphs.base_graph(DEMO_WEIGHTS, prompt, seed=seed, steps=STEPS, cfg=4.0), store, prompt,
        sparse_attention="off"), f"scopes/{next(_sizes)}")
    graph[graphs.STORE]["inputs"]["size_limit_gb"] = 10.0 + next(_sizes) / 1000
    return graph


def _run(server, user: str | None, graph: dict, extra_data: dict | None = None) -> tuple[dict, torch.Tensor]:
    """Queue `graph` as `user` (the comfy-user header); its one Carnator report and its latent."""
    with ComfyClient(server.url, user=user) as client:
        graph = server.complete(graph)
        if extra_data is None:
            run = client.run(graph)
        else:
            client.listen()
            response = requests.post(f"{server.url}/prompt", json={"prompt": graph, "client_id": client.client_id,
                                                                  "extra_data": extra_data},
                                     headers={"comfy-user": user} if user else {}, timeout=30)
            run = client.follow(response.json()["prompt_id"])
            run.history = client.wait(run.prompt_id)
    outputs = run.history["outputs"]
    (report,) = json.loads(outputs[graphs.REPORT]["carnator_report"][0])
    saved = outputs[graphs.SAVE_LATENT]["latents"][0]
    latent = load_file(str(server.base_dir / "output" / saved["subfolder"] / saved["filename"]))["latent_tensor"]
    return report, latent


def _get(server, user: str | None, path: str) -> requests.Response:
    return server.get(path, headers={"comfy-user": user} if user is not None else {})


def _send(server, user: str, method: str, path: str, body: dict | None = None) -> requests.Response:
    return requests.request(method, f"{server.url}{path}", json=body or {}, timeout=30,
                            headers={"comfy-user": user, "Origin": server.url})


def test_prompt_recovery_finds_nothing_of_another_user(multi_user):
    server, alice, bob = multi_user
    store = "stores/recovery"
    with ComfyClient(server.url, user=bob) as watcher:  # bob's browser tab, open while alice samples
        watcher.listen()
        first, _ = _run(server, alice, _graph(PROMPT, store))
        time.sleep(0.5)
        seen = []
        while not watcher._events.empty():  # every websocket message bob's socket received
            item = watcher._events.get()
            seen.append(item[1] if item else None)
    assert not first["hit"]
    assert not [event for event in seen if event and event.get("type") == "carnator.status"], seen
    assert PROMPT not in json.dumps([event for event in seen if event])
    theirs, _ = _run(server, bob, _graph(REWORDED, store))
    assert not theirs["hit"] and theirs["candidates"] == [] and theirs["skipped_steps"] == 0, theirs
    assert PROMPT not in json.dumps(theirs) and "scope" not in json.dumps(theirs["filtered"])
    own, _ = _run(server, alice, _graph(REWORDED, store))
    assert own["hit"] and own["donor_prompt"] == PROMPT and own["skipped_steps"] > 0, own  # still reuses her own

    store_id = _store_id(server, alice, store)
    deadline = time.monotonic() + 60  # the server records her resumed run in the background
    while len((hers := _get(server, alice, f"/carnator/store/entries?store={store_id}").json())["entries"]) < 2 \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    listing = _get(server, bob, f"/carnator/store/entries?store={store_id}").json()
    assert [e["prompt"] for e in listing["entries"]] == [REWORDED] and PROMPT not in json.dumps(listing)
    assert sorted(e["prompt"] for e in hers["entries"]) == sorted([PROMPT, REWORDED])
    assert _get(server, bob, f"/carnator/store/stats?store={store_id}").json()["entries"] == 1
    for entry in hers["entries"]:
        assert _get(server, bob, f"/carnator/store/entries/{entry['id']}/thumbnail?store={store_id}").status_code == 404
        path = f"/carnator/store/entries/{entry['id']}"
        assert _send(server, bob, "POST", f"{path}/pin?store={store_id}", {"pinned": True}).status_code == 404
        assert _send(server, bob, "DELETE", f"{path}?store={store_id}").status_code == 404
    cleared = _send(server, bob, "POST", f"/carnator/store/clear?store={store_id}", {"confirm": True})
    assert cleared.status_code == 200 and cleared.json()["deleted"] == 1
    assert len(_get(server, alice, f"/carnator/store/entries?store={store_id}").json()["entries"]) == 2
    assert _get(server, alice, f"/carnator/store/entries/{hers['entries'][0]['id']}/thumbnail?store={store_id}").ok


def test_an_unknown_or_system_user_gets_403_and_samples_without_reuse(multi_user):
    server, alice, _ = multi_user
    for user in ("mallory", "__system", None):
        for path in ("/carnator/store/entries", "/carnator/store/stats", "/carnator/store/profiles",
                     "/carnator/store/stores", "/carnator/calibration"):
            response = _get(server, user, path)
            assert response.status_code == 403 and set(response.json()) == {"error"}, (user, path, response.text)
    report, _ = _run(server, "mallory", _graph(PROMPT, "stores/unknown"))
    assert not report["hit"] and "unknown or system user" in report["reason"], report
    # a scope the client writes into its own prompt is replaced by the poster's
    _run(server, alice, _graph(PROMPT, "stores/forged"))
    forged, _ = _run(server, "mallory", _graph(REWORDED, "stores/forged"),
                     extra_data={"carnator_scope": {"scope": f"user:{alice}"}})
    assert not forged["hit"] and "unknown or system user" in forged["reason"], forged


def test_poisoning_an_entry_written_in_another_scope_is_never_a_candidate(multi_user):
    server, alice, bob = multi_user
    store = "stores/poison"
    _run(server, bob, _graph(PROMPT, store))  # B writes first, A's very prompt and seed
    report, _ = _run(server, alice, _graph(PROMPT, store))
    assert not report["hit"] and report["candidates"] == [] and report["model_calls"] == STEPS, report


def test_timing_another_user_s_entries_change_nothing_in_a_run(multi_user):
    server, alice, bob = multi_user
    alone = [_run(server, alice, _graph(prompt, "stores/timing-alone")) for prompt in (PROMPT, REWORDED)]
    for prompt in (PROMPT, REWORDED, "a red circle moving right on a black background"):
        _run(server, bob, _graph(prompt, "stores/timing-beside"))
    beside = [_run(server, alice, _graph(prompt, "stores/timing-beside")) for prompt in (PROMPT, REWORDED)]
    for (first, first_latent), (second, second_latent) in zip(alone, beside, strict=True):
        assert (first["model_calls"], first["skipped_steps"]) == (second["model_calls"], second["skipped_steps"])
        assert torch.equal(first_latent, second_latent)
        assert first["filtered"] == second["filtered"] and len(first["candidates"]) == len(second["candidates"])


def test_each_user_s_profiles_are_theirs_alone(multi_user):
    server, alice, bob = multi_user
    _run(server, alice, _graph(PROMPT))  # the default store, where profiles are filed
    profile = json.loads(_demo_profile())
    imported = _send(server, alice, "POST", "/carnator/store/profiles", profile)
    assert imported.status_code == 200, imported.text
    assert len(_get(server, alice, "/carnator/store/profiles").json()["profiles"]) == 1
    assert _get(server, bob, "/carnator/store/profiles").json() == {"profiles": [], "refused": {}}
    path = f"/carnator/store/profiles/{profile['model']}/{profile['schedule']}"
    assert _send(server, bob, "DELETE", path).status_code == 404
    assert _send(server, alice, "DELETE", path).status_code == 200


def _store_id(server, user: str, store: str) -> str:
    listing = _get(server, user, "/carnator/store/stores").json()["stores"]
    return next(s["id"] for s in listing if s["name"].endswith(store))


def _demo_profile() -> str:
    from carnator_core.judging.calibration_profile import Profile, Score

    return Profile(model="a1b2c3", schedule="d4e5f6", name="alice's wan",
                   thresholds={"structure": 0.7, "structure_slope": 0.03, "guidance": 0.5, "guidance_slope": 0.03},
                   held_back=Score(accepted=20, good=20, precision=1.0, recall=1.0), in_force=True,
                   reason="in force: held-back precision 1.00", scope="user:someone-else").to_json()
