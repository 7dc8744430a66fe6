"""A process told to keep freed memory (:func:`resources.heap.keep_freed_memory`) reuses a
freed block of a step's size instead of page-faulting fresh memory in each time. Each case in a
process of its own: the setting is the whole process's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests import ROOT

# 20 steps that each allocate, fill and free 64 MiB, as a train step's attention scores are;
# the process's minor page faults over them
STEPS = """
import json, resource, sys
from resources.heap import keep_freed_memory
applied = keep_freed_memory(1 << 30) if sys.argv[1] == "keep" else None
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    block = bytearray(64 << 20)  # malloc'd as torch's CPU tensors are, every page written
    del block
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _steps(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_block_is_reused_instead_of_faulted_in_again():
    default, keep = _steps("default"), _steps("keep")
    step = (64 << 20) // 4096  # pages a step writes
    # the C library's defaults: a fresh mapping per step, every page faulted in
    assert default["faults"] > 0.9 * 20 * step
    # kept: the first steps' memory is reused; the later steps fault nothing in
    assert keep["applied"] is True
    assert keep["faults"] < 3 * step
