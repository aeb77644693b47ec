"""The built images, run as a cluster runs them (``make images-test``; CI runs it after ``make images``).

These tests run the images ``make images`` built (``images/build.py``: Docker where an engine
answers, else podman with the project's settings) and fail, never skip, when one is missing: the
stage that runs them has just built them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from containers import Containers, build


@pytest.fixture(scope="session")
def containers() -> Iterator[Containers]:
    engine = build.find_engine()
    found = Containers(engine, build.project_version())
    missing = [
        found.tag(name)
        for name in ("operator", "runtime-cpu")
        if engine.run("image", "inspect", found.tag(name), capture=True).returncode != 0
    ]
    if missing:
        pytest.fail(f"not built: {', '.join(missing)}; run `make images IMAGES='operator runtime-cpu'` first")
    yield found
