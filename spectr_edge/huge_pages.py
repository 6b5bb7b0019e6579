"""Back the process's large anonymous memory (ONNX Runtime's copies of the model weights) with 2 MiB pages.

A CPU decode step streams every weight once. With 4 KiB pages that is about a quarter of a million TLB
misses per step for a 1 GB model, and how costly they are depends on where the kernel happened to place
the pages, so two processes of the same bundle can differ by several percent. On Linux 6.1 and later,
madvise(MADV_COLLAPSE) moves such memory into transparent huge pages synchronously (a few seconds per GB,
once, after the sessions are created). Where transparent huge pages are set to "madvise" (most
distributions) nothing else asks for them. Best effort: on other systems, older kernels, or when the
kernel declines a range, nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE = 2 << 20
MIN_REGION = 32 << 20      # smaller mappings are not weights


def _regions(min_bytes: int):
    """(start, end) of the process's writable anonymous mappings of at least min_bytes, 2 MiB aligned."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 5 and parts[5] != "[heap]":        # file-backed, stack, vdso...
                continue
            if not parts[1].startswith("rw"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            lo, hi = (lo + HUGE - 1) // HUGE * HUGE, hi // HUGE * HUGE
            if hi - lo >= min_bytes:
                yield lo, hi


def huge_page_bytes() -> int:
    """Anonymous memory of this process in transparent huge pages, bytes (0 where not reported)."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            return sum(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("AnonHugePages:"))
    except OSError:
        return 0


def back_with_huge_pages(min_bytes: int = MIN_REGION) -> int:
    """Ask the kernel to hold this process's large anonymous mappings in huge pages now; returns the
    bytes of the ranges it accepted (0 on systems without MADV_COLLAPSE). Asking again for a range already
    in huge pages costs milliseconds (6 ms for the int4 bundle's 1.1 GiB), so every load asks for all."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        regions = list(_regions(min_bytes))
    except (OSError, AttributeError):
        return 0
    accepted = 0
    for lo, hi in regions:
        madvise(lo, hi - lo, MADV_HUGEPAGE)        # later faults in the range also get huge pages
        if madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
            accepted += hi - lo
    return accepted
