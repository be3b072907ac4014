// Carnator node badges: every sampler node that ran with Carnator shows HIT or MISS above its title,
// live from the `carnator.status` websocket events (one per sampling run), with the details in a tooltip. A miss
// that only the seed caused, on a sampler whose seed control randomizes, takes a click on its badge: the last run's
// seed is put back and the control set to `fixed` (carnator_seed.js).

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { keepLastSeeds, keepLastSeedsLabel, randomizing, seedSourcesOf } from "./carnator_seed.js";
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

/** The seeds a click on `node`'s badge would keep: a miss only for the seed, on seeds that randomize. */
function seedFix(node, report) {
  return report.seed_miss ? randomizing(seedSourcesOf(node)) : [];
}

function setBadge(node, report) {
  const text = badgeText(report, seedFix(node, report).length > 0);
  const previous = badged.get(node);
  if (previous?.report === report && previous.badge.text === text) return;
  const bgColor = verdictOf(report) === "miss" ? MISS_COLOR : HIT_COLOR;
  const badge = new window.LGraphBadge({ text, fgColor: "#ffffff", bgColor });
  const index = previous ? node.badges.indexOf(previous.badge) : -1;
  if (index >= 0) node.badges[index] = badge;
  else node.badges.push(badge);
  badged.set(node, { node, badge, report });
  app.graph.setDirtyCanvas(true, true);
}

function showStatus(event) {
  const report = event.detail;
  if (!report || !ownPrompts.includes(report.prompt_id)) return;  // another client's prompt
  const node = findNode(report.node);
  if (!node || !Array.isArray(node.badges) || !window.LGraphBadge) return;
  setBadge(node, report);
}

/** Badges follow their samplers' seed controls: the click offer goes once the seed is fixed. */
function refreshBadges() {
  for (const node of app.graph?.nodes ?? []) {
    const entry = badged.get(node);
    if (entry) setBadge(node, entry.report);
  }
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

/** The badge entry whose badge row (just above its node's title bar) is under the pointer of `event`. */
function badgeUnderPointer(event) {
  const canvas = app.canvas;
  const rect = canvas?.canvas?.getBoundingClientRect();
  if (!rect) return null;
  const [x, y] = canvas.ds.convertCanvasToOffset([event.clientX - rect.left, event.clientY - rect.top]);
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
  const entry = badgeUnderPointer(event);
  const element = tooltipElement();
  if (!entry) {
    element.hidden = true;
    return;
  }
  const fix = seedFix(entry.node, entry.report);
  const action = fix.length ? `Click the badge: ${keepLastSeedsLabel(fix).toLowerCase()}` : null;
  element.replaceChildren(...[...tooltipLines(entry.report), ...(action ? [action] : [])].map((line) => {
    const row = document.createElement("div");
    row.textContent = line;
    return row;
  }));
  element.style.left = `${event.clientX + 14}px`;
  element.style.top = `${event.clientY + 14}px`;
  element.hidden = false;
}

/** A click on a badge that offers the seed fix applies it, and goes no further into the canvas. */
function clickBadge(event) {
  if (event.target !== app.canvas?.canvas || event.button !== 0) return;
  const entry = badgeUnderPointer(event);
  const fix = entry ? seedFix(entry.node, entry.report) : [];
  if (!fix.length) return;
  event.stopPropagation();
  event.preventDefault();
  keepLastSeeds(fix);
  refreshBadges();
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
    window.addEventListener("pointerdown", clickBadge, true);  // before the canvas takes the click
    setInterval(refreshBadges, 1000);
  },
});
