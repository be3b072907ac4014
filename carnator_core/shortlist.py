"""Semantic shortlist: the top-K stored requests most similar to a new one.

Hard compatibility partitions the index (one group per model/grid/schedule key), so a
query scores only candidates it could ever use. Inside a group, conditioning and text
vectors sit side by side in one fp16 matrix that grows by doubling, so a query is a single
matrix-vector product over the group and an add costs O(1); the best few are then
re-scored exactly in fp32. The index lives in memory, is filled from the store once, and
then follows the store's append sequence incrementally.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from carnator_core.entry import HardKey
from carnator_core.store import IndexVectors, ReuseStore

_RERANK_FACTOR = 4  # coarse fp16 candidates per requested candidate, re-scored in fp32


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
    """Rows of one hard-compatibility key: [cond | text] vectors in a doubling fp16 buffer."""

    def __init__(self, cond_width: int, text_width: int) -> None:
        self.cond_width, self.text_width = cond_width, text_width
        self.ids: list[str] = []
        self.prompts: list[str] = []
        self.live_count = 0
        self._rows = torch.zeros(16, cond_width + text_width, dtype=torch.float16)
        self._has_text = torch.zeros(16, dtype=torch.bool)
        self._text_weight = torch.ones(16)  # 2 for rows without text: their coarse dot holds cond/2 only
        self._dead = torch.zeros(16)  # -inf for removed rows, 0 for live ones

    def add(self, entry_id: str, prompt: str, vectors: IndexVectors) -> int:
        row = len(self.ids)
        if row == self._rows.shape[0]:
            grow = self._rows.shape[0]
            self._rows = torch.cat([self._rows, torch.zeros_like(self._rows[:grow])])
            self._has_text = torch.cat([self._has_text, torch.zeros_like(self._has_text[:grow])])
            self._text_weight = torch.cat([self._text_weight, torch.ones(grow)])
            self._dead = torch.cat([self._dead, torch.zeros(grow)])
        self._rows[row, : self.cond_width] = vectors.cond.reshape(-1).half()
        if vectors.text is not None and vectors.text.numel() == self.text_width:
            self._rows[row, self.cond_width:] = vectors.text.reshape(-1).half()
            self._has_text[row] = True
        else:
            self._text_weight[row] = 2.0
        self.ids.append(entry_id)
        self.prompts.append(prompt)
        self.live_count += 1
        return row

    def kill(self, row: int) -> None:
        if self._dead[row] == 0:
            self._dead[row] = float("-inf")
            self.live_count -= 1

    def exact_scores(self, rows: torch.Tensor, cond: torch.Tensor, text: torch.Tensor | None):
        """(score, cond similarity, text similarity or NaN) of the given rows, in fp32."""
        vectors, has_text = self._rows[rows].float(), self._has_text[rows]
        cond_sim = vectors[:, : self.cond_width] @ cond
        text_sim = torch.full_like(cond_sim, float("nan"))
        score = cond_sim
        if text is not None:
            text_sim = torch.where(has_text, vectors[:, self.cond_width:] @ text, text_sim)
            score = torch.where(has_text, (cond_sim + text_sim.nan_to_num()) / 2, cond_sim)
        return score, cond_sim, text_sim

    def coarse_scores(self, query: torch.Tensor, text_given: bool) -> torch.Tensor:
        """Approximate scores in one fp16 product: dead rows -inf, rows without text doubled.

        Few full-length operations on purpose: at 100k rows each one costs milliseconds.
        """
        count = len(self.ids)
        dot = (self._rows[:count] @ query).float()
        if text_given:
            return torch.addcmul(self._dead[:count], dot, self._text_weight[:count])
        return dot.add_(self._dead[:count])


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
            group = self._groups.get(hard_key)
            if group is None:
                text_width = vectors.text.numel() if vectors.text is not None else 384
                group = self._groups[hard_key] = _Group(vectors.cond.numel(), text_width)
            if vectors.cond.numel() != group.cond_width:
                return  # written with another conditioning summary width: not comparable
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

    def query(self, hard_key: HardKey, cond: torch.Tensor, text: torch.Tensor | None,
              top_k: int, min_similarity: float) -> ShortlistResult:
        """Top-K compatible entries by cosine similarity.

        The score is the mean of the conditioning and text cosines where both sides have text,
        else the conditioning cosine alone.
        """
        filtered: dict[str, int] = {}
        candidates: list[Candidate] = []
        searched = below = 0
        cond = cond.float().reshape(-1)
        with self._lock:
            for key, group in self._groups.items():
                if not group.live_count:
                    continue
                reason = hard_key.mismatch(key)
                if reason is not None or cond.numel() != group.cond_width:
                    reason = reason or "other conditioning width"
                    filtered[reason] = filtered.get(reason, 0) + group.live_count
                    continue
                searched += group.live_count
                found, dropped = self._query_group(group, cond, text, top_k, min_similarity)
                candidates.extend(found)
                below += dropped
        if below:
            filtered["below min similarity"] = below
        candidates.sort(key=lambda c: c.score, reverse=True)
        return ShortlistResult(candidates[:top_k], filtered, searched)

    @staticmethod
    def _query_group(group: _Group, cond: torch.Tensor, text: torch.Tensor | None, top_k: int,
                     min_similarity: float) -> tuple[list[Candidate], int]:
        text_used = text.float().reshape(-1) if text is not None and text.numel() == group.text_width else None
        query = torch.cat([cond, text_used if text_used is not None else torch.zeros(group.text_width)])
        coarse = group.coarse_scores((query / (2 if text_used is not None else 1)).half(), text_used is not None)
        below = int((coarse < min_similarity).sum()) - (len(group.ids) - group.live_count)
        rows = torch.topk(coarse, min(len(coarse), top_k * _RERANK_FACTOR)).indices
        rows = rows[coarse[rows] > float("-inf")]
        score, cond_sim, text_sim = group.exact_scores(rows, cond, text_used)
        found = []
        for position, row in enumerate(rows.tolist()):
            if float(score[position]) < min_similarity:
                continue
            similarity = float(text_sim[position])
            found.append(Candidate(entry_id=group.ids[row], prompt=group.prompts[row], score=float(score[position]),
                                   cond_similarity=float(cond_sim[position]),
                                   text_similarity=None if similarity != similarity else similarity))
        return found, below
