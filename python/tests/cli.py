"""The kvtier CLI the tests of this folder start (`kvtier serve`)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest


def kvtier_binary() -> str:
    """$KVTIER_BINARY, else the `kvtier` installed next to this interpreter, else on PATH."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    binary = os.environ.get("KVTIER_BINARY") or shutil.which("kvtier", path=path)
    if binary is None:
        pytest.fail("the kvtier CLI is not installed next to this interpreter nor on PATH")
    return binary


def stop_process(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM (after SIGCONT: a test may have stopped it), a wait, then SIGKILL."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGCONT)
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
