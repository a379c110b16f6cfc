"""Tokenizing text with llama.cpp's tokenizer without letting it abort the process.

llama.cpp's tokenizer throws a C++ exception when a character has no token and the
vocabulary has no byte token to fall back to (`llama_vocab::byte_to_token`); through
llama-cpp-python's ctypes call that is `std::terminate`: the host process dies. hobbitpy
calls the tokenizer through `hobbit_tokenize`, which turns the exception into an error,
and names the first character the vocabulary cannot encode.
"""

from __future__ import annotations

import os

from ..binding import hobbit
from ..errors import HobbitError, ModelFileError, TokenizeError
from .model_file import inspect_model


# how an error about a character the vocabulary has no token for begins (the server finds it by this)
UNENCODABLE = "the model's vocabulary cannot encode"


def out_of_vocabulary(ids, n_vocab: int) -> str | None:
    """What is wrong with a list of token ids for a vocabulary of n_vocab (None: nothing).
    llama.cpp refuses an id out of range only by failing the decode (detokenize aborts the
    process), so ids from outside are checked here. min and max: it runs at every generated token."""
    if not len(ids):
        return None
    if all(isinstance(t, int) and not isinstance(t, bool) for t in ids) and 0 <= min(ids) and max(ids) < n_vocab:
        return None
    bad = next(t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < n_vocab))
    return f"{bad!r} is not a token id of this model (an integer from 0 to {n_vocab - 1})"

def _tokenize_once(vocab, text: bytes, n_max: int, add_bos: bool, special: bool) -> tuple[int, list[int], str | None]:
    try:
        n, ids = hobbit.tokenize(vocab, text, n_max, add_bos, special)
    except TokenizeError as e:
        return 0, [], str(e)
    return n, ids, None


def _tokenize_or_error(vocab, text: bytes, add_bos: bool, special: bool) -> tuple[list[int], str | None]:
    # a token covers at least one byte; BOS, EOS and SPM's leading space come on top
    n, ids, error = _tokenize_once(vocab, text, len(text) + 8, add_bos, special)
    if error is None and n < 0:  # llama.cpp asks for more room: -n tokens
        n, ids, error = _tokenize_once(vocab, text, -n, add_bos, special)
        if error is None and n < 0:
            error = f"the tokenizer asks for {-n} tokens of room twice"
    return ids, error


def tokenize(llama_vocab, model_path: str, text: bytes, add_bos: bool, special: bool) -> list[int]:
    """llama_tokenize on llama_vocab (llama-cpp-python's ctypes pointer, LlamaModel.vocab);
    raises TokenizeError naming the model and the first character its vocabulary cannot
    encode."""
    vocab = hobbit.vocab_of(llama_vocab)
    ids, error = _tokenize_or_error(vocab, text, add_bos, special)
    if error is None:
        return ids
    chars = text.decode("utf-8", errors="replace")
    for i, ch in enumerate(chars):
        if _tokenize_or_error(vocab, ch.encode("utf-8"), False, False)[1] is not None:
            raise TokenizeError(f"{model_path}: {UNENCODABLE} {ch!r} (U+{ord(ch):04X}, character "
                                f"{i} of the text): it has no token for it and no byte token to fall back to")
    raise TokenizeError(f"{model_path}: {error}")


def encodable(llama_vocab, text: str) -> str:
    """The text less the characters the vocabulary of llama_vocab cannot encode (for a text of
    hobbitpy's own, such as the calibration text, that no user asked to be read as written)."""
    vocab = hobbit.vocab_of(llama_vocab)
    if _tokenize_or_error(vocab, text.encode("utf-8"), False, False)[1] is None:
        return text
    unencodable = {ch for ch in set(text) if _tokenize_or_error(vocab, ch.encode("utf-8"), False, False)[1] is not None}
    return "".join(ch for ch in text if ch not in unencodable)


def unencodable(llama_vocab, text: str) -> str | None:
    """What the vocabulary of llama_vocab cannot encode in the text, said as a tokenize error
    says it but without a file ("the model's vocabulary cannot encode '!' (U+0021, character
    3)"), or None when it encodes all of it."""
    missing = set(text) - set(encodable(llama_vocab, text))
    if not missing:
        return None
    i = min(text.index(ch) for ch in missing)
    return f"{UNENCODABLE} {text[i]!r} (U+{ord(text[i]):04X}, character {i + 1})"


class Vocabulary:
    """A model's tokenizer alone: a vocabulary-only load and no context (llama_cpp.Llama makes
    one even then, whose check of a context length against the hyperparameters a vocabulary
    load does not read printed a warning about nothing). For text to score (eval, tune)."""

    def __init__(self, model_path: str | os.PathLike):
        import llama_cpp
        from llama_cpp import _internals

        self.model_path = os.fspath(model_path)
        inspect_model(self.model_path)  # a missing, truncated or foreign file: one clear error
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        try:
            self._model = _internals.LlamaModel(path_model=self.model_path, params=params, verbose=False)
        except ValueError as e:
            raise ModelFileError(f"{self.model_path}: llama.cpp could not load its vocabulary ({e})") from None

    def tokenize(self, text: bytes, add_bos: bool = False, special: bool = False) -> list[int]:
        return tokenize(self._model.vocab, self.model_path, text, add_bos, special)

    def detokenize(self, ids: list[int]) -> bytes:
        return self._model.detokenize(ids, special=False)

    def close(self) -> None:
        self._model.close()

    def __enter__(self) -> "Vocabulary":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tokenize_text(model_path: str | os.PathLike, text: str, max_tokens: int | None = None) -> list[int]:
    """The text as the model's tokenizer cuts it (no BOS), at most max_tokens; at least 2 tokens."""
    with Vocabulary(model_path) as vocab:
        ids = vocab.tokenize(text.encode("utf-8"), add_bos=False, special=False)
    ids = ids[:max_tokens] if max_tokens is not None else ids
    if len(ids) < 2:
        raise HobbitError(f"the text has {len(ids)} token(s) with this model's tokenizer; evaluation needs at least 2")
    return ids
