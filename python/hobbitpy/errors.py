"""Errors hobbitpy raises; each message names the file and what is wrong."""


class HobbitError(Exception):
    """Base class of hobbitpy's errors."""


class ModelFileError(HobbitError):
    """The model file is missing, unreadable, not a GGUF, truncated or inconsistent."""


class BudgetError(HobbitError):
    """The expert budget is below the minimum the model needs."""


class TokenizeError(HobbitError, ValueError):
    """The model's vocabulary cannot encode the text, or has no such token id (a ValueError,
    as llama_cpp's own tokenizer errors are to its server)."""


class ExpertReadError(HobbitError):
    """Reading an expert from disk failed during a run."""


class ChatTemplateError(HobbitError):
    """The model's chat template could not render a conversation (it does not parse, raised,
    or ran past its deadline). Its message starts with PREFIX: the server answers it as a 400."""

    PREFIX = "the model's chat template"


class SettingError(HobbitError, ValueError):
    """A generation setting out of range, or not a finite number (a ValueError, as
    llama-cpp-python's own refusals are)."""


class RequestError(HobbitError):
    """A request the served model refused on its content (llama-cpp-python's ValueError of a
    tool choice naming no tool, a setting out of range, ...). Its message starts with PREFIX:
    the server answers it as a 400."""

    PREFIX = "the request cannot be served: "
