"""A model's GGUF tensors read as bytes, chunk by chunk, without mapping the file: what reads
every expert of a real-size model once (prepare's quantizer, the copies' rounding error)
without filling memory or the page cache."""

from __future__ import annotations

import os
import pathlib

import gguf
import numpy as np

from ..errors import ModelFileError
from .model_file import inspect_model, model_parts


class ModelTensors:
    """A model's GGUF files as gguf reads them: the metadata of the first, the tensors of every
    part (a split model's, llama.cpp's gguf-split), and which file holds each."""

    def __init__(self, path: pathlib.Path):
        info = inspect_model(path)  # the native indexer's errors: missing, not a GGUF, truncated, inconsistent
        if not info.is_moe:
            raise ModelFileError(f"{path}: no routed expert tensors (ffn_*_exps); a dense model has no experts to prepare")
        self.parts = [pathlib.Path(p) for p in model_parts(path)]
        try:
            readers = [gguf.GGUFReader(p) for p in self.parts]
        except ValueError as e:  # e.g. a tensor type newer than the gguf package
            raise ModelFileError(f"{path}: the gguf package cannot read it ({e})") from e
        self.fields = readers[0].fields
        self.tensors = [t for r in readers for t in r.tensors]
        self.file_of = {t.name: part for part, r in zip(self.parts, readers) for t in r.tensors}
        self.header_bytes = sum(r.data_offset for r in readers)  # metadata and tensor infos


class TensorReads:
    """A model's tensors read chunk by chunk with pread (threads read in parallel), each
    tensor's pages dropped from the page cache once done with: a real-size model passes
    through without filling memory or pushing out what else the machine caches."""

    def __init__(self, source: ModelTensors):
        self.file_of = source.file_of
        self.fds = {}
        try:
            for part in source.parts:
                self.fds[part] = os.open(part, os.O_RDONLY)
        except OSError:
            self.close()
            raise

    def path(self, t) -> pathlib.Path:
        return self.file_of[t.name]

    def rows(self, t, first: int, n: int) -> np.ndarray:
        """Rows first..first+n-1 of tensor t (one ggml row of bytes each)."""
        row_bytes = int(t.n_bytes) // n_rows(t)
        out = np.empty((n, row_bytes), np.uint8)
        offset = int(t.data_offset) + first * row_bytes
        if os.preadv(self.fds[self.path(t)], [out], offset) != out.nbytes:
            raise ModelFileError(f"{self.path(t)}: tensor '{t.name}' ends early (the file was truncated?)")
        return out

    def done(self, t) -> None:
        os.posix_fadvise(self.fds[self.path(t)], int(t.data_offset), int(t.n_bytes), os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def n_rows(t) -> int:
    """A tensor's rows (ggml's: of its first dimension)."""
    return int(np.prod([int(n) for n in t.shape[1:]]))
