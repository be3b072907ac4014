"""Block-sparse attention in plain PyTorch, fast on CPU.

Work is done by PyTorch's fused CPU flash attention (the op behind SDPA, in the variant that also
returns the log-sum-exp) on batches of query blocks, in two ways:

- long key runs (>= MIN_RUN consecutive key blocks, as bands at higher densities produce) are read in
  place: the same run attended by many query blocks is one call with those query blocks stacked
  ("column"), and runs at a fixed offset from consecutive query blocks are an overlapping strided view
  of K/V ("diagonal"), so none of their bytes are copied;
- every other key block of a query block is gathered, per query block, into one contiguous key
  sequence (cache-sized, reused buffers) and query blocks with equally many gathered blocks share a
  call. Short runs are cheaper gathered than attended one by one: a call over a few key tokens runs
  far below the kernel's peak, while the copy costs 13-25% of the attention it feeds (128-/64-token
  blocks, measured).

Partial results of one query block are merged exactly by log-sum-exp. A ragged last block is always
the last gathered block (or the end of a run) and is cut at the true token count. Query blocks with no
key block stay zero; NaN/inf propagate through the merge as through dense attention. CPU tensors only:
the LSE variant of the kernel is CPU's (CUDA uses the Triton kernel).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.layout import BlockLayout

# Gathered K+V bytes per call: enough query blocks per call to amortise its fixed cost, while the
# buffers stay in the last-level cache (1-8 MB measured within noise; 8 MB slightly ahead).
CHUNK_BYTES = 8 << 20
# Runs of at least this many blocks (>= 512 tokens, the kernel's key split) are read in place; shorter
# ones are cheaper gathered (measured: 8 beat 4 and 16 at densities 0.25-0.5 for 64- and 128-blocks).
MIN_RUN = 8
# ...as one stacked-query call when at least this many query blocks share the run.
MIN_COLUMN = 4

# Fused CPU flash attention returning (output, logsumexp); a private ATen op, present since torch 2.3.
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, 1, Lq, D) x (m, 1, Lk, D) -> output (m, Lq, D) and logsumexp (m, Lq)."""
    out, lse = _flash(q, k, v, 0.0, False, attn_mask=None, scale=scale)
    return out.squeeze(1), lse.squeeze(1)


def _blocked(x: torch.Tensor, block_size: int, num_blocks: int) -> torch.Tensor:
    """(B, H, N, D) -> contiguous (B*H*num_blocks, block_size, D), zero-padded; a view when already so."""
    batch, heads, n, dim = x.shape
    padded = num_blocks * block_size
    if n == padded and x.is_contiguous():
        return x.view(batch * heads * num_blocks, block_size, dim)
    out = x.new_zeros(batch, heads, padded, dim) if n != padded else torch.empty_like(x, memory_format=torch.contiguous_format)
    out[:, :, :n] = x
    return out.view(batch * heads * num_blocks, block_size, dim)


class _Accumulator:
    """Per query block: attention over the parts seen so far (kept normalised) and its log-sum-exp."""

    def __init__(self, rows: int, block_size: int, dim: int, like: torch.Tensor) -> None:
        dtype = like.dtype if like.dtype in (torch.float32, torch.float64) else torch.float32
        self.out = torch.zeros(rows, block_size, dim, dtype=dtype, device=like.device)
        self.lse = torch.full((rows, block_size), float("-inf"), dtype=dtype, device=like.device)
        self.touched = torch.zeros(rows, dtype=torch.bool, device=like.device)

    def add(self, rows: slice | torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
        """Merge (m, bs, D) outputs and (m, bs) log-sum-exps into the distinct query blocks `rows`."""
        lse = lse.to(self.lse.dtype)
        in_place = isinstance(rows, slice)
        first = not bool(self.touched[rows].any())
        self.touched[rows] = True
        if first:  # nothing to merge with: a plain copy
            if in_place:
                self.out[rows] = out
                self.lse[rows] = lse
            else:
                self.out.index_copy_(0, rows, out.to(self.out.dtype))
                self.lse.index_copy_(0, rows, lse)
            return
        acc = self.out[rows] if in_place else self.out.index_select(0, rows)
        acc_lse = self.lse[rows] if in_place else self.lse.index_select(0, rows)
        total = torch.logaddexp(acc_lse, lse)
        acc.mul_(torch.exp(acc_lse - total).unsqueeze(-1))
        acc.addcmul_(out, torch.exp(lse - total).unsqueeze(-1))
        if in_place:
            acc_lse.copy_(total)
        else:
            self.out.index_copy_(0, rows, acc)
            self.lse.index_copy_(0, rows, total)


def _sorted_rows(layout: BlockLayout, batch: int, heads: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B*H*nb, width) ascending key blocks per query block (padding = nb sorts last) and their counts."""
    nb = layout.num_blocks
    indices, counts = layout.to(device).expanded(batch, heads)
    rows = batch * heads * nb
    counts = counts.reshape(rows).long()
    width = indices.shape[-1]
    valid = torch.arange(width, device=device) < counts[:, None]
    return torch.where(valid, indices.reshape(rows, width).long(), nb).sort(-1).values, counts


def _long_runs(indices: torch.Tensor, counts: torch.Tensor) -> dict[str, torch.Tensor]:
    """Maximal runs of consecutive key blocks at least MIN_RUN long: row, position in row, start, length."""
    rows, width = indices.shape
    valid = torch.arange(width, device=indices.device) < counts[:, None]
    previous = torch.cat([indices.new_full((rows, 1), -2), indices[:, :-1]], dim=1)
    row, position = (valid & (indices != previous + 1)).nonzero(as_tuple=True)
    same_row = torch.roll(row, -1) == row
    if same_row.numel():
        same_row[-1] = False
    length = torch.where(same_row, torch.roll(position, -1), counts[row]) - position
    long = length >= MIN_RUN
    row, position, length = row[long], position[long], length[long]
    return {"row": row, "position": position, "start": indices[row, position], "length": length}


def cpu_block_sparse_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout, scale: float | None = None
) -> torch.Tensor:
    """Attention over CPU (B, H, N, D) tensors restricted to `layout`; returns (B, H, N, D)."""
    batch, heads, n, dim = q.shape
    bs, nb = layout.block_size, layout.num_blocks
    tail = n - (nb - 1) * bs  # real tokens in the last block
    qb, kb, vb = (_blocked(x, bs, nb) for x in (q, k, v))
    acc = _Accumulator(batch * heads * nb, bs, dim, q)
    indices, counts = _sorted_rows(layout, batch, heads, q.device)

    def key_tokens(blocks: int, ragged: bool) -> int:
        return blocks * bs - (bs - tail if ragged else 0)

    runs = _long_runs(indices, counts)
    columns, diagonals, in_place = _plan_runs(runs, nb, batch * heads, tail < bs)
    # Blocks not read in place are gathered: mark each in-place run's entries as covered.
    covered = torch.zeros(indices.shape[0], indices.shape[1] + 1, dtype=torch.int32, device=q.device)
    row, position, length = runs["row"][in_place], runs["position"][in_place], runs["length"][in_place]
    covered.index_put_((row, position), torch.ones_like(row, dtype=torch.int32), accumulate=True)
    covered.index_put_((row, position + length), torch.full_like(row, -1, dtype=torch.int32), accumulate=True)
    keep = (torch.arange(indices.shape[1], device=q.device) < counts[:, None]) & (covered.cumsum(1)[:, :-1] == 0)
    order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices
    rest = torch.where(keep, indices, nb).gather(1, order)  # gathered blocks first, ascending
    # Global block ids into qb/kb/vb: query block r belongs to (batch, head) r // nb.
    _attend_gathered(rest + (torch.arange(rest.shape[0], device=q.device) // nb * nb)[:, None], keep.sum(1),
                     (rest == nb - 1).any(1) & (tail < bs), qb, kb, vb, acc, key_tokens, scale)

    for rows, s, blocks, ragged in columns:
        tokens = key_tokens(blocks, ragged)
        out, lse = _attend(qb.index_select(0, rows).view(1, 1, -1, dim), kb[s : s + blocks].view(1, 1, -1, dim)[:, :, :tokens],
                           vb[s : s + blocks].view(1, 1, -1, dim)[:, :, :tokens], scale)
        acc.add(rows, out.view(-1, bs, dim), lse.view(-1, bs))
    strides = (bs * dim, bs * dim, dim, 1)
    for first_row, m, s, blocks in diagonals:
        window = (m, 1, blocks * bs, dim)
        keys = kb.as_strided(window, strides, kb.storage_offset() + s * bs * dim)
        values = vb.as_strided(window, strides, vb.storage_offset() + s * bs * dim)
        out, lse = _attend(qb[first_row : first_row + m].unsqueeze(1), keys, values, scale)
        acc.add(slice(first_row, first_row + m), out, lse)
    return acc.out.to(q.dtype).view(batch, heads, nb * bs, dim)[:, :, :n]


def _plan_runs(runs: dict[str, torch.Tensor], nb: int, groups: int, ragged: bool
               ) -> tuple[list[tuple[torch.Tensor, int, int, bool]], list[tuple[int, int, int, int]], torch.Tensor]:
    """Which long runs are read in place, batched as columns (query blocks, start, blocks, ragged) and
    diagonals (first query block, count, start, blocks), with global block indices; plus a mask of the
    runs so covered (the others are gathered)."""
    row, length = runs["row"], runs["length"]
    start = runs["start"] + row // nb * nb  # global block index
    cut = (runs["start"] + length == nb) & ragged
    # Columns: one run of one (batch, head) attended by many of its query blocks; queries stacked.
    column_key = start * (nb + 1) + length
    _, inverse, sizes = torch.unique(column_key, return_inverse=True, return_counts=True)
    in_column = sizes[inverse] >= MIN_COLUMN
    members = torch.nonzero(in_column)[:, 0]
    members = members[torch.argsort(column_key[members], stable=True)]
    _, group_sizes = torch.unique_consecutive(column_key[members], return_counts=True)
    groups_list = torch.split(members, group_sizes.tolist())
    firsts = [int(group[0]) for group in groups_list]
    columns = [(row[group], int(start[first]), int(length[first]), bool(cut[first]))
               for group, first in zip(groups_list, firsts, strict=True)]
    # Diagonals: equal-length runs at one offset from consecutive query blocks of one (batch, head).
    # Sorting by (offset, length, head, query block) puts a diagonal's members at key steps of 1; the
    # (nb + 1) spacing per head makes a step across heads 2, which ends the diagonal.
    rest = torch.nonzero(~in_column & ~cut)[:, 0]
    offset = start[rest] - row[rest]
    key = ((offset * (nb + 1) + length[rest]) * groups + row[rest] // nb) * (nb + 1) + row[rest] % nb
    key, order = torch.sort(key)
    rest = rest[order]
    breaks = torch.nonzero(key[1:] - key[:-1] != 1)[:, 0] + 1
    bounds = torch.cat([breaks.new_zeros(1), breaks, breaks.new_full((1,), rest.numel())])
    sizes = bounds[1:] - bounds[:-1]
    strided = sizes >= 2
    in_diagonal = torch.zeros_like(in_column)
    in_diagonal[rest[torch.repeat_interleave(strided, sizes)]] = True
    heads_of = rest[bounds[:-1][strided]]
    diagonals = list(zip(row[heads_of].tolist(), sizes[strided].tolist(), start[heads_of].tolist(),
                         length[heads_of].tolist(), strict=True))
    return columns, diagonals, in_column | in_diagonal


def _attend_gathered(indices: torch.Tensor, counts: torch.Tensor, ragged: torch.Tensor, qb: torch.Tensor,
                     kb: torch.Tensor, vb: torch.Tensor, acc: _Accumulator, key_tokens: Callable[[int, bool], int],
                     scale: float | None) -> None:
    """Per query block, its first `counts` (global) key blocks copied into one key sequence; query
    blocks with the same count (and raggedness) batched into cache-sized calls."""
    bs, dim = qb.shape[1], qb.shape[2]
    kind = counts * 2 + ragged
    order = torch.argsort(kind, stable=True)
    kinds, sizes = torch.unique_consecutive(kind[order], return_counts=True)
    per_buffer = max(CHUNK_BYTES // (2 * qb.element_size()), int(counts.max()) * bs * dim)
    key_buffer, value_buffer = qb.new_empty(per_buffer), qb.new_empty(per_buffer)
    for group, kind_value in zip(torch.split(order, sizes.tolist()), kinds.tolist(), strict=True):
        blocks = kind_value // 2
        if blocks == 0:
            continue
        tokens = key_tokens(blocks, bool(kind_value % 2))
        for rows in torch.split(group, max(1, per_buffer // (blocks * bs * dim))):
            m = rows.numel()
            ids = indices[rows, :blocks].reshape(-1)
            used = m * blocks * bs * dim
            keys = torch.index_select(kb, 0, ids, out=key_buffer[:used].view(m * blocks, bs, dim))
            values = torch.index_select(vb, 0, ids, out=value_buffer[:used].view(m * blocks, bs, dim))
            first = int(rows[0])
            # Query blocks with equal counts are often consecutive: then slices replace index copies.
            span: slice | torch.Tensor = slice(first, first + m) if int(rows[-1]) - first == m - 1 else rows
            out, lse = _attend(qb[span].unsqueeze(1), keys.view(m, 1, -1, dim)[:, :, :tokens],
                               values.view(m, 1, -1, dim)[:, :, :tokens], scale)
            acc.add(span, out, lse)
