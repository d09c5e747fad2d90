"""Give the heap memory Python and torch have freed back to the operating system (glibc only).

Why: a training step allocates and frees gigabytes of activations in tensors of a few MB. glibc
raises its mmap threshold after the first large free (up to 32 MB), so later tensors of that size
come from the heap, and freed heap pages stay in the process: the run's resident memory grew by
~0.15 GB per weight step and reached 8.9 GB after 48 steps of the search QA comparison (weight-only,
seed 1), too much for an 8 GB laptop, although the live data stayed under 2 GB. Measured on the
running seed-0 comparison at weight step 11: one `malloc_trim(0)` took the process from 5.94 GB to
1.76 GB resident. `malloc_trim` walks every arena and returns whole free pages; it frees nothing
that is in use, so calling it after each step costs a few milliseconds and changes no result.
"""

from __future__ import annotations

import ctypes
import functools
import os


@functools.lru_cache(maxsize=None)
def _libc(name: str, argtypes: tuple, restype):
    """The C library's function `name`, typed; None where it has none (not glibc: macOS, musl; or
    an older glibc). Looked up among the symbols the process already has (`CDLL(None)`): the CLI
    calls this at start, and `ctypes.util.find_library` would run `ldconfig` (~13 ms) every time."""
    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn


def _malloc_trim():
    return _libc("malloc_trim", (ctypes.c_size_t,), ctypes.c_int)


M_MMAP_THRESHOLD = -3  # mallopt's parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20


KERNEL_CACHE_ENTRIES = 64


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> None:
    """Bound the two caches of compiled CPU kernels that torch's oneDNN path keeps per GEMM shape
    (oneDNN's primitive cache and ideep's, 1,024 entries each by default) to `entries` each. The
    user's own `ONEDNN_PRIMITIVE_CACHE_CAPACITY` / `LRU_CACHE_CAPACITY` win.

    Why: every GEMM shape not seen before (each prefill forward's rows x width, each training
    micro-batch) adds entries to both, kept until each holds 1,024, so a run's resident memory grew
    with the shapes it met: 240 forwards of distinct lengths on SmolLM2-135M (bf16) left +557 MiB
    of heap in use, +255 with oneDNN's cache off, none with both bounded (2026-12-07, AMD EPYC);
    the demo's first test evaluation peaked ~140 MiB lower (0.93x) at 64 entries, with the same CPU.
    With no cache at all the kernels are compiled again at every call (that evaluation took 1.2-1.3x
    the CPU); the decode steps' few shapes recur and stay cached within a small bound. Read by the
    libraries once, at their first kernel: the CLI calls this at start, before torch is imported.
    ideep's capacity 0 crashes (torch 2.13), hence at least 1."""
    if entries < 1:
        raise ValueError(f"kernel cache entries must be >= 1, got {entries}")
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(entries))
    os.environ.setdefault("LRU_CACHE_CAPACITY", str(entries))


def _mallopt():
    return _libc("mallopt", (ctypes.c_int, ctypes.c_int), ctypes.c_int)


def map_large_blocks(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every allocation of `nbytes` or more from its own mapping (glibc), so a freed tensor of
    that size goes back to the OS at once; True if set. The user's `MALLOC_MMAP_THRESHOLD_` wins.

    Why: glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), and
    from then on a training step's activations come from the heap, where freed blocks are reused
    poorly (+2.0 GiB for one float32 micro-batch). A fixed 4 MiB was not low enough: one RSFT step of
    8 search-QA rows (SmolLM2-135M, float32, LoRA, gradient checkpointing; live tensors never more
    than +0.27 GiB over the loaded model) still raised the resident size by 1.5 GiB - the heap grew
    to 2.0 GiB, 1.35 GiB of it free, from blocks of 1-4 MiB - and by 0.39 / 0.28 / 0.25 GiB with
    2 MiB / 1 MiB / 256 KiB, in about the same CPU time (2026-12-07, AMD EPYC; trimming the heap
    after each micro-batch changed nothing: the waste builds up inside one forward and backward).
    The cost is page faults on fresh mappings. Set once at start (the CLI does), before the large
    allocations."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return False
    fn = _mallopt()
    return fn is not None and bool(fn(M_MMAP_THRESHOLD, int(nbytes)))


def release_free_memory() -> bool:
    """Return freed heap pages to the OS; True if the C library could do it (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo2():
    return _libc("mallinfo2", (), _MallInfo2)  # glibc >= 2.33


def process_memory(pid: int | str = "self") -> dict[str, int]:
    """Resident memory of one process in kB from /proc (Linux): Rss, Pss, Anonymous, Pss_Anon;
    empty where /proc has none."""
    out: dict[str, int] = {}
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            key, _, rest = line.partition(":")
            if key in ("Rss", "Pss", "Anonymous", "Pss_Anon"):
                out[key.lower()] = int(rest.split()[0])
    except OSError:
        pass
    return out


def peak_rss_kb(reset: bool = False) -> int:
    """This process's peak resident memory (VmHWM, kB) since it started or since the last reset;
    `reset` starts a new interval (Linux: /proc/self/clear_refs). 0 where /proc has none."""
    peak = 0
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1])
        if reset:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
    except OSError:
        pass
    return peak


def descendants(pid: int | str = "self") -> list[int]:
    """Every live descendant of `pid`, from the kernel's per-thread child lists."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            for task in os.scandir(f"/proc/{p}/task"):
                with open(os.path.join(task.path, "children")) as f:
                    kids = [int(c) for c in f.read().split()]
                out.extend(kids)
                todo.extend(kids)
        except OSError:
            continue
    return out


def heap_stats() -> dict[str, int]:
    """glibc's heap in MiB (mallinfo2): `heap_mib` the arenas' system bytes (main + thread arenas),
    `heap_free_mib` what they hold free, `mmap_mib` the large blocks mapped on their own; empty
    elsewhere. Free heap bytes are resident until trimmed (`release_free_memory`)."""
    fn = _mallinfo2()
    if fn is None:
        return {}
    info = fn()
    mib = 1 << 20
    return {"heap_mib": info.arena // mib, "heap_free_mib": info.fordblks // mib, "mmap_mib": info.hblkhd // mib}


def heap_bytes() -> tuple[int, int]:
    """(bytes glibc has handed out and not had back - heap in use plus blocks mapped on their own,
    bytes its heap holds free), from mallinfo2; (0, 0) elsewhere. Cheap enough to sample every few ms."""
    fn = _mallinfo2()
    if fn is None:
        return 0, 0
    info = fn()
    return info.uordblks + info.hblkhd, info.fordblks
