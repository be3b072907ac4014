"""The standalone demo DiT must be exactly the model ComfyUI loads from its weights (detection + forward)."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from carnator_core.demo import world
from carnator_core.demo.sampling import shifted_sigma
from carnator_core.demo.text import TOKENS
from carnator_core.demo.train import (
    PromptBank,
    Sensitivity,
    TrainConfig,
    _restore_optimizer,
    branch_run,
    export_weights,
    latest_checkpoint,
    learning_curve,
    learning_rate,
    load_ema,
    make_batch,
    save_checkpoint,
    start_frame_test,
    text_separation,
)
from carnator_core.demo.wan_model import WanConfig, WanT2V, config_from_state_dict

COMFYUI = Path(os.environ.get("COMFYUI_PATH", Path.home() / "ComfyUI"))


def _random_model(seed: int = 0) -> WanT2V:
    torch.manual_seed(seed)
    model = WanT2V(WanConfig(dim=256, ffn_dim=96, num_layers=2))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)  # the zero-initialised head would hide every other mismatch
    return model.eval()


@pytest.fixture(scope="module")
def comfy_sd():
    if not (COMFYUI / "comfy").is_dir():
        pytest.skip(f"ComfyUI not found at {COMFYUI}")
    sys.path.insert(0, str(COMFYUI))
    from comfy.cli_args import args

    args.cpu = True
    import comfy.sd

    return comfy.sd


def test_comfyui_detects_and_matches_forward(comfy_sd, tmp_path: Path) -> None:
    model = _random_model()
    path = tmp_path / "carnator_demo_test.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    patcher = comfy_sd.load_diffusion_model(str(path))
    base = patcher.model
    assert type(base.model_config).__name__ == "WAN21_T2V"
    assert base.diffusion_model.num_heads == 2 and len(base.diffusion_model.blocks) == 2

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, 3, 8, 10, generator=gen)
    sigma = torch.tensor([0.9, 0.35])
    context = torch.randn(2, TOKENS, 4096, generator=gen) * 0.3
    with torch.no_grad():
        ours = model(x, sigma * 1000, context)
        theirs = base.diffusion_model(x, sigma * 1000, context)
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4), (ours - theirs).abs().max()
        # Flow conventions: ComfyUI's denoised = x - sigma * out, with timestep = sigma * multiplier (1000).
        denoised = base.apply_model(x, sigma, c_crossattn=context)
        assert torch.allclose(denoised, x - sigma.view(-1, 1, 1, 1, 1) * ours, atol=1e-4, rtol=1e-4)
        # MiniLM's 384 features are fed unpadded during training: the same as zero-padding to 4096.
        narrow = context.clone()
        narrow[..., 384:] = 0
        assert torch.allclose(model(x, sigma * 1000, narrow[..., :384]), model(x, sigma * 1000, narrow), atol=1e-5)


def test_config_roundtrip_from_weights() -> None:
    model = _random_model()
    assert config_from_state_dict(model.state_dict()) == model.cfg


def test_training_batch_follows_flow_parametrisation(tmp_path: Path) -> None:
    """The velocity target noise - x0 turns back into x0 under ComfyUI's denoised = x_t - sigma * v."""
    cfg = TrainConfig(paraphrases=0)
    bank = PromptBank(cfg, tmp_path / "prompts.safetensors")
    a, b = make_batch(cfg, bank, 5), make_batch(cfg, bank, 5)
    assert torch.equal(a.x0, b.x0) and torch.equal(a.noise, b.noise)
    s = a.sigma.view(-1, 1, 1, 1, 1)
    xt = s * a.noise + (1 - s) * a.x0
    assert torch.allclose(xt - s * (a.noise - a.x0), a.x0, atol=1e-5)
    assert float(shifted_sigma(torch.tensor(0.5), 3.0)) == pytest.approx(0.75)


def test_frame_jitter_unequal_noise_for_a_share_of_samples(tmp_path: Path) -> None:
    """Jittered samples get per-frame noise levels around their timestep; the rest exactly the timestep; never
    before frame_jitter_start."""
    cfg = TrainConfig(paraphrases=0, batch=64, frame_jitter=0.5, frame_jitter_start=10)
    bank = PromptBank(cfg, tmp_path / "prompts.safetensors")
    late = make_batch(cfg, bank, 11)
    jittered = (late.frame_sigma != late.sigma[:, None]).any(dim=1)
    assert 10 < int(jittered.sum()) < 54  # about half of 64
    assert ((late.frame_sigma - late.sigma[:, None]).abs() <= cfg.frame_jitter_width + 1e-6).all()
    assert late.frame_sigma.min() >= 0.02 and late.frame_sigma.max() <= 1.0
    early = make_batch(cfg, bank, 9)
    assert torch.equal(early.frame_sigma, early.sigma[:, None].expand_as(early.frame_sigma))


def test_sensitivity_probe_measures_the_text_path_and_motion_sign(tmp_path: Path) -> None:
    """A model that cannot read its prompt scores exactly 0 on every word swap, the motion sign included, and
    its text embedding separates no motion words; one that reads it does not; the
    learning curve shows the sign column where a record has it."""
    cfg = TrainConfig(paraphrases=0)
    bank = PromptBank(cfg, tmp_path / "prompts.safetensors")
    probe = Sensitivity(cfg, bank, size=8)
    reading = probe.measure(_random_model(), bf16=False)
    assert reading["sens_motion_sign"] != 0
    assert reading["sens_background"] != 0
    blind = _random_model()
    with torch.no_grad():
        blind.text_embedding[2].weight.zero_()
    blind_result = probe.measure(blind, bf16=False)
    assert all(blind_result[k] == 0 for k in blind_result if k.startswith("sens_"))
    separated, collapsed = text_separation(_random_model(), bank), text_separation(blind, bank)
    assert separated["minilm"] == collapsed["minilm"] and all(v > 0 for v in separated["minilm"].values())
    assert all(v > 0 for v in separated["embedded"].values()) and set(collapsed["embedded"].values()) == {0.0}
    blind_start = start_frame_test(blind, bank, size=4)
    assert blind_start["true_own"] == blind_start["true_opposite"]  # a blind model cannot care about the word
    assert blind_start["reversed_own"] == blind_start["reversed_opposite"]
    reading_start = start_frame_test(_random_model(), bank, size=4)
    assert reading_start["true_own"] != reading_start["true_opposite"]
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 500, "probe_loss": 0.1, **{f"sens_{a}": 0.01 for a in world.ATTRIBUTES}}) + "\n"
        + json.dumps({"step": 1000, "probe_loss": 0.1, **{f"sens_{k}": 0.02 for k in (*world.ATTRIBUTES, "motion_sign")}})
        + "\n")
    curve = learning_curve(tmp_path).splitlines()
    assert curve[2].endswith("| 0.0100 | – |") and curve[3].endswith("| 0.0200 | 0.0200 |")


def test_learning_rate_warms_up_holds_then_cools_down_to_its_floor() -> None:
    """Without a cooldown the rate stays constant after warmup (the resumable trunk); with one it falls linearly
    from cooldown_start to cooldown_floor * lr and stays there."""
    trunk = TrainConfig(lr=1e-3, warmup=100)
    assert learning_rate(trunk, 0) == pytest.approx(1e-5)
    assert learning_rate(trunk, 99) == learning_rate(trunk, 50_000) == pytest.approx(1e-3)
    branch = TrainConfig(lr=1e-3, warmup=100, cooldown_start=1000, cooldown_steps=400, cooldown_floor=0.1)
    assert learning_rate(branch, 999) == pytest.approx(1e-3)
    assert learning_rate(branch, 1200) == pytest.approx(0.55e-3)
    assert learning_rate(branch, 1400) == learning_rate(branch, 9000) == pytest.approx(1e-4)


def _checkpoint(out: Path) -> tuple[WanT2V, torch.optim.Optimizer]:
    cfg = TrainConfig(dim=256, ffn_dim=96, num_layers=2)
    model = _random_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(1, 16, 1, 4, 4), torch.tensor([500.0]), torch.randn(1, 4, 384)).pow(2).mean().backward()
    opt.step()
    ema = _random_model(seed=1)
    save_checkpoint(out, model, ema, opt, cfg, step=7, elapsed=1.0)
    return ema, opt


def test_checkpoint_restores_optimizer_and_ema(tmp_path: Path) -> None:
    ema, opt = _checkpoint(tmp_path)
    from safetensors.torch import load_file

    ckpt = latest_checkpoint(tmp_path)
    assert ckpt is not None and not any(p.suffix in (".pt", ".pth", ".bin") for p in ckpt.iterdir())
    fresh = torch.optim.AdamW(_random_model().parameters(), lr=1e-3)
    state = __import__("json").loads((ckpt / "state.json").read_text())
    _restore_optimizer(fresh, load_file(ckpt / "optimizer.safetensors"), state["param_groups"])
    for key, value in opt.state_dict()["state"][0].items():
        assert torch.equal(fresh.state_dict()["state"][0][key], value)
    loaded, step = load_ema(tmp_path)
    assert step == 7 and all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                                ema.state_dict().values(), strict=True))


def test_branch_copies_the_latest_checkpoint_and_leaves_the_source_run(tmp_path: Path) -> None:
    source, branch = tmp_path / "run", tmp_path / "branch"
    _checkpoint(source)
    (source / "metrics.jsonl").write_text('{"step": 7}\n')
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (source / "ckpt").iterdir())
    branch_run(source, branch)
    assert load_ema(branch)[1] == 7 and (branch / "metrics.jsonl").read_text() == '{"step": 7}\n'
    assert sorted((p.name, p.stat().st_mtime_ns) for p in (source / "ckpt").iterdir()) == before
    with pytest.raises(FileExistsError, match="already holds a run"):
        branch_run(source, branch)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        branch_run(tmp_path / "empty", tmp_path / "other")


def test_exported_fp16_weights_load_in_comfyui(comfy_sd, tmp_path: Path) -> None:
    ema, _ = _checkpoint(tmp_path)
    path = export_weights(tmp_path, tmp_path / "weights" / "carnator_demo_test.safetensors")
    patcher = comfy_sd.load_diffusion_model(str(path))
    x = torch.randn(1, 16, 2, 4, 6)
    context = torch.randn(1, TOKENS, 4096) * 0.3
    with torch.no_grad():
        theirs = patcher.model.diffusion_model(x, torch.tensor([700.0]), context)
        ours = ema(x, torch.tensor([700.0]), context)
    assert torch.allclose(theirs.float(), ours, atol=0.05, rtol=0.05)


def test_attention_density_measures_blocks_of_mass() -> None:
    from carnator_core.demo.attention_density import block_density, self_attention_probs

    eye = torch.eye(64)[None, None]
    assert block_density(eye) == pytest.approx(1 / 4)
    assert block_density(torch.full((1, 1, 64, 64), 1 / 64)) == pytest.approx(1.0)
    model = _random_model()
    maps = self_attention_probs(model, torch.randn(1, 16, 2, 8, 8), torch.tensor([500.0]), torch.randn(1, 4, 384))
    assert len(maps) == 2 and maps[0].shape == (1, 2, 32, 32)
    assert torch.allclose(maps[0].sum(-1), torch.ones(1, 2, 32))
