"""The published tables, each generated from stored runs by `python -m carnator_core.bench report`: a table's name
(as its `<!-- results:NAME -->` marker gives it) -> the function that writes it from the runs and a link maker."""

from __future__ import annotations

from collections.abc import Callable

from carnator_core.bench.tables import (
    agreement,
    attention,
    deep_first,
    inputs,
    probe_calibration,
    stages,
    store,
    streams,
)
from carnator_core.bench.tables.stored_runs import Link, StoredRuns

TABLES: dict[str, Callable[[StoredRuns, Link], str]] = {
    **streams.TABLES, **deep_first.TABLES, **probe_calibration.TABLES, **inputs.TABLES, **store.TABLES, **agreement.TABLES, **attention.TABLES, **stages.TABLES}
