"""Where the tests find the `vae-parallel` command they compare the package with."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def find_cli() -> Path | None:
    """`$VAE_PARALLEL_CLI` (CI names the wheel's installed command), else the workspace's build
    (debug, then release), else None."""
    named = os.environ.get("VAE_PARALLEL_CLI")
    if named:
        return Path(named)
    for profile in ("debug", "release"):
        path = ROOT / "target" / profile / "vae-parallel"
        if path.exists():
            return path
    return None
