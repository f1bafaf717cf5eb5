"""Architecture adapters: one module per checkpoint family, found by `pkgutil`.

Every `Adapter` subclass a module here defines with `model_types` is registered; adding an
architecture is adding its module (README.md, "Adding an architecture").
"""

import importlib
import pkgutil

from colibri.convert.arch.base import Adapter, ConfigError, TinyModel


def _discover() -> list[Adapter]:
    adapters = []
    for module in pkgutil.iter_modules(__path__):
        loaded = importlib.import_module(f"{__name__}.{module.name}")
        adapters += [cls() for cls in vars(loaded).values()
                     if isinstance(cls, type) and issubclass(cls, Adapter) and cls.__module__ == loaded.__name__ and cls.model_types]
    return adapters


ADAPTERS: dict[str, Adapter] = {t: adapter for adapter in _discover() for t in adapter.model_types}
# other model types the same checkpoints carry (a multimodal release's text_config) → ours
ALIASES: dict[str, str] = {alias: t for t, adapter in ADAPTERS.items() if t == adapter.model_types[0]
                           for alias in adapter.model_type_aliases}
SUPPORTED = tuple(sorted(ADAPTERS))
# llama.cpp's architecture name (`general.architecture`) → the one adapter stored as it
GGUF_ADAPTERS: dict[str, Adapter] = {a.gguf_arch_name: a for a in dict.fromkeys(ADAPTERS.values())}
TINY_MODELS: dict[str, TinyModel] = {t: m for adapter in dict.fromkeys(ADAPTERS.values()) for t, m in adapter.tiny_models.items()}


def adapter_for(hf_config: dict) -> Adapter:
    model_type = hf_config.get("model_type")
    model_type = ALIASES.get(model_type, model_type) if isinstance(model_type, str) else model_type
    if not isinstance(model_type, str) or model_type not in ADAPTERS:
        raise ConfigError(f"config.json: unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED)})")
    return ADAPTERS[model_type]


def tiny_model(model_type: str) -> TinyModel:
    """The tiny synthetic model of `model_type` (ValueError for one without)."""
    if model_type not in TINY_MODELS:
        raise ValueError(f"unknown architecture {model_type!r}; expected one of {tuple(TINY_MODELS)}")
    return TINY_MODELS[model_type]


__all__ = ["ADAPTERS", "GGUF_ADAPTERS", "SUPPORTED", "TINY_MODELS", "Adapter", "ConfigError", "TinyModel", "adapter_for", "tiny_model"]
