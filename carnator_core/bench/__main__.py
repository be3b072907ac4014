"""`python -m carnator_core.bench <name> [options]`: run one benchmark, or `report` to regenerate the published tables.

Each benchmark is a module of this package with a `main(argv: list[str]) -> int`.
"""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "attention": "carnator_core.bench.attention",
    "lookup": "carnator_core.bench.lookup",
    "workload": "carnator_core.bench.workload",
    "probe": "carnator_core.bench.probe",
    "store": "carnator_core.bench.store",
    "masks": "carnator_core.bench.masks",
    "screen": "carnator_core.bench.screen",
    "stages": "carnator_core.bench.stages",
    "inputs": "carnator_core.bench.inputs",
    "exact-repeats": "carnator_core.bench.exact_repeats",
    "report": "carnator_core.bench.report",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        print(f"usage: python -m carnator_core.bench {{{','.join(BENCHMARKS)}}} [options]", file=sys.stderr)
        return 2
    return importlib.import_module(BENCHMARKS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
