#!/usr/bin/env python3
"""Decode time and bytes read, step by step, from a cold start under a memory cap: whether the
first steps `hobbitpy bench` times (its `-n`) are what a longer generation gets. Each
configuration in its own process, inside a cgroup v1/v2 memory cap (as bench makes it), after
the files beside the model are dropped from the page cache; a 16-token prompt (bench's), then
N-1 greedy decode steps, one JSON line each: the step's seconds and the MB the process read.

    python scripts/decode-per-token.py MODEL CAP_MB N default stock [exact]

default: what `hobbitpy run MODEL` serves (its first run measures what it serves, in the load);
exact: the model's own experts only; stock: llama.cpp's path (mapped; repacking as the memory allows).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time


def worker(model: str, n: int, config: str) -> None:
    import numpy as np

    import hobbitpy  # noqa: F401  (first: points llama_cpp at the patched library)
    from hobbitpy.bench.bench_plan import bench_context_shape
    from hobbitpy.bench.bench_worker import _prompt
    from hobbitpy.files.model_file import inspect_model
    from hobbitpy.plan.memory import fit_ubatch
    from hobbitpy.runtime.llama import Llama
    from hobbitpy.settings.config import OffloadConfig
    from hobbitpy.system.disk import read_bytes_of_process

    offload = {"default": OffloadConfig(), "exact": OffloadConfig(auto=False),
               "stock": OffloadConfig(enabled=False)}[config]
    shape = bench_context_shape(n, (16,))
    n_ubatch = None if offload.enabled else fit_ubatch(inspect_model(model), shape, OffloadConfig())
    t0 = time.perf_counter()
    llm = Llama(model, offload=offload, n_ctx=shape.n_ctx, n_batch=shape.n_batch, n_ubatch=n_ubatch, verbose=False)
    print(json.dumps({"config": config, "load_s": time.perf_counter() - t0, "plan": llm.offload_plan.reason}), flush=True)
    with llm:
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(_prompt(llm, 16))
        token = int(np.argmax(llm.last_logits()))
        print(json.dumps({"prompt_s": time.perf_counter() - t0}), flush=True)
        for step in range(n - 1):
            read0, t0 = read_bytes_of_process(), time.perf_counter()
            llm.eval([token])
            token = int(np.argmax(llm.last_logits()))
            print(json.dumps({"step": step, "s": time.perf_counter() - t0,
                              "mb": (read_bytes_of_process() - read0) / 2**20}), flush=True)


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[4])
        return 0
    if len(sys.argv) < 5:
        print(__doc__, file=sys.stderr)
        return 2
    model, cap_mb, n, configs = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
    from hobbitpy.system.disk import drop_from_page_cache
    from hobbitpy.system.memory_cgroup import MemoryCap

    cap = MemoryCap.create(f"decode-per-token-{os.getpid()}")
    if cap is None:
        print("no writable memory cgroup here: the cap cannot be set", file=sys.stderr)
        return 2
    try:
        for config in configs:
            subprocess.run(["sync"], check=True)
            for path in pathlib.Path(model).resolve().parent.rglob("*.gguf"):
                drop_from_page_cache(path)
            cap.set_limit(int(cap_mb * 2**20))
            subprocess.run([sys.executable, __file__, "--worker", model, str(n), config], preexec_fn=cap.enter)
            print(json.dumps({"config": config, "times_at_cap": cap.times_at_limit(),
                              "peak_mb": cap.peak_bytes() / 2**20}), flush=True)
    finally:
        cap.remove()
    return 0


if __name__ == "__main__":
    sys.exit(main())
