"""Domain errors. Each carries a one-line message that names the problem and the fix.

The library raises these; only the CLI turns them into click exceptions, and the
Triton models turn them into error responses.
"""


class PipelineError(Exception):
    """Base class: str(err) is the one-line message shown to the user."""

    exit_code = 1  # the CLI's exit status: 1 for what went wrong running, 2 for a bad option or value (usage)


def one_line(err: BaseException) -> str:
    """err's message on one line (whitespace runs folded), or its type's name when it has none."""
    return " ".join(str(err).split()) or type(err).__name__


class ModelNotFoundError(PipelineError):
    """A model reference resolves to nothing: unknown preset, missing folder or file, unreachable hub."""


class ModelFormatError(PipelineError):
    """The model files exist but can't be used: missing config/weights/tokenizer, unsupported architecture."""


class DraftMismatchError(PipelineError):
    """The draft can't propose for this target: different vocabulary or tokenizer."""


class RequestError(PipelineError):
    """A generation request is invalid: prompt too long, max_tokens < 1, bad sampling parameters."""

    exit_code = 2


class ConfigError(PipelineError):
    """An engine or pipeline setting is out of range."""

    exit_code = 2


class MissingDependencyError(PipelineError):
    """An optional dependency is not installed."""


class QuantizeError(PipelineError):
    """A quantization request can't run: unknown format, a model the format doesn't fit, output in the way."""

    exit_code = 2


class CalibrationError(PipelineError):
    """Calibration or evaluation text is missing, empty, unreadable or too short."""


class PlanError(PipelineError):
    """A memory plan can't be made (unknown GPU, bad tp, fp8 on a GPU without it) or doesn't fit."""

    exit_code = 2


class ServeError(PipelineError):
    """tritonserver can't serve: no binary, no models, a port in use, a model that fails to load."""
