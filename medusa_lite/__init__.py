"""medusa_lite: exact speculative decoding with Medusa draft heads on a frozen Hugging Face causal LM."""

from ._version import __version__
from .decode import GenerationStats
from .drafters import MedusaConfig
from .heads_io import HeadsMismatchError
from .kv.cache import UnsupportedCacheError
from .model import MedusaModel
from .targets import load_model

__all__ = ["MedusaConfig", "MedusaModel", "GenerationStats", "HeadsMismatchError", "UnsupportedCacheError", "load_model", "__version__"]
