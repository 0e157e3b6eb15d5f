"""The drop-in inside real diffusers pipelines: the pipeline itself calls ``pipe.vae``.

Each test builds a tiny pipeline in code (a random denoiser with a fixed seed, a scheduler from
its config, the text encoder bypassed by passing the prompt embeddings), takes its VAE from
``fixtures/`` both as the stock diffusers class and as ``DistributedVae.from_pretrained(dir,
ranks=3)``, and runs the pipeline with each, with the same seed:

- without ``enable_tiling()`` the three ranks give the stock VAE's untiled pixels (a pipeline
  that never asked for tiling gets none);
- with ``pipe.vae.enable_tiling()`` on both, the stock VAE's tiled pixels.

The latents are larger than one of the family's default tiles, so that the tiled and untiled
results differ (checked): forcing tiles on several ranks, as the drop-in once did, fails the
first check.

Runs where torch, diffusers and transformers are installed (versions in
requirements-pipelines.txt next to this file); skipped elsewhere. Nothing is downloaded.
"""

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")  # the pipelines' modules import it

from vae_parallel.diffusers import DistributedVae  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"
RANKS = 3
# The fixtures' tolerance against diffusers.
TOL = 1e-4
# Tiled and untiled pixels must differ by more than this for a case to tell them apart.
SEAMS = 1e-3


def max_diff(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


def run(pipe, vae, tiled, **call):
    """The pipeline's output with `vae` as its VAE, tiling as a user sets it, seed 0."""
    pipe.vae = vae
    if tiled:
        pipe.vae.enable_tiling()
    else:
        pipe.vae.disable_tiling()
    with torch.inference_mode():
        out = pipe(generator=torch.Generator().manual_seed(0), output_type="np", **call)
    return np.asarray(out.images if hasattr(out, "images") else out.frames)


def check_pipeline(pipe, stock, ours, **call):
    """Runs `pipe` with the stock VAE and the drop-in, untiled then tiled; returns the
    differences (ours vs stock untiled, tiled; stock tiled vs untiled)."""
    want = run(pipe, stock, False, **call)
    got = run(pipe, ours, False, **call)
    report = ours.last_report()
    assert report["world_size"] == RANKS
    # `auto` picks the strategy (a shard, or the direct pass where it predicts that faster).
    strategy = report["strategy"]
    untiled = max_diff(got, want)
    # The untiled pixels split exactly over the three ranks by a shard, as a user may ask.
    sharded = DistributedVae.from_pretrained(ours._directory, ranks=RANKS, mode="spatial_shard_height")
    got_sharded = run(pipe, sharded, False, **call)
    assert sharded.last_report()["strategy"] == "shard-height", sharded.last_report()
    untiled_sharded = max_diff(got_sharded, want)

    want_tiled = run(pipe, stock, True, **call)
    got_tiled = run(pipe, ours, True, **call)
    report = ours.last_report()
    assert report["strategy"] == "tile" and report["tile_count"] > 1, report
    tiled = max_diff(got_tiled, want_tiled)
    seams = max_diff(want_tiled, want)

    assert untiled <= TOL, f"untiled ({strategy}): ours vs stock {untiled}"
    assert untiled_sharded <= TOL, f"untiled (shard-height): ours vs stock {untiled_sharded}"
    assert tiled <= TOL, f"tiled: ours vs stock {tiled}"
    # The case is larger than a tile: tiling would have changed the pipeline's output.
    assert seams > SEAMS, f"tiled vs untiled only {seams}: the case does not tell them apart"
    print(f"\n{type(pipe).__name__}: untiled ({strategy}) {untiled:.3g}, untiled (shard-height) "
          f"{untiled_sharded:.3g}, tiled {tiled:.3g}; stock tiled vs untiled {seams:.3g}")
    return untiled, tiled, seams


def load(cls, model):
    return cls.from_pretrained(model).eval(), DistributedVae.from_pretrained(model, ranks=RANKS)


# ---- AutoencoderKL: Stable Diffusion (sd_like: 4 latent channels, 8x, 64 px / 8 latent tiles)


def stable_diffusion(cls):
    from diffusers import DDIMScheduler, UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16),
        layers_per_block=1,
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=4,
        norm_num_groups=4,
    ).eval()
    scheduler = DDIMScheduler.from_config(
        {"beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "clip_sample": False,
         "set_alpha_to_one": False, "steps_offset": 1}
    )
    stock, ours = load(diffusers.AutoencoderKL, FIXTURES / "autoencoder_kl/sd_like")
    pipe = cls(vae=stock, text_encoder=None, tokenizer=None, unet=unet, scheduler=scheduler,
               safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    embeds = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(1))
    negative = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(2))
    return pipe, stock, ours, {"prompt_embeds": embeds, "negative_prompt_embeds": negative}


def test_stable_diffusion_pipeline_decodes_as_the_stock_vae():
    pipe, stock, ours, embeds = stable_diffusion(diffusers.StableDiffusionPipeline)
    # 96 x 160 px: a 12 x 20 latent, larger than one 8 x 8 latent tile.
    check_pipeline(pipe, stock, ours, height=96, width=160, num_inference_steps=2, guidance_scale=3.0, **embeds)


def test_stable_diffusion_img2img_pipeline_encodes_and_decodes_as_the_stock_vae():
    """StableDiffusionImg2ImgPipeline encodes the image (`latent_dist.sample(generator)`) and
    decodes the result: both follow the tiling state."""
    pipe, stock, ours, embeds = stable_diffusion(diffusers.StableDiffusionImg2ImgPipeline)
    image = torch.rand(1, 3, 96, 160, generator=torch.Generator().manual_seed(3))  # in [0, 1]
    check_pipeline(pipe, stock, ours, image=image, strength=0.6, num_inference_steps=3, guidance_scale=3.0, **embeds)


# ---- AutoencoderKLWan: Wan2.1 (wan21_like: z_dim 16, 8x / 4x, 256 px / 32 latent tiles)


def wan(cls):
    from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

    torch.manual_seed(0)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=16,
        out_channels=16,
        text_dim=16,
        freq_dim=32,
        ffn_dim=16,
        num_layers=1,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=32,
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler.from_config({"shift": 3.0})
    stock, ours = load(diffusers.AutoencoderKLWan, FIXTURES / "wan/wan21_like")
    pipe = cls(tokenizer=None, text_encoder=None, vae=stock, scheduler=scheduler, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    embeds = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(1))
    negative = torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(2))
    return pipe, stock, ours, {"prompt_embeds": embeds, "negative_prompt_embeds": negative}


# 272 x 144 px, 5 frames: a 2 x 34 x 18 latent, taller than one 32 x 32 latent tile.
WAN_SIZE = {"height": 272, "width": 144, "num_frames": 5}


def test_wan_pipeline_decodes_as_the_stock_vae():
    pipe, stock, ours, embeds = wan(diffusers.WanPipeline)
    check_pipeline(pipe, stock, ours, num_inference_steps=2, guidance_scale=3.0, **WAN_SIZE, **embeds)


def test_wan_video_to_video_pipeline_encodes_and_decodes_as_the_stock_vae():
    """WanVideoToVideoPipeline encodes the video (`latent_dist.mode()`) and decodes the result."""
    from PIL import Image

    pipe, stock, ours, embeds = wan(diffusers.WanVideoToVideoPipeline)
    rng = np.random.default_rng(4)
    video = [Image.fromarray(rng.integers(0, 256, (272, 144, 3), dtype=np.uint8)) for _ in range(5)]
    check_pipeline(pipe, stock, ours, video=video, height=272, width=144, strength=0.6, num_inference_steps=3,
                   guidance_scale=3.0, **embeds)


# ---- AutoencoderKLQwenImage: Qwen-Image (qwen_image_like: z_dim 16, 8x, 256 px / 32 latent tiles)


def test_qwen_image_pipeline_decodes_as_the_stock_vae():
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline, QwenImageTransformer2DModel

    torch.manual_seed(0)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=64,  # 16 latent channels packed 2 x 2
        out_channels=16,
        num_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        guidance_embeds=False,
        axes_dims_rope=(8, 4, 4),
    ).eval()
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        {"base_shift": 0.5, "max_shift": 0.9, "base_image_seq_len": 256, "max_image_seq_len": 8192,
         "shift_terminal": 0.02, "use_dynamic_shifting": True, "time_shift_type": "exponential"}
    )
    stock, ours = load(diffusers.AutoencoderKLQwenImage, FIXTURES / "qwen_image/qwen_image_like")
    pipe = QwenImagePipeline(scheduler=scheduler, vae=stock, text_encoder=None, tokenizer=None, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    # The pipeline reads the VAE's `temperal_downsample` for its scale factor.
    assert ours.temperal_downsample == stock.temperal_downsample
    assert ours.spatial_compression_ratio == stock.spatial_compression_ratio
    embeds = {
        "prompt_embeds": torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(1)),
        "prompt_embeds_mask": torch.ones(1, 6, dtype=torch.long),
        "negative_prompt_embeds": torch.randn(1, 6, 16, generator=torch.Generator().manual_seed(2)),
        "negative_prompt_embeds_mask": torch.ones(1, 6, dtype=torch.long),
    }
    # 288 x 128 px: a 36 x 16 latent, taller than one 32 x 32 latent tile.
    check_pipeline(pipe, stock, ours, height=288, width=128, num_inference_steps=2, true_cfg_scale=3.0, **embeds)
