"""Loading with offload reads no expert data: the routed expert bytes of the file stay
out of the page cache (no MADV_WILLNEED / MAP_POPULATE, no repack copy, no mlock)."""

from __future__ import annotations

import ctypes
import mmap
import os
import shutil

import hobbitpy
from conftest import MB, expert_tensor_spans, tiny_model

PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def resident_fraction(path, start: int, end: int) -> float:
    """Share of the pages of bytes [start, end) of the file that are in the page cache
    (mincore on a fresh mapping, which itself touches no page)."""
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        base = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert base not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            first = start // PAGE
            n_pages = (end + PAGE - 1) // PAGE - first
            vec = (ctypes.c_ubyte * n_pages)()
            assert _libc.mincore(base + first * PAGE, n_pages * PAGE, vec) == 0, os.strerror(ctypes.get_errno())
            return sum(v & 1 for v in vec) / n_pages
        finally:
            _libc.munmap(base, size)
    finally:
        os.close(fd)


def drop_from_page_cache(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_offloaded_load_leaves_expert_bytes_on_disk(model_dir, tmp_path):
    path = tmp_path / "fresh.gguf"
    source = tiny_model(model_dir, "llama", n_layer=8)
    shutil.copy(source, path)
    # the generator writes the routed experts last, after every other tensor
    expert_start = expert_tensor_spans(source)[0][0]
    end = os.path.getsize(path)

    drop_from_page_cache(path)
    assert resident_fraction(path, expert_start, end) < 0.05  # the drop worked

    info = hobbitpy.inspect_model(path)
    llm = hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / 2 / MB, mode="gpu-centric"),
                         n_ctx=64, verbose=False)
    try:
        assert llm.offloaded
        # the non-expert weights were mapped and prefetched as usual; the expert bytes
        # were not touched (a page or two may be shared with the tensor before them)
        assert resident_fraction(path, expert_start, end) < 0.05
        assert llm.offload_stats()["bytes_read"] == 0
    finally:
        llm.close()

    # the same check can fail: stock llama.cpp prefetches the whole mapping at load
    drop_from_page_cache(path)
    stock = hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(enabled=False), n_ctx=64, verbose=False)
    try:
        stock.create_completion("Hello", max_tokens=4, temperature=0.0)
        assert resident_fraction(path, expert_start, end) > 0.5
    finally:
        stock.close()


def test_a_ladder_leaves_the_models_expert_bytes_on_disk_when_checking_its_companion(model_dir, tmp_path):
    # the companion records the fingerprint of the model it was made of; checking it reads
    # the first and last 4 KB of every expert tensor of the model, without the readahead that
    # once pulled megabytes of the model's experts into the page cache (charged to a cap,
    # counted by no budget: 4.4 MB of the inflated ref-mixtral's, 288 KB since)
    from hobbitpy.copies.prepare import prepare_companion

    path = tmp_path / "fresh.gguf"
    source = tiny_model(model_dir, "llama", n_layer=8)
    shutil.copy(source, path)
    high = prepare_companion(path, "Q4_0", tmp_path / "high.gguf", progress=False)
    spans = expert_tensor_spans(source)
    expert_start, n_expert_tensors = spans[0][0], len(spans)
    end = os.path.getsize(path)
    drop_from_page_cache(path)
    assert resident_fraction(path, expert_start, end) < 0.05
    info = hobbitpy.inspect_model(path)
    with hobbitpy.Llama(path, high=str(high), cache_mb=info.expert_bytes_total / 4 / MB, n_ctx=64, verbose=False) as llm:
        llm.create_completion("Hello", max_tokens=4, temperature=0.0)
        assert llm.offload_stats()["bytes_read"] > 0  # the experts came from the companion
        n_pages = (end - expert_start) // PAGE
        # the two 4 KB reads of each tensor, at most two pages each (they need not be aligned)
        assert resident_fraction(path, expert_start, end) * n_pages <= 4 * n_expert_tensors + 1


def test_stock_without_repacking_keeps_the_weights_mapped(model_dir, capfd):
    """repack=False is llama.cpp's --no-repack: a capped stock run's best setting (bench), where the
    CPU backend's repacked copy of Q4_K weights cannot fit beside the mapping."""
    path = tiny_model(model_dir, "llama", expert_type="Q4_K", n_embd=256, n_ff=512)
    logs = {}
    for repack in (True, False):
        capfd.readouterr()
        llm = hobbitpy.Llama(path, offload=False, n_ctx=64, verbose=True, repack=repack)
        llm("Once upon a time", max_tokens=2, temperature=0.0)
        llm.close()
        logs[repack] = capfd.readouterr().err
    assert "CPU_REPACK model buffer" in logs[True]
    assert "CPU_REPACK model buffer" not in logs[False] and "CPU_Mapped model buffer" in logs[False]
