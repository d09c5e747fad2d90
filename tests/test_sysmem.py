"""release_free_memory gives freed heap pages back to the OS (the run's memory growth, sysmem.py)."""

import os
import subprocess
import sys

import pytest

from whale import sysmem
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


linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


# In a fresh interpreter: in pytest's own process, threads left by earlier tests free memory while
# this one allocates, so the process's resident size is not this test's to measure (CI saw +38 MiB).
ALLOCATE = """
from whale import sysmem
before = sysmem.process_memory()
assert before["pss"] > 0 and before["rss"] >= before["pss"] // 2, before
sysmem.peak_rss_kb(reset=True)
block = bytearray(64 << 20)  # 64 MiB, touched
block[::4096] = b"x" * len(block[::4096])
now = sysmem.process_memory()["rss"]
assert set(sysmem.heap_stats()) <= {"heap_mib", "heap_free_mib", "mmap_mib"}
print(before["rss"], now, sysmem.peak_rss_kb())
"""


@linux
def test_process_memory_and_peak_see_a_large_allocation():
    out = subprocess.run([sys.executable, "-c", ALLOCATE], capture_output=True, text=True, check=True).stdout
    before, now, peak = map(int, out.split())
    assert peak >= now >= before + (60 << 10), (before, now, peak)


@linux
def test_descendants_lists_a_child_and_its_child():
    proc = subprocess.Popen([sys.executable, "-c",
                             "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])"])
    try:
        for _ in range(200):
            found = sysmem.descendants()
            if len(found) >= 2:
                break
            subprocess.run(["sleep", "0.05"])
        assert proc.pid in found and len(found) >= 2
    finally:
        for pid in sysmem.descendants(proc.pid):
            subprocess.run(["kill", str(pid)])
        proc.kill()
        proc.wait()


def test_the_memory_probe_writes_a_row_per_event_with_the_process_and_its_children(tmp_path):
    import json
    import subprocess
    import sys
    from types import SimpleNamespace

    from toy import ScriptedEngine
    from whale.memory_probe import MemoryProbe

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        probe = MemoryProbe(tmp_path / "memory.jsonl", ScriptedEngine(), SimpleNamespace(trainer=None))
        probe.log("eval", "eval-initial-val", 1.23)
        probe.log("weight_step", "w0", 4.56)
    finally:
        child.kill()
        child.wait()
    rows = [json.loads(line) for line in (tmp_path / "memory.jsonl").read_text().splitlines()]
    assert [(r["event"], r["unit"], r["t"]) for r in rows] == [("eval", "eval-initial-val", 1.2), ("weight_step", "w0", 4.6)]
    assert all(r["pss"] > 0 and r["peak_rss"] > 0 and r["threads"] >= 1 for r in rows)
    assert sum(rows[0]["children_pss"].values()) > 0  # the child python process is counted


# In a fresh process: a freed 12 MiB block raises glibc's dynamic mmap threshold, so a block of 2 or
# 8 MiB after it comes from the heap (where a freed one stays); with the threshold fixed both are
# mapped (2 MiB: the sizes that fragmented a float32 training step's heap under a 4 MiB threshold).
MAPPED = """
import ctypes, ctypes.util, sys
from whale import sysmem
if sys.argv[1] == "fixed":
    assert sysmem.map_large_blocks()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(12 << 20))
before = sysmem.heap_stats()["mmap_mib"]
block = libc.malloc(int(sys.argv[2]) << 20)
print(sysmem.heap_stats()["mmap_mib"] - before)
"""


@pytest.mark.skipif(sysmem._mallopt() is None or not sysmem.heap_stats(), reason="needs glibc's mallopt, mallinfo2")
@pytest.mark.parametrize("block_mib", [2, 8])
@pytest.mark.parametrize("mode", ["dynamic", "fixed"])
def test_large_blocks_are_mapped_once_the_threshold_is_fixed(mode, block_mib, monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    out = subprocess.run([sys.executable, "-c", MAPPED, mode, str(block_mib)], capture_output=True, text=True,
                         check=True).stdout
    assert int(out) == (block_mib if mode == "fixed" else 0)


def test_the_users_own_threshold_wins(monkeypatch):
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert sysmem.map_large_blocks() is False


# In a fresh process (the libraries read their cache bounds once, at their first kernel): bf16 GEMMs
# of 100 shapes not seen before, and the heap in use they leave behind.
KERNEL_SHAPES = """
import sys
from whale import sysmem
if sys.argv[1] == "bounded":
    sysmem.bound_kernel_caches(8)
import torch
torch.set_num_threads(1)
lin = torch.nn.Linear(256, 512, bias=False).to(torch.bfloat16)
def in_use():
    sysmem.release_free_memory()
    heap = sysmem.heap_stats()
    return heap["heap_mib"] - heap["heap_free_mib"]
with torch.no_grad():
    for m in range(65, 80):
        lin(torch.randn(m, 256, dtype=torch.bfloat16))
    before = in_use()
    for m in range(100, 400, 3):
        lin(torch.randn(m, 256, dtype=torch.bfloat16))
print(in_use() - before)
"""


def _onednn_bf16() -> bool:
    import torch
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


@pytest.mark.skipif(not sysmem.heap_stats() or not _onednn_bf16(), reason="needs glibc's mallinfo2 and oneDNN bf16")
def test_bounded_kernel_caches_stop_the_heap_growing_with_new_gemm_shapes(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    grown = {mode: int(subprocess.run([sys.executable, "-c", KERNEL_SHAPES, mode], capture_output=True, text=True,
                                      check=True).stdout)
             for mode in ("default", "bounded")}
    assert grown["default"] >= 20, grown  # the libraries' default: an entry per shape, up to 1,024
    assert grown["bounded"] <= 4, grown


def test_the_users_own_kernel_cache_bounds_win(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    sysmem.bound_kernel_caches(8)
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "512" and os.environ["LRU_CACHE_CAPACITY"] == "8"
    with pytest.raises(ValueError, match=">= 1"):
        sysmem.bound_kernel_caches(0)


@pytest.mark.skipif(not sysmem.heap_stats(), reason="needs glibc's mallinfo2")
def test_heap_bytes_counts_a_block_while_it_is_held():
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    before, _ = sysmem.heap_bytes()
    block = libc.malloc(3 << 20)
    held, _ = sysmem.heap_bytes()
    libc.free(block)
    after, _ = sysmem.heap_bytes()
    assert held - before >= 3 << 20 and held - after >= 3 << 20  # counted while held, not after
