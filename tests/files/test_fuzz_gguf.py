"""A seeded mutator over the GGUF files hobbitpy reads (a model and its low-precision
companion): header, key-value pairs and tensor infos get boundary values, flipped bytes and
truncations. Every mutant must give a clean error or a clean run, never a signal (an abort
of the host process). Every case runs, in a fixed order: what is covered never depends on the
machine's speed (about 40 s here)."""

from __future__ import annotations

import json
import pathlib
import random
import signal
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest

from conftest import tiny_model

pytestmark = pytest.mark.slow  # minutes: run by `python -m pytest -m slow` (and CI)

SEED = 12

# integers a parser must not trust: zero, one, the edges of every width, and nearby values
BOUNDARY = (0, 1, 2, 3, 7, 255, 256, 65535, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**64 - 1)

# the child loads every mutant in turn: a clean error is printed, a signal kills it and the
# parent knows from the last "case" line which mutant did it
CHILD = textwrap.dedent("""
    import json, sys
    import hobbitpy
    cases = json.loads(sys.stdin.read())
    for case in cases:
        print("case", case["i"], flush=True)
        try:
            hobbitpy.inspect_model(case["model"])
            llm = hobbitpy.Llama(case["model"], low=case.get("low"), cache_mb=case["cache_mb"], n_ctx=32,
                                 n_threads=1, verbose=False)
            try:
                llm.eval(llm.tokenize(b"the cat", add_bos=False)[:4])
            finally:
                llm.close()
            print("ran", case["i"], flush=True)
        except (hobbitpy.HobbitError, ValueError, RuntimeError) as e:
            print("error", case["i"], type(e).__name__, str(e).splitlines()[0][:200] if str(e) else "", flush=True)
    print("done", flush=True)
""")


def _integer_slots(path) -> list[tuple[int, int]]:
    """(offset, width) of every integer the header stores: lengths, counts, types, values,
    tensor dimensions and offsets."""
    reader = gguf.GGUFReader(str(path))
    base = reader.data.__array_interface__["data"][0]
    slots = []
    parts = [p for f in reader.fields.values() for p in f.parts] + [p for t in reader.tensors for p in t.field.parts]
    for part in parts:
        if np.issubdtype(part.dtype, np.integer) and part.dtype.itemsize >= 4:
            start = part.__array_interface__["data"][0] - base
            slots += [(start + k * part.dtype.itemsize, part.dtype.itemsize) for k in range(min(part.size, 4))]
    return slots


def _mutants(path, out_dir, rng: random.Random, n: int) -> list[tuple[pathlib.Path, str]]:
    data = path.read_bytes()
    header_end = gguf.GGUFReader(str(path)).data_offset
    slots = _integer_slots(path)
    out = []
    for k in range(n):
        b = bytearray(data)
        kind = rng.random()
        if kind < 0.6:
            offset, width = rng.choice(slots)
            value = rng.choice(BOUNDARY + (int.from_bytes(b[offset:offset + width], "little") + rng.choice((-1, 1)),))
            b[offset:offset + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
            what = f"integer at {offset} ({width} bytes) = {value}"
        elif kind < 0.85:
            offsets = [rng.randrange(header_end) for _ in range(rng.randint(1, 4))]
            for o in offsets:
                b[o] ^= 1 << rng.randrange(8)
            what = f"bits flipped at {offsets}"
        else:
            cut = rng.randrange(header_end + 64)
            del b[cut:]
            what = f"truncated at {cut}"
        mutant = out_dir / f"{path.stem}.m{k}.gguf"
        mutant.write_bytes(bytes(b))
        out.append((mutant, what))
    return out


def test_mutated_model_and_companion_headers_give_clean_errors_never_a_signal(model_dir, tmp_path):
    model = tiny_model(model_dir, "llama")
    companion = tmp_path / "companion-Q2_K.gguf"
    p = subprocess.run([sys.executable, "-m", "hobbitpy", "prepare", str(model), "--low", "Q2_K", "--out", str(companion)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    rng = random.Random(SEED)
    cases, what = [], {}
    for i, (mutant, how) in enumerate(
            _mutants(model, tmp_path, rng, 400) + _mutants(companion, tmp_path, rng, 200)):
        is_companion = mutant.name.startswith(companion.stem)
        cases.append({"i": i, "model": str(model if is_companion else mutant),
                      "low": str(mutant) if is_companion else None, "cache_mb": 1})
        what[i] = f"{'companion' if is_companion else 'model'} {how}"
    rng.shuffle(cases)  # model and companion mutants interleaved
    done, outcomes = 0, {"ran": 0, "error": 0}
    while done < len(cases):
        batch = cases[done:done + 40]
        child = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(batch), capture_output=True, text=True,
                               timeout=300)
        lines = child.stdout.splitlines()
        if child.returncode != 0:
            last = next((int(line.split()[1]) for line in reversed(lines) if line.startswith("case ")), None)
            how = what.get(last, "?")
            died = f"signal {signal.Signals(-child.returncode).name}" if child.returncode < 0 else f"exit {child.returncode}"
            raise AssertionError(f"mutant {last} ({how}) ended the process with {died}:\n{child.stderr[-3000:]}")
        for line in lines:
            kind = line.split()[0]
            if kind in outcomes:
                outcomes[kind] += 1
        done += len(batch)
    # every mutant loaded or was refused cleanly, and many broke something that was caught
    assert outcomes["ran"] + outcomes["error"] == len(cases) and outcomes["error"] > 0, outcomes
    print(f"{done} mutants: {outcomes}")
