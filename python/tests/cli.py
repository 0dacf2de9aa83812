"""The kvtier CLI the tests of this folder start (`kvtier serve`)."""

from __future__ import annotations

import os
import shutil
import sys

import pytest


def kvtier_binary() -> str:
    """$KVTIER_BINARY, else the `kvtier` installed next to this interpreter, else on PATH."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    binary = os.environ.get("KVTIER_BINARY") or shutil.which("kvtier", path=path)
    if binary is None:
        pytest.fail("the kvtier CLI is not installed next to this interpreter nor on PATH")
    return binary
