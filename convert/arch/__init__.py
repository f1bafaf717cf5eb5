"""Architecture adapters: one small module per checkpoint family."""

from colibri.convert.arch.base import Adapter, ConfigError
from colibri.convert.arch.deepseek import Deepseek
from colibri.convert.arch.glm4_moe import Glm4Moe
from colibri.convert.arch.mixtral import Mixtral
from colibri.convert.arch.olmoe import Olmoe
from colibri.convert.arch.qwen_moe import Qwen2Moe, Qwen3Moe

ADAPTERS: dict[str, Adapter] = {t: cls() for cls in (Mixtral, Qwen2Moe, Qwen3Moe, Olmoe, Deepseek, Glm4Moe) for t in cls.model_types}
SUPPORTED = tuple(sorted(ADAPTERS))


def adapter_for(hf_config: dict) -> Adapter:
    model_type = hf_config.get("model_type")
    if model_type not in ADAPTERS:
        raise ConfigError(f"config.json: unsupported architecture {model_type!r} (supported: {', '.join(SUPPORTED)})")
    return ADAPTERS[model_type]


__all__ = ["ADAPTERS", "SUPPORTED", "Adapter", "ConfigError", "adapter_for"]
