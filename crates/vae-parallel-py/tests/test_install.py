"""What an installation carries besides the API: its version, its devices, and (installed from the
wheel) the `vae-parallel` command beside it.

With `VAE_PARALLEL_WHEEL=1` (CI's wheel step: the package pip-installed from the wheel into a
fresh venv, no Rust toolchain on PATH) the package must come from that installation: its
metadata, its `vae-parallel` command in the venv's scripts, the CUDA kernels embedded, and the
command must write the same bytes as the cargo-built CLI named by `VAE_PARALLEL_CARGO_CLI`.
Without it (a development checkout) those checks are skipped, and say so.
"""

import importlib.metadata as metadata
import os
import re
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

import vae_parallel as vp
from cli_under_test import find_cli

ROOT = Path(__file__).resolve().parents[3]
FIXTURES = ROOT / "fixtures"
WHEEL = os.environ.get("VAE_PARALLEL_WHEEL") == "1"
wheel_only = pytest.mark.skipif(not WHEEL, reason="checks a wheel installation (VAE_PARALLEL_WHEEL=1, CI's wheel step)")


def workspace_version() -> str:
    """`[workspace.package] version` of the repository's Cargo.toml (the one version of all)."""
    text = (ROOT / "Cargo.toml").read_text()
    section = text.split("[workspace.package]", 1)[1].split("\n[", 1)[0]
    return re.search(r'^version\s*=\s*"([^"]+)"', section, re.M).group(1)


def cli() -> Path:
    """The CLI under test: `$VAE_PARALLEL_CLI`, else the workspace's build (as test_package.py)."""
    found = find_cli()
    if found is not None:
        return found
    pytest.fail("no vae-parallel binary: build it (cargo build -p vae-parallel) or set VAE_PARALLEL_CLI")


def test_the_package_and_the_cli_have_the_workspaces_version():
    assert vp.__version__ == workspace_version()
    done = subprocess.run([str(cli()), "--version"], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["vae-parallel", vp.__version__]


def test_devices_answers_without_raising():
    found = vp.devices()
    assert set(found) == {"cuda", "reason", "kernels", "nccl", "devices"}
    assert isinstance(found["kernels"], bool) and isinstance(found["nccl"], bool)
    for device in found["devices"]:
        assert set(device) == {"ordinal", "name", "compute_capability", "total_memory", "multiprocessors"}
        assert len(device["compute_capability"]) == 2 and device["total_memory"] > 0
    # Usable means a device that opens and kernels to run on it; otherwise the reason is given.
    assert found["cuda"] == (bool(found["devices"]) and found["kernels"])
    assert (found["reason"] is None) == found["cuda"], found
    if not found["devices"]:
        assert found["reason"], found


@wheel_only
def test_the_wheel_installed_the_package_its_command_and_the_kernels():
    dist = metadata.distribution("vae-parallel")
    assert dist.version == vp.__version__
    # The package imported is the installed one, not the checkout's sources.
    assert Path(vp.__file__).resolve() == Path(dist.locate_file("vae_parallel/__init__.py")).resolve()
    installed = shutil.which("vae-parallel")
    assert installed, "no vae-parallel on PATH"
    assert Path(installed).parent.resolve() == Path(sysconfig.get_path("scripts")).resolve()
    assert Path(installed).resolve() == cli().resolve(), "VAE_PARALLEL_CLI must name the installed command"
    assert vp.devices()["kernels"], "the wheel must embed the CUDA kernels (cargo xtask kernels before the build)"
    for typed in ("py.typed", "_native.pyi", "diffusers.pyi"):
        assert Path(dist.locate_file(f"vae_parallel/{typed}")).is_file(), typed


def run(args: list, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, cwd=cwd)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    return done


@wheel_only
@pytest.mark.parametrize("ranks", [1, 2])
def test_the_installed_command_writes_the_cargo_clis_bytes(tmp_path, ranks):
    cargo_cli = os.environ.get("VAE_PARALLEL_CARGO_CLI")
    assert cargo_cli, "VAE_PARALLEL_CARGO_CLI must name the cargo-built CLI to compare with"
    installed = shutil.which("vae-parallel")
    assert installed and Path(installed).resolve() != Path(cargo_cli).resolve()
    model = FIXTURES / "autoencoder_kl/sd_like"
    latent = FIXTURES / "autoencoder_kl/sd_like.decode_tiled.in.npy"
    image = FIXTURES / "demo_vae/chelsea_256.png"
    for name, program in (("installed", installed), ("cargo", cargo_cli)):
        out = tmp_path / name
        out.mkdir()
        common = ["--vae-patch-parallel-size", ranks]
        run([program, "decode", "--model", model, "--latent", latent, "--out", "pixels.npy", "--vae-use-tiling",
             *common], out)
        run([program, "decode", "--model", model, "--latent", latent, "--out", "pixels.png", *common], out)
        run([program, "encode", "--model", FIXTURES / "demo_vae", "--input", image, "--out", "latent.npy",
             *common], out)
    for file in ("pixels.npy", "pixels.png", "latent.npy"):
        a, b = (tmp_path / "installed" / file).read_bytes(), (tmp_path / "cargo" / file).read_bytes()
        assert a == b, f"{file} differs between the installed command and the cargo-built CLI"
    # The same flags: the same help, command by command.
    for command in ([], ["decode"], ["encode"], ["demo"]):
        helps = [run([program, *command, "--help"], tmp_path).stdout for program in (installed, cargo_cli)]
        assert helps[0] == helps[1], command
