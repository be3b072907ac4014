"""Standalone Wan 2.1 text-to-video DiT, used to *train* the embedded demo model without ComfyUI.

Why a separate implementation: `carnator_core` never imports ComfyUI, yet the demo weights must be loaded by
ComfyUI's own loader (UNETLoader -> `comfy.model_detection`), which recognises Wan 2.1 T2V purely from state-dict
keys and shapes. So this module reproduces exactly the parameter names/shapes and the forward arithmetic of
`comfy/ldm/wan/model.py::WanModel` for `model_type="t2v"` (3-axis RoPE, per-block modulation with time-projection,
RMS-normed q/k, affine LayerNorm before cross-attention, tanh-GELU FFN, patch (1, 2, 2)). ComfyUI derives
`num_heads = dim // 128`, `freq_dim = 256`, `eps = 1e-6` and the text width from the weights, so those are fixed
here too. Numerical equality with ComfyUI is checked in tests/test_demo_model.py.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HEAD_DIM = 128  # ComfyUI's detector assumes head size 128.
FREQ_DIM = 256
TEXT_DIM = 4096
LATENT_CHANNELS = 16
PATCH = (1, 2, 2)
EPS = 1e-6


WEIGHTS_PATH = Path(__file__).resolve().parent / "weights" / "carnator_demo_wan21_t2v.safetensors"

@dataclass(frozen=True)
class WanConfig:
    """Sizes of a Wan 2.1 T2V model; everything else is fixed by ComfyUI's detector."""

    dim: int = 256
    ffn_dim: int = 1024
    num_layers: int = 6

    @property
    def num_heads(self) -> int:
        return self.dim // HEAD_DIM

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def sinusoidal_embedding(dim: int, position: torch.Tensor) -> torch.Tensor:
    """Wan's timestep embedding: [cos | sin] with frequencies 10000^(-i/half)."""
    half = dim // 2
    position = position.float()
    freqs = torch.pow(10000, -torch.arange(half, device=position.device, dtype=torch.float32).div(half))
    sinusoid = torch.outer(position, freqs)
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


def rope_axes(head_dim: int) -> tuple[int, int, int]:
    """Per-axis rotary widths (frames, height, width) as Wan splits one head."""
    return head_dim - 4 * (head_dim // 6), 2 * (head_dim // 6), 2 * (head_dim // 6)


def rope_freqs(grid: tuple[int, int, int], head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [L, head_dim // 2] for the token grid (frames, h, w) in row-major order."""
    coords = torch.stack(
        torch.meshgrid(*[torch.arange(n, device=device, dtype=torch.float32) for n in grid], indexing="ij"), dim=-1
    ).reshape(-1, 3)
    angles = []
    for axis, width in enumerate(rope_axes(head_dim)):
        scale = torch.linspace(0, (width - 2) / width, steps=width // 2, dtype=torch.float64, device=device)
        omega = (1.0 / (10000.0**scale)).float()
        angles.append(coords[:, axis : axis + 1] * omega)
    theta = torch.cat(angles, dim=1)
    return torch.cos(theta), torch.sin(theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x [B, L, H, D] (the pairing ComfyUI's apply_rope1 uses)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([c * a - s * b, s * a + c * b], dim=-1).flatten(-2).type_as(x)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = nn.RMSNorm(dim, eps=EPS)
        self.norm_k = nn.RMSNorm(dim, eps=EPS)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (self.num_heads, -1))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(out.transpose(1, 2).flatten(2))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        q = apply_rope(self._heads(self.norm_q(self.q(x))), *rope)
        k = apply_rope(self._heads(self.norm_k(self.k(x))), *rope)
        return self._attend(q, k, self._heads(self.v(x)))


class CrossAttention(SelfAttention):
    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        q = self._heads(self.norm_q(self.q(x)))
        k = self._heads(self.norm_k(self.k(context)))
        return self._attend(q, k, self._heads(self.v(context)))


class Block(nn.Module):
    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        dim = cfg.dim
        self.norm1 = nn.LayerNorm(dim, eps=EPS, elementwise_affine=False)
        self.self_attn = SelfAttention(dim, cfg.num_heads)
        self.norm3 = nn.LayerNorm(dim, eps=EPS)
        self.cross_attn = CrossAttention(dim, cfg.num_heads)
        self.norm2 = nn.LayerNorm(dim, eps=EPS, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, cfg.ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(cfg.ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                context: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = (self.modulation.to(x.dtype) + e).unbind(1)
        shift1, scale1, gate1, shift2, scale2, gate2 = (t[:, None] for t in (shift1, scale1, gate1, shift2, scale2,
                                                                            gate2))
        x = x + gate1 * self.self_attn(shift1 + self.norm1(x) * (1 + scale1), rope)
        x = x + self.cross_attn(self.norm3(x), context)
        return x + gate2 * self.ffn(shift2 + self.norm2(x) * (1 + scale2))


class Head(nn.Module):
    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(cfg.dim, eps=EPS, elementwise_affine=False)
        self.head = nn.Linear(cfg.dim, math.prod(PATCH) * LATENT_CHANNELS)
        self.modulation = nn.Parameter(torch.randn(1, 2, cfg.dim) / cfg.dim**0.5)

    def forward(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        shift, scale = (self.modulation.to(x.dtype) + e[:, None]).unbind(1)
        return self.head(shift[:, None] + self.norm(x) * (1 + scale[:, None]))


class WanT2V(nn.Module):
    """Wan 2.1 T2V backbone. forward(x [B,16,F,H,W], timestep [B] = sigma*1000, context [B,T,4096]) -> velocity."""

    def __init__(self, cfg: WanConfig) -> None:
        super().__init__()
        self.cfg = cfg
        dim = cfg.dim
        self.patch_embedding = nn.Conv3d(LATENT_CHANNELS, dim, kernel_size=PATCH, stride=PATCH)
        self.text_embedding = nn.Sequential(nn.Linear(TEXT_DIM, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(FREQ_DIM, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.num_layers)])
        self.head = Head(cfg)
        self._init_weights()

    def _init_weights(self) -> None:
        """Wan's init (xavier linears, small-normal embeddings) with a zero output head so training starts at 0."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.xavier_uniform_(self.patch_embedding.weight.flatten(1))
        for seq in (self.text_embedding, self.time_embedding):
            for m in seq:
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, std=0.02)
        nn.init.zeros_(self.head.head.weight)

    def forward(self, x: torch.Tensor, timestep: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        b, _, f, h, w = x.shape
        grid = (f // PATCH[0], h // PATCH[1], w // PATCH[2])
        tokens = self.patch_embedding(x.float()).to(x.dtype).flatten(2).transpose(1, 2)
        e = self.time_embedding(sinusoidal_embedding(FREQ_DIM, timestep.flatten()).to(x.dtype))
        e0 = self.time_projection(e).unflatten(1, (6, self.cfg.dim))
        context = self.embed_text(context)
        rope = rope_freqs(grid, HEAD_DIM, x.device)
        for block in self.blocks:
            tokens = block(tokens, e0, rope, context)
        out = self.head(tokens, e)
        return self.unpatchify(out, grid)

    def embed_text(self, context: torch.Tensor) -> torch.Tensor:
        """Narrower context counts as zero-padded to 4096 (MiniLM's 384 features), without multiplying the zeros."""
        first, act, second = self.text_embedding
        width = context.shape[-1]
        return second(act(F.linear(context, first.weight[:, :width], first.bias)))

    @staticmethod
    def unpatchify(x: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """[B, L, p*q*r*C] -> [B, C, F, H, W] with ComfyUI's (p, q, r, c) feature order."""
        b = x.shape[0]
        u = x.view(b, *grid, *PATCH, LATENT_CHANNELS)
        u = torch.einsum("bfhwpqrc->bcfphqwr", u)
        return u.reshape(b, LATENT_CHANNELS, *[g * p for g, p in zip(grid, PATCH, strict=True)])


def model_from_state_dict(state: dict[str, torch.Tensor]) -> WanT2V:
    """The fp32 model (eval mode) for weights saved by training or export (fp16)."""
    model = WanT2V(config_from_state_dict(state))
    model.load_state_dict({k: v.float() for k, v in state.items()})
    return model.eval()


def config_from_state_dict(state: dict[str, torch.Tensor]) -> WanConfig:
    """Read sizes back from weights the same way ComfyUI's detector does."""
    layers = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    return WanConfig(dim=state["head.modulation"].shape[-1], ffn_dim=state["blocks.0.ffn.0.weight"].shape[0],
                     num_layers=layers)
