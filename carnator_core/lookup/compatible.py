"""Compatibility lookup: from a new request to a ranked, explained list of possible donors.

Hard compatibility and the semantic shortlist live here; the generation-native probes
that verify a donor run later, during sampling, on the candidates this returns.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from carnator_core import process_state
from carnator_core.lookup.embeddings import EmbeddingError
from carnator_core.lookup.noise_process import NOISE_PROCESS, NoiseProcess
from carnator_core.lookup.prompt_vectors import prompt_vectors
from carnator_core.lookup.shortlist import Candidate, ShortlistIndex, ShortlistResult
from carnator_core.store.entry import HardKey
from carnator_core.store.reuse_store import ReuseStore

_indexes_lock = threading.Lock()


def index_for(store: ReuseStore) -> ShortlistIndex:
    """The process-wide index of a store directory, brought up to date with the store."""
    with _indexes_lock:
        indexes: dict[str, ShortlistIndex] = process_state.one("shortlist indexes", dict)
        index = indexes.setdefault(store.location, ShortlistIndex())
    index.refresh(store)
    return index


@dataclass
class LookupRequest:
    """What a new request offers for matching."""

    hard_key: HardKey
    cond_vector: torch.Tensor
    prompt: str = ""
    text_vector: torch.Tensor | None = None
    noise: str = ""  # fingerprint of the initial noise, where the sampler has drawn it
    noise_process: NoiseProcess | None = None  # the model's: a donor of another process is filtered out


@dataclass
class Match:
    """The lookup's answer (the CARNATOR_MATCH value): candidates, best first, and why others fell out."""

    store_location: str  # the searched store's location: a directory or a store URL
    request: LookupRequest | None
    candidates: list[Candidate]
    filtered: dict[str, int] = field(default_factory=dict)
    searched: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def best(self) -> Candidate | None:
        return self.candidates[0] if self.candidates else None

    def report(self) -> str:
        """Readable summary for the node's string output."""
        lines = [f"Carnator lookup: {len(self.candidates)} candidate(s) among {self.searched} compatible entries"]
        for rank, candidate in enumerate(self.candidates, 1):
            text = "n/a" if candidate.text_similarity is None else f"{candidate.text_similarity:.3f}"
            lines.append(f"  {rank}. {candidate.entry_id[:8]} score {candidate.score:.3f} "
                         f"(text {text}, conditioning {candidate.cond_similarity:.3f}) {candidate.prompt[:80]!r}")
        for reason, count in sorted(self.filtered.items()):
            lines.append(f"  filtered: {count} with {reason}")
        lines.extend(f"  note: {note}" for note in self.notes)
        return "\n".join(lines)


def embed_prompt(prompt: str) -> tuple[torch.Tensor | None, str | None]:
    """Text vector of a prompt (`prompt_vectors`: ready when it was queued ahead), or (None, reason) when there is no
    text or no embedding model."""
    if not prompt.strip():
        return None, "no prompt text given: matched on conditioning only"
    try:
        return prompt_vectors().vector(prompt), None
    except EmbeddingError as error:
        return None, f"text embedding unavailable, matched on conditioning only: {error}"


def find_compatible(store: ReuseStore, request: LookupRequest, top_k: int, min_similarity: float,
                    same_noise_limit: int = 0) -> Match:
    """Shortlist donors for `request`: the `top_k` most similar above `min_similarity`, and the `same_noise_limit`
    most similar made from the request's initial noise whatever their similarity (the step-0 screen asks the model
    about those at no cost). Candidates whose entries vanished meanwhile are dropped.

    While the store is unavailable there are no candidates, and a note says why.
    """
    index = index_for(store)
    result: ShortlistResult = index.query(request.hard_key, request.cond_vector, request.text_vector,
                                          top_k=max(1, top_k) * 2, min_similarity=min_similarity,
                                          noise=request.noise, same_noise_limit=same_noise_limit * 2)
    live, filtered = [], dict(result.filtered)
    metas = store.get_metas([candidate.entry_id for candidate in result.candidates])
    if store.unavailable:  # nothing can be reused now; keep the index as it is for when the store is back
        return Match(store_location=store.location, request=request, candidates=[], searched=result.searched,
                     notes=[f"store unavailable, generating without reuse: {store.unavailable}"])
    for candidate, meta in zip(result.candidates, metas, strict=True):
        if meta is None:
            index.remove(candidate.entry_id)
            continue
        recorded = meta.extra.get(NOISE_PROCESS)
        reason = request.noise_process.mismatch(recorded) if request.noise_process and recorded is not None else None
        if reason is not None:
            filtered[reason] = filtered.get(reason, 0) + 1
            continue
        live.append(candidate)
    kept = [c for c in live if c.same_noise][:same_noise_limit]
    kept += [c for c in live if not c.same_noise][:top_k]
    kept.sort(key=lambda c: c.score, reverse=True)
    return Match(store_location=store.location, request=request, candidates=kept,
                 filtered=filtered, searched=result.searched)
