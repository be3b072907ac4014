"""docs/nodes.md is the node schemas as a loaded host builds them, and the README's node table and links hold.

Regenerate the reference after changing a node:

    CARNATOR_WRITE_NODE_REFERENCE=1 python -m pytest -q tests/host/test_node_reference.py
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
from pathlib import Path

import pytest
from support.comfy_host import REPO_ROOT
from support.node_reference import REFERENCE_PATH, advanced_inputs, node_list, render

README = REPO_ROOT / "README.md"


@pytest.fixture(scope="module")
def pack_nodes(comfy) -> list[type]:
    return node_list(comfy.node_classes["CarnatorReuse"])


def _host_lists() -> dict[str, list]:
    import comfy.samplers

    return {"the host's samplers (as KSampler)": comfy.samplers.KSampler.SAMPLERS,
            "the host's schedulers (as KSampler)": comfy.samplers.KSampler.SCHEDULERS}


def test_node_reference_is_rendered_from_the_schemas(comfy, pack_nodes):
    assert sorted(node.define_schema().node_id for node in pack_nodes) == comfy.pack_node_ids()
    page = render(pack_nodes, advanced_inputs(pack_nodes), _host_lists())
    if os.environ.get("CARNATOR_WRITE_NODE_REFERENCE") == "1":
        REFERENCE_PATH.write_text(page)
    written = REFERENCE_PATH.read_text() if REFERENCE_PATH.exists() else ""
    diff = "".join(difflib.unified_diff(written.splitlines(True), page.splitlines(True), "docs/nodes.md", "schemas"))
    assert written == page, ("docs/nodes.md differs from the node schemas; regenerate it with "
                             "CARNATOR_WRITE_NODE_REFERENCE=1 python -m pytest -q tests/host/test_node_reference.py\n"
                             + diff[:6000])


def test_advanced_marks_are_the_ones_the_host_shows(pack_nodes):
    """Where the host has the schema's `advanced` option, the inputs it folds away are the page's advanced ones."""
    from comfy_api.latest import io

    if "advanced" not in inspect.signature(io.Input.__init__).parameters:
        pytest.skip("this host's schema has no advanced inputs; the page takes them from the pack's advanced_input() marker")
    marked = advanced_inputs(pack_nodes)
    for node in pack_nodes:
        schema = node.define_schema()
        assert {i.id for i in schema.inputs if getattr(i, "advanced", None)} == marked[schema.node_id], schema.node_id


def test_readme_node_table_lists_every_node_and_links_the_reference(comfy):
    text = README.read_text()
    section = text.split("\n## Nodes\n", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \[?`(Carnator\w+)`", section, flags=re.MULTILINE)
    assert sorted(rows) == comfy.pack_node_ids()
    assert "(docs/nodes.md)" in section


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    anchors, seen = set(), {}
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        match = None if in_code else re.match(r"#{1,6} (.+)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@pytest.mark.parametrize("page", ["README.md", "docs/nodes.md"])
def test_relative_links_point_at_files_and_headings_that_exist(page: str):
    source = REPO_ROOT / page
    text = re.sub(r"```.*?```", "", source.read_text(), flags=re.DOTALL)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        if not file.exists():
            broken.append(f"{target}: no file {Path(path)}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO_ROOT)}")
    assert not broken, "\n".join(broken)
