"""The Python package against the CLI and the diffusers fixtures.

Every decode and encode through the package must equal, bit for bit, what the CLI writes for the
same model, input and options (on 1 and 3 local ranks), and stay within the fixtures' tolerance of
diffusers. The CLI is `$VAE_PARALLEL_CLI`, else the workspace's debug or release build.
"""

import os
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import vae_parallel as vp
from cli_under_test import find_cli

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "fixtures"

# One per family: model directory, decode case and its tiling keywords, encode input and its
# tiling keywords (the fixtures' own: their manifests name them).
WAN_DECODE = {"tile_sample_min_height": 16, "tile_sample_min_width": 24,
              "tile_sample_stride_height": 8, "tile_sample_stride_width": 16}
WAN_ENCODE = {"tile_sample_min_height": 24, "tile_sample_min_width": 32,
              "tile_sample_stride_height": 16, "tile_sample_stride_width": 16}
HV15_TILES = {"tile_sample_min_height": 32, "tile_sample_min_width": 32, "tile_latent_min_height": 4,
              "tile_latent_min_width": 4, "tile_overlap_factor": 0.25}
LTX_TILES = {"tile_sample_min_height": 16, "tile_sample_min_width": 16, "tile_sample_stride_height": 8,
             "tile_sample_stride_width": 8, "tile_sample_min_num_frames": 8, "tile_sample_stride_num_frames": 4}
LTX2_DECODE = LTX_TILES | {"tile_sample_min_height": 24, "tile_sample_min_width": 24, "tile_sample_stride_height": 16,
                           "tile_sample_stride_width": 16}
FAMILIES = [
    ("autoencoder_kl/sd_like", "sd_like.decode_tiled", {}, "sd_like.encode_tiled", {}),
    ("autoencoder_kl/flux1_like", "flux1_like.decode_tiled", {}, "flux1_like.encode_tiled", {}),
    ("autoencoder_kl/flux2_like", "flux2_like.decode_tiled", {}, "flux2_like.encode_tiled", {}),
    ("wan/wan21_like", "wan21_like.decode_tiled", WAN_DECODE, "wan21_like.encode_tiled_f5", WAN_ENCODE),
    ("qwen_image/qwen_image_like", "qwen_image_like.decode_tiled", WAN_DECODE,
     "qwen_image_like.encode_tiled_f5", WAN_ENCODE),
    ("hunyuan_video15/hunyuan_video15_like", "hunyuan_video15_like.decode_tiled", HV15_TILES,
     "hunyuan_video15_like.encode_tiled_f1", HV15_TILES),
    ("ltx/ltx_video_like", "ltx_video_like.decode_spatiotemporal", LTX_TILES | {"decode_timestep": 0.05},
     "ltx_video_like.encode_temporal", LTX_TILES),
    ("ltx/ltx2_like", "ltx2_like.decode_spatiotemporal", LTX2_DECODE, "ltx2_like.encode_temporal", LTX_TILES),
]


def flags(tiling: dict) -> list:
    """The CLI's flags for the package's tiling keywords."""
    return [f for key, value in tiling.items() for f in ("--" + key.replace("_", "-"), str(value))]


def cli() -> Path:
    found = find_cli()
    if found is not None:
        return found
    pytest.fail("no vae-parallel binary: build it (cargo build -p vae-parallel) or set VAE_PARALLEL_CLI")


def run_cli(tmp_path: Path, command: str, model: Path, source: Path, flag: str, ranks: int, *extra: str) -> np.ndarray:
    out = tmp_path / f"{command}-{ranks}.npy"
    args = [str(cli()), command, "--model", str(model), flag, str(source), "--out", str(out)]
    args += ["--vae-patch-parallel-size", str(ranks), "--vae-use-tiling", *extra]
    done = subprocess.run(args, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return np.load(out)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f[0].split("/")[1])
@pytest.mark.parametrize("ranks", [1, 3])
def test_decode_and_encode_match_the_cli_bit_for_bit(tmp_path, family, ranks):
    model, decode_case, decode_tiling, encode_case, encode_tiling = family
    group = model.split("/")[0]
    model = FIXTURES / model
    z_path = FIXTURES / group / f"{decode_case}.in.npy"
    x_path = FIXTURES / group / f"{encode_case}.in.npy"

    vae = vp.load(model, ranks=ranks, **decode_tiling)
    pixels = vae.decode(np.load(z_path), use_tiling=True)
    assert pixels.dtype == np.float32
    cli_pixels = run_cli(tmp_path, "decode", model, z_path, "--latent", ranks, *flags(decode_tiling))
    assert same_bits(pixels, cli_pixels)
    want = np.load(FIXTURES / group / f"{decode_case}.out.npy")
    assert np.abs(pixels - want).max() <= 1e-4

    vae = vp.load(model, ranks=ranks, **encode_tiling)
    x = np.load(x_path)
    for output in ("mean", "moments"):
        got = vae.encode(x, output=output, use_tiling=True)
        cli_out = run_cli(tmp_path, "encode", model, x_path, "--input", ranks, "--output", output, *flags(encode_tiling))
        assert same_bits(got, cli_out), output


def test_inputs_of_other_float_types_and_layouts_are_converted():
    model = FIXTURES / "autoencoder_kl/flux1_like"
    z = np.load(FIXTURES / "autoencoder_kl/flux1_like.decode.in.npy")
    vae = vp.load(model)
    want = vae.decode(z)
    assert same_bits(vae.decode(z.astype(np.float64)), want)
    # A Fortran-ordered copy: the same values in another memory layout.
    assert same_bits(vae.decode(np.asfortranarray(z)), want)
    assert same_bits(vae.decode(z.tolist()), want)
    # A row-major float32 array is read in place: never written, read-only ones too; a strided
    # view is converted.
    before = z.copy()
    assert same_bits(vae.decode(z, latents_normalized=True), vae.decode(before, latents_normalized=True))
    assert same_bits(z, before)
    frozen = z.copy()
    frozen.setflags(write=False)
    assert same_bits(vae.decode(frozen), want)
    wide = np.zeros(z.shape[:-1] + (2 * z.shape[-1],), dtype=np.float32)
    wide[..., ::2] = z
    assert same_bits(vae.decode(wide[..., ::2]), want)


def test_errors_are_typed_exceptions_with_the_clis_messages(tmp_path):
    model = FIXTURES / "autoencoder_kl/flux1_like"
    with pytest.raises(vp.ModelError):
        vp.load(tmp_path / "missing")
    with pytest.raises(vp.ConfigError, match="ranks must be at least 1"):
        vp.load(model, ranks=0)
    with pytest.raises(vp.ConfigError):
        vp.load(model, mode="diagonal")
    with pytest.raises(vp.ConfigError):
        vp.load(model, dtype="f64")
    vae = vp.load(model, ranks=2)
    bad = np.zeros((1, 3, 4, 4), dtype=np.float32)  # 3 channels: the model's latent has 16
    with pytest.raises(vp.InputError) as raised:
        vae.decode(bad)
    assert isinstance(raised.value, vp.VaeParallelError)
    # The CLI's one line for the same input.
    path = tmp_path / "bad.npy"
    np.save(path, bad)
    done = subprocess.run(
        [str(cli()), "decode", "--model", str(model), "--latent", str(path), "--out", str(tmp_path / "o.npy"),
         "--vae-patch-parallel-size", "2"],
        capture_output=True, text=True,
    )
    assert done.returncode != 0
    assert str(raised.value) in done.stderr
    with pytest.raises(vp.ConfigError):
        vae.encode(np.zeros((1, 3, 16, 16), dtype=np.float32), output="median")


def test_the_gil_is_released_while_a_request_runs():
    model = FIXTURES / "wan/wan21_like"
    vae = vp.load(model)
    # The fixture's latent, 8x8 times larger: a release build decodes the fixture itself in a few
    # milliseconds, too short to count the other thread's ticks in.
    z = np.tile(np.load(FIXTURES / "wan/wan21_like.decode_tiled.in.npy"), (1, 1, 1, 8, 8))
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    thread = threading.Thread(target=tick)
    thread.start()
    try:
        started = time.perf_counter()
        vae.decode(z, use_tiling=True)
        ended = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    # The other thread kept running during the decode.
    during = [t for t in ticks if started < t < ended]
    assert len(during) >= 3, f"{len(during)} ticks in a {ended - started:.3f} s decode"


def test_inspect_and_report():
    vae = vp.load(FIXTURES / "autoencoder_kl/sd_like", ranks=2)
    info = vae.inspect()
    assert info["class"] == "AutoencoderKL"
    assert "tile" in info["modes"] and info["ranks"] == 2 and info["mode"] == "auto"
    assert vae.last_report() is None
    z = np.load(FIXTURES / "autoencoder_kl/sd_like.decode_tiled.in.npy")
    # diffusers' tiled decode, as after `enable_tiling()`: the tiles over the two ranks.
    tiled = vae.decode(z, use_tiling=True)
    report = vae.last_report()
    assert report["mode"] == "auto" and report["strategy"] == "tile" and report["world_size"] == 2
    assert len(report["ranks"]) == 2 and report["tile_count"] > 1
    # Without tiling, the untiled decode's pixels, whatever `auto` runs them with (here the
    # cost model finds the direct decode on one rank fastest for so small a map), and a shard
    # over the two ranks gives the same bits.
    untiled = vae.decode(z)
    report = vae.last_report()
    assert report["mode"] == "auto" and report["reason"].startswith("auto:"), report
    alone = vp.load(FIXTURES / "autoencoder_kl/sd_like").decode(z)
    assert same_bits(untiled, alone)
    assert not same_bits(untiled, tiled)
    sharded = vae.decode(z, mode="spatial_shard_height")
    assert vae.last_report()["strategy"] == "shard-height"
    assert same_bits(sharded, alone)
    # A request in the tile mode: the tiles, with tiling on.
    assert same_bits(vae.decode(z, mode="tile", use_tiling=True), tiled)
    with pytest.raises(vp.ConfigError):
        vae.decode(z, mode="diagonal")
    assert "AutoencoderKL" in repr(vae)


def test_a_two_dimensional_shard_is_the_direct_decode():
    model = FIXTURES / "autoencoder_kl/sd_like"
    z = np.load(FIXTURES / "autoencoder_kl/sd_like.decode_tiled.in.npy")
    direct = vp.load(model).decode(z)
    vae = vp.load(model, ranks=4, mode="spatial_shard_2d", shard_grid=(2, 2))
    assert "spatial_shard_2d" in vae.inspect()["modes"]
    blocks = vae.decode(z)
    report = vae.last_report()
    assert report["strategy"] == "shard-2x2", report
    assert [r["block"] is not None for r in report["ranks"]] == [True] * 4
    assert same_bits(blocks, direct)
    # The grid goes with the 2-D mode only; another mode in a request ignores it.
    vae.decode(z, mode="tile", use_tiling=True)
    assert vae.last_report()["strategy"] == "tile"
    with pytest.raises(vp.ConfigError):
        vp.load(model, ranks=4, mode="spatial_shard_2d", shard_grid=(0, 2))


def test_a_pipelined_decode_is_the_direct_decode():
    model = FIXTURES / "wan/wan21_like"
    z = np.load(FIXTURES / "wan/wan21_like.decode_t3.in.npy")
    vae = vp.load(model, ranks=3, mode="pipeline")
    assert "pipeline" in vae.inspect()["modes"]
    pipelined = vae.decode(z)
    report = vae.last_report()
    assert report["strategy"] == "pipeline", report
    assert [r["pipeline"]["stage"] for r in report["ranks"]] == [0, 1, 2]
    assert same_bits(pipelined, vp.load(model).decode(z))
    # An image VAE has no frames to pipeline.
    with pytest.raises(vp.VaeParallelError, match="pipeline mode"):
        vp.load(FIXTURES / "autoencoder_kl/sd_like", mode="pipeline")


RANK_SCRIPT = """
import json, sys
import numpy as np
import vae_parallel as vp

cases, out_dir = json.loads(sys.argv[1]), sys.argv[2]
for i, (model, latent, image, decode_tiling, encode_tiling) in enumerate(cases):
    for what, path, tiling in (("decode", latent, decode_tiling), ("encode", image, encode_tiling)):
        vae = vp.load(model, transport="socket", **tiling)
        assert vae.world_size == 2, vae.world_size
        x = np.load(path)
        got = vae.decode(x, use_tiling=True) if what == "decode" else vae.encode(x, use_tiling=True)
        # The output goes to rank 0, and to the others where the family's placement says so.
        placement = vae.inspect()[f"{what}_placement"]
        assert (got is None) == (vae.rank != 0 and placement == "OwnerOnly"), (vae.rank, placement, got is None)
        if vae.rank == 0:
            np.save(f"{out_dir}/{what}-{i}.npy", got)
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def family_cases():
    """Per family: model, decode input, encode input and their tiling keywords."""
    for model, decode_case, decode_tiling, encode_case, encode_tiling in FAMILIES:
        group = model.split("/")[0]
        yield (str(FIXTURES / model), str(FIXTURES / group / f"{decode_case}.in.npy"),
               str(FIXTURES / group / f"{encode_case}.in.npy"), decode_tiling, encode_tiling)


def run_socket_group(tmp_path: Path, env_of_rank) -> None:
    import json
    import sys

    cases = json.dumps(list(family_cases()))
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, cases, str(tmp_path)],
            env={**os.environ, **env_of_rank(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err


@pytest.mark.parametrize("naming", ["torchrun", "vae"])
def test_processes_join_a_socket_group_from_the_environment(tmp_path, naming):
    port = free_port()
    secret = "ab" * 32
    if naming == "torchrun":
        # torchrun's names; the group listens one port above MASTER_PORT (torchrun's store).
        def env_of_rank(rank):
            return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port - 1), "VAE_GROUP_SECRET": secret}
    else:
        sock = tmp_path / "group.sock"

        def env_of_rank(rank):
            return {"VAE_RANK": str(rank), "VAE_WORLD_SIZE": "2", "VAE_MASTER_ADDR": f"unix:{sock}"}
    run_socket_group(tmp_path, env_of_rank)
    # Every family's decode and encode: the CLI's bits on two local ranks.
    for i, (model, latent, image, decode_tiling, encode_tiling) in enumerate(family_cases()):
        want = run_cli(tmp_path, "decode", Path(model), Path(latent), "--latent", 2, *flags(decode_tiling))
        assert same_bits(np.load(tmp_path / f"decode-{i}.npy"), want), model
        want = run_cli(tmp_path, "encode", Path(model), Path(image), "--input", 2, "--output", "mean",
                       *flags(encode_tiling))
        assert same_bits(np.load(tmp_path / f"encode-{i}.npy"), want), model


def test_a_socket_group_needs_its_environment():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    code = "import vae_parallel as vp, sys\ntry:\n vp.load(sys.argv[1], transport='socket')\nexcept vp.ConfigError as e:\n print(e)"
    import sys

    done = subprocess.run([sys.executable, "-c", code, str(FIXTURES / "autoencoder_kl/sd_like")],
                          env={k: v for k, v in env.items() if not k.startswith("VAE_")},
                          capture_output=True, text=True, timeout=60)
    assert "VAE_RANK (or RANK)" in done.stdout or "VAE_MASTER_ADDR" in done.stdout, done.stdout + done.stderr
    with pytest.raises(vp.ConfigError):
        vp.load(FIXTURES / "autoencoder_kl/sd_like", transport="carrier-pigeon")


def test_save_writes_what_the_cli_writes(tmp_path):
    import shutil

    model = FIXTURES / "wan/wan21_like"
    latent = FIXTURES / "wan/wan21_like.decode_t3.in.npy"
    pixels = vp.load(model).decode(np.load(latent))
    frames = pixels.shape[2]
    [npy] = vp.save(tmp_path / "clip.npy", pixels)
    assert same_bits(np.load(npy), pixels)
    [gif] = vp.save(tmp_path / "clip.gif", pixels, fps=8)
    cli_gif = tmp_path / "cli.gif"
    done = subprocess.run([str(cli()), "decode", "--model", str(model), "--latent", str(latent), "--out",
                           str(cli_gif), "--fps", "8"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert Path(gif).read_bytes() == cli_gif.read_bytes()
    pngs = vp.save(tmp_path / "frame.png", pixels)
    assert len(pngs) == frames and all(Path(p).read_bytes()[:4] == b"\x89PNG" for p in pngs)
    if shutil.which("ffmpeg") and shutil.which("ffprobe"):
        [mp4] = vp.save(tmp_path / "clip.mp4", pixels, fps=16)
        probe = subprocess.run(["ffprobe", "-v", "error", "-count_frames", "-select_streams", "v:0", "-show_entries",
                                "stream=nb_read_frames,r_frame_rate", "-of", "default=nw=1", str(mp4)],
                               capture_output=True, text=True)
        assert f"nb_read_frames={frames}" in probe.stdout and "r_frame_rate=16/1" in probe.stdout, probe.stdout
    with pytest.raises(vp.ConfigError):
        vp.save(tmp_path / "clip.avi", pixels)
    with pytest.raises(vp.InputError):
        vp.save(tmp_path / "flat.gif", np.zeros((4, 4), dtype=np.float32))
    with pytest.raises(vp.InputError, match="MP4 output needs ffmpeg"):
        os.environ["VAE_FFMPEG"] = "/nonexistent/ffmpeg"
        try:
            vp.save(tmp_path / "none.mp4", pixels)
        finally:
            del os.environ["VAE_FFMPEG"]
    assert not (tmp_path / "none.mp4").exists()


@pytest.mark.parametrize("ranks", [1, 2])
def test_decode_to_streams_the_files_the_cli_writes(tmp_path, ranks):
    model = FIXTURES / "wan/wan21_like"
    latent = FIXTURES / "wan/wan21_like.decode_t3.in.npy"
    # Over 2 ranks the stream is a spatial shard, as the CLI's.
    mode = "spatial_shard_width" if ranks > 1 else None
    vae = vp.load(model, ranks=ranks)
    extra = ["--vae-parallel-mode", mode] if mode else []
    for name in ("clip.npy", "clip.gif", "frame.png"):
        written = vae.decode_to(tmp_path / name, np.load(latent), fps=8, mode=mode)
        cli_out = tmp_path / f"cli-{name}"
        done = subprocess.run([str(cli()), "decode", "--model", str(model), "--latent", str(latent), "--out",
                               str(cli_out), "--fps", "8", "--ranks", str(ranks), "--vae-patch-parallel-size",
                               str(ranks), *extra], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        cli_files = sorted(tmp_path.glob(f"cli-{Path(name).stem}*{Path(name).suffix}"))
        assert len(written) == len(cli_files) > 0, (written, cli_files)
        for ours, theirs in zip(sorted(written), cli_files):
            assert Path(ours).read_bytes() == theirs.read_bytes(), (ours, theirs)
    if ranks > 1:
        assert vae.last_report()["strategy"] == "shard-width"
        # In tile mode the tiles stream (a latent of one tile here), with the CLI's bytes.
        [tiles] = vae.decode_to(tmp_path / "tiles.npy", np.load(latent), mode="tile", use_tiling=True)
        assert vae.last_report()["strategy"] == "tile"
        done = subprocess.run([str(cli()), "decode", "--model", str(model), "--latent", str(latent), "--out",
                               str(tmp_path / "cli-tiles.npy"), "--ranks", "2"], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert Path(tiles).read_bytes() == (tmp_path / "cli-tiles.npy").read_bytes()
    with pytest.raises(vp.InputError, match="must end in"):
        vae.decode_to(tmp_path / "clip.avi", np.load(latent))
    # An image family does not stream: refused before any rank starts.
    image_vae = vp.load(FIXTURES / "autoencoder_kl/flux1_like", ranks=ranks)
    with pytest.raises(vp.ConfigError, match="does not stream"):
        image_vae.decode_to(tmp_path / "image.npy", np.load(FIXTURES / "autoencoder_kl/flux1_like.decode.in.npy"))


INTERRUPT_SCRIPT = """
import os, signal, sys, threading, time
import numpy as np
import vae_parallel as vp

# A shell that starts a command in the background without job control has it ignore SIGINT,
# and Python then leaves it ignored: restore the handler the test exercises.
signal.signal(signal.SIGINT, signal.default_int_handler)

vae = vp.load(sys.argv[1], ranks=2, tile_sample_min_size=32)
z = np.random.default_rng(0).standard_normal((1, 16, 96, 96), dtype=np.float32)  # ~100 tiles
started = time.perf_counter()
vae.decode(z, use_tiling=True)
full = time.perf_counter() - started
threading.Timer(0.2 * full, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
started = time.perf_counter()
try:
    vae.decode(z, use_tiling=True)
    print("not interrupted")
except KeyboardInterrupt:
    print(f"interrupted after {time.perf_counter() - started:.3f} s of {full:.3f} s")
small = vae.decode(z[:, :, :8, :8])  # the model still serves requests
print("served", small.shape)
"""


def test_ctrl_c_stops_a_request_and_the_model_serves_the_next():
    import re
    import sys

    done = subprocess.run([sys.executable, "-c", INTERRUPT_SCRIPT, str(FIXTURES / "autoencoder_kl/flux1_like")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    found = re.search(r"interrupted after ([0-9.]+) s of ([0-9.]+) s", done.stdout)
    assert found, done.stdout + done.stderr
    after, full = float(found.group(1)), float(found.group(2))
    # Sent at a fifth of the full decode's time; stopped well before its end.
    assert after < 0.6 * full, done.stdout
    assert "served (1, 3, 32, 32)" in done.stdout, done.stdout
