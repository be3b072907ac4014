"""docs/nodes.md, rendered from the schemas of the pack's nodes as a loaded ComfyUI host builds them.

`render(nodes, advanced, host_lists)` takes the pack's node classes (`NODE_LIST`, in menu order), the ids of the
inputs the pack marks advanced, per node, and the host's own choice lists by name. Only what the pack itself sets
goes into the page (ids, names, categories, descriptions, input types, defaults, ranges, options, tooltips,
outputs), never a host's additions, so the page reads the same on every tested host: a combo whose options are a
host's list (KSampler's samplers, say) shows that list's name, not its entries, and which inputs are advanced
comes from the pack's `advanced_input()` marker (see `advanced_inputs`), because hosts without the schema's `advanced`
option drop it.

Regenerate the page with `CARNATOR_WRITE_NODE_REFERENCE=1 python -m pytest -q tests/host/test_node_reference.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

REFERENCE_PATH = Path(__file__).resolve().parents[2] / "docs" / "nodes.md"

HEADER = """\
# Node reference

Every Carnator node as its schema defines it: id, menu name, category, what it does, each input (type, default,
range or choices, tooltip) and each output. *Advanced* inputs are folded away in the node on hosts that support
it; *optional* inputs may be left unconnected. Nodes appear in the menu under **Carnator/**.

This page is generated from the node schemas and a test checks it against them; after changing a node, regenerate
it with `CARNATOR_WRITE_NODE_REFERENCE=1 python -m pytest -q tests/host/test_node_reference.py`.
"""


class _Marked:
    """The value the patched `advanced_input()` passes as `lazy`: every host's inputs keep it as given."""

    def __repr__(self) -> str:
        return "<advanced>"


ADVANCED_MARK = _Marked()


def pack_modules(node_class: type) -> list[ModuleType]:
    """The loaded modules of the pack that defines `node_class` (its `nodes` package and what is under it)."""
    package = node_class.__module__.rsplit(".", 1)[0]
    return [module for name, module in sorted(sys.modules.items())
            if module is not None and (name == package or name.startswith(package + "."))]


def node_list(node_class: type) -> list[type]:
    """The pack's `NODE_LIST` (menu order), found from one of its node classes."""
    return list(sys.modules[node_class.__module__.rsplit(".", 1)[0]].NODE_LIST)


def advanced_inputs(nodes: Iterable[type]) -> dict[str, frozenset[str]]:
    """Node id -> ids of its inputs built with `**advanced_input()`, the pack's advanced marker.

    The schemas are built once more with every pack module's `advanced_input` replaced by one that passes a marker through
    the `lazy` option, which the inputs of every tested host take and keep as given; the originals are put back.
    """
    nodes = list(nodes)
    replaced = {module: module.advanced_input for module in pack_modules(nodes[0])
                if callable(getattr(module, "advanced_input", None))}
    try:
        for module in replaced:
            module.advanced_input = lambda: {"lazy": ADVANCED_MARK}
        return {schema.node_id: frozenset(i.id for i in schema.inputs if getattr(i, "lazy", None) is ADVANCED_MARK)
                for schema in (node.define_schema() for node in nodes)}
    finally:
        for module, original in replaced.items():
            module.advanced_input = original


def _cell(text: Any) -> str:
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f"`{value}`" if value else "empty"
    return f"`{value}`"


def _type(item: Any, host_lists: dict[str, list]) -> str:
    io_type = str(item.get_io_type())
    options = getattr(item, "options", None)
    if options:
        named = [name for name, host_list in host_lists.items() if list(options) == list(host_list)]
        return f"{io_type}: {named[0]}" if named else f"{io_type}: " + ", ".join(_value(option) for option in options)
    low, high = getattr(item, "min", None), getattr(item, "max", None)
    if low is not None or high is not None:
        return f"{io_type} ({'' if low is None else low} .. {'' if high is None else high})"
    return io_type


def _input_row(item: Any, advanced: bool, host_lists: dict[str, list]) -> str:
    marks = [mark for mark, on in (("optional", item.optional), ("advanced", advanced)) if on]
    name = f"`{item.id}`" + (f" *({', '.join(marks)})*" if marks else "")
    default = getattr(item, "default", None)
    default_text = "—" if default is None else _value(default)
    return f"| {name} | {_cell(_type(item, host_lists))} | {default_text} | {_cell(item.tooltip or '')} |"


def render_node(schema: Any, advanced: frozenset[str], host_lists: dict[str, list]) -> str:
    lines = [f"## {schema.node_id}", "", f"**{schema.display_name}** — category `{schema.category}`", "",
             _cell(schema.description), ""]
    if schema.inputs:
        lines += ["| input | type | default | what it does |", "|---|---|---|---|"]
        lines += [_input_row(item, item.id in advanced, host_lists) for item in schema.inputs]
        lines.append("")
    outputs = [f"`{item.display_name or item.id}` ({item.get_io_type()})" for item in schema.outputs]
    lines += [f"Outputs: {', '.join(outputs) if outputs else 'none'}.", ""]
    return "\n".join(lines)


def render(nodes: Iterable[type], advanced: dict[str, frozenset[str]], host_lists: dict[str, list]) -> str:
    """The whole page. `host_lists`: name -> a choice list the host defines (shown by name wherever a combo offers
    exactly that list)."""
    schemas = [node.define_schema() for node in nodes]
    index = ["| node | name | category |", "|---|---|---|"]
    index += [f"| [`{s.node_id}`](#{s.node_id.lower()}) | {_cell(s.display_name)} | `{s.category}` |" for s in schemas]
    sections = [render_node(s, advanced.get(s.node_id, frozenset()), host_lists) for s in schemas]
    return "\n".join([HEADER, *index, "", *sections]).rstrip("\n") + "\n"
