"""The node that finds compatible earlier requests for a new one."""

from __future__ import annotations

from dataclasses import replace

from comfy_api.latest import io

from carnator_core.lookup.compatible import LookupRequest, Match, embed_prompt, find_compatible
from carnator_core.lookup.embeddings import condition_vector
from carnator_core.lookup.fingerprint import FingerprintError
from carnator_core.reuse.recording import await_earlier_entries
from carnator_core.reuse.settings import input_default, input_range
from carnator_core.store.backend import StoreError

from .fault_boundary import CarnatorFault, carnator_code
from .host import conditioning_frame_rate, conditioning_tensor, hard_key, store_at
from .noise_process import noise_process
from .types import MatchType, StoreType
from .user_scope import run_scope


class CarnatorCompatibilityLookup(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorCompatibilityLookup",
            display_name="Carnator Compatibility Lookup",
            category="Carnator/reuse",
            description="Finds stored earlier requests this one could reuse: same model (incl. LoRAs), same "
                        "token grid and schedule, ranked by prompt-text and conditioning similarity. The "
                        "sampler verifies the best candidates with the model itself before reusing anything.",
            not_idempotent=True,
            inputs=[
                io.Model.Input("model", tooltip="The model that will sample this request (after LoRAs/patches)."),
                io.Conditioning.Input("positive", tooltip="Positive conditioning of the new request."),
                io.Latent.Input("latent", tooltip="Initial latent of the new request; fixes the token grid."),
                io.String.Input("prompt", default=input_default("prompt"), multiline=True, optional=True,
                                tooltip="Prompt text, for text similarity. Leave empty to match on the "
                                        "conditioning tensor alone."),
                StoreType.Input("store", optional=True, tooltip="Reuse store; the default store when not connected."),
                io.Sigmas.Input("sigmas", optional=True,
                                tooltip="Sampling schedule, to filter candidates by schedule already here. "
                                        "Without it the sampler checks the schedule."),
                io.Int.Input("top_k", default=input_default("top_k"), **input_range("top_k"),
                             tooltip="How many candidates to pass on for verification by the model."),
                io.Float.Input("min_similarity", default=input_default("min_similarity"), **input_range("min_similarity"),
                               step=0.01,
                               tooltip="Candidates scoring below this cosine similarity are dropped."),
            ],
            outputs=[MatchType.Output(display_name="match"), io.String.Output(display_name="report")],
        )

    @classmethod
    def execute(cls, model, positive, latent, top_k: int, min_similarity: float, prompt: str = "",
                store=None, sigmas=None) -> io.NodeOutput:
        try:
            store = store if store is not None else store_at()
        except StoreError as error:
            raise ValueError(f"Carnator Compatibility Lookup: {error}") from error
        try:
            with carnator_code("looking up candidates", expected=(FingerprintError, ValueError)):
                match = _lookup(store, model, latent["samples"], positive, sigmas, prompt or "", top_k, min_similarity)
        except (FingerprintError, ValueError, CarnatorFault) as error:
            if isinstance(error, CarnatorFault):
                error.log_once("no lookup")
            match = Match(store_location=store.location, request=None, candidates=[],
                          notes=[f"no lookup (clean miss): {error}"])
        return io.NodeOutput(match, match.report())


def _lookup(store, model, samples, positive, sigmas, prompt: str, top_k: int, min_similarity: float) -> Match:
    scope, refusal = run_scope()
    if refusal:
        raise ValueError(refusal)
    key = replace(hard_key(model, samples, sigmas, frame_rate=conditioning_frame_rate(positive)), scope=scope)
    cond = condition_vector(conditioning_tensor(positive))
    text_vector, note = embed_prompt(prompt)
    request = LookupRequest(hard_key=key, cond_vector=cond, prompt=prompt, text_vector=text_vector,
                            noise_process=noise_process(model))
    await_earlier_entries()
    match = find_compatible(store, request, top_k=top_k, min_similarity=min_similarity)
    match.notes.extend([note] if note else [])
    return match
