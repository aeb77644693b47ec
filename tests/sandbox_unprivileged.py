"""The sandbox called by an unprivileged uid with no cgroup of its own: what a pod's process is.

``setpriv --reuid 65534 --regid 65534 --clear-groups /usr/bin/python3 tests/sandbox_unprivileged.py``
(Debian's interpreter, which any uid can read; the repository's ``runtime`` on ``PYTHONPATH``):
strict isolation is refused for want of a cgroup, and the launcher alone, given no cgroup, still
builds its user namespace and private root for an unprivileged caller. Prints JSON.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hybridflow.agents.sandbox import SandboxLimits, _Call, run_python


def main() -> None:
    refused = run_python("print(1)")
    work = Path(tempfile.mkdtemp(prefix="hybridflow-sandbox-"))
    code = "import os\nprint(os.getuid(), sorted(os.listdir('/work')))"
    alone = _Call(code, SandboxLimits(), True, None)._launch(work, None)
    applied = alone.isolation
    print(
        json.dumps(
            {
                "refused": refused.refused,
                "stderr": refused.stderr,
                "alone": alone.stdout,
                "private_root": bool(applied and applied.private_root and applied.seccomp),
            }
        )
    )


if __name__ == "__main__":
    main()
