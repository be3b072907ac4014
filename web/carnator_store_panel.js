// Carnator store panel: a sidebar tab (and a dialog from the Carnator menu, the only way on frontends without
// sidebar tabs) listing the reuse store's entries with prompt, date, size, hits, time saved and thumbnail; search, pin, delete, clear all; totals;
// and the store's calibration profiles (python -m carnator_core.calibrate) with export, import and delete; and where
// the Calibrate node's background calibration stands, with a Stop button.
// It talks to the /carnator/store routes (nodes/routes.py). It refreshes when opened, on user actions and
// after Carnator runs; a failed request shows an empty state with a retry button and is never retried by itself.
// Where the server serves more than one store (its default and those Carnator Store nodes opened), a picker
// chooses among them; requests name the chosen store by the id /carnator/store/stores gives it.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { calibrationText, formatBytes, formatDate, formatSeconds, loadStylesheet, shorten, totalsText } from "./carnator_ui.js";

const PAGE = 50;
const SEARCH_DELAY_MS = 250;
const AFTER_RUN_DELAY_MS = 1500;  // the sampler records its entry on a background thread after the run

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attributes)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else if (value !== undefined && value !== null && value !== false) node.setAttribute(key, value);
  }
  node.append(...children.filter((child) => child !== null && child !== undefined));
  return node;
}

class StoreRequestError extends Error {}

async function request(path, options = {}) {
  let response;
  try {
    response = await api.fetchApi(path, options);
  } catch (error) {
    throw new StoreRequestError(`server unreachable (${error.message || error})`);
  }
  let body = null;
  try {
    body = await response.json();
  } catch {
    body = null;
  }
  if (!response.ok) throw new StoreRequestError(body?.error || `HTTP ${response.status}`);
  return body;
}

const mounted = new Set();  // panels on screen (the sidebar tab, the dialog)

class StorePanel {
  constructor() {
    this.query = "";
    this.storeId = "";  // empty: the server's default store
    this.entries = [];
    this.total = 0;
    this.root = null;
    this.timer = null;
    this.generation = 0;  // answers to superseded requests are dropped
  }

  mount(container) {
    loadStylesheet();
    this.search = element("input", {
      type: "search", class: "carnator-search", placeholder: "Search prompts", "aria-label": "Search prompts",
      oninput: () => this.schedule(SEARCH_DELAY_MS),
    });
    this.picker = element("select", {
      class: "carnator-store-picker", "aria-label": "Store", hidden: true,
      onchange: () => { this.storeId = this.picker.value; this.refresh(); },
    });
    this.totals = element("div", { class: "carnator-totals" });
    this.calibration = element("div", { class: "carnator-calibration", hidden: true });
    this.profiles = element("details", { class: "carnator-profiles" });
    this.importer = element("input", { type: "file", accept: ".json,application/json", hidden: true,
                                       onchange: () => this.importProfile() });
    this.list = element("div", { class: "carnator-list", role: "list" });
    this.more = element("button", { class: "carnator-button", onclick: () => this.load(true) }, "Load more");
    this.root = element("div", { class: "carnator-panel" },
      element("div", { class: "carnator-header" },
        element("span", { class: "carnator-title" }, "Carnator store"),
        element("button", { class: "carnator-icon-button", title: "Refresh", "aria-label": "Refresh",
                            onclick: () => this.refresh() }, element("i", { class: "pi pi-refresh" }))),
      this.picker, this.totals, this.calibration, this.profiles, this.importer, this.search, this.list,
      element("div", { class: "carnator-footer" }, this.more,
        element("button", { class: "carnator-button carnator-danger", onclick: () => this.clearAll() }, "Clear all…")));
    container.replaceChildren(this.root);
    mounted.add(this);
    this.refresh();
    request("/carnator/calibration").then((state) => this.showCalibration(state), () => {});
  }

  /** The background calibration's line; a Stop button while it runs. */
  showCalibration(state) {
    if (!this.root) return;
    const text = calibrationText(state);
    this.calibration.hidden = !text;
    const stop = element("button", { class: "carnator-button",
                                     onclick: () => this.act("/carnator/calibration/stop", { method: "POST" }) }, "Stop");
    this.calibration.replaceChildren(element("span", { title: state?.line ?? "" }, text),
                                     ...(state?.phase === "running" ? [stop] : []));
  }

  unmount() {
    clearTimeout(this.timer);
    mounted.delete(this);
    this.root = null;
  }

  /** Refresh after `delay` ms, once however many triggers arrive meanwhile. */
  schedule(delay) {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.refresh(), delay);
  }

  refresh() {
    if (!this.root) return;
    this.query = this.search.value.trim();
    this.load(false);
  }

  /** `path` on the store the panel shows, with `params`. */
  url(path, params = {}) {
    const query = new URLSearchParams(params);
    if (this.storeId) query.set("store", this.storeId);
    const text = query.toString();
    return text ? `${path}?${text}` : path;
  }

  /** The picker lists the stores the server serves; a chosen store the server no longer serves falls back to the default. */
  renderStores(stores) {
    if (this.storeId && !stores.some((store) => store.id === this.storeId)) this.storeId = "";
    this.picker.replaceChildren(...stores.map((store) => element("option", {
      value: store.default ? "" : store.id, title: store.name, selected: (store.default ? "" : store.id) === this.storeId,
    }, `${store.default ? "Default: " : ""}${shorten(store.name, 60)}${store.unavailable ? " (unavailable)" : ""}`)));
    this.picker.hidden = stores.length < 2;
  }

  async load(append) {
    const generation = ++this.generation;
    const params = { offset: append ? this.entries.length : 0, limit: PAGE };
    if (this.query) params.q = this.query;
    try {
      if (!append) {
        const listing = await request("/carnator/store/stores");
        if (generation !== this.generation || !this.root) return;
        this.renderStores(listing.stores);
      }
      const [page, totals, profiles] = await Promise.all([
        request(this.url("/carnator/store/entries", params)),
        append ? Promise.resolve(null) : request(this.url("/carnator/store/stats")),
        append ? Promise.resolve(null) : request(this.url("/carnator/store/profiles")),
      ]);
      if (profiles && generation === this.generation && this.root) this.renderProfiles(profiles);
      if (generation !== this.generation || !this.root) return;
      this.entries = append ? this.entries.concat(page.entries) : page.entries;
      this.total = page.total;
      if (totals) {
        this.totals.textContent = totalsText(totals);
        this.totals.title = totals.store ? `Store: ${totals.store}` : "";
      }
      this.render();
    } catch (error) {
      if (generation !== this.generation || !this.root) return;
      this.entries = [];
      this.total = 0;
      this.totals.textContent = "";
      this.renderEmpty(`Store unavailable: ${error.message}`, true);
    }
  }

  /** The calibration profiles: what each judges with, how it scored on held-back pairs and whether reuse beats lowering
   *  the steps; export, delete, import. */
  renderProfiles(listing) {
    const open = this.profiles.open;
    const rows = listing.profiles.map((profile) => {
      const t = profile.thresholds;
      const score = profile.held_back?.precision === null || profile.held_back?.precision === undefined ? "–"
        : `${Math.round(profile.held_back.precision * 100)}% precision, ${Math.round((profile.held_back.recall ?? 0) * 100)}% recall held back`;
      return element("div", { class: "carnator-profile", "data-profile": profile.key },
        element("div", { class: "carnator-info" },
          element("div", { class: "carnator-prompt" }, profile.description),
          element("div", { class: "carnator-facts" },
            `structure ${t.structure.toFixed(3)} + ${t.structure_slope.toFixed(2)}×depth · guidance ${t.guidance.toFixed(2)} · ${score}`),
          // in force or not, and why, in one line (the shipped thresholds judge while it is not in force)
          element("div", { class: `carnator-facts${profile.in_force ? "" : " carnator-refused"}`, "data-in-force": String(profile.in_force) },
                  profile.reason),
          // per mode, whether reuse beats just lowering the steps on this model (one sentence each)
          ...(profile.verdict || []).map((sentence) =>
            element("div", { class: "carnator-facts carnator-verdict" }, sentence))),
        element("div", { class: "carnator-actions" },
          element("button", { class: "carnator-icon-button", title: "Export as JSON", "aria-label": "Export",
                               onclick: () => this.exportProfile(profile) }, element("i", { class: "pi pi-download" })),
          element("button", { class: "carnator-icon-button carnator-delete", title: "Delete this profile", "aria-label": "Delete profile",
                               onclick: () => this.act(this.url(`/carnator/store/profiles/${profile.model}/${profile.schedule}`), { method: "DELETE" }) },
                  element("i", { class: "pi pi-trash" }))));
    });
    const refused = Object.entries(listing.refused || {}).map(([key, reason]) =>
      element("div", { class: "carnator-facts carnator-refused", title: key }, `refused ${shorten(key, 24)}: ${reason}`));
    this.profiles.replaceChildren(
      element("summary", {}, `Calibration profiles (${listing.profiles.length})`),
      ...rows, ...refused,
      element("button", { class: "carnator-button", onclick: () => this.importer.click() }, "Import profile…"));
    this.profiles.open = open;
  }

  exportProfile(profile) {
    const { key, description, verdict, ...data } = profile;
    const link = element("a", { download: `carnator-profile-${profile.name}.json`,
                                href: URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" })) });
    link.click();
    URL.revokeObjectURL(link.href);
  }

  async importProfile() {
    const file = this.importer.files?.[0];
    this.importer.value = "";
    if (!file) return;
    await this.act(this.url("/carnator/store/profiles"), { method: "POST", body: await file.text() });
  }

  render() {
    this.more.hidden = this.entries.length >= this.total;
    if (!this.entries.length) {
      this.renderEmpty(this.query ? `No entry matches “${this.query}”.`
        : "No entries yet. Queue a workflow with a Carnator node: each run is recorded here for later reuse.", false);
      return;
    }
    this.list.replaceChildren(...this.entries.map((entry) => this.renderEntry(entry)));
  }

  renderEmpty(message, retry) {
    this.more.hidden = true;
    this.list.replaceChildren(element("div", { class: "carnator-empty" }, message,
      retry ? element("button", { class: "carnator-button", onclick: () => this.refresh() }, "Retry") : null));
  }

  renderEntry(entry) {
    const thumbnail = entry.thumbnail
      ? element("img", { class: "carnator-thumb", alt: "" })
      : element("div", { class: "carnator-thumb carnator-no-thumb" });
    const noThumbnail = () => thumbnail.replaceWith(element("div", { class: "carnator-thumb carnator-no-thumb" }));
    thumbnail.onerror = noThumbnail;
    // fetched through the app's API client, which names the user (comfy-user) as a plain image request cannot
    if (entry.thumbnail) {
      api.fetchApi(this.url(`/carnator/store/entries/${entry.id}/thumbnail`))
        .then((response) => (response.ok ? response.blob() : Promise.reject(new Error(`HTTP ${response.status}`))))
        .then((blob) => { thumbnail.src = URL.createObjectURL(blob); }, noThumbnail);
    }
    const facts = [formatDate(entry.created_at), formatBytes(entry.bytes), `${entry.hits} hits`,
                   `${formatSeconds(entry.seconds_saved)} saved`];
    if (entry.donor_id) facts.push(`reused ${entry.donor_depth}/${entry.total_steps}`);
    return element("div", { class: "carnator-entry", role: "listitem", "data-entry-id": entry.id },
      thumbnail,
      element("div", { class: "carnator-info" },
        element("div", { class: "carnator-prompt", title: entry.prompt || "" },
          shorten(entry.prompt, 140) || element("em", {}, "(no prompt text)")),
        element("div", { class: "carnator-facts" }, facts.join(" · "))),
      element("div", { class: "carnator-actions" },
        element("button", {
          class: `carnator-icon-button${entry.pinned ? " carnator-pinned" : ""}`,
          title: entry.pinned ? "Pinned: never evicted (click to unpin)" : "Pin (never evict)",
          "aria-label": entry.pinned ? "Unpin" : "Pin", "aria-pressed": String(entry.pinned),
          onclick: () => this.act(this.url(`/carnator/store/entries/${entry.id}/pin`),
                                  { method: "POST", body: JSON.stringify({ pinned: !entry.pinned }) }),
        }, element("i", { class: "pi pi-thumbtack" })),
        element("button", {
          class: "carnator-icon-button carnator-delete", title: "Delete this entry", "aria-label": "Delete",
          onclick: () => this.act(this.url(`/carnator/store/entries/${entry.id}`), { method: "DELETE" }),
        }, element("i", { class: "pi pi-trash" }))));
  }

  async act(path, options) {
    try {
      await request(path, { headers: { "Content-Type": "application/json" }, ...options });
    } catch (error) {
      app.extensionManager?.toast?.add?.({ severity: "error", summary: "Carnator store", detail: error.message,
                                           life: 5000 });
    }
    this.refresh();
  }

  async clearAll() {
    const message = "Delete every entry of the Carnator store (pinned ones too)? Later runs start from zero.";
    const dialog = app.extensionManager?.dialog;
    const confirmed = dialog?.confirm
      ? await dialog.confirm({ title: "Clear the Carnator store", message, type: "delete" })
      : window.confirm(message);
    if (confirmed) await this.act(this.url("/carnator/store/clear", { confirm: "true" }), { method: "POST" });
  }
}

/** The panel in a dialog: the Carnator menu's "Store" command, and the only way on frontends without sidebar tabs. */
function openDialog() {
  const panel = new StorePanel();
  const body = element("div", { class: "carnator-dialog-body" });
  const dialog = element("dialog", { class: "carnator-dialog" },
    element("button", { class: "carnator-icon-button carnator-close", "aria-label": "Close",
                        onclick: () => dialog.close() }, "×"), body);
  dialog.addEventListener("close", () => { panel.unmount(); dialog.remove(); });
  document.body.appendChild(dialog);
  panel.mount(body);
  dialog.showModal();
}

app.registerExtension({
  name: "Carnator.StorePanel",
  commands: [{ id: "Carnator.OpenStore", label: "Store", icon: "pi pi-database", function: openDialog }],
  menuCommands: [{ path: ["Carnator"], commands: ["Carnator.OpenStore"] }],
  async setup() {
    const manager = app.extensionManager;
    if (typeof manager?.registerSidebarTab === "function") {
      const panel = new StorePanel();
      manager.registerSidebarTab({
        id: "carnator-store",
        icon: "carnator-sidebar-icon",
        title: "Carnator",
        tooltip: "Carnator reuse store",
        type: "custom",
        render: (container) => panel.mount(container),
        destroy: () => panel.unmount(),
      });
    }
    loadStylesheet();  // the sidebar icon is styled before the tab is ever opened
    const afterRun = () => { for (const panel of mounted) panel.schedule(AFTER_RUN_DELAY_MS); };
    api.addEventListener("carnator.status", afterRun);
    api.addEventListener("execution_success", afterRun);
    api.addEventListener("carnator.calibration", ({ detail }) => {
      for (const panel of mounted) {
        panel.showCalibration(detail);
        if (detail.phase === "done") panel.refresh();  // the new profile
      }
    });
  },
});
