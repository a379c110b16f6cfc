"""The planner's memory: the context's buffers estimated from the model's hyperparameters
cover what llama.cpp really allocates, and a run whose budget the planner derived under
a memory cap never runs into that cap."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

import hobbitpy
from hobbitpy.plan.memory import ContextShape, context_sizes

from conftest import ARCHES, MB, PROMPT, tiny_model

LLAMA_SIZES = """
import sys, hobbitpy
llm = hobbitpy.Llama(sys.argv[1], offload=hobbitpy.OffloadConfig(enabled=False), n_ctx=int(sys.argv[2]),
                     n_batch=int(sys.argv[3]), n_ubatch=int(sys.argv[4]), logits_all=sys.argv[5] == "1", verbose=True)
"""


def llama_cpp_buffers(path, n_ctx, n_batch, n_ubatch, logits_all) -> dict[str, float]:
    """MiB of the KV and compute buffers, as llama.cpp logs them when it makes a context
    (a model with sliding-window layers has two KV caches)."""
    p = subprocess.run([sys.executable, "-c", LLAMA_SIZES, str(path), str(n_ctx), str(n_batch), str(n_ubatch),
                        str(int(logits_all))], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    sizes = {}
    for kind in ("KV", "compute"):
        found = re.findall(rf"CPU\s+{kind} buffer size =\s+([\d.]+) MiB", p.stderr)
        assert found, f"no {kind} buffer in llama.cpp's log:\n{p.stderr[-3000:]}"
        # the compute buffer is logged twice (reserved, and freed with the context)
        sizes[kind] = sum(float(x) for x in found) if kind == "KV" else float(found[0])
    return sizes


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("n_ctx,n_batch,n_ubatch,logits_all", [(512, 512, 512, False), (256, 256, 32, True),
                                                                (128, 512, 1, False)])
def test_context_estimate_covers_llama_cpp_buffers(model_dir, arch, n_ctx, n_batch, n_ubatch, logits_all):
    path = tiny_model(model_dir, arch)
    info = hobbitpy.inspect_model(path)
    est = context_sizes(info, ContextShape(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, logits_all=logits_all))
    real = llama_cpp_buffers(path, n_ctx, n_batch, n_ubatch, logits_all)
    assert est.kv / MB >= real["KV"] - 0.01
    assert est.compute / MB >= real["compute"] - 0.01
    # an estimate, not a guess: within 50 % (plus 1 MB for the graph's fixed part)
    assert est.compute / MB <= 1.5 * real["compute"] + 1.0
    assert est.kv / MB <= 1.5 * real["KV"] + 0.1


@pytest.mark.slow
def test_run_with_a_derived_budget_never_reaches_its_cap(model_dir, tmp_path):
    # experts large enough that the cap, not the process, decides the budget
    path = tiny_model(model_dir, "llama", n_embd=256, n_ff=1024, n_expert=32)
    info = hobbitpy.inspect_model(path)
    out = tmp_path / "b"
    # the stock run with no cap tells what the process needs with every expert in memory;
    # the cap then leaves room for about half of the experts
    p = subprocess.run([sys.executable, "-m", "hobbitpy", "bench", str(path), "--caps", "none", "--repeats", "1",
                        "-n", "4", "--threads", "2", "--no-progress", "--out", str(out), "--config", "lru"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    peak = json.loads((out / "bench.json").read_text())["rows"][0]["configs"][0]["peak_mb"]
    cap_mb = peak - info.expert_bytes_total / MB / 2 + 40  # + the context and slack the planner keeps
    out2 = tmp_path / "c"
    # the fate preset reads a prompt's least popular experts from the Q2_K copy: two levels under the cap
    if not path.with_name(f"{path.stem}.experts-Q2_K.gguf").exists():
        from hobbitpy.copies.prepare import prepare_companion

        prepare_companion(path, "Q2_K", progress=False)
    # (lru: the model's own experts through an LRU cache, --exact: what the default measures on
    # its first run, a ladder, is test_default_ladder's)
    p = subprocess.run([sys.executable, "-m", "hobbitpy", "bench", str(path), "--caps", "--cap-mb", f"{cap_mb:.1f}",
                        "--repeats", "2", "-n", "8", "--threads", "2", "--no-progress", "--out", str(out2),
                        "--config", "lru=--exact", "--config", "fate=--preset fate"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    configs = json.loads((out2 / "bench.json").read_text())["rows"][0]["configs"]
    lru, fate = configs[1], configs[2]
    if lru.get("times_at_cap") is None:
        pytest.fail("no memory cgroup here: the cap cannot be checked")
    # fate: a pool per layer, each a fraction of the shared one; the prompt's ubatches select
    # more experts in a layer than its pool holds, and the page cache has no room to compute
    # the rest in place on the mapped file: they go through the pool in waves
    for run in (lru, fate):
        assert run["errors"] == [] and run["offloaded"]
        assert info.min_budget_bytes / MB <= run["budget_mb"] < info.expert_bytes_total / MB
        assert run["times_at_cap"] == 0, run
        assert run["peak_mb"] < cap_mb
    # the prompt went through ubatches narrower than the batch, to give the experts more
    n_ubatch = re.search(r"ubatches of (\d+) tokens", lru["plan"])
    assert n_ubatch and int(n_ubatch.group(1)) < 128, lru["plan"]  # the batch holds the long prompt's 128


def test_a_ubatch_left_open_narrows_only_when_the_experts_do_not_all_fit(model_dir):
    from hobbitpy.plan.memory import (COMPUTE_SHARE, HEADROOM_SHARE, SLACK_BYTES, fit_ubatch, headroom_bytes,
                                      io_buffer_bytes, plan_offload)

    path = tiny_model(model_dir, "llama", n_embd=256, n_ff=1024, n_expert=32)
    info = hobbitpy.inspect_model(path)
    shape = ContextShape(n_ctx=512, n_batch=512)
    auto = hobbitpy.OffloadConfig()

    def sizes(n_ubatch):
        return context_sizes(info, ContextShape(n_ctx=512, n_batch=512, n_ubatch=n_ubatch))

    # plenty of memory: the whole batch, as llama.cpp would have it
    assert fit_ubatch(info, shape, auto, available_bytes=64 * 1024 * MB) == 512
    # asked for, or a budget given, or no offload: what was asked
    assert fit_ubatch(info, ContextShape(n_ctx=512, n_batch=512, n_ubatch=128), auto, available_bytes=MB) == 128
    assert fit_ubatch(info, shape, hobbitpy.OffloadConfig(cache_mb=8), available_bytes=MB) == 512
    assert fit_ubatch(info, shape, hobbitpy.OffloadConfig(enabled=False), available_bytes=MB) == 512
    # short of memory (room for 12 ubatches of 64 tokens, fewer bytes than the experts'): 64
    # tokens, whose buffer is within its share of the memory beside the rest, 128 would not be
    other = info.resident_bytes + sizes(512).kv + sizes(512).logits + io_buffer_bytes(auto, (info,)) + SLACK_BYTES
    # (the headroom a derived budget leaves is a share of the memory)
    available = int((other + 12 * sizes(64).compute) / (1 - HEADROOM_SHARE)) + 1
    other += headroom_bytes(available)
    assert 12 * sizes(64).compute < info.expert_bytes_total + sizes(64).compute
    assert fit_ubatch(info, shape, auto, available_bytes=available) == 64
    assert sizes(64).compute <= COMPUTE_SHARE * (available - other) < sizes(128).compute
    # ... and the experts get what the narrower buffer leaves
    narrow = plan_offload(info, auto, sizes(64).total, available_bytes=available).budget_bytes
    assert narrow is not None and narrow > available - other - sizes(128).compute


@pytest.mark.parametrize("arch,expert_type", [(arch, "Q8_0") for arch in ARCHES] + [("llama", "Q4_K"), ("llama", "IQ4_NL")])
def test_stock_logits_do_not_depend_on_the_ubatch(model_dir, arch, expert_type):
    # what lets the planner narrow a ubatch the caller left open without a bit of difference
    # (also for the types the CPU repacks: its mul_mat_id multiplies them row by row)
    import numpy as np

    path = tiny_model(model_dir, arch, **({} if expert_type == "Q8_0" else dict(expert_type=expert_type, n_embd=256,
                                                                                  n_ff=512)))
    logits = []
    for n_ubatch in (512, 32, 7):
        llm = hobbitpy.Llama(path, offload=False, n_ctx=256, n_batch=256, n_ubatch=n_ubatch, logits_all=True,
                             verbose=False, n_threads=2)
        tokens = llm.tokenize((PROMPT * 4).encode())
        llm.eval(tokens)
        logits.append(np.array(llm.scores[:len(tokens)]))
        llm.close()
    assert len(tokens) > 32
    assert all(np.array_equal(logits[0], other) for other in logits[1:])


def test_page_cache_no_process_maps_counts_as_free_whichever_list_it_is_on(tmp_path):
    """A cgroup's clean, unmapped file pages are free to a new run, active or inactive: the
    kernel reclaims both lists (which list holds a page depends on how often and how recently
    it was read, and counting one list made a run's budget hang on that timing)."""
    from hobbitpy.plan.memory import _reclaimable_file_bytes

    stat = tmp_path / "memory.stat"
    stat.write_text("total_cache 900\ntotal_active_file 500\ntotal_inactive_file 300\ntotal_mapped_file 150\n"
                    "total_dirty 40\ntotal_writeback 10\n")
    assert _reclaimable_file_bytes(stat, "total_", ("mapped_file", "dirty", "writeback")) == 600
    stat.write_text("active_file 500\ninactive_file 0\nfile_mapped 600\nfile_dirty 0\nfile_writeback 0\n")
    assert _reclaimable_file_bytes(stat, "", ("file_mapped", "file_dirty", "file_writeback")) == 0


def test_a_run_after_another_in_its_cgroup_finds_the_same_memory(tmp_path):
    """The page cache a finished run left charged to the cgroup (read twice: most of it on the
    active list) is counted as free by the next run, as it is after a reclaim."""
    from hobbitpy.system.memory_cgroup import MemoryCap

    data = tmp_path / "data.bin"
    data.write_bytes(b"\1" * (96 * MB))
    cap = MemoryCap.create(f"hobbitpy-test-reclaim-{os.getpid()}")
    if cap is None:
        pytest.fail("no writable memory cgroup here: the test needs one")
    probe = "from hobbitpy.plan.memory import available_memory_bytes; print(available_memory_bytes())"
    try:
        cap.set_limit(512 * MB)  # reclaims whatever the cgroup held
        fresh = int(subprocess.run([sys.executable, "-c", probe], preexec_fn=cap.enter, capture_output=True,
                                   text=True, timeout=60, check=True).stdout)
        for _ in range(2):
            subprocess.run(["cat", str(data)], preexec_fn=cap.enter, stdout=subprocess.DEVNULL, check=True, timeout=60)
        after = int(subprocess.run([sys.executable, "-c", probe], preexec_fn=cap.enter, capture_output=True,
                                   text=True, timeout=60, check=True).stdout)
    finally:
        cap.remove()
    # the probes hold the same interpreter; 8 MB for the kernel's bookkeeping of 96 MB of cache
    assert abs(after - fresh) < 8 * MB, (fresh / MB, after / MB)


def test_a_gpu_holding_every_layer_sizes_the_cache_by_its_free_memory(model_dir):
    # a discrete GPU with every layer on it (-ngl -1): the pools live there, so its free memory, not
    # the host's, decides whether the experts are offloaded and how large their cache is
    from hobbitpy.errors import BudgetError
    from hobbitpy.plan.memory import plan_offload

    info = hobbitpy.inspect_model(tiny_model(model_dir, "qwen3moe"))
    auto, context = hobbitpy.OffloadConfig(), 8 * MB
    host = 64 * 1024 * MB  # every expert fits the host many times over
    assert plan_offload(info, auto, context, available_bytes=host).budget_bytes is None
    fixed = info.resident_bytes + context + 24 * MB  # what the GPU holds beside the pools (and slack)
    small_gpu = fixed + info.expert_bytes_total // 2
    plan = plan_offload(info, auto, context, available_bytes=host, gpu_bytes=small_gpu)
    assert plan.budget_bytes is not None and plan.budget_bytes < info.expert_bytes_total // 2, plan
    assert plan.budget_bytes >= info.min_budget_bytes and "on the GPU" in plan.reason
    assert plan.page_cache_room_bytes > host // 2  # the host keeps only the readers' buffers
    big_gpu = 4 * (fixed + info.expert_bytes_total)
    plan = plan_offload(info, auto, context, available_bytes=host, gpu_bytes=big_gpu)
    assert plan.budget_bytes is None and "fit in the GPU's" in plan.reason
    with pytest.raises(BudgetError, match="not enough GPU memory.*-ngl"):
        plan_offload(info, auto, context, available_bytes=host, gpu_bytes=fixed)
    # an expert cache size given is the user's: the runtime checks it against the device
    assert plan_offload(info, hobbitpy.OffloadConfig(cache_mb=8), context, available_bytes=host,
                        gpu_bytes=fixed).budget_bytes == 8 * MB


def test_without_a_gpu_of_its_own_the_host_memory_plans(model_dir):
    # this machine: no GPU, so no layer count puts the pools on one
    from hobbitpy.system.devices import gpu_free_bytes

    assert gpu_free_bytes(True) is None and gpu_free_bytes(False) is None
    llm = hobbitpy.Llama(tiny_model(model_dir, "qwen3moe"), n_gpu_layers=-1, cache_mb=2, verbose=False)
    try:
        assert "on the GPU" not in llm.offload_plan.reason
    finally:
        llm.close()


def test_weights_are_repacked_only_where_the_file_fits_beside_the_copy(model_dir):
    # stock's best setting for the memory: llama.cpp's CPU backend copies Q4_0/Q4_K/IQ4_NL weights
    # repacked into memory of its own; a file that does not fit beside that copy runs mapped
    # (--no-repack), whether the run is a user's with offload off or the reference quality scores
    from hobbitpy.plan.run_plan import REPACK_ROOM, plan_run

    info = hobbitpy.inspect_model(tiny_model(model_dir, "qwen3moe"))
    shape = ContextShape(n_ctx=64, n_batch=64, n_ubatch=64)
    stock = hobbitpy.OffloadConfig(enabled=False)
    roomy = 64 * info.file_bytes + 256 * MB
    assert plan_run(info, stock, shape, roomy).repack
    tight = int(REPACK_ROOM * info.file_bytes) - 1
    assert not plan_run(info, stock, shape, tight).repack
    # offloaded, the same: the pools follow the weights (test_exactness.py), so an offloaded run
    # computes with the kernels of stock's best run in that memory
    offloaded = plan_run(info, hobbitpy.OffloadConfig(cache_mb=2), shape, tight)
    assert offloaded.offloaded and not offloaded.repack
    assert plan_run(info, hobbitpy.OffloadConfig(cache_mb=2), shape, roomy).repack
