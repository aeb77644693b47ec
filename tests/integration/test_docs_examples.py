"""The controller example of docs/architecture.md runs as written (in a fresh interpreter with its own Ray)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def test_the_controller_example_runs(tmp_path: Path) -> None:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "architecture.md").read_text(), flags=re.S)
    assert blocks, "docs/architecture.md has no python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    assert len(blocks[0].strip().splitlines()) <= 25
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("mean_advantage") == 4
