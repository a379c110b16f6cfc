"""The slow tier as benchmarks see it: dropping a model file from the page cache, and
the read bandwidth the expert loads can reach (the disk bound of decoding)."""

from __future__ import annotations

import concurrent.futures
import mmap
import os
import random
import time

ALIGN = 4096


def drop_from_page_cache(path: str | os.PathLike) -> None:
    """Evict this file's pages (only this file's: never the machine's whole cache). Written
    pages are flushed first: the kernel does not drop a dirty page."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_bytes_of_process() -> int:
    """Bytes this process (all its threads) caused to be read from storage."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def measure_read_bandwidth(path: str | os.PathLike, chunk_bytes: int, *, n_threads: int = 2,
                           total_bytes: int = 768 << 20, seed: int = 0) -> tuple[float, bool]:
    """Bytes/s of reading expert-sized chunks at random places of the file, the way the
    expert loader does (O_DIRECT where the file system allows it, n_threads readers).
    Returns (bandwidth, direct) where direct says whether O_DIRECT was in use."""
    size = os.path.getsize(path)
    chunk = max(ALIGN, (chunk_bytes + ALIGN - 1) // ALIGN * ALIGN)
    chunk = min(chunk, size // ALIGN * ALIGN)
    if chunk <= 0:
        raise ValueError(f"{path}: too small to measure reads ({size} bytes)")
    n_chunks = max(n_threads, total_bytes // chunk)
    rng = random.Random(seed)
    offsets = [rng.randrange(0, (size - chunk) // ALIGN + 1) * ALIGN for _ in range(n_chunks)]
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        direct = hasattr(os, "O_DIRECT")
    except OSError:
        fd = os.open(path, os.O_RDONLY)
        direct = False
    try:
        if not direct:
            drop_from_page_cache(path)

        def reader(part: list[int]) -> int:
            buf = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT wants
            n = 0
            for off in part:
                n += os.preadv(fd, [buf], off)
            buf.close()
            return n

        parts = [offsets[i::n_threads] for i in range(n_threads)]
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(n_threads) as pool:
            n_read = sum(pool.map(reader, parts))
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
    return n_read / seconds, direct
