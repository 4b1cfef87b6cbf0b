"""Giving freed memory back to the system, for a long-running process (``tellkit serve``).

glibc's allocator keeps what a burst of requests freed: tensors under its mmap threshold (which
grows to 32 MiB as large blocks are freed) come from per-thread heaps ("arenas") that shrink
only from their top, so a server stays hundreds of MiB above its idle size after a burst.
:func:`release_memory` asks glibc to return every free page of every arena (``malloc_trim(0)``)
and :func:`limit_arenas` caps how many arenas the threads of the process spread over. Elsewhere
(another C library, another system) both do nothing and say so.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools

M_ARENA_MAX = -8  # glibc's mallopt parameter


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    try:
        lib = ctypes.CDLL(name)
        lib.malloc_trim.argtypes, lib.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        lib.mallopt.argtypes, lib.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        return lib
    except (OSError, AttributeError):  # not glibc
        return None


def release_memory() -> bool:
    """Return the free pages of every malloc arena to the system; True where glibc did it."""
    lib = _libc()
    if lib is None:
        return False
    lib.malloc_trim(0)
    return True


def limit_arenas(n: int) -> bool:
    """At most ``n`` malloc arenas for the process's threads (call before threads start
    allocating); True where glibc accepted it."""
    lib = _libc()
    return bool(lib is not None and lib.mallopt(M_ARENA_MAX, int(n)) == 1)
