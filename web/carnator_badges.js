// Carnator node badges: every sampler node that ran with Carnator shows HIT or MISS above its title,
// live from the `carnator.status` websocket events (one per sampling run), with the details in a tooltip.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { badgeText, loadStylesheet, tooltipLines, verdictOf } from "./carnator_ui.js";

const HIT_COLOR = "#2e7d32";
const MISS_COLOR = "#8a6d00";
const KEEP_PROMPTS = 64;

const ownPrompts = [];  // prompts this browser tab queued (execution_start is sent to the queuing client only)
const badged = new WeakMap();  // node -> { badge, report }
let tooltip = null;

function rememberPrompt(event) {
  const promptId = event.detail?.prompt_id;
  if (!promptId || ownPrompts.includes(promptId)) return;
  ownPrompts.push(promptId);
  if (ownPrompts.length > KEEP_PROMPTS) ownPrompts.shift();
}

/** The graph node a report names ("12", or "5:12" inside a subgraph); null when it is not in this graph. */
function findNode(nodeId) {
  let graph = app.graph;
  let node = null;
  for (const part of String(nodeId ?? "").split(":")) {
    node = graph?.getNodeById?.(part) ?? graph?.getNodeById?.(Number(part)) ?? null;
    if (!node) return null;
    graph = node.subgraph;
  }
  return node;
}

function showStatus(event) {
  const report = event.detail;
  if (!report || !ownPrompts.includes(report.prompt_id)) return;  // another client's prompt
  const node = findNode(report.node);
  const Badge = window.LGraphBadge;
  if (!node || !Array.isArray(node.badges) || !Badge) return;
  const bgColor = verdictOf(report) === "miss" ? MISS_COLOR : HIT_COLOR;
  const badge = new Badge({ text: badgeText(report), fgColor: "#ffffff", bgColor });
  const previous = badged.get(node);
  const index = previous ? node.badges.indexOf(previous.badge) : -1;
  if (index >= 0) node.badges[index] = badge;
  else node.badges.push(badge);
  badged.set(node, { badge, report });
  app.graph.setDirtyCanvas(true, true);
}

function tooltipElement() {
  if (!tooltip) {
    tooltip = document.createElement("div");
    tooltip.className = "carnator-tooltip";
    tooltip.hidden = true;
    document.body.appendChild(tooltip);
  }
  return tooltip;
}

/** The badged node whose badge row (just above its title bar) is under the pointer. */
function badgeUnderPointer() {
  const canvas = app.canvas;
  const [x, y] = canvas?.graph_mouse ?? [NaN, NaN];
  const title = window.LiteGraph?.NODE_TITLE_HEIGHT ?? 30;
  for (const node of canvas?.graph?.nodes ?? []) {
    const entry = badged.get(node);
    if (!entry) continue;
    const top = node.pos[1] - title - 2 - entry.badge.height;
    if (x >= node.pos[0] && x <= node.pos[0] + node.size[0] && y >= top && y <= node.pos[1] - title) return entry;
  }
  return null;
}

function followPointer(event) {
  const entry = badgeUnderPointer();
  const element = tooltipElement();
  if (!entry) {
    element.hidden = true;
    return;
  }
  element.replaceChildren(...tooltipLines(entry.report).map((line) => {
    const row = document.createElement("div");
    row.textContent = line;
    return row;
  }));
  element.style.left = `${event.clientX + 14}px`;
  element.style.top = `${event.clientY + 14}px`;
  element.hidden = false;
}

app.registerExtension({
  name: "Carnator.Badges",
  async setup() {
    loadStylesheet();
    api.addEventListener("execution_start", rememberPrompt);
    api.addEventListener("carnator.status", showStatus);
    const canvas = app.canvas?.canvas;
    canvas?.addEventListener("pointermove", followPointer);
    canvas?.addEventListener("pointerleave", () => { tooltipElement().hidden = true; });
  },
});
