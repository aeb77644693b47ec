"""The container engine ``make images`` used and the built images, for the tests of tests/images."""

from __future__ import annotations

import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "images"))
import build  # noqa: E402

sys.path.pop(0)


@dataclass(frozen=True)
class Containers:
    """The engine and the tags of the built images."""

    engine: build.Engine
    version: str

    def tag(self, name: str) -> str:
        return build.tag(build.IMAGES[name], self.version)

    def run(
        self, image: str, *command: str, options: tuple[str, ...] = ()
    ) -> subprocess.CompletedProcess[str]:
        """``run --rm`` of ``command`` in the image (by its name in images/build.py), output captured."""
        return self.engine.run("run", "--rm", *options, self.tag(image), *command, capture=True)

    def start(self, image: str, *command: str, options: tuple[str, ...] = ()) -> str:
        """A detached container's name; removed by :meth:`remove`."""
        name = f"hybridflow-test-{uuid.uuid4().hex[:8]}"
        started = self.engine.run(
            "run", "-d", "--name", name, *options, self.tag(image), *command, capture=True
        )
        assert started.returncode == 0, started.stderr
        return name

    def exec(self, name: str, *command: str) -> subprocess.CompletedProcess[str]:
        return self.engine.run("exec", name, *command, capture=True)

    def remove(self, name: str) -> None:
        self.engine.run("rm", "-f", "-t", "0", name, capture=True)
