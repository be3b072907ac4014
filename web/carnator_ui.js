// Shared by carnator_badges.js and carnator_store_panel.js: the stylesheet, and the text of badges, tooltips
// and the store panel from `carnator.status` reports and store entries (pure functions, no ComfyUI).

/** Add web/carnator.css to the page once. */
export function loadStylesheet() {
  if (document.getElementById("carnator-css")) return;
  const link = document.createElement("link");
  link.id = "carnator-css";
  link.rel = "stylesheet";
  link.href = new URL("./carnator.css", import.meta.url).href;
  document.head.appendChild(link);
}

export function shorten(text, width) {
  const value = String(text ?? "").replace(/\s+/g, " ").trim();
  return value.length <= width ? value : value.slice(0, width - 1) + "…";
}

export function formatBytes(bytes) {
  const value = Number(bytes) || 0;
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let size = value;
  let unit = 0;
  while (size >= 1024 && unit < units.length - 1) {
    size /= 1024;
    unit += 1;
  }
  return `${size.toFixed(unit === 0 ? 0 : 1)} ${units[unit]}`;
}

export function formatSeconds(seconds) {
  const value = Number(seconds) || 0;
  if (value < 60) return `${value.toFixed(1)} s`;
  const minutes = Math.floor(value / 60);
  return minutes < 60 ? `${minutes} min ${Math.round(value % 60)} s` : `${(minutes / 60).toFixed(1)} h`;
}

export function formatDate(epochSeconds) {
  return epochSeconds ? new Date(epochSeconds * 1000).toLocaleString() : "";
}

function number(value, digits = 2) {
  return value === null || value === undefined || Number.isNaN(Number(value)) ? "–" : Number(value).toFixed(digits);
}

/** What the run reused: the report's `verdict` (RunReport.verdict), derived the same way for a report without one. */
export function verdictOf(report) {
  if (report.verdict) return report.verdict;
  if (report.stage?.skipped_whole) return "stage skipped";
  if (report.skipped_steps) return "resumed";
  return report.hit ? "masks borrowed" : "miss";
}

/** One line for the node badge: HIT and what it reused (steps skipped, donor, density, time saved) or MISS (why);
 * a miss only for the seed says so, and that a click keeps the seed where `seedFix` offers it. */
export function badgeText(report, seedFix = false) {
  const verdict = verdictOf(report);
  if (report.seed_miss) return `MISS · other seed than the donor${seedFix ? " · click to keep the last seed" : ""}`;
  if (verdict === "miss") return `MISS · ${shorten(report.reason || "no reuse", 40)}`;
  const parts = [];
  if (verdict === "masks borrowed") {
    parts.push(`HIT masks ${report.heads_reuse}/${(report.heads_reuse || 0) + (report.heads_own || 0)} heads`);
  } else {
    parts.push(`HIT ${verdict} ${report.skipped_steps}/${report.total_steps} steps`);
  }
  if (report.donor_prompt) parts.push(`“${shorten(report.donor_prompt, 24)}”`);
  if (report.attention_density !== null && report.attention_density !== undefined) {
    parts.push(`density ${number(report.attention_density)}`);
  }
  if (report.time_saved_s) parts.push(`−${formatSeconds(report.time_saved_s)}`);
  return parts.join(" · ");
}

/** The tooltip's lines: everything the report says, one fact per line. */
export function tooltipLines(report) {
  const verdict = verdictOf(report);
  const lines = [verdict === "miss" ? `Carnator MISS: ${report.reason || "no reuse"}` : `Carnator HIT: ${verdict}`];
  if (report.seed_miss) {
    lines.push("only the seed kept this run from reusing: with seed policy same-noise an edited prompt reuses " +
               "only a run made with the same seed");
  }
  lines.push(`mode ${report.mode}, ${report.total_steps} steps, ${report.model_calls ?? "–"} model calls`);
  if (report.prompt) lines.push(`prompt: “${shorten(report.prompt, 120)}”`);
  if (report.skipped_steps) lines.push(`resumed at step ${report.skipped_steps} of ${report.total_steps}`);
  if (report.donor_id) {
    lines.push(`donor: “${shorten(report.donor_prompt || "(no prompt text)", 120)}” (${report.donor_id.slice(0, 8)})`);
  }
  if (report.text_similarity !== null && report.text_similarity !== undefined) {
    lines.push(`text similarity ${number(report.text_similarity, 3)}`);
  }
  if (report.agreement !== null && report.agreement !== undefined) {
    const parts = (report.other_parts_agreement || []).map((value, index) => `, packed part ${index + 2} ${number(value, 3)}`);
    lines.push(`probe: agreement ${number(report.agreement, 3)}, structure ${number(report.structure_agreement, 3)}, ` +
               `guidance ${number(report.guidance_cosine, 3)}${parts.join("")}`);
  }
  if (report.judged_by) lines.push(`judged by ${report.judged_by}`);
  const probes = report.probes || [];
  if (probes.length) lines.push(`probes: ${probes.length} (${probes.filter((p) => p.passed).length} passed)`);
  const candidates = report.candidates || [];
  if (candidates.length) lines.push(`candidates: ${candidates.length}, best “${shorten(candidates[0].prompt, 60)}”`);
  const filtered = Object.entries(report.filtered || {});
  if (filtered.length) lines.push(`filtered: ${filtered.map(([why, count]) => `${count} ${why}`).join(", ")}`);
  if (report.attention_density !== null && report.attention_density !== undefined) {
    lines.push(`attention density ${number(report.attention_density, 3)}, heads reuse/own ` +
               `${report.heads_reuse}/${report.heads_own}`);
  }
  lines.push(`time ${formatSeconds(report.time_s)}, saved ~${formatSeconds(report.time_saved_s)}`);
  return lines;
}

/** The store panel's totals line. */
export function totalsText(totals) {
  const rate = totals.hit_rate === null || totals.hit_rate === undefined ? "–" : `${Math.round(totals.hit_rate * 100)}%`;
  return `${totals.entries} ${totals.entries === 1 ? "entry" : "entries"} · ${formatBytes(totals.bytes)} · hit rate ${rate} · ` +
         `${totals.hits} reuses · ${formatSeconds(totals.seconds_saved)} saved`;
}

/** One line for the Calibrate node's background calibration (GET /carnator/calibration, `carnator.calibration`). */
export function calibrationText(state) {
  if (!state || state.phase === "idle") return "";
  const runs = state.runs_total ? ` ${state.runs_done}/${state.runs_total} runs` : "";
  const left = state.phase === "running" && state.seconds_left ? `, about ${formatSeconds(state.seconds_left)} left` : "";
  const heading = { running: "Calibrating", stopping: "Stopping", done: "Calibrated", stopped: "Stopped",
                    interrupted: "Interrupted", failed: "Calibration failed" }[state.phase] ?? state.phase;
  const detail = ["running", "stopping"].includes(state.phase) ? `${runs}${left}` : `: ${state.line ?? ""}`;
  return `${heading} “${state.name}”${detail}`;
}
