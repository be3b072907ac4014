"""A donor's attention masks, read from the store for a run to borrow."""

from __future__ import annotations

from carnator_core.attention.masks import BlockSparseMask
from carnator_core.attention.sparse_attention import masks_from_blob
from carnator_core.store.reuse_store import ReuseStore


def load_donor_masks(store: ReuseStore, entry_id: str) -> dict[int, BlockSparseMask]:
    """A donor entry's recorded masks; missing or corrupt masks are a clean miss (empty dict)."""
    meta = store.get_meta(entry_id)
    tensors = store.get_tensors(entry_id, "masks") if meta is not None and meta.masks else None
    if tensors is None:
        return {}
    return masks_from_blob(meta.masks, tensors)
