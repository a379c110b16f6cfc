"""rounding_error.py: what a low copy loses expert by expert, and the order a ladder places by."""

from __future__ import annotations

import pathlib

import gguf
import numpy as np
import pytest

from hobbitpy.binding import ggml
from hobbitpy.copies.prepare import EXPERT_SUFFIXES, prepare_companion
from hobbitpy.copies.rounding_error import rounding_error
from hobbitpy.errors import ModelFileError
from hobbitpy.files.model_file import inspect_model

MODELS = pathlib.Path(__file__).resolve().parents[2] / "models"
DEEPSEEK_Q8 = MODELS / "ref-deepseek-Q8_0.gguf"
MIXTRAL_Q8 = MODELS / "ref-mixtral-Q8_0.gguf"


@pytest.fixture(scope="module")
def deepseek_q2(tmp_path_factory) -> pathlib.Path:
    return prepare_companion(DEEPSEEK_Q8, "Q2_K", tmp_path_factory.mktemp("q2") / "d.experts-Q2_K.gguf", progress=False)


def _expert_tensors(path: pathlib.Path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors if t.name.endswith(EXPERT_SUFFIXES)}


def _power(path: pathlib.Path) -> dict[str, np.ndarray]:
    """Column mean squares unlike one another (as an importance matrix's are), per expert tensor."""
    rng = np.random.default_rng(0)
    return {name: rng.uniform(0.1, 10.0, (int(t.shape[2]), int(t.shape[0]))).astype(np.float32)
            for name, t in _expert_tensors(path).items()}


def test_the_rounding_error_is_each_experts_input_weighted_squared_error(deepseek_q2):
    """Computed apart, from the whole tensors as gguf maps them: for each expert, the sum over its
    tensors of sum_j power_j sum_i (W - W_copy)_ij^2."""
    info = inspect_model(DEEPSEEK_Q8)
    power = _power(DEEPSEEK_Q8)
    error = rounding_error(DEEPSEEK_Q8, deepseek_q2, power, threads=2)
    assert error.shape == (info.n_layer_moe, info.n_expert) and np.all(error > 0)
    model, copy = _expert_tensors(DEEPSEEK_Q8), _expert_tensors(deepseek_q2)
    blocks = sorted({int(name.split(".")[1]) for name in model})
    expected = np.zeros_like(error)
    for name, t in model.items():
        n_per_row = int(t.shape[0])
        for e in range(info.n_expert):
            w = ggml.rows_as_float(np.ascontiguousarray(t.data[e]), int(t.tensor_type), n_per_row)
            low = ggml.rows_as_float(np.ascontiguousarray(copy[name].data[e]), int(copy[name].tensor_type), n_per_row)
            expected[blocks.index(int(name.split(".")[1])), e] += float(
                (np.square(w.astype(np.float64) - low).sum(axis=0) * power[name][e]).sum())
    np.testing.assert_allclose(error, expected, rtol=1e-5)


def test_a_copy_loses_nothing_of_itself_and_another_models_is_refused(deepseek_q2, tmp_path):
    power = _power(DEEPSEEK_Q8)
    assert not rounding_error(deepseek_q2, deepseek_q2, power).any()
    with pytest.raises(ModelFileError, match="not this model's copy"):
        rounding_error(MIXTRAL_Q8, deepseek_q2, _power(MIXTRAL_Q8))
