"""medusa_lite: exact speculative decoding with Medusa draft heads on a frozen Hugging Face causal LM."""

__version__ = "0.1.0"

from .config import MedusaConfig  # noqa: E402
from .generate import GenerationStats  # noqa: E402
from .model import HeadsMismatchError, MedusaModel  # noqa: E402


def load_default(*args, **kwargs):
    """The bundled default target (SmolLM2-135M-Instruct) with the bundled heads: (MedusaModel, tokenizer)."""
    from .targets import load_default as _load_default
    return _load_default(*args, **kwargs)


__all__ = ["MedusaConfig", "MedusaModel", "GenerationStats", "HeadsMismatchError", "load_default", "__version__"]
