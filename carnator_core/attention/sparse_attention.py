"""Which attention calls go block-sparse, under which mask: the per-run attention controller.

The host calls `SparseAttentionRun.attend(q, k, v, ...)` for every attention call of the
diffusion model; it returns the block-sparse result, or None to say "run it dense" (cross-
attention, text refiners, the dense first steps and edge blocks, unsupported shapes).

Masks cover the video tokens only. In joint image+text attention (HunyuanVideo) the video
tokens come first; every block holding a text token is attended by every query block and
attends every key block, so text rows and columns stay dense. Per layer a mask is either
the request's own (estimated online from pooled Q·K at refresh steps and kept in between)
or borrowed from a donor; with a donor, each head switches between the two by hysteresis
on the borrowed mask's recall, re-checked every `recheck_every` steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from carnator_core.attention.hysteresis import HeadHysteresis, HeadMode
from carnator_core.attention.masks import BlockSparseMask, estimate_block_mass, recall, select_blocks
from carnator_core.kernels import BlockLayout, block_sparse_attention, kernel_fallbacks

log = logging.getLogger("carnator.attention")

MASK_SOURCES = ("own", "borrowed", "borrowed+own")
MASKS_TOO_FULL = "donor masks fit, but were too full for sparse attention to pay (dense_above): ran dense"
INACTIVE = "sparse attention inactive: attention is patched by {}"
TOO_FEW_TOKENS = "dense attention: {} video tokens, fewer than min_tokens ({})"
# A model that carries ComfyUI's own block-sparse attention (its "Model Sparse Attention" node) keeps it: Carnator
# puts no attention of its own into that run.
COMFYUI_SPARSE_ATTENTION = "sparse attention is ComfyUI's (Model Sparse Attention): Carnator's attention stays off"
# A host whose model compiler records a block's allocations into a graph that Carnator cannot step out of: the run's
# attention is the host's from that call on.
GRAPHED_DENSE = ("dense attention: the model's blocks run inside the model compiler's malloc graph, which offers no "
                 "way to step out of it")
# The attention a run's masks belong to, as its recorded masks name it: the video's self-attention (with text in a
# joint block), never audio, text or cross-attention.
MASKED_ATTENTION = "video self-attention"


@dataclass
class SparseAttentionSettings:
    """User-facing knobs of block-sparse attention."""

    source: str = "own"  # own: online masks; borrowed: donor masks only (dense otherwise); borrowed+own
    block_size: int = 64
    tau: float = 0.9
    min_density: float = 0.05
    max_density: float = 1.0
    # A layer whose mask is fuller than this runs dense: block-sparse attention is no faster there (the kernels
    # reach a fraction of the ideal 1/density speedup, and per-call overhead lowers the break-even on short
    # sequences; docs/measurements.md has the attention benchmark).
    dense_above: float = 0.6
    # Below this many video tokens every layer runs dense and no mask is estimated, borrowed or recorded: a short
    # sequence holds too few blocks for a mask to leave many out, and attention is too small a share of a step for
    # what it leaves out to pay for estimating it (docs/measurements.md, "What a miss costs").
    min_tokens: int = 1024
    dense_fraction: float = 0.25  # first share of steps stays dense
    dense_first_blocks: int = 1
    dense_last_blocks: int = 1
    refresh_every: int = 5  # steps between re-estimates of own masks
    recheck_every: int = 3  # steps between recall checks of borrowed masks
    enter_recall: float = 0.9
    exit_recall: float = 0.75
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.source not in MASK_SOURCES:
            raise ValueError(f"mask source must be one of {MASK_SOURCES}, got {self.source!r}")
        if self.block_size not in (64, 128):
            raise ValueError(f"block size must be 64 or 128, got {self.block_size}")


@dataclass
class _LayerState:
    own: BlockSparseMask | None = None
    own_step: int = -1
    checked_step: int = -1
    density: float = 1.0
    source: str = "dense"
    layout: BlockLayout | None = None  # kernel layout of the current blocks, rebuilt only when they change
    layout_key: tuple = ()


@dataclass
class SparseAttentionRun:
    """Attention state of one sampling run."""

    settings: SparseAttentionSettings
    video_tokens: int
    first_frame_tokens: int
    num_layers: int
    total_steps: int
    # Whether a self-attention call over more tokens than the video's is the video attended with text (HunyuanVideo's
    # joint blocks). Not in a packed run, where only the video's own token count is video self-attention.
    joint_tokens: bool = True
    borrowed: dict[int, BlockSparseMask] = field(default_factory=dict)  # layer -> donor mask (video part)
    layers: dict[int, _LayerState] = field(default_factory=dict)
    hysteresis: HeadHysteresis | None = None
    sparse_calls: int = 0
    dense_calls: int = 0
    borrowed_sparse_calls: int = 0  # sparse calls that used a donor's mask for at least one head: a masks hit
    self_attention_calls: int = 0  # video self-attention calls that reached the override, sparse or dense
    # why no video self-attention runs sparse (another patch replaced it, too few tokens, an error), if so: every call
    # is dense and no mask is estimated, borrowed or recorded
    inactive: str = ""
    _report_deferred: bool = field(default=False, init=False, repr=False)  # see `defer_report`
    # The last model evaluation's (host's sigma tensor, step index): a memo that maps the sigma object every attention
    # call of one evaluation shares to its sampling step, computed once per evaluation (`step_of`).
    _sigma_step: tuple[Any, int] | None = field(default=None, init=False, repr=False)
    # Context under which every tensor of a sparse call is made (estimates, masks, kernel layouts and buffers): a host
    # that records a block's allocations into a replayed graph (ComfyUI's model compiler) must not own them.
    outside_graph: Callable[[], AbstractContextManager] = nullcontext
    # Whether this call runs inside such a graph that offers no way to step out: the run then goes inactive.
    in_unpausable_graph: Callable[[], bool] = field(default=lambda: False)

    def __post_init__(self) -> None:
        self.hysteresis = HeadHysteresis(self.settings.enter_recall, self.settings.exit_recall)
        if self.video_tokens < self.settings.min_tokens and not self.inactive:
            self.inactive = TOO_FEW_TOKENS.format(self.video_tokens, self.settings.min_tokens)

    # ------------------------------------------------------------------ decisions
    def first_sparse_step(self) -> int:
        return int(self.settings.dense_fraction * self.total_steps + 0.5)

    def layer_is_dense(self, layer: int) -> bool:
        return layer < self.settings.dense_first_blocks or layer >= self.num_layers - self.settings.dense_last_blocks

    def may_be_sparse(self, tokens: int, layer: int | None, step: int) -> bool:
        """Whether a self-attention call over `tokens` at this layer and step can be sparse at all."""
        video = tokens == self.video_tokens or (self.joint_tokens and tokens > self.video_tokens)
        return video and not self.inactive and layer is not None and step >= self.first_sparse_step() \
            and not self.layer_is_dense(layer)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, layer: int | None, step: int,
               key_valid: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor | None:
        """Block-sparse attention for a video self-attention call, or None to run it dense.

        q, k, v: (B, H, N, D). `key_valid` (N,) bool drops masked-out keys (padded text tokens). `scale` is the
        softmax scale the model asked for (None: 1/sqrt(D)); masks are estimated under it too.
        """
        n = q.shape[2]
        if k.shape[2] != n or not self.may_be_sparse(n, layer, step) or not self.can_step_out():
            self.dense_calls += 1
            return None
        with self.outside_graph():
            return self.attend_outside_graph(q, k, v, heads, layer, step, key_valid, scale)

    def can_step_out(self) -> bool:
        """Whether a call that may be sparse can make its tensors outside the host's malloc graph. Where it runs inside
        a graph with no way out, every later call would too: the run goes inactive (said once) and is dense from here."""
        if not self.in_unpausable_graph():
            return True
        self.inactive = GRAPHED_DENSE
        log.warning("Carnator: %s", GRAPHED_DENSE)
        return False

    def attend_outside_graph(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, layer: int,
                             step: int, key_valid: torch.Tensor | None = None,
                             scale: float | None = None) -> torch.Tensor | None:
        """`attend` for a call that may be sparse, already under `outside_graph`: a caller that makes tensors of its
        own for the call (layouts, masks, the output's) steps out once around them and this."""
        n = q.shape[2]
        if key_valid is not None and not bool(key_valid.all()):
            return self._attend_valid_keys(q, k, v, heads, layer, step, key_valid, scale)
        blocks = self._video_blocks(q, k, layer, step, scale)
        if blocks is None or (self.settings.source == "borrowed" and layer not in self.borrowed):
            # without a donor, "borrowed" runs dense; its own estimate is still recorded for later requests
            self.dense_calls += 1
            return None
        state = self.layers[layer]
        if state.density > self.settings.dense_above:
            state.density, state.source = 1.0, f"dense ({state.source} mask fuller than {self.settings.dense_above:g})"
            self.dense_calls += 1
            return None
        key = (state.own_step, state.checked_step, layer in self.borrowed, n, str(q.device))
        if state.layout_key != key:  # masks change only at refreshes and re-checks, not at every call
            state.layout = BlockLayout.from_dense(self._embed(blocks, n).to(q.device), self.settings.block_size, n)
            state.layout_key = key
        layout = state.layout
        self.sparse_calls += 1
        if state.source in ("borrowed", "mixed"):
            self.borrowed_sparse_calls += 1
        return block_sparse_attention(q, k, v, layout, scale=scale, backend=self.settings.backend)

    def _attend_valid_keys(self, q, k, v, heads, layer, step, key_valid, scale) -> torch.Tensor | None:
        """Padded text keys never receive attention: drop them, attend, and let padded queries read
        the valid keys densely (their outputs never reach the video tokens)."""
        valid = key_valid.nonzero().flatten()
        kept = self.attend_outside_graph(q[:, :, valid], k[:, :, valid], v[:, :, valid], heads, layer, step, None, scale)
        if kept is None:
            return None
        out = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, valid], v[:, :, valid], scale=scale)
        out[:, :, valid] = kept
        return out

    def _video_blocks(self, q: torch.Tensor, k: torch.Tensor, layer: int, step: int,
                      scale: float | None = None) -> torch.Tensor | None:
        """(1, H, nv, nv) bool blocks over the video tokens for this call."""
        settings = self.settings
        state = self.layers.setdefault(layer, _LayerState())
        qv, kv = q[:, :, : self.video_tokens], k[:, :, : self.video_tokens]
        heads = q.shape[1]
        donor = self.borrowed.get(layer)
        if donor is not None and not donor.fits(1, heads, self.video_tokens):
            log.info("Carnator: borrowed mask of layer %d does not fit the live tokens; ignored", layer)
            self.borrowed.pop(layer)
            donor = None
        refreshing = settings.source != "borrowed" or donor is not None  # own masks in use, keep them fresh
        needs_own = state.own is None or (refreshing and step - state.own_step >= settings.refresh_every)
        needs_check = donor is not None and (state.checked_step < 0 or step - state.checked_step >= settings.recheck_every)
        mass = None
        if needs_own or needs_check:
            mass = estimate_block_mass(qv, kv, settings.block_size, scale).mean(dim=0, keepdim=True)
        if needs_own:
            state.own = select_blocks(mass, self.video_tokens, settings.block_size, settings.tau,
                                      self.first_frame_tokens, settings.min_density, settings.max_density)
            state.own_step = step
        if donor is None:
            if settings.source != "borrowed":
                state.density, state.source = state.own.density(), "own"
            return state.own.blocks
        if needs_check:
            recalls = recall(donor, mass)[0]
            for head in range(heads):
                self.hysteresis.check((layer, head), float(recalls[head]), step)
            state.checked_step = step
        use_donor = torch.tensor([self.hysteresis.mode((layer, h)) is HeadMode.REUSE for h in range(heads)])
        donor_blocks = donor.blocks.expand(1, heads, *donor.blocks.shape[2:])
        own_blocks = state.own.blocks.expand_as(donor_blocks)
        blocks = torch.where(use_donor.view(1, heads, 1, 1), donor_blocks, own_blocks)
        state.density = float(blocks.float().mean())
        state.source = "borrowed" if bool(use_donor.all()) else ("own" if not bool(use_donor.any()) else "mixed")
        return blocks

    def _embed(self, video_blocks: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """Place video blocks in the grid of all `n_tokens`; blocks holding text are dense both ways."""
        if n_tokens == self.video_tokens:
            return video_blocks
        block = self.settings.block_size
        total = -(-n_tokens // block)
        first_text_block = self.video_tokens // block
        blocks = torch.ones(*video_blocks.shape[:2], total, total, dtype=torch.bool)
        blocks[..., :first_text_block, :first_text_block] = video_blocks[..., :first_text_block, :first_text_block]
        return blocks

    def go_dense(self, reason: str) -> None:
        """Every call from here on is dense, and the report says why (the first reason given stands)."""
        self.inactive = self.inactive or reason

    def lend(self, masks: dict[int, BlockSparseMask]) -> None:
        """A donor's masks, per layer, for the heads whose recall keeps them (`MASK_SOURCES`)."""
        self.borrowed = masks

    def step_of(self, sigma: torch.Tensor, schedule: torch.Tensor) -> int:
        """The sampling step of the model evaluation at `sigma` in `schedule`. Every attention call of one evaluation
        sees the same `sigma` tensor object, so the step is computed once per evaluation, memoised by identity (holding
        the tensor keeps its identity from being reused), and read outside the host's malloc graph."""
        memo = self._sigma_step
        if memo is not None and memo[0] is sigma:
            return memo[1]
        with self.outside_graph():
            sigmas, now = schedule.flatten().tolist(), float(sigma.flatten()[0])
        step = min(range(len(sigmas)), key=lambda index: abs(sigmas[index] - now))
        self._sigma_step = (sigma, step)
        return step

    # ------------------------------------------------------------------ reporting and recording
    def defer_report(self) -> None:
        """The run's report is the reuse run's around it, which includes this summary: publish none of its own."""
        self._report_deferred = True

    @property
    def reports_itself(self) -> bool:
        """Whether this run publishes its own report (no reuse run's report includes it)."""
        return not self._report_deferred

    @property
    def wants_donor_masks(self) -> bool:
        """Whether a donor's masks would be used and none are borrowed yet."""
        return self.settings.source != "own" and not self.borrowed and not self.inactive

    def summary(self) -> dict[str, Any]:
        densities = [s.density for s in self.layers.values()]
        counts = self.hysteresis.counts() if self.hysteresis.heads else {"heads_reuse": 0, "heads_own": 0}
        return {
            "density": sum(densities) / len(densities) if densities else None,
            "sparse_calls": self.sparse_calls,
            "dense_calls": self.dense_calls,
            "borrowed_sparse_calls": self.borrowed_sparse_calls,
            "self_attention_calls": self.self_attention_calls,
            "inactive": self.inactive,
            "per_layer": {str(layer): {"density": s.density, "source": s.source} for layer, s in sorted(self.layers.items())},
            "head_history": self.hysteresis.history(),
            "kernel_fallbacks": kernel_fallbacks(),
            **counts,
        }

    def own_masks(self) -> dict[int, BlockSparseMask]:
        """The request's own latest masks per layer: what a later request may borrow."""
        return {layer: state.own for layer, state in self.layers.items() if state.own is not None}


def masks_to_blob(masks: dict[int, BlockSparseMask]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Metadata and uint8 tensors (bit-packed) for the store's `masks` blob, named by the attention they mask."""
    meta: dict[str, Any] = {"attention": MASKED_ATTENTION, "layers": {}}
    tensors = {}
    for layer, mask in sorted(masks.items()):
        data, layer_meta = mask.to_bytes()
        meta["layers"][str(layer)] = layer_meta
        tensors[f"layer_{layer}"] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return meta, tensors


def masks_from_blob(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[int, BlockSparseMask]:
    """Inverse of `masks_to_blob`; a malformed layer is skipped (ValueError never escapes), and masks of another
    attention are none."""
    if meta.get("attention", MASKED_ATTENTION) != MASKED_ATTENTION:  # masks that name none are video self-attention's
        return {}
    masks = {}
    for layer, layer_meta in (meta.get("layers") or {}).items():
        tensor = tensors.get(f"layer_{layer}")
        if tensor is None:
            continue
        try:
            masks[int(layer)] = BlockSparseMask.from_bytes(tensor.numpy().tobytes(), layer_meta)
        except (ValueError, KeyError, TypeError) as error:
            log.info("Carnator: donor mask of layer %s unusable: %s", layer, error)
    return masks
