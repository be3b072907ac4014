// The seed controls of the samplers a Carnator reuse node feeds. With seed policy `same-noise` an edited prompt
// reuses only a run made with the same seed, so a control that randomizes the seed on every run keeps every edit
// from reusing. Where one does, the Carnator node shows a notice with one click that puts back the seed of the last
// run (the widget already holds the next random one) and sets the control to `fixed`; a sampler's MISS badge that
// only the seed caused offers the same click (carnator_badges.js).
//
// Everything is read from the graph's widgets: a sampler is a node the reuse node reaches through MODEL, GUIDER or
// SAMPLER links that has a seed widget (`seed`, `noise_seed`) or a NOISE input (its noise node's seed); a seed fed
// by a link counts only where it comes straight from a primitive, whose widget then holds it. A sampler that adds
// no noise (`add_noise` off) has no seed to keep. The seed of the last run is the value each seed widget held when
// this tab submitted its last prompt, which is the value that prompt carried.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const REUSE_NODES = ["CarnatorReuse", "CarnatorReuseSampler", "CarnatorKSampler"];
const CHAIN_TYPES = ["MODEL", "GUIDER", "SAMPLER"];
const SEED_WIDGETS = ["seed", "noise_seed"];
const PRIMITIVES = ["PrimitiveNode", "PrimitiveInt"];  // pass their `value` widget on unchanged
const NOTICE = "carnator seed notice";
const NOTICE_HEIGHT = 112;

const lastRun = new WeakMap();  // seed widget -> its value in the last prompt this tab submitted

/** The widget that decides `widget`'s value on `node` (itself, or the primitive its input is linked to) with its
 * seed control; null where no control can be read. */
function seedSource(node, widget, sampler) {
  const slot = (node.inputs ?? []).findIndex((input) => input.widget?.name === widget.name);
  if (slot >= 0 && node.inputs[slot].link != null) {
    const origin = node.getInputNode(slot);
    if (!PRIMITIVES.includes(origin?.type)) return null;
    return seedSource(origin, origin.widgets?.find((w) => w.name === "value") ?? {}, sampler);
  }
  const control = (widget.linkedWidgets ?? []).find((w) => {
    const values = w.options?.values;
    return Array.isArray(values) && values.includes("randomize") && values.includes("fixed");
  });
  return control ? { node, widget, control, sampler } : null;
}

function addsNoNoise(node) {
  const addNoise = node.widgets?.find((w) => w.name === "add_noise");
  return addNoise !== undefined && (addNoise.value === "disable" || addNoise.value === false);
}

function seedWidgets(node) {
  return (node.widgets ?? []).filter((w) => SEED_WIDGETS.includes(w.name));
}

function noiseSlot(node) {
  return (node.inputs ?? []).findIndex((input) => input.type === "NOISE");
}

function isSampler(node) {
  return seedWidgets(node).length > 0 || noiseSlot(node) >= 0;
}

/** The seed sources of one sampler node: its own seed widget, or its noise node's. */
export function seedSourcesOf(sampler) {
  if (addsNoNoise(sampler)) return [];
  const slot = noiseSlot(sampler);
  const noise = slot >= 0 ? sampler.getInputNode(slot) : null;
  const holders = [sampler, ...(noise ? [noise] : [])];
  return holders.flatMap((node) => seedWidgets(node).map((widget) => seedSource(node, widget, sampler)))
    .filter(Boolean);
}

/** The samplers `node` feeds through MODEL, GUIDER and SAMPLER links (a Carnator KSampler is its own sampler). */
function samplersFedBy(node) {
  if (isSampler(node)) return [node];
  const seen = new Set([node.id]);
  const samplers = [];
  const queue = [node];
  while (queue.length) {
    const current = queue.shift();
    (current.outputs ?? []).forEach((output, slot) => {
      if (!CHAIN_TYPES.includes(output.type)) return;
      for (const next of current.getOutputNodes(slot) ?? []) {
        if (seen.has(next.id)) continue;
        seen.add(next.id);
        (isSampler(next) ? samplers : queue).push(next);
      }
    });
  }
  return samplers;
}

function sameNoise(reuseNode) {
  return reuseNode.widgets?.find((w) => w.name === "seed_policy")?.value !== "serving";
}

/** The seed sources of the samplers a Carnator reuse node feeds whose control randomizes the seed every run; none
 * under seed policy `serving`, which takes donors of any seed. */
function randomizedSeeds(reuseNode) {
  if (!sameNoise(reuseNode)) return [];
  return samplersFedBy(reuseNode).flatMap(seedSourcesOf).filter((source) => source.control.value === "randomize");
}

/** Of `sources`, the ones whose control randomizes the seed. */
export function randomizing(sources) {
  return sources.filter((source) => source.control.value === "randomize");
}

/** The seed `source` had in the last prompt this tab submitted; its current value before any was submitted. */
function lastSeed(source) {
  return lastRun.has(source.widget) ? lastRun.get(source.widget) : source.widget.value;
}

/** Put back the last run's seed of each source and set its control to `fixed`. */
export function keepLastSeeds(sources) {
  for (const source of sources) {
    const seed = lastSeed(source);
    source.widget.value = seed;
    source.widget.callback?.(seed);
    source.control.value = "fixed";
    source.control.callback?.("fixed");
  }
  refreshNotices();
  app.graph?.setDirtyCanvas(true, true);
}

/** What the one click does, in words. */
export function keepLastSeedsLabel(sources) {
  const seeds = [...new Set(sources.map(lastSeed))];
  return seeds.length === 1 ? `Keep seed ${seeds[0]} and fix it` : "Keep the last run's seeds and fix them";
}

function reuseNodes() {
  return (app.graph?.nodes ?? []).filter((node) => REUSE_NODES.includes(node.type));
}

function title(node) {
  return node.title || node.type;
}

function noticeElement(node, sources) {
  const element = document.createElement("div");
  element.className = "carnator-seed-notice";
  const heading = document.createElement("div");
  heading.className = "carnator-seed-heading";
  const names = [...new Set(sources.map((source) => `“${title(source.sampler)}”`))].join(", ");
  heading.textContent = `${names}: the seed is randomized on every run.`;
  const why = document.createElement("div");
  why.textContent = "With seed policy same-noise an edited prompt reuses only a run made with the same seed.";
  const button = document.createElement("button");
  button.className = "carnator-seed-fix";
  button.textContent = keepLastSeedsLabel(sources);
  button.addEventListener("click", () => keepLastSeeds(randomizedSeeds(node)));
  element.append(heading, why, button);
  return element;
}

function resize(node) {
  node.setSize([node.size[0], node.computeSize()[1]]);
}

function removeNotice(node) {
  const widget = node.widgets?.find((w) => w.name === NOTICE);
  if (!widget) return;
  if (node.removeWidget) node.removeWidget(widget);
  else {
    widget.onRemove?.();
    node.widgets.splice(node.widgets.indexOf(widget), 1);
  }
  resize(node);
}

function showNotice(node, sources) {
  const element = noticeElement(node, sources);
  const widget = node.widgets?.find((w) => w.name === NOTICE);
  if (widget) {
    if (widget.element.textContent !== element.textContent) widget.element.replaceChildren(...element.childNodes);
    return;
  }
  const added = node.addDOMWidget(NOTICE, "carnator-notice", element, {
    serialize: false, hideOnZoom: false, getMinHeight: () => NOTICE_HEIGHT, getHeight: () => NOTICE_HEIGHT,
  });
  added.serialize = false;
  added.computeSize = (width) => [width, NOTICE_HEIGHT];
  resize(node);
}

/** Show or take down each Carnator reuse node's notice as its samplers' seed controls stand now. */
export function refreshNotices() {
  for (const node of reuseNodes()) {
    const sources = randomizedSeeds(node);
    if (sources.length) showNotice(node, sources);
    else removeNotice(node);
  }
}

/** Every seed source a Carnator reuse node's samplers read. */
function allSeedSources() {
  return reuseNodes().flatMap((node) => samplersFedBy(node).flatMap(seedSourcesOf));
}

function recordSubmittedSeeds() {
  const submit = api.queuePrompt;
  api.queuePrompt = async function (...args) {
    const values = allSeedSources().map((source) => [source.widget, source.widget.value]);
    const response = await submit.apply(this, args);
    if (response?.prompt_id) for (const [widget, value] of values) lastRun.set(widget, value);
    return response;
  };
}

app.registerExtension({
  name: "Carnator.SeedNotice",
  async setup() {
    recordSubmittedSeeds();
    setInterval(refreshNotices, 1000);
  },
});
