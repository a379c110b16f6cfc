"""How fast this disk serves reads of a given size: O_DIRECT preads at random page-aligned
offsets of FILE, from N threads at once (the queue depth), for each size; GB/s.

CORM's neuron reads are runs of a few rows (a Q8_0 row of 4096 is 4352 bytes): whether they
pay depends on what the disk gives such reads, not only on the bytes they save.

    python scripts/read-size-bench.py FILE [--sizes 8192,16384,65536,2097152] [--threads 2,8,16,32]
"""

import argparse
import mmap
import os
import random
import threading
import time


def read_rate(path: str, size: int, n_threads: int, total: int) -> float:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        n_pages = (os.fstat(fd).st_size - size) // 4096
        per_thread = max(1, total // size // n_threads)

        def work(seed: int) -> None:
            buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
            rng = random.Random(seed)
            for _ in range(per_thread):
                os.preadv(fd, [buf], rng.randrange(n_pages) * 4096)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return per_thread * n_threads * size / (time.perf_counter() - start) / 1e9
    finally:
        os.close(fd)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file", help="a large file on the disk to measure (not in the page cache: O_DIRECT)")
    p.add_argument("--sizes", default="8192,16384,65536,2097152")
    p.add_argument("--threads", default="2,8,16,32")
    args = p.parse_args()
    threads = [int(n) for n in args.threads.split(",")]
    print("bytes per read  " + "  ".join(f"{n:>3} threads" for n in threads) + "   (GB/s)")
    for size in (int(s) for s in args.sizes.split(",")):
        total = (64 << 20) if size < 65536 else (256 << 20)
        print(f"{size:>14}  " + "  ".join(f"{read_rate(args.file, size, n, total):>11.2f}" for n in threads), flush=True)


if __name__ == "__main__":
    main()
