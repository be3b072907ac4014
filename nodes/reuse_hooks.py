"""Installs the ComfyUI sampling wrappers that run a `carnator_core.reuse.run.ReuseRun` around any sampler.

Modelled on ComfyUI's built-in EasyCache: supported `add_wrapper_with_key` hooks only, per-run state
(`nodes.run_state.CarnatorRun`, one key) on a clone of the guider's model options, dropped in `finally`. The engine
decides (`ReuseRun.decide` returns one `Outcome`); the wrappers convert between ComfyUI objects and the engine's, install
what the outcome says, and report.

- OUTER_SAMPLE    (`reuse_lifecycle`) opens the run (fingerprints) and samples it under `reuse_lifecycle`, which
                  records and reports it afterwards (the reuse sampler runs its SAMPLER under the same lifecycle)
- SAMPLER_SAMPLE  (`sampler_preparation`) asks the engine with the loaded model as its evaluation, and installs the
                  outcome: the donor stage's output, a resume (with or without a replayed history), or a fresh start
- PREDICT_NOISE   (`model_call_wrappers`) answers a multistep sampler's calls before the resume step with the donor's
                  predictions (`carnator_core.reuse.history_replay`), counts model calls, applies the optional
                  guidance boost, and hands the run each prediction it records
- CALC_COND_BATCH (`model_call_wrappers`) serves the accepted probe's predictions per condition as the first
                  evaluation after the resume (or, without one, the probing's step-0 evaluation as step 0), so the
                  host's whole CFG path runs on them as on the model's own; keeps a probe's predictions, and cond -
                  uncond where a probe or a checkpoint needs it

Every one of them keeps Carnator's own code inside `nodes.fault_boundary` and the host's calls outside it: an error of
Carnator's before sampling starts leaves the run plain, one in the recording stops the recording, and one after the
run has left the plain path (a resume, a replay) samples the run again plain from the start (`sample_plain_again`).
So does any error the host raises in a run Carnator altered (a served, replayed or skipped call, sparse attention):
the run is sampled again plain, and only where that fails too does the prompt fail, as it would without Carnator.
The report gives the error in one line; interrupts, and the host's errors in a run left plain, pass through untouched.
"""

from __future__ import annotations

import comfy.patcher_extension

from carnator_core.attention.sparse_attention import SparseAttentionSettings
from carnator_core.reuse.settings import ReuseSettings

from .attention_hooks import install_sparse_attention
from .host import missing_hooks
from .keys import REUSE_SETTINGS_KEY, REUSE_WRAPPER_KEY
from .model_call_wrappers import calc_cond_batch_wrapper, predict_noise_wrapper
from .reuse_lifecycle import outer_sample_wrapper
from .sampler_preparation import sampler_sample_wrapper


def install(model, settings: ReuseSettings, attention: SparseAttentionSettings | None = None):
    """A clone of `model` whose sampling runs go through Carnator reuse (and sparse attention, when given)."""
    if missing_hooks():
        return model.clone()
    model = install_sparse_attention(model, attention) if attention is not None else model.clone()
    model.model_options["transformer_options"][REUSE_SETTINGS_KEY] = settings
    wrappers = comfy.patcher_extension.WrappersMP
    model.add_wrapper_with_key(wrappers.OUTER_SAMPLE, REUSE_WRAPPER_KEY, outer_sample_wrapper)
    model.add_wrapper_with_key(wrappers.SAMPLER_SAMPLE, REUSE_WRAPPER_KEY, sampler_sample_wrapper)
    model.add_wrapper_with_key(wrappers.PREDICT_NOISE, REUSE_WRAPPER_KEY, predict_noise_wrapper)
    model.add_wrapper_with_key(wrappers.CALC_COND_BATCH, REUSE_WRAPPER_KEY, calc_cond_batch_wrapper)
    return model

