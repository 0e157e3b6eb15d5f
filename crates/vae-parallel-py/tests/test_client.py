"""`vae_parallel.Client` against the real `vae-parallel serve` (2 local ranks sharding the
untiled decode): its answers are the in-process `Vae`'s bit for bit, a streamed decode's frames
are the whole decode's, `decode_to` writes the whole file, and a refusal is a `ServiceError` after
which the service keeps serving. Skipped only where no CLI binary is found ($VAE_PARALLEL_CLI,
else the workspace's debug or release build)."""

import subprocess
from pathlib import Path

import numpy as np
import pytest

import vae_parallel as vp
from cli_under_test import find_cli

ROOT = Path(__file__).resolve().parents[3]
FIX = ROOT / "fixtures"
SD = FIX / "autoencoder_kl" / "sd_like"
WAN = FIX / "wan" / "wan21_like"
TOKEN = "client-test-token"


def same_bits(a, b) -> bool:
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    exe = find_cli()
    if exe is None:
        pytest.skip("no vae-parallel binary: build it (cargo build -p vae-parallel) or set VAE_PARALLEL_CLI")
    token_file = tmp_path_factory.mktemp("token") / "token"
    token_file.write_text(TOKEN + "\n")
    args = [str(exe), "serve", "--listen", "127.0.0.1:0", "--model", f"sd={SD}", "--model", f"wan={WAN}",
            "--vae-patch-parallel-size", "2", "--vae-parallel-mode", "spatial_shard_height",
            "--token-file", str(token_file)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
    url = None
    for line in proc.stdout:
        if line.startswith("listening on "):
            url = line.split()[-1]
            break
    assert url, "the service exited before listening"
    yield url
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def test_decode_and_encode_are_the_in_process_vaes(service):
    client = vp.Client(service, token=TOKEN)
    z = np.load(FIX / "autoencoder_kl" / "sd_like.decode.in.npy")
    x = np.load(FIX / "autoencoder_kl" / "sd_like.encode.in.npy")
    vae = vp.load(SD)
    assert same_bits(client.decode(z, "sd"), vae.decode(z))
    assert client.last_report["ranks"][1]["rank"] == 1
    assert same_bits(client.encode(x, "sd"), vae.encode(x))
    assert same_bits(client.encode(x, "sd", output="moments"), vae.encode(x, output="moments"))
    names = [m["name"] for m in client.models()]
    assert names == ["sd", "wan"]


def test_torch_in_torch_out(service):
    torch = pytest.importorskip("torch")
    client = vp.Client(service, token=TOKEN)
    z = np.load(FIX / "autoencoder_kl" / "sd_like.decode.in.npy")
    out = client.decode(torch.from_numpy(z), "sd")
    assert isinstance(out, torch.Tensor)
    assert same_bits(out.numpy(), vp.load(SD).decode(z))


def test_streamed_frames_are_the_whole_decode_and_decode_to_writes_it(service, tmp_path):
    client = vp.Client(service, token=TOKEN)
    z = np.load(FIX / "wan" / "wan21_like.decode_t3.in.npy")
    whole = client.decode(z, "wan")
    runs = list(client.decode_frames(z, "wan"))
    assert len(runs) > 1
    assert same_bits(np.concatenate(runs, axis=2), whole)
    assert same_bits(whole, vp.load(WAN).decode(z))
    path = client.decode_to(z, tmp_path / "video.npy", "wan")
    assert same_bits(np.load(path), whole)
    assert [p.name for p in tmp_path.iterdir()] == ["video.npy"]


def test_refusals_are_service_errors_and_the_service_keeps_serving(service):
    client = vp.Client(service, token=TOKEN)
    z = np.load(FIX / "autoencoder_kl" / "sd_like.decode.in.npy")
    with pytest.raises(vp.ServiceError) as unknown:
        client.decode(z, "nope")
    assert unknown.value.status == 404 and "unknown model" in unknown.value.message
    with pytest.raises(vp.ServiceError) as bad:
        client.decode(np.full((1, 4, 8, 8), np.nan, dtype=np.float32), "sd")
    assert bad.value.status == 422 and bad.value.kind == "invalid_input"
    with pytest.raises(vp.ServiceError) as no_token:
        vp.Client(service).decode(z, "sd")
    assert no_token.value.status == 401
    assert same_bits(client.decode(z, "sd"), vp.load(SD).decode(z))
