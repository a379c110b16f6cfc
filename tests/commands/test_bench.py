"""`hobbitpy bench` end to end on a tiny model: every configuration runs in its own
capped process, the report has every figure, the outputs are replaced only with --force."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import hobbitpy

from conftest import MB, default_signals, hobbitpy_cli, tiny_model


def _bench(args, **kw):
    return hobbitpy_cli("bench", *args, timeout=600, **kw)


def test_bench_reports_every_figure(model_dir, tmp_path):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    info = hobbitpy.inspect_model(path)
    budget = 5 * info.expert_bytes / MB
    out = tmp_path / "result"
    p = _bench([str(path), "--caps", "none", "--cap-mb", "700", "--repeats", "2", "-n", "6", "--threads", "2",
                "--prompt-tokens", "16,128,512",
                "--config", f"lru=--cache-mb {budget:.4f} --mode gpu-centric",
                "--config", f"lfu=--policy lfu --cache-mb {budget:.4f} --mode gpu-centric",
                "--out", str(out), "--no-progress"])
    assert p.returncode == 0, p.stderr
    assert "disk:" in p.stdout and "reproduce stock: yes" in p.stdout
    # each run is in the log as it ends: 2 caps x 3 configurations x 2 repeats
    assert len([l for l in p.stdout.splitlines() if l.startswith("run: cap ")]) == 12
    assert "run: cap 700MB lfu: " in p.stdout and " tok/s, load " in p.stdout and " MB read to the first token" in p.stdout
    assert ", first token after a 16-token prompt " in p.stdout
    r = json.loads((out / "bench.json").read_text())
    assert r["disk_bytes_per_s"] > 0 and r["stock_compute_ms"] > 0
    assert [row["cap"] for row in r["rows"]] == ["none", "700MB"]
    for row in r["rows"]:
        assert row["same_output_as_stock"]
        stock, lru, lfu = row["configs"]
        assert [s["config"] for s in row["configs"]] == ["stock", "lru", "lfu"]
        for s in row["configs"]:
            assert s["errors"] == [] and s["decode_tok_s"] > 0 and len(s["all_decode_tok_s"]) == 2
            assert set(s["ttft_ms"]) == {"16", "128", "512"} and min(s["ttft_ms"].values()) > 0 and s["same_output_all_repeats"]
            assert s["ratio_to_stock"] > 0 and s["same_output_as_stock"]
            # the bound is the disk time of the bytes read (at the disk's speed measured around the
            # configuration's runs) plus compute
            assert s["compute_ms_per_token"] > 0 and s["bound_tok_s"] > 0 and s["time_over_bound"] > 0
            assert s["disk_bytes_per_s"] > 0 and s["first_token_read_mb"] >= 0
            assert {n: len(v) for n, v in s["all_ttft_ms"].items()} == {n: s["n_runs"] for n in s["ttft_ms"]}
        assert not stock["offloaded"] and lru["offloaded"] and lfu["offloaded"]
        # every expert of the tiny model fits: stock keeps its whole-batch ubatch (the planner's
        # choice for this file, bench_worker), as do runs with an explicit budget
        assert stock["n_ubatch"] == lru["n_ubatch"] == 512
        assert stock["ratio_to_stock"] == 1.0
        # 5 slots for 4 layers x top-2: the pools miss and read from disk
        assert 0 <= lru["pool_hit_ratio"][0] < 1
        assert lru["runtime_bytes_per_token"] > 0 and lru["runtime_bytes_per_token"] % info.expert_bytes == 0
        assert abs(lru["budget_mb"] - budget) < 1e-3
    png = out / "bench.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # overwrites an earlier result only with --force
    p = _bench([str(path), "--caps", "none", "--repeats", "1", "-n", "2", "--out", str(out), "--no-progress"])
    assert p.returncode == 2 and "only with --force" in p.stderr
    assert json.loads((out / "bench.json").read_text()) == r


def test_bench_bad_input(model_dir, tmp_path):
    path = tiny_model(model_dir, "llama")
    p = _bench([str(tmp_path / "nope.gguf"), "--caps", "none", "--no-progress"])
    assert p.returncode == 2 and "nope.gguf" in p.stderr
    p = _bench([str(path), "--config", "x=--cache-mb", "--no-progress"])
    assert p.returncode == 2 and "bad flags in configuration" in p.stderr
    p = _bench([str(path), "--config", "x=--policy nonsense", "--no-progress"])
    assert p.returncode == 2 and "invalid choice" in p.stderr
    for cap in ("-1", "abc"):  # "abc" was Python's own words: could not convert string to float
        p = _bench([str(path), "--caps", cap, "--no-progress"])
        assert p.returncode == 2 and f"--caps: a cap is a fraction of the model's file in (0, 4], or none; got '{cap}'" \
            in p.stderr, p.stderr
    p = _bench([str(path), "--prompt-tokens", "16,0", "--no-progress"])
    assert p.returncode == 2 and "--prompt-tokens" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_bench_several_models_in_one_command(model_dir, tmp_path):
    a = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    b = tiny_model(model_dir, "qwen2moe")
    out = tmp_path / "both"
    # a missing model is reported before anything runs
    p = _bench([str(a), str(tmp_path / "missing.gguf"), "--caps", "none", "--out", str(out), "--no-progress"])
    assert p.returncode == 2 and "missing.gguf" in p.stderr and not out.exists()
    p = _bench([str(a), str(b), "--caps", "none", "--repeats", "1", "-n", "3", "--threads", "2",
                "--config", "lru=--cache-mb 1", "--out", str(out), "--no-progress"])
    assert p.returncode == 0, p.stderr
    for model in (a, b):
        r = json.loads((out / model.stem / "bench.json").read_text())
        assert r["model"] == str(model.resolve()) and r["rows"][0]["same_output_as_stock"]
        assert [s["config"] for s in r["rows"][0]["configs"]] == ["stock", "lru"]


@pytest.mark.slow
def test_bench_mixed_precision_config(model_dir, tmp_path):
    from hobbitpy.copies.prepare import prepare_companion

    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    low = prepare_companion(path, "Q4_0", out_path=tmp_path / "low.gguf", progress=False)
    info = hobbitpy.inspect_model(path)
    budget = info.expert_bytes_total / 2 / MB
    out = tmp_path / "mixed"
    p = _bench([str(path), "--caps", "none", "--repeats", "1", "-n", "6", "--threads", "2",
                "--config", f"hobbit=--low {low} --cache-mb {budget:.4f} --prefetch-layers 2 --policy hobbit",
                "--out", str(out), "--no-progress"])
    assert p.returncode == 0, p.stderr
    stock, hobbit = json.loads((out / "bench.json").read_text())["rows"][0]["configs"]
    d = hobbit["decode_stats"]
    assert d["n_level"] == 2 and len(d["served"]) == 2
    assert sum(d["served"]) + d["n_skipped"] == 5 * info.n_layer_moe * info.n_expert_used  # 5 decode steps
    assert len(hobbit["pool_hit_ratio"]) == 2


@pytest.mark.slow
def test_bench_frontier_against_uniform_quants(model_dir, tmp_path):
    # stock on the model and on two uniform quants made by llama.cpp's quantizer, a
    # hobbitpy ladder, each scored against stock on the model: the frontier table and PNG
    from hobbitpy.copies.prepare import prepare_companion

    path = tiny_model(model_dir, "llama", n_embd=256)  # rows of whole K-quant blocks
    low = prepare_companion(path, "Q2_K", tmp_path / "experts-Q2_K.gguf", progress=False)
    text = tmp_path / "held-out.txt"
    text.write_text("The keeper climbed the stairs of the tower every evening and lit the lamp. " * 40)
    quant_dir = tmp_path / "quants"
    out = tmp_path / "frontier"
    args = [str(path), "--caps", "none", "--repeats", "1", "-n", "4", "--threads", "2", "--quants", "Q4_K_M,Q2_K",
            "--quant-dir", str(quant_dir), "--quality", str(text), "--quality-tokens", "96",
            "--config", f"q2=--high {low}", "--no-progress"]
    p = _bench(args + ["--out", str(out)])
    assert p.returncode == 0, p.stderr
    assert "frontier, cap none" in p.stdout and "made " in p.stdout
    r = json.loads((out / "bench.json").read_text())
    assert r["quality"]["n_tokens"] == 96 and r["quality"]["reference_perplexity"] > 1
    row = r["rows"][0]
    assert [s["config"] for s in row["configs"]] == ["stock", "Q4_K_M", "Q2_K", "q2"]
    by = {s["config"]: s for s in row["configs"]}
    assert by["stock"]["ppl_increase"] == 0 and by["stock"]["mean_kl"] == 0
    for s in row["configs"]:
        assert s["decode_tok_s"] > 0 and isinstance(s["dominated_by"], list) and s["lossy"] == (s["config"] != "stock")
    # a lossy copy moves the distribution, and its file is smaller
    assert by["Q2_K"]["mean_kl"] > 0 and by["q2"]["mean_kl"] > 0
    # each increase comes with the standard error of its tokens' scatter (stock: none)
    assert by["stock"]["ppl_increase_se"] == 0 and by["Q2_K"]["ppl_increase_se"] > 0 and by["q2"]["ppl_increase_se"] > 0
    assert by["Q2_K"]["file_mb"] < by["Q4_K_M"]["file_mb"] < by["stock"]["file_mb"]
    assert by["q2"]["offloaded"] and not by["Q2_K"]["offloaded"]
    # a configuration that is slower than another and further from the model (its mean KL) is
    # dominated by it, and only then
    for s in row["configs"]:
        for o in row["configs"]:
            beaten = (o["decode_tok_s"] >= s["decode_tok_s"] and o["mean_kl"] <= s["mean_kl"]
                      and (o["decode_tok_s"] > s["decode_tok_s"] or o["mean_kl"] < s["mean_kl"]))
            assert (o["config"] in s["dominated_by"]) == beaten, (s, o)
    assert (out / "frontier.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the quants are kept, each with its record of the file it was made from, and reused, never made again
    made = sorted(quant_dir.iterdir())
    assert sorted(p.suffix for p in made) == [".gguf", ".gguf", ".json", ".json"], made
    p = _bench(args + ["--out", str(tmp_path / "again"), "--caps", "none"])
    assert p.returncode == 0, p.stderr
    assert "reusing" in p.stdout and sorted(quant_dir.iterdir()) == made


@pytest.mark.slow
def test_bench_tunes_for_every_cap(model_dir, tmp_path):
    # --tune runs `tune` at each cap's memory first and benchmarks its pick there as "tuned",
    # scored like every other configuration
    path = tiny_model(model_dir, "llama", n_embd=256)
    tune_text = tmp_path / "tune.txt"
    tune_text.write_text("The miller's daughter carried flour to the bakery at dawn and sang on the way. " * 30)
    quality = tmp_path / "held-out.txt"
    quality.write_text("The keeper climbed the stairs of the tower every evening and lit the lamp. " * 40)
    args = [str(path), "--caps", "--cap-mb", "400", "--repeats", "1", "-n", "4", "--threads", "2",
            "--tune", str(tune_text), "--tune-candidates", "Q4_K_M,Q2_K", "--tune-tokens", "96",
            "--max-kl", "5", "--quality", str(quality), "--quality-tokens", "96", "--no-progress"]
    out = tmp_path / "tuned"
    p = _bench(args + ["--out", str(out)])
    assert p.returncode == 0, p.stderr
    assert "tune for cap 400MB" in p.stdout and "chosen:" in p.stdout
    r = json.loads((out / "bench.json").read_text())
    pick = r["tuned"]["400MB"]
    # every candidate scored, or left out for costing more than a pick within the budget
    assert pick["chosen"] in ("Q4_K_M", "Q2_K")
    assert {c["name"] for c in pick["candidates"] + pick["not_scored"]} == {"Q4_K_M", "Q2_K"}
    row = r["rows"][0]
    assert [s["config"] for s in row["configs"]] == ["stock", "tuned"]
    tuned = row["configs"][1]
    assert tuned["settings"]["high"] == pick["settings"]["high"] and tuned["decode_tok_s"] > 0
    assert tuned["mean_kl"] > 0 and "ppl_increase" in tuned and tuned["lossy"]
    # tune planned the budget the run got (it counts the memory a worker starts with)
    chosen = next(c for c in pick["candidates"] if c["name"] == pick["chosen"])
    assert abs(chosen["budget_mb"] - tuned["budget_mb"]) < 4, (chosen["budget_mb"], tuned["budget_mb"])

    # tuning needs a memory size: a cap of 'none' is refused before any work
    p = _bench([str(path), "--caps", "none", "--tune", str(tune_text), "--out", str(tmp_path / "none")])
    assert p.returncode == 2 and "--tune needs a memory size" in p.stderr
    assert not (tmp_path / "none").exists()


@pytest.mark.slow
def test_bench_never_reports_a_failure_as_a_result(model_dir, tmp_path):
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    # a cap below what the process itself needs is refused before any run, with the figure
    out = tmp_path / "low"
    p = _bench([str(path), "--caps", "0.5", "--repeats", "1", "-n", "2", "--out", str(out), "--no-progress"])
    assert p.returncode == 2 and "is below the" in p.stderr and "MB a run needs" in p.stderr
    assert not out.exists()

    # a configuration whose every run fails (a budget below the minimum: each run refuses it) is
    # marked failed; a configuration whose experts all fit ran stock's path and claims no ratio
    info = hobbitpy.inspect_model(path)
    out = tmp_path / "marked"
    p = _bench([str(path), "--caps", "none", "--cap-mb", "400", "--repeats", "1", "-n", "4", "--threads", "2",
                "--config", "fits=--policy lfu", "--config", "doomed=--cache-mb 0.01",
                "--out", str(out), "--no-progress"])
    assert p.returncode == 0, p.stderr
    r = json.loads((out / "bench.json").read_text())
    none_row, capped = r["rows"]
    fits = {s["config"]: s for s in none_row["configs"]}["fits"]
    assert fits["stock_path"] and "ratio_to_stock" not in fits and not fits["failed"]
    assert info.expert_bytes_total < 400 * MB
    doomed = {s["config"]: s for s in capped["configs"]}["doomed"]
    assert doomed["failed"] and doomed["errors"] and doomed.get("decode_tok_s") is None
    assert "doomed" in p.stdout and "failed:" in p.stdout


def _bench_until_a_worker_runs(model, out, parent):
    """Start a capped bench and return it once a worker runs inside its cgroup."""
    import time

    proc = subprocess.Popen([sys.executable, "-m", "hobbitpy", "bench", str(model), "--caps", "none",
                             "--cap-mb", "400", "--repeats", "20", "-n", "16", "--no-progress", "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=default_signals)
    cgroup = parent / f"hobbitpy-bench-{proc.pid}"
    deadline = time.time() + 120
    while time.time() < deadline:
        tasks = cgroup / "tasks" if (cgroup / "tasks").exists() else cgroup / "cgroup.procs"
        if tasks.exists() and tasks.read_text().split():
            return proc, cgroup
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("no bench worker started within 120 s")


def test_an_interrupted_bench_leaves_no_cgroup_behind(model_dir, tmp_path):
    import os
    import signal

    from hobbitpy.system.memory_cgroup import MemoryCap

    probe = MemoryCap.create(f"hobbitpy-probe-{os.getpid()}")
    assert probe is not None, "no writable memory cgroup: the caps of every bench test would not hold either"
    parent = probe.path.parent
    probe.remove()
    model = tiny_model(model_dir, "llama")
    for i, sig in enumerate((signal.SIGTERM, signal.SIGINT)):
        proc, cgroup = _bench_until_a_worker_runs(model, tmp_path / f"out{i}", parent)
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 130
        assert not cgroup.exists(), f"{sig!r} left {cgroup}"
    # SIGKILL leaves no time to clean up: the next bench removes what the dead one left
    proc, cgroup = _bench_until_a_worker_runs(model, tmp_path / "out-kill", parent)
    proc.kill()
    proc.wait(timeout=60)
    assert cgroup.exists()
    again = MemoryCap.create(f"hobbitpy-bench-{os.getpid()}")
    try:
        assert not cgroup.exists()
    finally:
        again.remove()


@pytest.mark.slow
def test_bench_beam_search_against_stocks(model_dir, tmp_path):
    # Fiddler's beam case: every run decodes with a beam search of 4 beams; hobbitpy's beams are stock's
    path = tiny_model(model_dir, "llama", n_layer=4, n_expert=8, n_expert_used=2)
    info = hobbitpy.inspect_model(path)
    budget = 5 * info.expert_bytes / MB
    out = tmp_path / "beams"
    p = _bench([str(path), "--caps", "none", "--repeats", "1", "-n", "6", "--threads", "2", "--beams", "4",
                "--config", f"lru=--cache-mb {budget:.4f} --mode gpu-centric", "--out", str(out), "--no-progress"])
    assert p.returncode == 0, p.stderr
    assert "a beam search of 4 beams" in p.stdout and "reproduce stock: yes" in p.stdout
    stock, lru = json.loads((out / "bench.json").read_text())["rows"][0]["configs"]
    assert stock["decode_tok_s"] > 0 and lru["decode_tok_s"] > 0 and lru["same_output_as_stock"]
    assert len(lru["generated"]) == 6
    # each step selects the union of four tokens' experts: more than one token's top-k
    assert lru["decode_stats"]["expert_hits"] + lru["decode_stats"]["expert_misses"] > 5 * info.n_layer_moe * 2


def test_a_configuration_is_lossy_when_it_substitutes_or_serves_another_precision():
    """bench checks only the exact configurations against stock's tokens: a preset that
    substitutes experts (importance) must not count as exact (it printed a false "NO")."""
    from hobbitpy.bench.bench_plan import BenchConfig, is_lossy
    from hobbitpy.cli.bench import parse_bench_config

    assert not is_lossy(parse_bench_config("lru=--preset lru"))
    assert not is_lossy(parse_bench_config("fate-exact=--policy arc --shallow-layers 1 --prefill-order popularity"))
    assert is_lossy(parse_bench_config("importance=--preset importance"))
    assert is_lossy(parse_bench_config("sub=--substitute 0.1"))
    assert is_lossy(parse_bench_config("mixed=--low Q2_K"))
    assert is_lossy(parse_bench_config("ladder=--high Q4_K"))
    assert is_lossy(BenchConfig("q3", None, model="other.gguf"))
