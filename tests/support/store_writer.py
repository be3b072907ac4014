"""Subprocess helper for store tests: writes synthetic entries into a store (directory or Redis URL).

Run as `python tests/support/store_writer.py LOCATION COUNT TAG [BLOB_FLOATS]`; prints one line per entry
written (`wrote <id>`), flushing each, so a parent can kill it mid-stream.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import torch

sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # after ComfyUI, whose `nodes` we must not shadow

from carnator_core.store.entry import EntryMeta, HardKey  # noqa: E402
from carnator_core.store.reuse_store import IndexVectors, ReuseStore  # noqa: E402
from carnator_core.store.tensor_codec import encode_tensors  # noqa: E402


def synthetic_entry(tag: str, number: int, blob_floats: int) -> tuple[EntryMeta, dict[str, bytes], IndexVectors]:
    """A deterministic entry: metadata, one checkpoint blob, index vectors."""
    generator = torch.Generator().manual_seed(zlib.crc32(f"{tag}:{number}".encode()))
    meta = EntryMeta(entry_id=EntryMeta.new_id(), hard_key=HardKey("model-a", (3, 8, 8), "schedule-a"),
                     prompt=f"{tag} prompt {number}", sample_seconds=1.0 + number % 7)
    blob = encode_tensors({"x": torch.randn(blob_floats, generator=generator).half()})
    vectors = IndexVectors(text=torch.nn.functional.normalize(torch.randn(384, generator=generator), dim=0),
                           cond=torch.nn.functional.normalize(torch.randn(256, generator=generator), dim=0))
    return meta, {"checkpoints": blob}, vectors


def main() -> None:
    directory, count, tag = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    blob_floats = int(sys.argv[4]) if len(sys.argv) > 4 else 1024
    store = ReuseStore(directory)
    for number in range(count):
        meta, blobs, vectors = synthetic_entry(tag, number, blob_floats)
        store.put(meta, blobs, vectors)
        print(f"wrote {meta.entry_id}", flush=True)


class Exploit:
    """A value that runs a command when unpickled: stores must refuse it, and `marker` shows they did."""

    marker: Path

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


if __name__ == "__main__":
    main()
