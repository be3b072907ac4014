"""A donor's attention masks, read from the store for a run to borrow."""

from __future__ import annotations

from carnator_core.attention.masks import BlockSparseMask
from carnator_core.attention.sparse_attention import masks_from_blob
from carnator_core.store.reuse_store import ReuseStore
from carnator_core.store.stages import masks_blob, stage_entry


def load_donor_masks(store: ReuseStore, entry_id: str, stage: int = 0, model: str = "") -> dict[int, BlockSparseMask]:
    """A donor entry's recorded masks (of stage `stage` of its trajectory); missing or corrupt masks, or masks of a
    stage another model made (`model`, when given), are a clean miss (empty dict)."""
    meta = store.get_meta(entry_id)
    view = stage_entry(meta, stage) if meta is not None else None
    if view is None or not view.masks or (stage and model and view.hard_key.model != model):
        return {}
    tensors = store.get_tensors(entry_id, masks_blob(stage))
    return masks_from_blob(view.masks, tensors) if tensors is not None else {}
