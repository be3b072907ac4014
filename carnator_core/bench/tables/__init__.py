"""The published tables, each generated from stored runs by `python -m carnator_core.bench report`: a table's name
(as its `<!-- results:NAME -->` marker gives it) -> the function that writes it from the runs and a link maker."""

from __future__ import annotations

from collections.abc import Callable

from carnator_core.bench.tables import (
    agreement,
    attention,
    calibration,
    deep_first,
    demo,
    exact_repeats,
    inputs,
    probe_calibration,
    recommended,
    stages,
    store,
    streams,
)
from carnator_core.bench.tables.stored_runs import Link, StoredRuns

TABLES: dict[str, Callable[[StoredRuns, Link], str]] = {
    **streams.TABLES, **agreement.TABLES, **deep_first.TABLES, **attention.TABLES, **probe_calibration.TABLES,
    **calibration.TABLES, **inputs.TABLES, **stages.TABLES, **store.TABLES, **demo.TABLES,
    **recommended.TABLES, **exact_repeats.TABLES}
