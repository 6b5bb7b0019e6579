"""spectr-edge: lossless speculative decoding (SpecTr k-SEQ draft selection) on ONNX Runtime.

    import spectr_edge
    gen = spectr_edge.load("models/default", provider="cpu")
    result = gen.generate("prompt", max_new_tokens=64, temperature=0.0)

The runtime needs numpy, onnxruntime and tokenizers only; it never imports torch.
"""

from .errors import BundleError, ExportError, InputError, ProviderError, SpectrError
from .generator import GenerationResult, Generator, load
from .stats import GenerationStats

__version__ = "0.1.0"
__all__ = ["load", "Generator", "GenerationResult", "GenerationStats", "SpectrError", "BundleError",
           "InputError", "ProviderError", "ExportError", "__version__"]
