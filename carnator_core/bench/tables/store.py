"""The store's tables, from stored `bench store`, `bench lookup` and `bench screen` runs: what an entry weighs, what
a put, a hit's fetch and a lookup cost on each backend, and what the step-0 screen costs per same-noise donor."""

from __future__ import annotations

from carnator_core.bench.tables.cells import table
from carnator_core.bench.tables.stored_runs import Link, StoredRun, StoredRuns

STORE_RUNS = {"diskcache": "store-diskcache", "Redis (loopback)": "store-redis"}
LOOKUP_RUN = "lookup-1m"
SCREEN_RUN = "screen"
MIB = 2**20


def entry_size_table(runs: StoredRuns, link: Link) -> str:
    """A Wan 2.1 1.3B 480p 81-frame entry, plain and as a multistep sampler records it (with its predictions)."""
    name = STORE_RUNS["diskcache"]
    result = runs[name].result
    rows = [["Wan 2.1 1.3B, 832×480, 81 frames", f"{result['entry_bytes'] / MIB:.1f} MiB"],
            ["the same, sampled by a multistep sampler (uni_pc, dpmpp_2m, deis ...)",
             f"{result['entry_bytes_multistep'] / MIB:.1f} MiB"]]
    return f"From [`{name}`]({link(name)}).\n\n" + table(["request", "entry"], rows)


def store_table(runs: StoredRuns, link: Link) -> str:
    """Put, hit fetch and lookup per backend, medians; times only from a run that had the machine to itself."""
    stored = {backend: runs[name] for backend, name in STORE_RUNS.items()}
    sizes = list(next(iter(stored.values())).result["lookup_ms"])

    def row(what: str, cell) -> list[str]:
        return [what, *(cell(run.result) if run.conditions.alone else "— (not measured alone)"
                        for run in stored.values())]

    def fetch(result: dict) -> str:
        local = f"; {result['get_local_cache_ms']:.0f} ms from the local blob cache" if "get_local_cache_ms" in result \
            else ""
        return f"{result['get_ms']:.0f} ms ({result['get_mb_s']:.0f} MiB/s){local}"

    rows = [row("put, Wan 480p entry", lambda r: f"{r['put_ms']:.0f} ms ({r['put_mb_s']:.0f} MiB/s)"),
            row("hit fetch: metadata, checkpoints and masks, decoded", fetch),
            row("a multistep sampler's hit, besides: its predictions, decoded", lambda r: f"{r['get_history_ms']:.0f} ms"),
            *(row(f"lookup per request, {int(size):,} entries", lambda r, size=size: f"{r['lookup_ms'][size]:.1f} ms")
              for size in sizes),
            row("demo-model hit: blob fetch over the steps it saves",
                lambda r: f"{r['hit_fetch_share']:.2%} ({r['demo_fetch_ms']:.1f} ms against {r['demo_step_ms']:.0f} ms "
                          f"steps)")]
    links = " and ".join(f"[`{run.name}`]({link(run.name)})" for run in stored.values())
    return f"From {links}.\n\n" + table(["", *stored], rows)


def lookup_table(runs: StoredRuns, link: Link) -> str:
    """The shortlist query over a large index and how often a planted near-duplicate comes first."""
    run = runs[LOOKUP_RUN]
    result = run.result
    timed = run.conditions.alone
    rows = [[f"{result['entries']:,}",
             f"{result['query_ms']:.2f} ms (p95 {result['query_p95_ms']:.2f} ms)" if timed else "— (not measured alone)",
             f"{result['planted_recall']:.0%}",
             f"{result['index_build_ms_per_1k']:.0f} ms per 1k entries" if timed else "— (not measured alone)"]]
    return f"From [`{LOOKUP_RUN}`]({link(LOOKUP_RUN)}).\n\n" + table(
        ["entries", "query, median", "near-duplicate ranked first", "index build"], rows)


def screen_markdown(result: dict) -> str:
    """Per donor count: donors screened, the plan and screen's milliseconds, and per donor its cost and bytes read."""
    rows = [[str(row["donors"]), str(row["screened"]), f"{row['plan_ms']:.1f}", "n/a", "n/a", "n/a"]
            if row["donors"] == 0 else
            [str(row["donors"]), str(row["screened"]), f"{row['plan_ms']:.1f}", f"{row['ms_per_donor']:.2f}",
             f"{row['share_of_model_call_per_donor']:.1%}", f"{row['bytes_per_donor']:,.0f}"]
            for row in result["rows"]]
    return table(["same-noise donors", "screened", "plan + screen (ms)", "per donor (ms)",
                  "per donor, share of a model call", "bytes read per donor"], rows).rstrip("\n")


def screen_table(runs: StoredRuns, link: Link) -> str:
    run: StoredRun = runs[SCREEN_RUN]
    if not run.conditions.alone:
        return f"[`{SCREEN_RUN}`]({link(SCREEN_RUN)}): {run.conditions.why_no_time}.\n"
    result = run.result
    return (f"From [`{SCREEN_RUN}`]({link(SCREEN_RUN)}): the demo latent {tuple(result['latent_shape'])}, an index of "
            f"{result['entries']:,} entries; one model call {result['model_call_ms']:.1f} ms.\n\n"
            + screen_markdown(result) + "\n")


TABLES = {"entry-size": entry_size_table, "store": store_table, "lookup": lookup_table, "screen": screen_table}
