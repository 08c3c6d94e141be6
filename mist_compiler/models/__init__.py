"""Reference GPT/LLaMA models in plain PyTorch and the model zoo names the CLI accepts. May import
``ir`` only: models know nothing of distribution."""
from .transformer import TransformerConfig, TransformerLM, parameter_count
from .zoo import ZOO, ModelSpec, ModelSpecError, build_model, known_model_names, resolve_model, zoo_config

__all__ = [
    "TransformerConfig", "TransformerLM", "parameter_count", "ZOO", "ModelSpec", "ModelSpecError",
    "build_model", "known_model_names", "resolve_model", "zoo_config",
]
