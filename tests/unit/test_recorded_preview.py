"""An entry's preview is drawn by the recorder's thread, not the sampler: the run hands over the latent frame and the
model's preview factors, and the entry holds the PNG they make; a preview that cannot be drawn costs the entry its
thumbnail, never the entry."""

from __future__ import annotations

import torch

from carnator_core.reuse.recording import entry_writer
from carnator_core.reuse.run import ReuseRun
from carnator_core.reuse.settings import ReuseSettings
from carnator_core.store.entry import HardKey
from carnator_core.store.reuse_store import ReuseStore
from carnator_core.store.thumbnail import PreviewFrame, preview_png

KEY = HardKey("model", (2, 4, 4), "schedule")
SHAPE = (1, 16, 2, 8, 8)


def _recorded(tmp_path, preview: PreviewFrame) -> tuple[ReuseStore, str]:
    store = ReuseStore(str(tmp_path / "store"))
    run = ReuseRun(settings=ReuseSettings(prompt="a red ball rolls left"), store=store, hard_key=KEY,
                   latent_shape=SHAPE, noise_fingerprint="noise", cond_vector=torch.ones(256) / 16,
                   sigmas=[1 - s / 10 for s in range(11)], cfg=1.0, seed=0)
    run.plan()
    run.finish(model_calls=10, thumbnail=preview)
    assert entry_writer().flush()
    [entry_id] = list(store.entry_ids())
    return store, entry_id


def test_the_entry_holds_the_png_of_the_frame_it_was_handed(tmp_path):
    frame = torch.randn(16, 8, 8, generator=torch.Generator().manual_seed(0))
    factors = torch.rand(16, 3, generator=torch.Generator().manual_seed(1)).tolist()
    store, entry_id = _recorded(tmp_path, PreviewFrame(frame, factors, [0.1, 0.0, -0.1]))
    png = store.get_blob(entry_id, "thumb")
    assert png is not None and png.startswith(b"\x89PNG")
    assert png == preview_png(frame, factors, [0.1, 0.0, -0.1])


def test_a_preview_that_cannot_be_drawn_leaves_the_entry_whole(tmp_path):
    unmatched = PreviewFrame(torch.randn(16, 8, 8), [[1.0, 0.0, 0.0]] * 4)  # factors for 4 channels, not 16
    store, entry_id = _recorded(tmp_path, unmatched)
    assert store.get_blob(entry_id, "thumb") is None
    meta = store.get_meta(entry_id)
    assert meta is not None and meta.prompt == "a red ball rolls left" and "thumb" not in meta.blob_bytes
