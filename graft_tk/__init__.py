"""graft_tk: lossless speculative decoding with hybrid (drafted + retrieved) token trees."""
from .decode import DecodeResult, decode
from .errors import GraftError
from .models import Model, load_model

__version__ = "0.1.0"
__all__ = ["decode", "DecodeResult", "load_model", "Model", "GraftError", "__version__"]
