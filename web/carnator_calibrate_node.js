// The Carnator Calibrate node shows where its background calibration stands: the node's own answer when queued,
// then every `carnator.calibration` update (runs done, time left, the fitted profile), in a read-only text box on
// the node; a toast says when the calibration ends.

import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { calibrationText } from "./carnator_ui.js";

const NODE = "CarnatorCalibrate";
const ENDS = { done: "success", stopped: "info", interrupted: "warn", failed: "error" };

/** The node's read-only status box, added on first use. */
function statusBox(node) {
  let widget = node.widgets?.find((w) => w.name === "calibration status");
  if (!widget) {
    const element = document.createElement("textarea");
    element.readOnly = true;
    element.className = "carnator-calibration-status";
    widget = node.addDOMWidget("calibration status", "carnator-status", element, { serialize: false,
      getValue: () => element.value, setValue: (value) => { element.value = value; } });
    widget.serialize = false;
  }
  return widget;
}

function show(node, text) {
  statusBox(node).value = text;
  node.setDirtyCanvas?.(true, true);
}

app.registerExtension({
  name: "Carnator.CalibrateNode",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== NODE) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      if (message?.text?.length) show(this, message.text.join("\n"));
    };
  },
  async setup() {
    api.addEventListener("carnator.calibration", ({ detail }) => {
      const text = [calibrationText(detail), ...(detail.phase === "done" ? detail.summary ?? [] : [])].join("\n");
      for (const node of app.graph?.nodes ?? []) if (node.type === NODE) show(node, text);
      if (ENDS[detail.phase]) {
        app.extensionManager?.toast?.add?.({ severity: ENDS[detail.phase], summary: "Carnator calibration",
                                             detail: detail.line, life: 8000 });
      }
    });
  },
});
