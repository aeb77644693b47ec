"""The Python tool's sandbox (``hybridflow.agents.sandbox``): escape attempts, each contained and reported.

Every attempt runs twice: with the namespaces this machine allows, and without them (as in a pod
whose seccomp profile refuses ``unshare``: rlimits, Landlock and, as root, an empty capability
bounding set). Each must end as an error the model can read, leave no process behind and touch
nothing outside its working directory.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import psutil
import pytest

from hybridflow.agents.sandbox import SandboxLimits, isolation, run_python

pytestmark = pytest.mark.unit

LIMITS = SandboxLimits(wall_seconds=2.0, cpu_seconds=1, memory_bytes=256 * 2**20, processes=8)


@pytest.fixture(scope="module", autouse=True)
def confined() -> None:
    applied = isolation()
    if applied is None or applied.landlock_abi < 4:
        pytest.skip(f"this kernel cannot confine the sandbox's files and sockets (Landlock: {applied})")


def leftovers() -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if any("hybridflow-sandbox-" in part for part in process.info.get("cmdline") or []):
            found.append(process)
    return found


@pytest.fixture(params=[True, False], ids=["namespaces", "no-namespaces"])
def namespaces(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def test_code_runs_and_may_use_its_working_directory(namespaces: bool) -> None:
    result = run_python(
        "open('f.txt', 'w').write('hi')\nprint(open('f.txt').read(), 6 * 7)", LIMITS, namespaces=namespaces
    )
    assert result.ok and result.stdout == "hi 42\n" and result.as_tool_text() == "hi 42\n"
    assert result.isolation is not None and result.isolation.namespaces == namespaces


def test_an_exception_is_an_error_message_with_its_last_lines(namespaces: bool) -> None:
    result = run_python("raise ValueError('boom')", LIMITS, namespaces=namespaces)
    assert result.outcome == "error" and "ValueError: boom" in result.as_tool_text()


def test_a_fork_bomb_is_stopped_and_leaves_no_process(namespaces: bool) -> None:
    result = run_python("import os\nwhile True:\n    os.fork()", LIMITS, namespaces=namespaces)
    assert not result.ok and result.as_tool_text().startswith("error:")
    deadline = time.monotonic() + 5
    while leftovers() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not leftovers()


def test_memory_exhaustion_is_a_memory_error(namespaces: bool) -> None:
    result = run_python("x = bytearray(2 * 1024**3)", LIMITS, namespaces=namespaces)
    assert result.outcome == "memory_limit" and "ran out of memory" in result.as_tool_text()


def test_an_infinite_loop_is_stopped(namespaces: bool) -> None:
    result = run_python("while True:\n    pass", LIMITS, namespaces=namespaces)
    assert result.outcome in ("cpu_limit", "timeout") and result.seconds < LIMITS.wall_seconds + 2


def test_endless_output_is_cut_at_the_file_size_limit(namespaces: bool) -> None:
    limits = SandboxLimits(wall_seconds=5.0, file_bytes=2**20, output_bytes=1000)
    result = run_python("while True:\n    print('x' * 1000)", limits, namespaces=namespaces)
    assert result.outcome == "output_limit" and len(result.stdout) == 1000


def test_no_socket_reaches_even_this_host(namespaces: bool) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[object] = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    try:
        code = (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        )
        result = run_python(code, LIMITS, namespaces=namespaces)
    finally:
        server.close()
    assert result.outcome == "error" and "connected" not in result.stdout and not accepted


def test_files_outside_the_working_directory_can_be_neither_read_nor_written(
    namespaces: bool, tmp_path: Path
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("token")
    target = tmp_path / "written.txt"
    for code in (
        f"print(open({str(secret)!r}).read())",
        "print(open('/etc/passwd').read())",
        f"open({str(target)!r}, 'w').write('x')",
        "import os\nprint(os.listdir('/'))",
    ):
        result = run_python(code, LIMITS, namespaces=namespaces)
        assert result.outcome == "error" and "PermissionError" in result.stderr, (code, result)
        assert "token" not in result.stdout
    assert not target.exists()
