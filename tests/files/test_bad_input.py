"""Bad input gets a clear error naming the file and the problem; nothing crashes,
hangs or returns garbage."""

from __future__ import annotations

import os
import pathlib
import select
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import hobbitpy
from conftest import MB, expert_tensor_spans, hobbitpy_cli, model_without_byte_tokens, tiny_model

CLI = [sys.executable, "-m", "hobbitpy", "run"]


def cli(*args, timeout=300):
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True, timeout=timeout)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(hobbitpy.ModelFileError, match=r"nope\.gguf: cannot open model file: No such file"):
        hobbitpy.Llama(path)
    proc = cli(path, "--prompt", "hi")
    assert proc.returncode == 2
    assert f"{path}: cannot open model file: No such file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(hobbitpy.ModelFileError, match="is a directory"):
        hobbitpy.inspect_model(tmp_path)


def test_unreadable_file(model_dir, tmp_path):
    path = tmp_path / "locked.gguf"
    shutil.copy(tiny_model(model_dir, "llama"), path)
    path.chmod(0)
    if os.geteuid() != 0:
        with pytest.raises(hobbitpy.ModelFileError, match="Permission denied"):
            hobbitpy.inspect_model(path)
        return
    # root reads anything: check as an unprivileged user in a forked child
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a child that cannot finish dies instead of hanging the suite
        os.close(read_fd)
        try:
            os.setgid(65534)
            os.setuid(65534)
            hobbitpy.inspect_model(path)
            msg = "no error"
        except Exception as e:  # noqa: BLE001 - reported to the parent
            msg = f"{type(e).__name__}: {e}"
        os.write(write_fd, msg.encode())
        os._exit(0)
    os.close(write_fd)
    ready, _, _ = select.select([read_fd], [], [], 90)
    msg = os.read(read_fd, 4096).decode() if ready else "child timed out"
    os.waitpid(pid, 0)
    assert msg.startswith("ModelFileError"), msg
    assert str(path) in msg and "Permission denied" in msg


def test_not_a_gguf(tmp_path):
    path = tmp_path / "notes.gguf"
    path.write_text("these are my notes, not a model\n")
    with pytest.raises(hobbitpy.ModelFileError, match=r"notes\.gguf: not a GGUF file"):
        hobbitpy.Llama(path)
    assert path.read_text() == "these are my notes, not a model\n"  # untouched

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(hobbitpy.ModelFileError, match="not a GGUF file"):
        hobbitpy.inspect_model(empty)

    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(hobbitpy.ModelFileError, match="header is corrupt or truncated"):
        hobbitpy.inspect_model(corrupt)


def test_truncated_file(model_dir, tmp_path):
    src = tiny_model(model_dir, "llama")
    path = tmp_path / "cut.gguf"
    path.write_bytes(src.read_bytes()[: src.stat().st_size // 2])
    with pytest.raises(hobbitpy.ModelFileError, match=r"cut\.gguf: truncated: tensor '.*' ends at byte \d+ but the file has \d+ bytes"):
        hobbitpy.Llama(path)
    proc = cli(path, "--prompt", "hi", "--no-offload")
    assert proc.returncode == 2 and "truncated" in proc.stderr and "Traceback" not in proc.stderr


def test_dense_model_runs_without_offload(model_dir):
    path = tiny_model(model_dir, "llama", n_expert=0)
    llm = hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=1), n_ctx=64, verbose=False)
    try:
        assert not llm.offloaded
        assert "dense model" in llm.offload_plan.reason
        out = llm.create_completion("Hello", max_tokens=4, temperature=0.0)["choices"][0]["text"]
        assert len(out) > 0
    finally:
        llm.close()
    proc = cli(path, "--prompt", "Hello", "-n", "4", "--temp", "0", "--cache-mb", "1")
    assert proc.returncode == 0, proc.stderr
    assert "dense model (no routed experts): running it without offload" in proc.stderr
    # no hint to run the experts through a cache: there are none (and --cache-mb was given)
    assert "--cache-mb N runs the experts" not in proc.stderr
    plain = cli(path, "--prompt", "Hello", "-n", "4", "--temp", "0")
    assert plain.returncode == 0 and "--cache-mb N runs the experts" not in plain.stderr


def test_budget_below_minimum(model_dir):
    path = tiny_model(model_dir, "llama")
    info = hobbitpy.inspect_model(path)
    min_mb = info.min_budget_bytes / MB
    with pytest.raises(hobbitpy.BudgetError, match=rf"below the minimum of {min_mb:.1f} MB"):
        hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=min_mb * 0.9))
    proc = cli(path, "--prompt", "hi", "--cache-mb", f"{min_mb * 0.5:.3f}")
    assert proc.returncode == 2
    assert f"below the minimum of {min_mb:.1f} MB" in proc.stderr and str(path) in proc.stderr


def test_bad_arguments(model_dir, tmp_path):
    path = tiny_model(model_dir, "llama")
    assert cli(path, "--prompt", "hi", "--cache-mb", "1", "--no-offload").returncode == 2
    proc = cli(path, "--prompt", "hi", "--cache-mb", "-3")
    assert proc.returncode == 2 and "--cache-mb must be positive" in proc.stderr
    proc = cli(path, "--prompt", "hi", "--stats-json", tmp_path / "no" / "such" / "dir" / "s.json")
    assert proc.returncode == 2 and "cannot write there" in proc.stderr

    # stock llama.cpp serves every expert: a technique, a preset or a profile would be ignored
    for flags, named in ((["--low", "Q2_K"], "--low"), (["--preset", "hobbit"], "--preset"),
                         (["--policy", "lfu", "--t1", "0.5"], "--policy, --t1")):
        proc = cli(path, "--prompt", "hi", "--no-offload", *flags)
        assert proc.returncode == 2 and f"{named} cannot go with --no-offload" in proc.stderr, proc.stderr[-400:]


# (change, mode): the model's file cut at its experts, cut to nothing (the resident weights
# too: a SIGBUS in the compute threads before, in every mode), written over in place
# (generation stopped silently, exit 0, before), or written in the middle of one expert tensor,
# between the fingerprint's samples of its first and last 4 KB (served on, mixed, before)
# one case per change in the README's run; the other modes of each in the slow one
_slow = pytest.mark.slow
FILE_CHANGES = [("cut at the experts", "gpu-centric"), pytest.param("cut at the experts", "cooperative", marks=_slow),
                pytest.param("cut to nothing", "gpu-centric", marks=_slow), ("cut to nothing", "cooperative"),
                pytest.param("cut to nothing", "auto", marks=_slow), pytest.param("cut to nothing", "balanced", marks=_slow),
                pytest.param("overwritten in place", "gpu-centric", marks=_slow),
                pytest.param("overwritten in place", "cooperative", marks=_slow), ("overwritten in place", "balanced"),
                ("written between the samples", "cooperative"),
                pytest.param("written between the samples", "gpu-centric", marks=_slow)]


@pytest.mark.parametrize("change,mode", FILE_CHANGES)
def test_a_model_cut_or_overwritten_while_running_is_an_error_never_a_signal(model_dir, tmp_path, change, mode):
    """The model file changes under a decoding process: the next ubatch (or the mapping guard,
    for a read of the mapping past the new end) fails the decode with an error that names the
    file and says what happened; no signal, no hang, no silent stop; the object closes cleanly."""
    path = tmp_path / "victim.gguf"
    source = tiny_model(model_dir, "llama")
    shutil.copy(source, path)
    expert_start, expert_bytes = expert_tensor_spans(source)[0]
    info = hobbitpy.inspect_model(path)
    if change == "overwritten in place":  # other experts of the same size, nothing cut
        disturb = (f"with open({str(path)!r}, 'r+b') as f:\n"
                   f"    f.seek({expert_start}); f.write(os.urandom({path.stat().st_size - expert_start}))")
        why = "overwritten while running"
    elif change == "written between the samples":
        middle = expert_start + 64 * 1024
        assert expert_bytes >= middle - expert_start + 4096 + 4096  # clear of the last 4 KB sampled
        disturb = (f"with open({str(path)!r}, 'r+b') as f:\n"
                   f"    f.seek({middle}); f.write(os.urandom(4096))")
        why = "written to while running"
    else:
        disturb = f"os.truncate({str(path)!r}, {0 if change == 'cut to nothing' else expert_start})"
        why = "truncated while running"

    script = textwrap.dedent(f"""
        import os, hobbitpy
        # half the experts: decode keeps missing, and runs experts in place where the mode does
        llm = hobbitpy.Llama({str(path)!r}, n_ctx=256, verbose=False,
                             offload=hobbitpy.OffloadConfig(cache_mb={info.expert_bytes_total / 2 / MB!r},
                                                            mode={mode!r}))
        llm.eval(llm.tokenize(b"Hi"))
    """) + disturb + textwrap.dedent("""
        try:
            for t in range(200):
                llm.eval([1000 + 37 * t])
            print("NO ERROR")
        except hobbitpy.ExpertReadError as e:
            print("ERROR:", e)
        llm.close()
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-2000:]}"
    assert "ERROR: an expert could not be read during decode:" in proc.stdout, proc.stdout + proc.stderr
    assert str(path) in proc.stdout and why in proc.stdout, proc.stdout


@pytest.mark.parametrize("change,mode", [("renamed over", "cooperative"), ("removed", "cooperative"),
                                         ("renamed over", "gpu-centric"), ("removed", "auto")])
def test_a_model_replaced_or_removed_while_running_serves_the_file_it_opened(model_dir, tmp_path, change, mode):
    """The safe way to update a model (write a new file, rename it over the old) and `rm` leave
    the file a running process opened and maps intact: it decodes on, with the bits of a run
    nothing disturbed, in each mode (the runtime asks the open file its size and identity, not the path)."""
    path = tmp_path / "model.gguf"
    shutil.copy(tiny_model(model_dir, "llama"), path)
    info = hobbitpy.inspect_model(path)
    offload = hobbitpy.OffloadConfig(cache_mb=info.expert_bytes_total / 2 / MB, mode=mode)

    def decode(disturb: bool):
        llm = hobbitpy.Llama(str(path), n_ctx=256, verbose=False, logits_all=True, offload=offload)
        try:
            llm.eval(llm.tokenize(b"Once upon a time"))
            in_place_before = llm.offload_stats()["expert_inplace"]
            if disturb and change == "removed":
                os.remove(path)
            elif disturb:
                new = tmp_path / "model.gguf.new"
                new.write_bytes(path.read_bytes()[:1024])  # another file: a rename makes the path name it
                os.replace(new, path)
            for t in range(24):
                llm.eval([1000 + 37 * t])
            in_place_after = llm.offload_stats()["expert_inplace"] - in_place_before
            return np.array(llm.scores[: llm.n_tokens], np.float32), in_place_after
        finally:
            llm.close()

    undisturbed, _ = decode(False)
    scores, in_place_after = decode(True)
    if mode == "cooperative":
        assert in_place_after > 0  # experts really ran on the mapping after the change
    assert np.array_equal(scores.view(np.uint32), undisturbed.view(np.uint32))


def test_lora_with_offload_is_refused_clearly(model_dir, tmp_path):
    path = tiny_model(model_dir, "llama")
    adapter = tmp_path / "adapter.gguf"
    adapter.write_bytes(b"GGUF")  # never read: refused before loading
    with pytest.raises(hobbitpy.HobbitError, match="LoRA adapters are not supported with expert offload"):
        hobbitpy.Llama(path, offload=hobbitpy.OffloadConfig(cache_mb=1), lora_path=str(adapter), verbose=False)


BAD_HPARAMS = [  # key, value, what the error says (llama.cpp would abort in load_hparams)
    ("llama.expert_used_count", 0, "llama.expert_used_count is 0; llama.cpp needs 1..8"),
    ("llama.expert_used_count", 9, "llama.expert_used_count is 9; llama.cpp needs 1..8"),
    # the same checks at the ends of the integer's range: in the slow run
    pytest.param("llama.expert_used_count", 0xFFFFFFFF, "llama.expert_used_count is 4294967295", marks=pytest.mark.slow),
    ("llama.block_count", 600, "llama.block_count is 600; llama.cpp needs 1..512"),
    pytest.param("llama.block_count", 5_000_000, "llama.block_count is 5000000", marks=pytest.mark.slow),
    pytest.param("llama.block_count", 2**31 - 1, "llama.block_count is 2147483647", marks=pytest.mark.slow),
    ("llama.expert_count", 2000, "llama.expert_count is 2000; llama.cpp needs 0..1024"),
    ("llama.expert_used_count", None, "llama.expert_used_count is missing; llama.cpp needs 1..8"),
]


def _with_hparam(src: pathlib.Path, dst: pathlib.Path, key: str, value) -> pathlib.Path:
    """A copy of a GGUF with one integer key set to value (or removed: None), through gguf-py."""
    if value is None:
        subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--force", "--remove-metadata", key, str(src),
                        str(dst)], check=True, capture_output=True, timeout=120)
        return dst
    shutil.copy(src, dst)
    from gguf import GGUFReader

    reader = GGUFReader(str(dst), "r+")
    field = reader.fields[key]
    field.parts[field.data[0]][0] = value  # the same width (uint32) in place
    reader.data.flush()
    return dst


@pytest.fixture(scope="module")
def letters_model(tmp_path_factory) -> pathlib.Path:
    """A tiny MoE (8 experts, top-2) whose vocabulary is 55 tokens: gguf-py rewrites one of its
    keys in milliseconds, where the 32,000 tokens of the others take it seconds to parse."""
    return model_without_byte_tokens(tmp_path_factory.mktemp("letters"))


@pytest.mark.parametrize("key,value,message", BAD_HPARAMS)
def test_metadata_llama_cpp_asserts_on_is_one_clear_error(letters_model, tmp_path, key, value, message):
    src = letters_model
    bad = _with_hparam(src, tmp_path / "bad.gguf", key, value)
    p = cli(str(bad), "-p", "hello", "-n", "1", "--cache-mb", "64", timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-500:])
    assert message in p.stderr and str(bad) in p.stderr and "Traceback" not in p.stderr
    # the host process of the Python API survives it
    probe = ("import hobbitpy, sys\ntry:\n    hobbitpy.Llama(sys.argv[1], cache_mb=64, verbose=False)\n"
             "except hobbitpy.HobbitError as e:\n    print('refused:', e)\n")
    q = subprocess.run([sys.executable, "-c", probe, str(bad)], capture_output=True, text=True, timeout=120)
    assert q.returncode == 0 and "refused:" in q.stdout and message in q.stdout, (q.returncode, q.stderr[-500:])


def test_trace_never_writes_through_a_symlink(model_dir, tmp_path):
    model = tiny_model(model_dir, "llama")
    prompts = tmp_path / "p.txt"
    prompts.write_text("Once upon a time\n")
    victim = tmp_path / "victim.npz"
    out = tmp_path / "t.npz"
    out.symlink_to(victim)  # dangling: the trace must not create the file it points to
    p = hobbitpy_cli("trace", str(model), "--prompts", str(prompts), "--out", str(out), "-n", "2", timeout=120)
    assert p.returncode == 2 and "already exists" in p.stderr and not victim.exists()
    # the trace's file is written under a fresh temporary name, then linked: nothing planted beside it is followed
    planted = tmp_path / "t2.npz.partial.npz"
    planted.symlink_to(victim)
    p = hobbitpy_cli("trace", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "t2.npz"), "-n", "2", timeout=120)
    assert p.returncode == 0, p.stderr
    assert not victim.exists() and (tmp_path / "t2.npz").is_file() and planted.is_symlink()


def test_io_threads_out_of_range_is_one_clear_error(model_dir):
    model = tiny_model(model_dir, "llama")
    p = cli(str(model), "-p", "hello", "-n", "1", "--cache-mb", "64", "--io-threads", "100000", timeout=60)
    assert p.returncode == 2 and "--io-threads must be 1..64" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.slow
def test_a_companion_of_another_model_with_the_same_shapes_is_refused(model_dir, tmp_path):
    from hobbitpy.copies.prepare import prepare_companion

    mine = tiny_model(model_dir, "llama", n_embd=256)
    other = tiny_model(model_dir, "llama", n_embd=256, seed=1)  # the same shapes, other weights
    theirs = prepare_companion(other, "Q2_K", tmp_path / "other.experts-Q2_K.gguf", progress=False)
    ours = prepare_companion(mine, "Q2_K", tmp_path / "mine.experts-Q2_K.gguf", progress=False)
    p = cli(str(mine), "-p", "hello", "-n", "2", "--cache-mb", "64", "--low", str(theirs), timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"{theirs} does not hold the experts of {mine}: it was made of the experts of another model" in p.stderr
    assert other.name in p.stderr
    p = cli(str(mine), "-p", "hello", "-n", "2", "--cache-mb", "64", "--low", str(ours), timeout=120)
    assert p.returncode == 0, p.stderr


def test_out_of_range_numbers_and_odd_files_are_one_line_errors(model_dir, tmp_path):
    model = tiny_model(model_dir, "llama")
    cases = [
        (["--cache-mb", "inf"], "--cache-mb must be positive and at most"),
        (["--cache-mb", "1e30"], "--cache-mb must be positive and at most"),
        (["--policy", "hobbit", "--policy-weights", "nan,0,0,1"], "--policy-weights must be"),
        (["--low", "Q2_K", "--level-shares", "inf,1"], "--level-shares must be"),
    ]
    for flags, message in cases:
        p = cli(str(model), "-p", "hello", "-n", "1", *flags, timeout=60)
        assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, (flags, p.stderr[-400:])
    fifo = tmp_path / "model.fifo"
    os.mkfifo(fifo)
    p = cli(str(fifo), "-p", "hello", "-n", "1", timeout=60)  # would block in open() if it were opened
    assert p.returncode == 2 and "is not a regular file" in p.stderr, p.stderr[-400:]
    p = cli(str(model), "-p", "hello", "-n", "1", "--cache-mb", "64", "--low", str(tmp_path), timeout=60)
    assert p.returncode == 2 and f"{tmp_path}: is not a regular file (given as --low" in p.stderr, p.stderr[-400:]
    # a prompt longer than the context, and one that is not UTF-8
    p = cli(str(model), "-p", "word " * 400, "-n", "1", "--ctx", "64", "--cache-mb", "64", timeout=60)
    assert p.returncode == 2 and "as long as the context" in p.stderr and "Traceback" not in p.stderr, p.stderr[-400:]
    p = cli(str(model), "-p", "hello", "-n", "1", "--ctx", "100000000", timeout=60)
    assert p.returncode == 2 and "a context of 100000000 tokens needs" in p.stderr, p.stderr[-400:]
    bad = subprocess.run([*CLI, str(model), "-p", b"caf\xe9", "-n", "1"], capture_output=True, timeout=60)
    assert bad.returncode == 2 and b"not valid UTF-8" in bad.stderr and b"Traceback" not in bad.stderr


def test_the_c_api_refuses_nan_and_infinite_weights():
    from hobbitpy.binding.native import error_buffer, lib, to_str

    for field, value in (("lru", float("nan")), ("fld", float("inf"))):
        params, _keep = hobbitpy.OffloadConfig().to_native(8 * MB)
        setattr(params.policy_weights, field, value)
        err = error_buffer()
        assert lib.hobbit_request_offload(params, err, len(err)) == lib.HOBBIT_STATUS_ERROR_INVALID
        assert "policy_weights must be finite" in to_str(err)
    params, _keep = hobbitpy.OffloadConfig(low="Q2_K").to_native(8 * MB, (None, "unused.gguf"))
    params.level_shares[1] = float("inf")
    err = error_buffer()
    assert lib.hobbit_request_offload(params, err, len(err)) == lib.HOBBIT_STATUS_ERROR_INVALID
    assert "level_shares must be finite" in to_str(err)
    lib.hobbit_cancel_offload_request()


def test_text_the_vocabulary_cannot_encode_is_an_error_not_an_abort(tmp_path):
    path = model_without_byte_tokens(tmp_path)
    # through the API (in a child: before the fix the process died of std::terminate)
    script = textwrap.dedent(f"""
        import hobbitpy
        llm = hobbitpy.Llama({str(path)!r}, offload=hobbitpy.OffloadConfig(cache_mb=1), n_ctx=64, verbose=False)
        assert llm.tokenize(b"abc the", add_bos=False) == llm.tokenize(b"abc the", add_bos=False)
        assert len(llm.tokenize(b"abc the")) >= 4
        try:
            llm.tokenize("the caf\\u00e9".encode())
        except hobbitpy.TokenizeError as e:
            print("error:", e)
        try:
            llm.create_completion("caf\\u00e9", max_tokens=2)
        except ValueError as e:
            print("completion:", e)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (f"error: {path}: the model's vocabulary cannot encode 'é' (U+00E9, character 7 of the text)"
            in p.stdout), p.stdout
    assert "completion:" in p.stdout and "U+00E9" in p.stdout
    # through run and eval: one line, status 2
    proc = cli(path, "--prompt", "caf\u00e9 au lait", "-n", "2", "--cache-mb", "1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].endswith("and no byte token to fall back to"), proc.stderr
    assert "Traceback" not in proc.stderr
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on the mat " * 20 + "na\u00efve")
    proc = hobbitpy_cli("eval", path, "--text", text, "--cache-mb", "1")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "U+00EF" in proc.stderr and "Traceback" not in proc.stderr


def test_io_threads_that_cannot_start_are_one_clear_error(model_dir):
    # an address-space limit that leaves room for the model and a few threads' stacks, not
    # for 64: the threads started are joined and the load fails with a message (before the
    # fix, std::terminate on the joinable threads)
    path = tiny_model(model_dir, "llama")
    script = textwrap.dedent(f"""
        import resource, hobbitpy
        vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + 160 * 2**20, resource.RLIM_INFINITY))
        try:
            hobbitpy.Llama({str(path)!r}, cache_mb=1, io_threads=64, n_ctx=32, verbose=False)
            print("loaded")
        except hobbitpy.HobbitError as e:
            print("error:", e)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "error:" in p.stdout and "cannot start I/O thread" in p.stdout and "of 64" in p.stdout, p.stdout
    assert "cannot start I/O thread 1 of" not in p.stdout  # some started, and were joined
