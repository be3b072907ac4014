"""Where Carnator keeps its state in ComfyUI's `transformer_options`, and the keys of its wrappers: every key in
one place, so that the reuse and attention hooks never collide, and each reads what the other wrote by one name."""

# The reuse holder (`nodes.reuse_hooks.ReuseHolder`): on a CarnatorReuse model its settings; for one sampling run
# (OUTER_SAMPLE, or the reuse sampler) a holder opened for that run in its place, reset in `finally`. The attention
# wrapper leaves the run's report to the reuse wrapper when one is installed.
REUSE_KEY = "carnator_reuse"

# Set on the patched model (cloned with it).
ATTENTION_SETTINGS_KEY = "carnator_attention"  # SparseAttentionSettings of a sparse-attention model
ATTENTION_DONOR_KEY = "carnator_attention_donor"  # (store directory, entry id) to borrow masks from, from a lookup
PREVIOUS_OVERRIDE_KEY = "carnator_previous_attention_override"  # another pack's override, chained to
TEXT_FIRST_KEY = "carnator_text_first"  # the model's joint attention puts text before video

# Set for one sampling run and dropped in `finally`.
ATTENTION_RUN_KEY = "carnator_attention_run"  # the run's SparseAttentionRun
BLOCK_KEY = "carnator_block"  # the index of the transformer block being evaluated
# Takes Carnator's override off the run's options (where the next model evaluation reads it) once the run cannot act.
WITHDRAW_KEY = "carnator_withdraw_attention"
# Set when a Carnator error made the run sample again plain (`nodes.fault_boundary`): every Carnator hook passes through.
PLAIN_RETRY_KEY = "carnator_plain_retry"

# Keys of Carnator's sampling wrappers (`add_wrapper_with_key`).
REUSE_WRAPPER_KEY = "carnator_reuse"
ATTENTION_WRAPPER_KEY = "carnator_attention"
