"""Where Carnator keeps its state in ComfyUI's `transformer_options`, and the keys of its wrappers: every key in
one place, so that the reuse and attention hooks never collide."""

# Set on the patched model (cloned with it).
REUSE_SETTINGS_KEY = "carnator_reuse"  # ReuseSettings of a CarnatorReuse model
ATTENTION_SETTINGS_KEY = "carnator_attention"  # SparseAttentionSettings of a sparse-attention model
ATTENTION_DONOR_KEY = "carnator_attention_donor"  # (store directory, entry id) to borrow masks from, from a lookup
TEXT_FIRST_KEY = "carnator_text_first"  # the model's joint attention puts text before video

# Set for one sampling run, on its cloned options, and gone with them: Carnator's per-run state
# (`nodes.run_state.CarnatorRun`), one object every hook of the run reads.
RUN_KEY = "carnator_run"

# Keys of Carnator's sampling wrappers (`add_wrapper_with_key`).
REUSE_WRAPPER_KEY = "carnator_reuse"
ATTENTION_WRAPPER_KEY = "carnator_attention"
