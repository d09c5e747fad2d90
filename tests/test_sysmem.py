"""release_free_memory gives freed heap pages back to the OS (the run's memory growth, sysmem.py)."""

import subprocess
import sys

import pytest

from whale.sysmem import release_free_memory

# In a fresh process: freeing a 16 MB tensor raises glibc's mmap threshold, so the 3 MB tensors
# after it come from the heap, with small live tensors between them (activations and the bits
# that outlive a training step). Freed, they stay resident until the heap is trimmed.
PROBE = """
import re, torch
from whale.sysmem import release_free_memory
def rss_mb():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) // 1024
big = torch.ones(4 * 1024 * 1024); del big
chunks, pins = [], []
for _ in range(300):
    chunks.append(torch.ones(3 * 256 * 1024)); pins.append(torch.ones(200))
del chunks
before = rss_mb(); release_free_memory(); print(before, rss_mb())
"""


@pytest.mark.skipif(not release_free_memory(), reason="needs glibc's malloc_trim")
def test_freed_heap_memory_goes_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    before, after = map(int, out.split())
    assert before - after > 600, (before, after)  # ~900 MB of freed tensors were still resident
