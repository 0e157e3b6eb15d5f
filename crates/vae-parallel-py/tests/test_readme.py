"""The README's Python quick start, run as a newcomer copies it, from the repository's root."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_the_python_quick_start_runs_as_written(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    start = readme.index("**Python**")
    block = re.search(r"```python\n(.*?)```", readme[start:], re.S).group(1)
    # The repository's root, as far as the snippet can tell: its fixtures, and a place to write.
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["pixels"].shape == (1, 3, 256, 256)
    assert (tmp_path / "cat.png").stat().st_size > 10_000


def test_the_first_python_lines_run_as_written(tmp_path, monkeypatch):
    readme = (ROOT / "README.md").read_text()
    top = readme[: readme.index("## Quick start")]
    install = re.findall(r"```bash\n(.*?)```", top, re.S)[1].strip()
    assert install.startswith("pip install ") and install.endswith(".whl"), install
    block = re.search(r"```python\n(.*?)```", top, re.S).group(1)
    assert len(block.strip().splitlines()) == 3, block
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    monkeypatch.chdir(tmp_path)
    exec(compile(block, "README.md", "exec"), {})
    assert (tmp_path / "cat.png").stat().st_size > 10_000
