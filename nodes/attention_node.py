"""The node that makes a video model's self-attention block-sparse."""

from __future__ import annotations

from comfy_api.latest import io

from carnator_core.attention.hysteresis import check_recall_thresholds
from carnator_core.attention.sparse_attention import MASK_SOURCES, SparseAttentionSettings

from .attention_hooks import install_sparse_attention
from .types import MatchType, advanced_input

SPARSE_CHOICES = ("off",) + MASK_SOURCES
ATTENTION = SparseAttentionSettings()  # the defaults every attention input shows


def attention_settings(source: str, **inputs) -> SparseAttentionSettings | None:
    """Sparse-attention settings from a node's inputs; None for source 'off'. Recall thresholds that cannot keep a
    head from flapping are refused either way (ValueError naming both inputs), when the node runs."""
    check_recall_thresholds(inputs["enter_recall"], inputs["exit_recall"])
    return None if source == "off" else SparseAttentionSettings(source=source, **inputs)


def attention_choice_input(default: str) -> io.Input:
    return io.Combo.Input(
        "sparse_attention", options=list(SPARSE_CHOICES), default=default,
        tooltip="off: leave attention as it is (e.g. as patched by Carnator Sparse Attention upstream). "
                "borrowed: use a compatible donor's recorded masks, dense otherwise (sparsity reuse). own: masks "
                "estimated online from this request. borrowed+own: donor masks, own masks for heads that do not fit.")


def min_tokens_input() -> io.Input:
    """The video token count below which attention stays dense; optional, after every older input (saved workflows
    hold widget values by position)."""
    return io.Int.Input("min_tokens", **advanced_input(), default=ATTENTION.min_tokens, min=0, max=1_000_000,
                        optional=True,
                        tooltip="Below this many video tokens attention runs dense and no mask is estimated, borrowed "
                                "or recorded: short clips gain less than the masks cost. 0 lets any clip run sparse.")


def recall_inputs() -> list[io.Input]:
    return [
        io.Float.Input("enter_recall", **advanced_input(), default=ATTENTION.enter_recall, min=0.0, max=1.0, step=0.01,
                       tooltip="A head borrows the donor mask only while the mask covers at least this share of the "
                               "live attention mass (and re-enters after two consecutive checks at this level)."),
        io.Float.Input("exit_recall", **advanced_input(), default=ATTENTION.exit_recall, min=0.0, max=1.0, step=0.01,
                       tooltip="A borrowing head falls back to its own mask when recall drops below this "
                               "(must be lower than enter_recall: the gap prevents flapping)."),
    ]


class CarnatorSparseAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="CarnatorSparseAttention",
            display_name="Carnator Sparse Attention",
            category="Carnator/attention",
            description="Block-sparse self-attention over video tokens (Wan, HunyuanVideo, LTX-Video). Cross-attention "
                        "and text tokens stay dense. Masks are estimated online or borrowed from a lookup match. "
                        "Place it after attention patch nodes such as SageAttention: dense calls go to them.",
            inputs=[
                io.Model.Input("model", tooltip="The video model to patch."),
                MatchType.Input("match", optional=True, tooltip="Borrow the recorded masks of the best candidate "
                                                                "of a Carnator Compatibility Lookup."),
                io.Combo.Input("source", options=list(MASK_SOURCES), default=ATTENTION.source,
                               tooltip="own: online masks. borrowed: donor masks only (dense without a donor). "
                                       "borrowed+own: donor masks where they fit, own masks elsewhere."),
                io.Combo.Input("block_size", options=["64", "128"], default=str(ATTENTION.block_size),
                               tooltip="Tokens per mask block (128 suits large GPUs, 64 finer masks)."),
                io.Float.Input("tau", default=ATTENTION.tau, min=0.5, max=1.0, step=0.01,
                               tooltip="Estimated share of each query block's attention its key blocks must keep."),
                io.Float.Input("min_density", default=ATTENTION.min_density, min=0.0, max=1.0, step=0.01,
                               tooltip="Floor on the share of key blocks each query block attends."),
                io.Float.Input("max_density", default=ATTENTION.max_density, min=0.01, max=1.0, step=0.01,
                               tooltip="Cap on the share of key blocks each query block attends."),
                io.Float.Input("dense_fraction", default=ATTENTION.dense_fraction, min=0.0, max=1.0, step=0.01,
                               tooltip="The first share of steps stays dense (layout forms early)."),
                io.Int.Input("dense_first_blocks", default=ATTENTION.dense_first_blocks, min=0, max=100,
                             tooltip="How many first transformer blocks stay dense."),
                io.Int.Input("dense_last_blocks", default=ATTENTION.dense_last_blocks, min=0, max=100,
                             tooltip="How many last transformer blocks stay dense."),
                io.Int.Input("refresh_every", default=ATTENTION.refresh_every, min=1, max=100,
                             tooltip="Steps between re-estimates of the online masks."),
                io.Int.Input("recheck_every", default=ATTENTION.recheck_every, min=1, max=100,
                             tooltip="Steps between recall checks of borrowed masks (hysteresis)."),
            ] + recall_inputs() + [
                io.Combo.Input("backend", options=["auto", "triton", "flex", "cpu", "dense"], default=ATTENTION.backend,
                               tooltip="Kernel: auto picks Triton on CUDA and the fastest CPU path elsewhere."),
                io.Float.Input("dense_above", default=ATTENTION.dense_above, min=0.0, max=1.0, step=0.01,
                               optional=True,
                               tooltip="A layer whose mask keeps more than this share of key blocks runs dense: "
                                       "block-sparse attention is not faster there. 1.0 runs every mask sparse."),
                min_tokens_input(),
            ],
            outputs=[io.Model.Output(display_name="model")],
        )

    @classmethod
    def execute(cls, model, source: str, block_size: str, match=None, **knobs) -> io.NodeOutput:
        settings = attention_settings(source=source, block_size=int(block_size), **knobs)
        donor = None
        if match is not None and match.best is not None and source != "own":
            donor = (match.store_location, match.best.entry_id)
        return io.NodeOutput(install_sparse_attention(model, settings, donor))
