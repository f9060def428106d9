"""graft_tk: lossless speculative decoding with hybrid (drafted + retrieved) token trees."""
from . import kernels as _kernels  # noqa: F401  first: without CUDA it switches Triton to its interpreter
from .config import GraftConfig
from .decode import DecodeResult, decode
from .engine import Engine
from .errors import GraftError
from .models import Model, load_model
from .models.eagle3_checkpoint import load_eagle3
from ._version import __version__

__all__ = ["decode", "DecodeResult", "GraftConfig", "Engine", "load_model", "load_eagle3", "Model", "GraftError",
           "__version__"]
