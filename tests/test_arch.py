"""The architecture registry: every adapter module in convert/arch declares a whole
architecture, and conversion refuses what the runtime cannot compute."""

import importlib
import json
import pkgutil

import pytest

import colibri.convert.arch as arch
from colibri.cli import convert_main
from colibri.convert.arch import ADAPTERS, GGUF_ADAPTERS, TINY_MODELS, Adapter, ConfigError, adapter_for
from colibri.convert.synthetic import ARCHITECTURES, tiny_config
from colibri.convert.synthetic.tokenizer import FAMILIES


def test_every_module_is_an_architecture():
    for module in pkgutil.iter_modules(arch.__path__):
        if module.name != "base":
            loaded = importlib.import_module(f"colibri.convert.arch.{module.name}")
            assert any(isinstance(a, Adapter) and type(a).__module__ == loaded.__name__ for a in ADAPTERS.values()), module.name


def test_every_model_type_has_a_tiny_model_and_one_gguf_architecture():
    assert ARCHITECTURES == tuple(TINY_MODELS) == tuple(ADAPTERS)
    for model_type, model in TINY_MODELS.items():
        assert model.config["model_type"] == model_type and model.tokenizer in FAMILIES
        assert adapter_for(tiny_config(model_type)).normalize(tiny_config(model_type)).architecture == model_type
    adapters = list(dict.fromkeys(ADAPTERS.values()))
    assert sorted(GGUF_ADAPTERS) == sorted(a.gguf_arch_name for a in adapters), "two adapters share a llama.cpp architecture"


def test_glm_pre_ffn_norm_has_the_name_of_every_architecture():
    for model_type in ("glm4_moe", "mixtral", "deepseek_v3"):
        name = ADAPTERS[model_type].canonical_name("model.layers.1.post_attention_layernorm.weight", 3)
        assert name == "blk.1.ffn_norm.weight", model_type
    assert ADAPTERS["glm4_moe"].gguf_name("blk.1.ffn_norm.weight") == "blk.1.post_attention_norm.weight"
    assert ADAPTERS["glm4_moe"].colibri_name("blk.1.post_attention_norm.weight") == "blk.1.ffn_norm.weight"


@pytest.mark.parametrize("model_type", ARCHITECTURES)
@pytest.mark.parametrize("key, value", [("hidden_act", "gelu"), ("hidden_activation", "gelu_pytorch_tanh")])
def test_activation_the_runtime_lacks_is_refused(model_type, key, value):
    with pytest.raises(ConfigError, match=f"^config.json: {key} '{value}' is not supported"):
        adapter_for(tiny_config(model_type)).normalize(tiny_config(model_type, **{key: value}))


def test_swish_and_an_absent_activation_are_silu():
    for config in (tiny_config("mixtral", hidden_act="swish"), {k: v for k, v in tiny_config("olmoe").items() if k != "hidden_act"}):
        adapter_for(config).normalize(config)


def test_conversion_refuses_the_activation_in_one_line(checkpoint, tmp_path, capsys):
    src = checkpoint("qwen3_moe")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "hidden_act": "relu"}))
    code = convert_main([str(src), str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code != 0 and "\n" not in err and "hidden_act 'relu'" in err, err
    assert not (tmp_path / "out").exists()
