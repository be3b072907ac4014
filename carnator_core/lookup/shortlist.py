"""Semantic shortlist: the top-K stored requests most similar to a new one.

Hard compatibility partitions the index (one group per model/grid/schedule key), so a
query scores only candidates it could ever use. Inside a group, conditioning and text
vectors sit side by side in fp16 rows, kept in lists of at most `list_size` rows. A small
group is one list, scanned whole. A list that outgrows `list_size` splits in two by 2-means,
so a large group becomes an inverted file: a query scores the lists' centroids, then the
rows of the nearest lists up to `probe_rows` rows, and finally re-scores the best few
exactly in fp32. Once a group has split, its coarse stage uses compact codes (the rows
projected on the group's CODE_DIMS principal axes, fp32: on CPUs a fp32 product over those few
numbers costs a small fraction of a fp16 one over the whole row), so a query reads the codes of
the probed lists rather than every row. The index lives in memory, is filled from the store
once in batches, and then follows the store's append log.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from carnator_core.store.entry import OTHER_SCOPE, HardKey
from carnator_core.store.reuse_store import IndexEntry, ReuseStore

_RERANK_FACTOR = 8  # coarse candidates per requested candidate, re-scored exactly in fp32
LIST_SIZE = 1024  # rows per list before it splits: one list (an exact scan) up to this size
PROBE_ROWS = 16384  # rows a query scores: groups up to this size are scanned whole
_REFRESH_BATCH = 1000  # entries fetched from the store per round trip
CODE_DIMS = 128  # width of the compact coarse vectors of split groups
_BASIS_SAMPLE = 16384  # rows a group's principal axes are estimated from
_BASIS_FINAL = 65536  # a group re-estimates its axes each time it grows 8x, until it holds this many rows
_NOT_PROBED = "outside the probed index lists"


@dataclass
class Candidate:
    """One shortlisted entry and how it scored."""

    entry_id: str
    prompt: str
    score: float
    cond_similarity: float
    text_similarity: float | None
    same_noise: bool = False  # made from the request's initial noise: the step-0 screen judges it at no cost


@dataclass
class ShortlistResult:
    """Ranked candidates plus, for the report, how many entries were filtered and why."""

    candidates: list[Candidate]
    filtered: dict[str, int] = field(default_factory=dict)
    searched: int = 0


class _List:
    """Rows of one list: [cond | text] vectors in doubling buffers, removed rows marked -inf."""

    def __init__(self, width: int, capacity: int = 16, basis: torch.Tensor | None = None) -> None:
        self.rows = torch.zeros(capacity, width, dtype=torch.float16)
        self.basis = basis
        self.codes = torch.zeros(capacity, basis.shape[1]) if basis is not None else None
        self.has_text = torch.zeros(capacity, dtype=torch.bool)
        self.text_weight = torch.ones(capacity)  # 2 for rows without text: their coarse dot holds cond/2 only
        self.dead = torch.zeros(capacity)  # -inf for removed rows, 0 for live ones
        self.ids: list[str] = []
        self.prompts: list[str] = []

    def append(self, rows: torch.Tensor, has_text: torch.Tensor, ids: list[str], prompts: list[str]) -> range:
        start, end = len(self.ids), len(self.ids) + len(ids)
        if end > self.rows.shape[0]:
            capacity = max(end, 2 * self.rows.shape[0])
            grow = capacity - self.rows.shape[0]
            self.rows = torch.cat([self.rows, self.rows.new_zeros(grow, self.rows.shape[1])])
            self.has_text = torch.cat([self.has_text, self.has_text.new_zeros(grow)])
            self.text_weight = torch.cat([self.text_weight, torch.ones(grow)])
            self.dead = torch.cat([self.dead, torch.zeros(grow)])
            if self.codes is not None:
                self.codes = torch.cat([self.codes, self.codes.new_zeros(grow, self.codes.shape[1])])
        self.rows[start:end] = rows.half()
        if self.codes is not None:
            self.codes[start:end] = rows.float() @ self.basis
        self.has_text[start:end] = has_text
        self.text_weight[start:end] = torch.where(has_text, 1.0, 2.0)
        self.ids.extend(ids)
        self.prompts.extend(prompts)
        return range(start, end)

    def use_basis(self, basis: torch.Tensor) -> None:
        """Score through compact codes (rows projected on `basis`) from now on."""
        self.basis = basis
        self.codes = self.rows.float() @ basis

    def coarse_scores(self, query: torch.Tensor, query_code: torch.Tensor | None, text_given: bool) -> torch.Tensor:
        """Approximate scores in one product (fp32 codes, else fp16 rows): dead rows -inf, rows without text doubled."""
        count = len(self.ids)
        if self.codes is not None:
            dot = self.codes[:count] @ query_code
        else:
            dot = (self.rows[:count] @ query).float()
        if text_given:
            return torch.addcmul(self.dead[:count], dot, self.text_weight[:count])
        return dot.add_(self.dead[:count])


class _Group:
    """Rows of one hard-compatibility key, in lists with running centroids."""

    def __init__(self, cond_width: int, text_width: int, list_size: int) -> None:
        self.cond_width, self.text_width, self.list_size = cond_width, text_width, list_size
        self.width = cond_width + text_width
        self.lists = [_List(self.width)]
        self.sums = torch.zeros(1, self.width)  # per list: sum of its live rows (the centroid, unnormalised)
        self.counts = torch.zeros(1)
        self.where: dict[str, tuple[int, int]] = {}  # entry id -> (list, row)
        self.by_noise: dict[str, set[str]] = {}  # initial-noise fingerprint -> live entry ids
        self.noise_of: dict[str, str] = {}
        self.basis: torch.Tensor | None = None  # (width, CODE_DIMS) principal axes, once the group has split
        self._basis_rows = 0
        self._centroids: torch.Tensor | None = None  # sums / counts, kept until the lists change

    @property
    def live_count(self) -> int:
        return len(self.where)

    def add(self, entries: list[IndexEntry]) -> None:
        has_text = torch.tensor([e.vectors.text is not None and e.vectors.text.numel() == self.text_width
                                 for e in entries])
        blank = torch.zeros(self.text_width)
        rows = torch.cat([torch.stack([e.vectors.cond.reshape(-1) for e in entries]).float(),
                          torch.stack([e.vectors.text.reshape(-1) if text else blank
                                       for e, text in zip(entries, has_text.tolist(), strict=True)]).float()], dim=1)
        if len(self.lists) == 1:
            targets = torch.zeros(len(entries), dtype=torch.long)
        else:
            targets = (rows @ self.centroids().T).argmax(dim=1)
        for entry in entries:
            if entry.noise:
                self.by_noise.setdefault(entry.noise, set()).add(entry.entry_id)
                self.noise_of[entry.entry_id] = entry.noise
        pending = targets.unique().tolist()
        for slot in pending:
            chosen = (targets == slot).nonzero().squeeze(1).tolist()
            self._place(slot, rows[chosen], has_text[chosen], [entries[i].entry_id for i in chosen],
                        [entries[i].prompt for i in chosen])
        while pending:
            slot = pending.pop()
            if len(self.lists[slot].ids) > self.list_size:
                pending += [slot, self._split(slot)]
        if len(self.lists) > 1 and self._basis_rows < _BASIS_FINAL and self.live_count >= 8 * self._basis_rows:
            self._estimate_basis()

    def _estimate_basis(self) -> None:
        """Principal axes of (a sample of) the live rows: the compact coarse stage keeps most of each row's
        energy in CODE_DIMS numbers, and a fp32 product over them costs a fraction of one over fp16 rows."""
        alive = torch.cat([lst.rows[: len(lst.ids)][lst.dead[: len(lst.ids)] == 0] for lst in self.lists])
        sample = alive[torch.randperm(len(alive), generator=torch.Generator().manual_seed(0))[:_BASIS_SAMPLE]].float()
        _, vectors = torch.linalg.eigh(sample.T @ sample)
        self.basis = vectors[:, -CODE_DIMS:].flip(1).contiguous()
        self._basis_rows = self.live_count
        for lst in self.lists:
            lst.use_basis(self.basis)

    def centroids(self) -> torch.Tensor:
        if self._centroids is None:
            self._centroids = self.sums / self.counts.clamp(min=1).unsqueeze(1)
        return self._centroids

    def _place(self, slot: int, rows: torch.Tensor, has_text: torch.Tensor, ids: list[str], prompts: list[str]) -> None:
        positions = self.lists[slot].append(rows, has_text, ids, prompts)
        for entry_id, position in zip(ids, positions, strict=True):
            self.where[entry_id] = (slot, position)
        self.sums[slot] += rows.sum(dim=0)
        self.counts[slot] += len(ids)
        self._centroids = None

    def _split(self, slot: int) -> int:
        """Replace an overfull list by two, cut by a few 2-means rounds over its live rows; returns the new slot.

        Removed rows are dropped on the way; a list that is overfull only with removed rows is just compacted.
        """
        old = self.lists[slot]
        alive = (old.dead[: len(old.ids)] == 0).nonzero().squeeze(1)
        vectors = old.rows[alive].float()
        side = torch.zeros(len(alive), dtype=torch.bool)
        if len(alive) > self.list_size:
            first = vectors[0]
            second = vectors[(vectors @ first).argmin()]
            for _ in range(4):
                side = (vectors @ second) > (vectors @ first)
                if side.all() or not side.any():
                    break
                first, second = vectors[~side].mean(dim=0), vectors[side].mean(dim=0)
            if side.all() or not side.any():  # identical rows: halve
                side = torch.arange(len(alive)) % 2 == 1
        new_slot = len(self.lists)
        self.lists[slot] = _List(self.width, max(16, self.list_size), self.basis)
        self.lists.append(_List(self.width, max(16, self.list_size), self.basis))
        self.sums = torch.cat([self.sums, self.sums.new_zeros(1, self.width)])
        self.counts = torch.cat([self.counts, self.counts.new_zeros(1)])
        self.sums[slot], self.counts[slot] = 0, 0
        self._centroids = None
        for target, members in ((slot, alive[~side]), (new_slot, alive[side])):
            rows = members.tolist()
            self._place(target, old.rows[members].float(), old.has_text[members], [old.ids[i] for i in rows],
                        [old.prompts[i] for i in rows])
        return new_slot

    def kill(self, entry_id: str) -> None:
        noise = self.noise_of.pop(entry_id, None)
        if noise is not None:
            self.by_noise[noise].discard(entry_id)
            if not self.by_noise[noise]:
                del self.by_noise[noise]
        slot, row = self.where.pop(entry_id)
        target = self.lists[slot]
        target.dead[row] = float("-inf")
        self.sums[slot] -= target.rows[row].float()
        self.counts[slot] -= 1
        self._centroids = None

    def probe(self, query: torch.Tensor, probe_rows: int) -> list[int]:
        """The lists a query scores: all when the group has at most `probe_rows` rows, else the lists with
        the nearest centroids until they hold `probe_rows` rows together."""
        if self.live_count <= probe_rows or len(self.lists) == 1:
            return list(range(len(self.lists)))
        order = torch.argsort(self.centroids() @ query, descending=True)
        enough = int(torch.searchsorted(self.counts[order].cumsum(0), float(probe_rows))) + 1
        return order[:enough].tolist()


class ShortlistIndex:
    """In-memory index over a store's entries, refreshed incrementally from its append log."""

    def __init__(self, list_size: int = LIST_SIZE, probe_rows: int = PROBE_ROWS) -> None:
        self.list_size, self.probe_rows = list_size, probe_rows
        self._groups: dict[HardKey, _Group] = {}
        self._group_of: dict[str, HardKey] = {}
        self._seen_sequence = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._group_of)

    def add_many(self, entries: list[IndexEntry]) -> None:
        """Add entries (ones already indexed, or with another conditioning width than their group, are skipped)."""
        by_key: dict[HardKey, list[IndexEntry]] = {}
        with self._lock:
            for entry in entries:
                if entry.entry_id in self._group_of:
                    continue
                group = self._groups.get(entry.hard_key)
                if group is None:
                    text_width = entry.vectors.text.numel() if entry.vectors.text is not None else 384
                    group = self._groups[entry.hard_key] = _Group(entry.vectors.cond.numel(), text_width,
                                                                  self.list_size)
                if entry.vectors.cond.numel() != group.cond_width:
                    continue  # written with another conditioning summary width: not comparable
                self._group_of[entry.entry_id] = entry.hard_key
                by_key.setdefault(entry.hard_key, []).append(entry)
            for key, group_entries in by_key.items():
                self._groups[key].add(group_entries)

    def remove(self, entry_id: str) -> None:
        with self._lock:
            key = self._group_of.pop(entry_id, None)
            if key is not None:
                self._groups[key].kill(entry_id)

    def refresh(self, store: ReuseStore) -> int:
        """Add entries the store gained since the last refresh; returns how many were added.

        Starts over when the store's log did (a server that lost its data); stops where it is,
        to continue next time, when the store becomes unavailable midway.
        """
        new_ids, sequence = store.entries_since(self._seen_sequence)
        if sequence < self._seen_sequence:
            with self._lock:
                self._groups.clear()
                self._group_of.clear()
            new_ids, sequence = store.entries_since(0)
        added = 0
        for start in range(0, len(new_ids), _REFRESH_BATCH):
            entries = store.index_entries(new_ids[start:start + _REFRESH_BATCH])
            if store.unavailable:
                return added
            self.add_many(entries)
            added += len(entries)
        self._seen_sequence = sequence
        return added

    def same_noise_ids(self, hard_key: HardKey, noise: str) -> list[str]:
        """The live entries of `hard_key`'s scope, model and grid (any schedule) made from the initial noise `noise`."""
        with self._lock:
            return sorted(entry for key, group in self._groups.items() if hard_key.mismatch(key) is None
                          for entry in group.by_noise.get(noise, ()))

    def query(self, hard_key: HardKey, cond: torch.Tensor, text: torch.Tensor | None,
              top_k: int, min_similarity: float, noise: str = "", same_noise_limit: int = 0) -> ShortlistResult:
        """Top-K compatible entries by cosine similarity, plus up to `same_noise_limit` entries made from the
        initial noise `noise`, ranked but never cut by `min_similarity`: the model judges those at step 0 with the
        request's own first evaluation, so no similarity may keep them from it.

        The score is the mean of the conditioning and text cosines where both sides have text,
        else the conditioning cosine alone.
        """
        filtered: dict[str, int] = {}
        candidates: list[Candidate] = []
        same_noise: list[Candidate] = []
        noise_ids: set[str] = set()
        searched = 0
        cond = cond.float().reshape(-1)
        with self._lock:
            for key, group in self._groups.items():
                if not group.live_count:
                    continue
                reason = hard_key.mismatch(key)
                if reason == OTHER_SCOPE:
                    continue  # another user's entries: not searched, not counted, not named
                if reason is not None or cond.numel() != group.cond_width:
                    reason = reason or "other conditioning width"
                    filtered[reason] = filtered.get(reason, 0) + group.live_count
                    continue
                searched += group.live_count
                candidates.extend(self._query_group(group, cond, text, top_k, min_similarity, filtered))
                if noise and same_noise_limit > 0:
                    same_noise.extend(self._same_noise(group, noise, cond, text, same_noise_limit))
                    noise_ids |= group.by_noise.get(noise, set())
        candidates.sort(key=lambda c: c.score, reverse=True)
        candidates = candidates[:top_k]
        same_noise.sort(key=lambda c: c.score, reverse=True)
        kept = {c.entry_id for c in candidates}
        for candidate in candidates:
            candidate.same_noise = candidate.entry_id in noise_ids
        extra = [c for c in same_noise if c.entry_id not in kept][:same_noise_limit]
        below = sum(c.score < min_similarity for c in extra)
        if below:
            filtered["below min similarity"] = filtered.get("below min similarity", 0) - below
        merged = sorted(candidates + extra, key=lambda c: c.score, reverse=True)
        return ShortlistResult(merged, {k: v for k, v in filtered.items() if v > 0}, searched)

    def _same_noise(self, group: _Group, noise: str, cond: torch.Tensor, text: torch.Tensor | None,
                    limit: int) -> list[Candidate]:
        """The `limit` most similar live entries of `group` made from the initial noise `noise`, exactly scored."""
        ids = group.by_noise.get(noise)
        if not ids:
            return []
        located = [(group.lists[slot], row) for slot, row in (group.where[i] for i in ids)]
        text_used = text.float().reshape(-1) if text is not None and text.numel() == group.text_width else None
        found = self._rerank(group, located, cond, text_used, float("-inf"), limit)
        for candidate in found:
            candidate.same_noise = True
        return found

    def _query_group(self, group: _Group, cond: torch.Tensor, text: torch.Tensor | None, top_k: int,
                     min_similarity: float, filtered: dict[str, int]) -> list[Candidate]:
        text_used = text.float().reshape(-1) if text is not None and text.numel() == group.text_width else None
        query = torch.cat([cond, text_used if text_used is not None else torch.zeros(group.text_width)])
        query = query / (2 if text_used is not None else 1)
        slots = group.probe(query, self.probe_rows)
        query_half = query.half()
        query_code = query @ group.basis if group.basis is not None else None
        parts = [group.lists[slot].coarse_scores(query_half, query_code, text_used is not None) for slot in slots]
        coarse = torch.cat(parts)
        dead = int(torch.isneginf(coarse).sum())
        filtered["below min similarity"] = filtered.get("below min similarity", 0) + int(
            (coarse < min_similarity).sum()) - dead
        filtered[_NOT_PROBED] = filtered.get(_NOT_PROBED, 0) + group.live_count - (len(coarse) - dead)
        picks = torch.topk(coarse, min(len(coarse), top_k * _RERANK_FACTOR)).indices
        picks = picks[coarse[picks] > float("-inf")]
        starts = torch.tensor([0] + [len(part) for part in parts]).cumsum(0)
        parts_of = torch.searchsorted(starts, picks, right=True) - 1
        located = [(group.lists[slots[part]], pick - int(starts[part]))
                   for part, pick in zip(parts_of.tolist(), picks.tolist(), strict=True)]
        return self._rerank(group, located, cond, text_used, min_similarity, top_k)

    @staticmethod
    def _rerank(group: _Group, located: list[tuple[_List, int]], cond: torch.Tensor, text: torch.Tensor | None,
                min_similarity: float, top_k: int) -> list[Candidate]:
        """The best `top_k` coarse winners by exact fp32 score (mean of cond and text cosines where both exist)."""
        if not located:
            return []
        vectors = torch.stack([rows.rows[row] for rows, row in located]).float()
        has_text = torch.stack([rows.has_text[row] for rows, row in located])
        cond_sim = vectors[:, : group.cond_width] @ cond
        text_sim = torch.full_like(cond_sim, float("nan"))
        score = cond_sim
        if text is not None:
            text_sim = torch.where(has_text, vectors[:, group.cond_width:] @ text, text_sim)
            score = torch.where(has_text, (cond_sim + text_sim.nan_to_num()) / 2, cond_sim)
        order = torch.argsort(score, descending=True)[:top_k].tolist()
        scores, conds, texts = score.tolist(), cond_sim.tolist(), text_sim.tolist()
        return [Candidate(entry_id=located[i][0].ids[located[i][1]], prompt=located[i][0].prompts[located[i][1]],
                          score=scores[i], cond_similarity=conds[i],
                          text_similarity=None if texts[i] != texts[i] else texts[i])
                for i in order if scores[i] >= min_similarity]
