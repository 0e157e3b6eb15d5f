"""The diffusers drop-in against diffusers itself, on the fixture models.

Runs where torch and diffusers are installed (the fixtures' pinned venv:
scripts/requirements-fixtures.txt); skipped elsewhere, as the CI venv has neither.
"""

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

import vae_parallel as vp  # noqa: E402
from vae_parallel.diffusers import DistributedVae  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures"


def tensor(path: Path) -> "torch.Tensor":
    return torch.from_numpy(np.load(path))


def close(a, b, tol=1e-4) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= tol


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_autoencoder_kl_decode_encode_and_config_match_diffusers(ranks):
    """Whatever the ranks, the untiled decode and encode, as a stock VAE without
    `enable_tiling()` gives them (inputs larger than a tile, where tiling would change them)."""
    model = FIXTURES / "autoencoder_kl/flux1_like"
    ours = DistributedVae.from_pretrained(model.parent, subfolder=model.name, ranks=ranks)
    ref = diffusers.AutoencoderKL.from_pretrained(model).eval()
    assert ours.config.scaling_factor == ref.config.scaling_factor
    assert ours.config["block_out_channels"] == list(ref.config.block_out_channels)
    assert next(ours.parameters()).dtype == torch.float32
    assert not ours.use_tiling

    z = tensor(FIXTURES / "autoencoder_kl/flux1_like.decode_tiled.in.npy")
    with torch.inference_mode():
        want = ref.decode(z).sample
        got = ours.decode(z).sample
        assert isinstance(got, torch.Tensor) and got.dtype == z.dtype
        assert close(got, want)
        # The tensor is the package's own result, bit for bit.
        assert np.array_equal(got.numpy(), vp.load(model, ranks=ranks).decode(z.numpy()))
        (again,) = ours.decode(z, return_dict=False)
        assert torch.equal(again, got)
        # On the ranks asked for (`auto` picks a shard or the direct pass: never tiles here).
        assert ours.last_report()["world_size"] == ranks

        x = tensor(FIXTURES / "autoencoder_kl/flux1_like.encode_tiled.in.npy")
        want_dist = ref.encode(x).latent_dist
        got_dist = ours.encode(x).latent_dist
        assert close(got_dist.mean, want_dist.mean)
        assert close(got_dist.std, want_dist.std)
        # The same generator gives the same sample.
        a = got_dist.sample(generator=torch.Generator().manual_seed(7))
        b = want_dist.sample(generator=torch.Generator().manual_seed(7))
        assert close(a, b)


@pytest.mark.parametrize("ranks", [1, 3])
def test_tiling_follows_enable_tiling(ranks):
    model = FIXTURES / "autoencoder_kl/sd_like"
    ours = DistributedVae.from_pretrained(model, ranks=ranks)
    ref = diffusers.AutoencoderKL.from_pretrained(model).eval()
    z = tensor(FIXTURES / "autoencoder_kl/sd_like.decode_tiled.in.npy")
    x = tensor(FIXTURES / "autoencoder_kl/sd_like.encode_tiled.in.npy")
    with torch.inference_mode():
        untiled, untiled_mean = ref.decode(z).sample, ref.encode(x).latent_dist.mean
        ours.enable_tiling()
        ref.enable_tiling()
        tiled, tiled_mean = ref.decode(z).sample, ref.encode(x).latent_dist.mean
        # The inputs are larger than a tile: tiling changes the result.
        assert not close(tiled, untiled) and not close(tiled_mean, untiled_mean)
        assert close(ours.decode(z).sample, tiled)
        assert ours.last_report()["strategy"] == "tile" and ours.last_report()["tile_count"] > 1
        assert close(ours.encode(x).latent_dist.mean, tiled_mean)
        ours.disable_tiling()
        assert close(ours.decode(z).sample, untiled)
        assert close(ours.encode(x).latent_dist.mean, untiled_mean)
    with pytest.raises(TypeError):
        ours.enable_tiling(tile_size=3)


def test_the_mode_says_how_the_ranks_share_the_work_not_which_pixels():
    """`mode=` stays overridable. `tile` on an untiled request computes it on one rank (the
    report says why); a named shard mode gives the untiled pixels even after `enable_tiling()`
    (a shard has no tiles)."""
    model = FIXTURES / "autoencoder_kl/sd_like"
    ref = diffusers.AutoencoderKL.from_pretrained(model).eval()
    z = tensor(FIXTURES / "autoencoder_kl/sd_like.decode_tiled.in.npy")
    assert DistributedVae.from_pretrained(model, ranks=3)._options["mode"] == "auto"
    with torch.inference_mode():
        untiled = ref.decode(z).sample
        ref.enable_tiling()
        tiled = ref.decode(z).sample
        tile = DistributedVae.from_pretrained(model, ranks=3, mode="tile")
        assert close(tile.decode(z).sample, untiled)
        assert "one rank" in tile.last_report()["reason"], tile.last_report()
        tile.enable_tiling()
        assert close(tile.decode(z).sample, tiled)
        sharded = DistributedVae.from_pretrained(model, ranks=2, mode="spatial_shard_height")
        sharded.enable_tiling()
        assert close(sharded.decode(z).sample, untiled)
        assert sharded.last_report()["strategy"] == "shard-height"


@pytest.mark.parametrize("ranks", [2, 3])
def test_wan_decode_matches_diffusers(ranks):
    model = FIXTURES / "wan/wan21_like"
    ours = DistributedVae.from_pretrained(model, ranks=ranks)
    ref = diffusers.AutoencoderKLWan.from_pretrained(model).eval()
    assert (ours.z_dim, ours.temperal_downsample, ours.temperal_upsample, ours.spatial_compression_ratio) == (
        ref.z_dim, ref.temperal_downsample, ref.temperal_upsample, ref.spatial_compression_ratio)
    z = tensor(FIXTURES / "wan/wan21_like.decode_t3.in.npy")
    with torch.inference_mode():
        assert close(ours.decode(z).sample, ref.decode(z).sample)
        x = tensor(FIXTURES / "wan/wan21_like.encode_f5.in.npy")
        assert close(ours.encode(x).latent_dist.mean, ref.encode(x).latent_dist.mean)
        # Larger than a tile of the fixture's tiling: untiled, then as diffusers tiles it.
        tiles = {"tile_sample_min_height": 16, "tile_sample_min_width": 24, "tile_sample_stride_height": 8,
                 "tile_sample_stride_width": 16}
        z = tensor(FIXTURES / "wan/wan21_like.decode_tiled.in.npy")
        ours = DistributedVae.from_pretrained(model, ranks=ranks, **tiles)
        assert close(ours.decode(z).sample, ref.decode(z).sample)
        ours.enable_tiling()
        ref.enable_tiling(**tiles)
        assert close(ours.decode(z).sample, tensor(FIXTURES / "wan/wan21_like.decode_tiled.out.npy"))
        assert close(ours.decode(z).sample, ref.decode(z).sample)


def test_ltx_decodes_at_the_pipelines_timestep_as_diffusers_does():
    """The LTX pipelines' call, `vae.decode(latents, timestep, return_dict=False)`: the
    timestep-conditioned LTX-Video decoder at 0.05 (and at 0.0), LTX-2's with `timestep=None`."""
    model = FIXTURES / "ltx/ltx_video_like"
    ours = DistributedVae.from_pretrained(model, ranks=2)
    ref = diffusers.AutoencoderKLLTXVideo.from_pretrained(model).eval()
    z = tensor(FIXTURES / "ltx/ltx_video_like.decode_t3.in.npy")
    with torch.inference_mode():
        for t in (0.05, 0.0):
            timestep = torch.tensor([t])
            assert close(ours.decode(z, timestep, return_dict=False)[0], ref.decode(z, timestep, return_dict=False)[0])
        with pytest.raises(ValueError, match="one decode timestep"):
            ours.decode(torch.cat([z, z]), torch.tensor([0.05, 0.1]))
        # A float timestep, as diffusers takes it.
        assert close(ours.decode(z, 0.05).sample, ref.decode(z, 0.05).sample)
        model = FIXTURES / "ltx/ltx2_like"
        ours = DistributedVae.from_pretrained(model, ranks=2)
        ref = diffusers.AutoencoderKLLTX2Video.from_pretrained(model).eval()
        z = tensor(FIXTURES / "ltx/ltx2_like.decode_t3.in.npy")
        assert close(ours.decode(z, None, return_dict=False)[0], ref.decode(z, None, return_dict=False)[0])
        x = tensor(FIXTURES / "ltx/ltx2_like.encode_f5.in.npy")
        assert close(ours.encode(x).latent_dist.mean, ref.encode(x).latent_dist.mean)
        # What the LTX pipelines read off their VAE.
        assert torch.equal(ours.latents_mean, ref.latents_mean) and torch.equal(ours.latents_std, ref.latents_std)
        assert (ours.spatial_compression_ratio, ours.temporal_compression_ratio) == (
            ref.spatial_compression_ratio, ref.temporal_compression_ratio)
        # Frame tiles follow use_framewise_decoding, as in diffusers: the keywords alone do not tile.
        z = tensor(FIXTURES / "ltx/ltx2_like.decode_temporal.in.npy")
        frames = {"tile_sample_min_num_frames": 8, "tile_sample_stride_num_frames": 4}
        ours.enable_tiling(**frames)
        ref.enable_tiling(**frames)
        assert close(ours.decode(z).sample, ref.decode(z).sample)
        ours.use_framewise_decoding = ref.use_framewise_decoding = True
        chunked = ref.decode(z).sample
        assert close(ours.decode(z).sample, chunked)
        assert close(chunked, tensor(FIXTURES / "ltx/ltx2_like.decode_temporal.out.npy"))


def test_torch_inputs_come_back_as_torch_on_their_device_and_dtype():
    model = FIXTURES / "autoencoder_kl/flux1_like"
    vae = vp.load(model)
    z = np.load(FIXTURES / "autoencoder_kl/flux1_like.decode.in.npy")
    want = vae.decode(z)
    got = vae.decode(torch.from_numpy(z))
    assert isinstance(got, torch.Tensor) and got.device.type == "cpu" and got.dtype == torch.float32
    assert np.array_equal(got.numpy(), want)
    # Other float types are converted to float32 on the way in, as numpy inputs are.
    got16 = vae.decode(torch.from_numpy(z).to(torch.float64))
    assert np.array_equal(got16.numpy(), want)


def test_a_pipeline_takes_it_as_its_vae():
    """A DiffusionPipeline's last step as FluxPipeline writes it (unscale, shift, decode,
    postprocess), with the drop-in assigned as `pipe.vae` or given at construction."""
    from diffusers import DiffusionPipeline
    from diffusers.image_processor import VaeImageProcessor

    class LatentsToImage(DiffusionPipeline):
        def __init__(self, vae):
            super().__init__()
            self.register_modules(vae=vae)
            self.vae_scale_factor = 2 ** (len(self.vae.config.block_out_channels) - 1)
            self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)

        @torch.no_grad()
        def __call__(self, latents, output_type="np"):
            latents = latents / self.vae.config.scaling_factor + (self.vae.config.shift_factor or 0)
            image = self.vae.decode(latents.to(self.vae.dtype), return_dict=False)[0]
            return self.image_processor.postprocess(image, output_type=output_type)

    model = FIXTURES / "autoencoder_kl/flux1_like"
    z = tensor(FIXTURES / "autoencoder_kl/flux1_like.decode.in.npy")
    want = LatentsToImage(diffusers.AutoencoderKL.from_pretrained(model))(z)
    pipe = LatentsToImage(diffusers.AutoencoderKL.from_pretrained(model))
    pipe.vae = DistributedVae.from_pretrained(model, ranks=2)
    pipe.to("cpu")
    assert pipe.config["vae"] == ("vae_parallel.diffusers", "DistributedVae")
    assert np.abs(pipe(z) - want).max() <= 1e-4
    assert np.abs(LatentsToImage(DistributedVae.from_pretrained(model))(z) - want).max() <= 1e-4
