"""Semantic shortlist: the top-K stored requests most similar to a new one.

Hard compatibility partitions the index (one group per model/grid/schedule key), so a
query scores only candidates it could ever use; inside the group, similarity is one matrix
product. The index lives in memory, is filled from the store once, and then follows the
store's append sequence incrementally, so it stays fast at 100k entries and beyond.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from carnator_core.entry import HardKey
from carnator_core.store import IndexVectors, ReuseStore


@dataclass
class Candidate:
    """One shortlisted entry and how it scored."""

    entry_id: str
    prompt: str
    score: float
    cond_similarity: float
    text_similarity: float | None


@dataclass
class ShortlistResult:
    """Ranked candidates plus, for the report, how many entries were filtered and why."""

    candidates: list[Candidate]
    filtered: dict[str, int] = field(default_factory=dict)
    searched: int = 0


class _Group:
    """Rows of one hard-compatibility key; matrices are rebuilt lazily after appends."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.prompts: list[str] = []
        self.alive: list[bool] = []
        self._cond_rows: list[torch.Tensor] = []
        self._text_rows: list[torch.Tensor | None] = []
        self._matrices: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def add(self, entry_id: str, prompt: str, vectors: IndexVectors) -> int:
        self.ids.append(entry_id)
        self.prompts.append(prompt)
        self.alive.append(True)
        self._cond_rows.append(vectors.cond.float().reshape(-1))
        self._text_rows.append(None if vectors.text is None else vectors.text.float().reshape(-1))
        self._matrices = None
        return len(self.ids) - 1

    def kill(self, row: int) -> None:
        self.alive[row] = False
        self._matrices = None

    @property
    def live_count(self) -> int:
        return sum(self.alive)

    def matrices(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cond matrix, text matrix, has-text mask, alive mask), built once per change."""
        if self._matrices is None:
            cond = torch.stack(self._cond_rows).half()
            text_width = next((t.numel() for t in self._text_rows if t is not None), 1)
            text = torch.stack([t if t is not None else torch.zeros(text_width) for t in self._text_rows]).half()
            has_text = torch.tensor([t is not None for t in self._text_rows])
            self._matrices = (cond, text, has_text, torch.tensor(self.alive))
        return self._matrices


class ShortlistIndex:
    """In-memory index over a store's entries, refreshed incrementally from its sequence log."""

    def __init__(self) -> None:
        self._groups: dict[HardKey, _Group] = {}
        self._where: dict[str, tuple[HardKey, int]] = {}
        self._seen_sequence = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._where)

    def add(self, entry_id: str, hard_key: HardKey, prompt: str, vectors: IndexVectors) -> None:
        with self._lock:
            if entry_id in self._where:
                return
            group = self._groups.setdefault(hard_key, _Group())
            self._where[entry_id] = (hard_key, group.add(entry_id, prompt, vectors))

    def remove(self, entry_id: str) -> None:
        with self._lock:
            located = self._where.pop(entry_id, None)
            if located is not None:
                self._groups[located[0]].kill(located[1])

    def refresh(self, store: ReuseStore) -> int:
        """Add entries the store gained since the last refresh; returns how many were added."""
        new_ids, sequence = store.entries_since(self._seen_sequence)
        added = 0
        for entry_id in new_ids:
            meta = store.get_meta(entry_id)
            vectors = store.get_vectors(entry_id) if meta is not None else None
            if meta is None or vectors is None:
                continue  # deleted since, or corrupt (the store logged it once)
            self.add(entry_id, meta.hard_key, meta.prompt, vectors)
            added += 1
        self._seen_sequence = sequence
        return added

    @staticmethod
    def _with_text_width(matrices, width: int):
        """Entries embedded by another text model (other width) count as having no text."""
        cond, text, has_text, alive = matrices
        if text.shape[1] != width:
            text, has_text = torch.zeros(text.shape[0], width, dtype=text.dtype), torch.zeros_like(has_text)
        return cond, text, has_text, alive

    def query(self, hard_key: HardKey, cond: torch.Tensor, text: torch.Tensor | None,
              top_k: int, min_similarity: float) -> ShortlistResult:
        """Top-K compatible entries by cosine similarity.

        The score is the mean of the conditioning and text cosines where both sides have text,
        else the conditioning cosine alone.
        """
        filtered: dict[str, int] = {}
        parts = []
        with self._lock:
            for key, group in self._groups.items():
                if not group.live_count:
                    continue
                reason = hard_key.mismatch(key)
                if reason is not None:
                    filtered[reason] = filtered.get(reason, 0) + group.live_count
                else:
                    parts.append((group.matrices(), list(group.ids), list(group.prompts)))
        if not parts:
            return ShortlistResult([], filtered, 0)
        text_width = text.numel() if text is not None else 1
        matrices = [self._with_text_width(p[0], text_width) for p in parts]
        cond_matrix, text_matrix, has_text, alive = (torch.cat([m[i] for m in matrices]) for i in range(4))
        ids = [entry_id for p in parts for entry_id in p[1]]
        prompts = [prompt for p in parts for prompt in p[2]]
        cond_sim = cond_matrix.float() @ cond.float().reshape(-1)
        score = cond_sim.clone()
        text_sim = None
        if text is not None:
            text_sim = text_matrix.float() @ text.float().reshape(-1)
            score = torch.where(has_text, (cond_sim + text_sim) / 2, cond_sim)
        score = torch.where(alive, score, torch.full_like(score, -2.0))
        eligible = alive & (score >= min_similarity)
        below = int((alive & ~eligible).sum())
        if below:
            filtered["below min similarity"] = below
        count = min(int(top_k), int(eligible.sum()))
        if count <= 0:
            return ShortlistResult([], filtered, int(alive.sum()))
        best = torch.topk(torch.where(eligible, score, torch.full_like(score, -3.0)), count).indices.tolist()
        candidates = [
            Candidate(entry_id=ids[i], prompt=prompts[i], score=float(score[i]), cond_similarity=float(cond_sim[i]),
                      text_similarity=float(text_sim[i]) if text_sim is not None and bool(has_text[i]) else None)
            for i in best
        ]
        return ShortlistResult(candidates, filtered, int(alive.sum()))
