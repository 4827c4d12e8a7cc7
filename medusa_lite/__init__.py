"""medusa_lite: exact speculative decoding with Medusa draft heads on a frozen Hugging Face causal LM."""

__version__ = "0.1.0"

from .config import MedusaConfig  # noqa: E402
from .generate import GenerationStats  # noqa: E402
from .model import HeadsMismatchError, MedusaModel  # noqa: E402
from .targets import load_model  # noqa: E402


__all__ = ["MedusaConfig", "MedusaModel", "GenerationStats", "HeadsMismatchError", "load_model", "__version__"]
