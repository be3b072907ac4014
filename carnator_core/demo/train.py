"""Train the embedded demo model (a tiny Wan 2.1 T2V DiT) with rectified flow on the synthetic world.

    python -m carnator_core.demo.train [--out DIR] [--steps N] [--threads N]   # train / resume
    python -m carnator_core.demo.train --eval [--out DIR]                      # sample + oracle accuracy
    python -m carnator_core.demo.train --sensitivity [--out DIR]               # which words the model reads
    python -m carnator_core.demo.train --branch-from RUN --out BRANCH --cooldown-start S   # a cooled-down branch

Sizing: dim 256 (2 heads of 128, the head size ComfyUI's detector assumes), FFN 768, 6 layers, 5 x 16 x 16
latent clips, batch 8 — small enough to train on a CPU; docs/demo-model.md has the cost per step. Wan's 3-axis
RoPE has no fixed grid, so the model can be fine-tuned at a larger, sparser clip later. For the motion word to
be read at all: objects move at least one patch per latent frame, the loss weights the foreground, a curriculum
starts with the canonical wording, and text dropout (empty prompt / zeros) makes CFG work.

Conventions are ComfyUI's for Wan (ModelType.FLOW, ModelSamplingDiscreteFlow, multiplier 1000): timestep =
sigma * 1000, x_t = sigma * noise + (1 - sigma) * x0, denoised = x_t - sigma * out, so the target is
noise - x0. Checkpoints are safetensors + JSON only, written atomically every few minutes, and the data of step
k depends only on (seed, k), so a resumed run sees exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from carnator_core.demo import world
from carnator_core.demo.sampling import sample, shifted_sigma
from carnator_core.demo.text import TOKENS, token_embeddings
from carnator_core.demo.wan_model import WEIGHTS_PATH, WanConfig, WanT2V, model_from_state_dict
from carnator_core.recorded_runs import Recording, add_record_option

DEFAULT_OUT = Path.home() / ".cache" / "carnator-demo-train"


@dataclass(frozen=True)
class TrainConfig:
    dim: int = 256
    ffn_dim: int = 768
    num_layers: int = 6
    batch: int = 8
    lr: float = 5e-4
    warmup: int = 300
    weight_decay: float = 0.01
    ema_decay: float = 0.999
    shift: float = 3.0  # sigma = shift*u / (1 + (shift-1)*u), u ~ U(0,1): more steps at high noise, where
    # layout, shape and motion are decided
    fg_weight: float = 4.0  # extra loss weight on (dilated) object pixels, a minority of the frame's pixels
    drop_empty: float = 0.08  # share trained with the empty prompt's embedding (CFG's negative)
    drop_zero: float = 0.02  # share trained with all-zero conditioning (ConditioningZeroOut)
    paraphrases: int = 15  # wordings per attribute set besides the canonical one
    curriculum_start: int = 1000  # canonical wording only before this step ...
    curriculum_end: int = 4000  # ... then the share of paraphrases ramps up to max_paraphrase_share
    max_paraphrase_share: float = 0.8
    frame_jitter: float = 0.5  # share of samples whose frames get unequal noise levels (see frame_sigmas)
    frame_jitter_start: int = 0  # from this step on
    frame_jitter_width: float = 0.5  # per-frame sigma offsets ~ U(-w, w)
    cooldown_start: int = -1  # from this step the learning rate falls linearly ... (-1: never)
    cooldown_steps: int = 3000  # ... over this many steps to cooldown_floor * lr (train it on a --branch-from
    cooldown_floor: float = 0.05  # copy: the constant-rate run stays resumable, as in a WSD schedule)
    seed: int = 0
    bf16: bool = True

    def model_config(self) -> WanConfig:
        return WanConfig(dim=self.dim, ffn_dim=self.ffn_dim, num_layers=self.num_layers)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    """Linear warmup, then constant, then (if a cooldown was asked for) a linear decay to a floor.

    Why a cooldown branch: at a constant rate the loss plateaus noisily; decaying it at the end of a run is
    what turns the plateau into a lower loss, and doing it on a copy keeps the constant-rate run going.
    """
    rate = cfg.lr * min(1.0, (step + 1) / cfg.warmup)
    if 0 <= cfg.cooldown_start <= step:
        progress = min(1.0, (step - cfg.cooldown_start) / max(1, cfg.cooldown_steps))
        rate *= 1 - (1 - cfg.cooldown_floor) * progress
    return rate


class PromptBank:
    """Every training prompt and its cached MiniLM token embeddings.

    Row 0 is the empty prompt; attribute set i owns rows 1 + i*(K+1) ... (canonical first, then K paraphrases).
    """

    def __init__(self, cfg: TrainConfig, cache: Path) -> None:
        self.sets = world.all_attribute_sets()
        self.per_set = cfg.paraphrases + 1
        rng = np.random.default_rng([cfg.seed, 7])
        prompts = [""]
        for attrs in self.sets:
            prompts.append(world.canonical_prompt(attrs))
            prompts += [world.paraphrase(attrs, rng) for _ in range(cfg.paraphrases)]
        self.prompts = prompts
        self.tokens = self._load_or_encode(cache)

    def _load_or_encode(self, cache: Path) -> torch.Tensor:
        meta = cache.with_suffix(".json")
        if cache.exists() and meta.exists() and json.loads(meta.read_text()) == self.prompts:
            return load_file(cache)["tokens"].float()
        tokens = token_embeddings(self.prompts)
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_file({"tokens": tokens.half()}, cache)
        meta.write_text(json.dumps(self.prompts))
        return tokens.half().float()

    def row(self, set_index: int, wording: int) -> int:
        return 1 + set_index * self.per_set + wording

    def index_of(self, attrs: dict[str, str]) -> int:
        return self.sets.index(attrs)


def paraphrase_share(cfg: TrainConfig, step: int) -> float:
    if step < cfg.curriculum_start:
        return 0.0
    ramp = (step - cfg.curriculum_start) / max(1, cfg.curriculum_end - cfg.curriculum_start)
    return cfg.max_paraphrase_share * min(1.0, ramp)


@dataclass
class Batch:
    x0: torch.Tensor  # [B, 16, F, H, W]
    weight: torch.Tensor  # [B, 1, F, H, W] loss weights, mean 1 per sample
    context: torch.Tensor  # [B, TOKENS, 384]
    noise: torch.Tensor
    sigma: torch.Tensor  # [B] the timestep the model is given
    frame_sigma: torch.Tensor  # [B, F] the noise actually in each frame

    def to(self, device: torch.device) -> Batch:
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self)))


def loss_weight(alpha: torch.Tensor, fg_weight: float) -> torch.Tensor:
    """1 on the background, 1 + fg_weight on the object grown by one pixel, normalised to mean 1."""
    grown = F.max_pool2d(alpha, kernel_size=3, stride=1, padding=1)
    w = 1 + fg_weight * grown
    return w / w.mean()


def make_batch(cfg: TrainConfig, bank: PromptBank, step: int) -> Batch:
    """The batch of `step`: a pure function of (seed, step), which makes resuming exact."""
    rng = np.random.default_rng([cfg.seed, step])
    share = paraphrase_share(cfg, step)
    clips, weights, rows = [], [], []
    zero = torch.zeros(cfg.batch, dtype=torch.bool)
    for b in range(cfg.batch):
        set_index = int(rng.integers(len(bank.sets)))
        rgb, alpha = world.render(world.sample_scene(rng, **bank.sets[set_index]))
        clips.append(world.encode(rgb))
        weights.append(loss_weight(alpha, cfg.fg_weight))
        r = rng.random()
        if r < cfg.drop_empty:
            rows.append(0)
        elif r < cfg.drop_empty + cfg.drop_zero:
            rows.append(0)
            zero[b] = True
        else:
            wording = int(rng.integers(1, bank.per_set)) if rng.random() < share else 0
            rows.append(bank.row(set_index, wording))
    context = bank.tokens[rows].clone()
    context[zero] = 0
    gen = torch.Generator().manual_seed(int(rng.integers(2**62)))
    x0 = torch.stack(clips)
    noise = torch.randn(x0.shape, generator=gen)
    sigma = shifted_sigma(torch.rand(cfg.batch, generator=gen), cfg.shift)
    frame_sigma = frame_sigmas(cfg, step, sigma, x0.shape[2], gen)
    return Batch(x0, torch.stack(weights)[:, None], context, noise, sigma, frame_sigma)


def frame_sigmas(cfg: TrainConfig, step: int, sigma: torch.Tensor, frames: int, gen: torch.Generator) -> torch.Tensor:
    """[B, F] noise level of each latent frame: `sigma` for most samples, jittered per frame for some.

    Why: with every frame equally noisy, the clip itself shows where the object is in each frame, so the motion
    and shape words barely change the loss and the model does not learn them (docs/measurements.md has the
    learning curve). A clearer frame next to a noisier one makes the motion word decide where the object goes
    next. The model still gets the sample's `sigma` as its timestep, as at inference.
    """
    jitter = (torch.rand(sigma.shape[0], frames, generator=gen) * 2 - 1) * cfg.frame_jitter_width
    chosen = torch.rand(sigma.shape[0], 1, generator=gen) < (cfg.frame_jitter if step >= cfg.frame_jitter_start else 0)
    return (sigma[:, None] + jitter * chosen).clamp(0.02, 1.0)


def flow_loss(model: WanT2V, batch: Batch, bf16: bool, context: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample weighted MSE between the predicted and true velocity (noise - x0)."""
    s = batch.frame_sigma[:, None, :, None, None]
    xt = s * batch.noise + (1 - s) * batch.x0
    with torch.autocast(batch.x0.device.type, dtype=torch.bfloat16, enabled=bf16):
        out = model(xt, batch.sigma * 1000, batch.context if context is None else context)
    err = (out.float() - (batch.noise - batch.x0)).pow(2).mean(dim=1, keepdim=True)
    return (err * batch.weight).flatten(1).mean(dim=1)


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints: safetensors for tensors, JSON for the rest; a directory swap makes each save atomic.

def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    sd = opt.state_dict()
    tensors = {f"{i}.{k}": v.detach().clone() if torch.is_tensor(v) else torch.tensor(v)
               for i, st in sd["state"].items() for k, v in st.items()}
    return tensors, sd["param_groups"]


def _restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        i, name = key.split(".", 1)
        state.setdefault(int(i), {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": groups})


def _cpu(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}


def save_checkpoint(out: Path, model: WanT2V, ema: WanT2V, opt: torch.optim.Optimizer, cfg: TrainConfig,
                    step: int, elapsed: float) -> None:
    tmp, final, old = out / "ckpt.tmp", out / "ckpt", out / "ckpt.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = {"step": str(step), "config": json.dumps(model.cfg.to_dict())}
    save_file(_cpu(model.state_dict()), tmp / "model.safetensors", metadata=meta)
    save_file(_cpu(ema.state_dict()), tmp / "ema.safetensors", metadata=meta)
    tensors, groups = _optimizer_tensors(opt)
    save_file(_cpu(tensors), tmp / "optimizer.safetensors")
    (tmp / "state.json").write_text(json.dumps({"step": step, "elapsed_s": elapsed, "train_config": asdict(cfg),
                                                "param_groups": groups}, indent=1))
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(out: Path) -> Path | None:
    for name in ("ckpt", "ckpt.old"):
        if (out / name / "state.json").exists():
            return out / name
    return None


BRANCH_FILES = ("metrics.jsonl", "eval.jsonl", "prompt_tokens.safetensors", "prompt_tokens.json")


def branch_run(source: Path, out: Path) -> Path:
    """Start `out` as a copy of `source`'s latest checkpoint and logs, so that a cooldown trains there while the
    source run stays as it was. Refuses an `out` that already holds a run (resume it instead)."""
    ckpt = latest_checkpoint(source)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint in {source} to branch from")
    if latest_checkpoint(out) is not None:
        raise FileExistsError(f"{out} already holds a run; resume it without --branch-from")
    out.mkdir(parents=True, exist_ok=True)
    for name in BRANCH_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, out / name)
    shutil.copytree(ckpt, out / "ckpt.tmp")
    (out / "ckpt.tmp").rename(out / "ckpt")
    return out / "ckpt"


def saved_config(ckpt: Path) -> TrainConfig:
    """The TrainConfig a checkpoint was trained with (a field it does not record takes its default)."""
    return TrainConfig(**json.loads((ckpt / "state.json").read_text())["train_config"])


def load_ema(out: Path) -> tuple[WanT2V, int]:
    """The EMA model of the latest checkpoint (what gets evaluated and exported) and its step."""
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint in {out}; train first: python -m carnator_core.demo.train")
    model = model_from_state_dict(load_file(ckpt / "ema.safetensors"))
    return model, json.loads((ckpt / "state.json").read_text())["step"]


def export_weights(out: Path = DEFAULT_OUT, path: Path = WEIGHTS_PATH) -> Path:
    """Write the latest EMA weights as the fp16 safetensors file that ComfyUI's UNETLoader loads."""
    model, step = load_ema(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, path, metadata={"step": str(step), "config": json.dumps(model.cfg.to_dict()),
                                       "format": "pt", "carnator_demo_tokens": str(TOKENS)})
    return path


# ---------------------------------------------------------------------------------------------------------------
# Training

class Sensitivity:
    """Fixed probe set: loss with the true canonical prompt vs. with one attribute word swapped (same noise).

    If swapping e.g. the motion word leaves the loss unchanged, the model is not using that word. The motion
    swap mostly lands on another axis or "still"; `sens_motion_sign` swaps moving samples to the opposite
    direction only, because a model can know a word's axis and still ignore its sign.
    """

    SIGMAS = (0.4, 0.6, 0.8, 0.95)

    def __init__(self, cfg: TrainConfig, bank: PromptBank, size: int = 16) -> None:
        rng = np.random.default_rng([cfg.seed, 99])
        sets = [bank.sets[int(i)] for i in rng.choice(len(bank.sets), size, replace=False)]
        clips, weights = [], []
        for attrs in sets:
            rgb, alpha = world.render(world.sample_scene(rng, **attrs))
            clips.append(world.encode(rgb))
            weights.append(loss_weight(alpha, cfg.fg_weight))
        gen = torch.Generator().manual_seed(cfg.seed + 99)
        x0 = torch.stack(clips)
        sigma = torch.tensor([self.SIGMAS[i % len(self.SIGMAS)] for i in range(size)])
        rows = [bank.row(bank.index_of(a), 0) for a in sets]
        self.batch = Batch(x0, torch.stack(weights)[:, None], bank.tokens[rows], torch.randn(x0.shape, generator=gen),
                           sigma, sigma[:, None].expand(size, x0.shape[2]).contiguous())
        self.swapped = {attr: bank.tokens[[bank.row(bank.index_of(world.swap(a, attr, rng)), 0) for a in sets]]
                        for attr in world.ATTRIBUTES}
        self.empty = bank.tokens[[0] * size]
        self.opposite = bank.tokens[[bank.row(bank.index_of({**a, "motion": world.OPPOSITE[a["motion"]]}), 0)
                                     for a in sets]]
        self.moving = torch.tensor([a["motion"] != "still" for a in sets])

    @torch.no_grad()
    def measure(self, model: WanT2V, bf16: bool) -> dict[str, float]:
        device = next(model.parameters()).device
        batch = self.batch.to(device)
        per_sample = flow_loss(model, batch, bf16)
        base = per_sample.mean().item()
        result = {"probe_loss": base,
                  "uncond_gain": flow_loss(model, batch, bf16, self.empty.to(device)).mean().item() - base}
        for attr, ctx in self.swapped.items():
            result[f"sens_{attr}"] = flow_loss(model, batch, bf16, ctx.to(device)).mean().item() - base
        sign = flow_loss(model, batch, bf16, self.opposite.to(device)) - per_sample
        result["sens_motion_sign"] = sign[self.moving.to(device)].mean().item()
        return result


def train(out: Path, steps: int, threads: int, cfg: TrainConfig, compile_model: bool = False,
          checkpoint_minutes: float = 5.0, log_every: int = 50, probe_every: int = 250) -> None:
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = WanT2V(cfg.model_config()).to(device)
    ema = WanT2V(cfg.model_config()).to(device)
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 or "modulation" in name or "norm" in name else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.99))
    step, elapsed = 0, 0.0
    ckpt = latest_checkpoint(out)
    if ckpt is not None:
        state = json.loads((ckpt / "state.json").read_text())
        model.load_state_dict(load_file(ckpt / "model.safetensors"))
        ema.load_state_dict(load_file(ckpt / "ema.safetensors"))
        _restore_optimizer(opt, load_file(ckpt / "optimizer.safetensors"), state["param_groups"])
        step, elapsed = state["step"], state["elapsed_s"]
        print(f"resumed from {ckpt} at step {step}", flush=True)
    else:
        ema.load_state_dict(model.state_dict())
    ema.requires_grad_(False)
    bank = PromptBank(cfg, out / "prompt_tokens.safetensors")
    probe = Sensitivity(cfg, bank)
    metrics = (out / "metrics.jsonl").open("a")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {model.cfg} ({n_params / 1e6:.2f}M params), clip {world.CLIP}, batch {cfg.batch}, "
          f"threads {threads}, device {device}, target step {steps}", flush=True)
    # torch.compile is opt-in (--compile): with bf16 autocast on the CPU inductor it can give NaN losses
    # (docs/demo-model.md); eager bf16 autocast is the default.
    step_model = torch.compile(model) if compile_model else model
    last_save = time.time()
    window: list[float] = []
    t_window = time.time()
    while step < steps:
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        batch = make_batch(cfg, bank, step).to(device)
        loss = flow_loss(step_model, batch, cfg.bf16).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():
            d = min(cfg.ema_decay, (step + 1) / (step + 10))
            torch._foreach_lerp_(list(ema.parameters()), list(model.parameters()), 1 - d)
        step += 1
        window.append(loss.item())
        if step % log_every == 0:
            dt = time.time() - t_window
            elapsed += dt
            record = {"step": step, "loss": float(np.mean(window)), "grad_norm": float(grad_norm),
                      "s_per_step": dt / len(window), "elapsed_s": round(elapsed),
                      "paraphrase_share": paraphrase_share(cfg, step), "lr": learning_rate(cfg, step)}
            if step % probe_every == 0:
                record.update(probe.measure(model, cfg.bf16))
            print(json.dumps(record), flush=True)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            window, t_window = [], time.time()
        if time.time() - last_save > checkpoint_minutes * 60 or step == steps:
            save_checkpoint(out, model, ema, opt, cfg, step, elapsed)
            last_save = time.time()


# ---------------------------------------------------------------------------------------------------------------
# Sampling and evaluation

def evaluate(out: Path, n: int, steps: int, cfg_scale: float, threads: int, seed: int = 1234,
             weights: Path | None = None) -> dict:
    """Sample canonical (held-in) prompts from the latest EMA weights of `out` (or the exported `weights`, whose
    score is then not logged in `out`) and score them with the oracle."""
    from carnator_core.demo.oracle import score

    torch.set_num_threads(threads)
    if weights is None:
        model, step = load_ema(out)
    else:
        model, step = model_from_state_dict(load_file(str(weights))), None
    rng = np.random.default_rng(seed)
    prompts = [world.canonical_prompt(a) for a in world.pick_attribute_sets(rng, n)]
    context = token_embeddings(prompts)
    uncond = token_embeddings([""] * n)
    noise = torch.randn((n, 16, *world.CLIP), generator=torch.Generator().manual_seed(seed))
    x0 = torch.cat([sample(model, context[i:i + 8], uncond[i:i + 8], noise[i:i + 8], steps, cfg_scale=cfg_scale)
                    for i in range(0, n, 8)])
    per_attr = {a: 0.0 for a in world.ATTRIBUTES}
    adherence = []
    mistakes: Counter[str] = Counter()  # "attribute: asked -> read back", to see which classes the model lacks
    for prompt, latent in zip(prompts, x0, strict=True):
        result = score(prompt, world.decode(latent))
        adherence.append(result.adherence)
        for a in world.ATTRIBUTES:
            per_attr[a] += result.matches[a] / n
            if not result.matches[a]:
                mistakes[f"{a}: {result.expected[a]} -> {result.observed[a]}"] += 1
    report = {"step": step, "n": n, "steps": steps, "cfg": cfg_scale, "adherence": float(np.mean(adherence)),
              **{f"acc_{a}": round(v, 3) for a, v in per_attr.items()}, "mistakes": dict(mistakes.most_common())}
    if weights is None:
        with (out / "eval.jsonl").open("a") as f:
            f.write(json.dumps(report) + "\n")
    return report


def density(out: Path, n: int, threads: int, seed: int = 4321) -> dict:
    """Self-attention density at 90% mass (16-token blocks) of the latest EMA weights, per noise level."""
    from carnator_core.demo.attention_density import block_density, self_attention_probs

    torch.set_num_threads(threads)
    model, step = load_ema(out)
    rng = np.random.default_rng(seed)
    scenes = [world.sample_scene(rng, **attrs) for attrs in world.pick_attribute_sets(rng, n)]
    x0 = torch.stack([world.encode(world.render(s)[0]) for s in scenes])
    context = token_embeddings([world.canonical_prompt(s.attributes()) for s in scenes])
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    report: dict = {"step": step, "tokens": x0[0, 0].numel() // 4}
    for sigma in (0.9, 0.5, 0.2):
        probs = self_attention_probs(model, sigma * noise + (1 - sigma) * x0, torch.full((n,), sigma * 1000), context)
        report[f"sigma_{sigma}"] = [round(block_density(p), 3) for p in probs]
    return report


def sensitivity(out: Path, threads: int) -> dict:
    """The training probe (Sensitivity) on the latest EMA weights, for comparing checkpoints whatever their training
    log recorded; plus the text path's motion-word separation and the start-frame test."""
    torch.set_num_threads(threads)
    model, step = load_ema(out)
    cfg = saved_config(latest_checkpoint(out))
    bank = PromptBank(cfg, out / "prompt_tokens.safetensors")
    return {"step": step, **Sensitivity(cfg, bank).measure(model, cfg.bf16),
            "text_separation": text_separation(model, bank), "start_frame": start_frame_test(model, bank)}


@torch.no_grad()
def start_frame_test(model: WanT2V, bank: PromptBank, size: int = 24) -> dict[str, float]:
    """Frame 0 clear (sigma 0.3), the other frames pure noise: which way does the model take the object?

    Losses of four (clip, prompt) pairs, each clip a moving scene: `true_own` (the scene, its prompt),
    `true_opposite` (the scene, the opposite direction's prompt), `reversed_opposite` (the same start going the
    other way, with the prompt that asks for it) and `reversed_own`. Why: where a clip's start position gives its
    direction away (an object kept inside every frame must start at the far edge), a model can follow the start
    and ignore the word; such a model scores the true clip low and the reversed one high under either prompt. A
    model that reads the word scores each clip lower under its own prompt (docs/measurements.md, "Motion sign:
    the start-frame test").
    """
    rng = np.random.default_rng(5)
    moving = [a for a in bank.sets if a["motion"] != "still"]
    picked = [moving[int(i)] for i in rng.choice(len(moving), size, replace=False)]
    scenes = [world.sample_scene(rng, **attrs) for attrs in picked]
    other_way = [replace(s, motion=world.OPPOSITE[s.motion]) for s in scenes]
    true_clips = torch.stack([world.encode(world.render(s)[0]) for s in scenes])
    other_clips = torch.stack([world.encode(world.render(s)[0]) for s in other_way])
    own = bank.tokens[[bank.row(bank.index_of(s.attributes()), 0) for s in scenes]]
    opposite = bank.tokens[[bank.row(bank.index_of(s.attributes()), 0) for s in other_way]]
    noise = torch.randn(true_clips.shape, generator=torch.Generator().manual_seed(3))
    frame_sigma = torch.ones(size, true_clips.shape[2])
    frame_sigma[:, 0] = 0.3
    ones = torch.ones(size)

    def loss(clips: torch.Tensor, context: torch.Tensor) -> float:
        batch = Batch(clips, torch.ones_like(clips[:, :1]), context, noise, ones, frame_sigma)
        return round(flow_loss(model, batch, bf16=False).mean().item(), 4)

    return {"true_own": loss(true_clips, own), "true_opposite": loss(true_clips, opposite),
            "reversed_opposite": loss(other_clips, opposite), "reversed_own": loss(other_clips, own)}


MOTION_PAIRS = (("left", "right"), ("up", "down"), ("left", "up"))


@torch.no_grad()
def text_separation(model: WanT2V, bank: PromptBank) -> dict[str, dict[str, float]]:
    """How far apart one canonical prompt's conditioning lies with two motion words (|a - b| / |a|), as MiniLM
    tokens and after the model's text embedding. Why: says whether a word's sign is lost on the way into the
    blocks (the embedding shrinks it) or inside them (it arrives, but nothing turns it into motion)."""
    base = next(a for a in bank.sets if a["motion"] == "left")
    tokens = {m: bank.tokens[bank.row(bank.index_of({**base, "motion": m}), 0)] for m in world.MOTIONS}
    embedded = {m: model.embed_text(t[None])[0] for m, t in tokens.items()}
    return {stage: {f"{a}/{b}": round(((v[a] - v[b]).norm() / v[a].norm()).item(), 4) for a, b in MOTION_PAIRS}
            for stage, v in (("minilm", tokens), ("embedded", embedded))}


def learning_curve(out: Path, every: int = 500) -> str:
    """Markdown tables of the run's learning curve: loss sensitivity to each attribute word (from the probe
    records in metrics.jsonl, every `every` steps) and the oracle accuracies of every --eval (eval.jsonl)."""
    lines = ["| step | loss | " + " | ".join(f"sens. {a}" for a in world.ATTRIBUTES) + " | sens. motion sign |",
             "|" + "---|" * (len(world.ATTRIBUTES) + 3)]
    seen: set[int] = set()
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        step = record["step"]
        if "sens_motion" in record and step % every == 0 and step not in seen:
            seen.add(step)
            lines.append(f"| {step} | {record['probe_loss']:.4f} | "
                         + " | ".join(f"{record[f'sens_{a}']:.4f}" for a in world.ATTRIBUTES)
                         + (f" | {record['sens_motion_sign']:.4f} |" if "sens_motion_sign" in record else " | – |"))
    lines += ["", "| step | prompts | cfg | adherence | " + " | ".join(world.ATTRIBUTES) + " |",
              "|" + "---|" * (len(world.ATTRIBUTES) + 4)]
    evals = out / "eval.jsonl"
    for line in evals.read_text().splitlines() if evals.exists() else []:
        record = json.loads(line)
        lines.append(f"| {record['step']} | {record['n']} | {record['cfg']} | {record['adherence']:.3f} | "
                     + " | ".join(f"{record[f'acc_{a}']:.2f}" for a in world.ATTRIBUTES) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint/log directory (outside the repo)")
    parser.add_argument("--steps", type=int, default=1_000_000, help="stop after this many steps in total")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--branch-from", type=Path, default=None,
                        help="start --out as a copy of this run's latest checkpoint (e.g. for a cooldown)")
    parser.add_argument("--eval", action="store_true", help="sample from the latest checkpoint and score it")
    parser.add_argument("--eval-n", type=int, default=40)
    parser.add_argument("--eval-steps", type=int, default=30)
    parser.add_argument("--cfg", type=float, default=1.0, help="CFG scale for --eval")
    parser.add_argument("--weights", type=Path, default=None,
                        help="--eval these exported weights (e.g. the shipped file) instead of --out's latest checkpoint")
    add_record_option(parser, "the --eval report")
    parser.add_argument("--compile", action="store_true", help="torch.compile the training step (see train())")
    parser.add_argument("--density", action="store_true", help="attention density at 90%% mass, per layer")
    parser.add_argument("--sensitivity", action="store_true",
                        help="loss sensitivity to each attribute word and the motion word's sign, the text path's "
                             "motion-word separation and the start-frame test, on --out's weights")
    parser.add_argument("--export", action="store_true", help=f"write fp16 weights to {WEIGHTS_PATH}")
    parser.add_argument("--curve", action="store_true", help="print the learning curve (markdown) of --out")
    for f in fields(TrainConfig):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default) if f.type != "bool" else int,
                            default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.eval:
        recording = Recording(args.record, "carnator_core.demo.train", argv if argv is not None else sys.argv[1:])
        report = evaluate(args.out, args.eval_n, args.eval_steps, args.cfg, args.threads, weights=args.weights)
        recording.store(report, torch_threads=args.threads, timed=False)
        print(json.dumps(report))
        return
    if args.density:
        print(json.dumps(density(args.out, 8, args.threads)))
        return
    if args.sensitivity:
        print(json.dumps(sensitivity(args.out, args.threads)))
        return
    if args.export:
        print(export_weights(args.out))
        return
    if args.curve:
        print(learning_curve(args.out))
        return
    if args.branch_from is not None:
        try:
            branch_run(args.branch_from, args.out)
        except (FileNotFoundError, FileExistsError) as error:
            parser.error(str(error))
    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name) is not None}
    ckpt = latest_checkpoint(args.out)
    base = saved_config(ckpt) if ckpt else TrainConfig()
    train(args.out, args.steps, args.threads, TrainConfig(**{**asdict(base), **overrides}),
          compile_model=args.compile)


if __name__ == "__main__":
    main()
