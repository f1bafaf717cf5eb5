"""Llama 4 (meta-llama/Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E): GQA whose layers
rotate pairs and keep to chunks of `attention_chunk_size` positions, but every fourth, which is
position-free, sees everything and scales its queries by a temperature that grows with the
position; a weightless q/k norm after the rotation (Scout's, not Maverick's); MoE on every
`interleave_moe_layer_step`-th layer: one expert a token, chosen by a sigmoid router whose
score scales the expert's *input*, beside one shared expert; dense layers between.

The release is multimodal (`Llama4ForConditionalGeneration`): the text model is read from
its `text_config` and `language_model.` tensors (`formats.checkpoint`); its model type is
`llama4_text`, as transformers' `Llama4ForCausalLM` saves it. Routed experts are stored
fused and transposed (`gate_up_proj` [E, hidden, 2·ffn], gate columns then up columns;
`down_proj` [E, ffn, hidden]), one tensor a matrix in the FP8 release. llama.cpp stores it as
`llama4`, with the chunk (8192), the temperature (0.1, 8192) and the layer pattern (every
fourth position-free) built into its loader.
"""

import gguf

from colibri.convert.arch.base import Adapter, ConfigError, TinyModel, common_fields, require
from colibri.convert.gguf_source import GGUFError
from colibri.formats.model_config import ModelConfig

NOPE_INTERVAL = 4  # transformers' no_rope_layer_interval default, and llama.cpp's fixed layer pattern
LLAMA_CPP_CHUNK = 8192  # what llama.cpp's llama4 loader sets, whatever the file says
LLAMA_CPP_TEMPERATURE = (0.1, 8192)  # its f_attn_temp_scale and n_attn_temp_floor_scale
LLAMA_CPP_NO_QK_NORM_EXPERTS = 128  # llama.cpp turns the q/k norm off for (only) the 128-expert model
TINY = {  # Llama-4-Scout's text_config at tiny widths; two MoE layers between dense ones, as Maverick
    "architectures": ["Llama4ForCausalLM"],
    "attention_bias": False,
    "attention_chunk_size": 8192,
    "attn_scale": 0.1,
    "attn_temperature_tuning": True,
    "floor_scale": 8192,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 256,
    "interleave_moe_layer_step": 2,
    "intermediate_size": 256,
    "intermediate_size_mlp": 512,
    "max_position_embeddings": 16384,
    "model_type": "llama4_text",
    "num_attention_heads": 4,
    "num_experts_per_tok": 1,
    "num_hidden_layers": 4,
    "num_key_value_heads": 2,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "vocab_size": 512,
}


def _layer_kinds(hf: dict, layers: int) -> tuple[list[int], list[int]]:
    """(the rotated layers, the chunked layers) as transformers' Llama4TextConfig derives them."""
    rotated = hf.get("no_rope_layers")
    if not rotated:
        interval = hf.get("no_rope_layer_interval") or NOPE_INTERVAL
        rotated = [int((i + 1) % interval != 0) for i in range(layers)]
    if not (isinstance(rotated, list) and len(rotated) == layers and all(r in (0, 1) for r in rotated)):
        raise ConfigError(f"config.json: no_rope_layers is not {layers} of 0, 1")
    kinds = hf.get("layer_types")
    if kinds is None:
        chunked = [i for i in range(layers) if rotated[i] and hf.get("attention_chunk_size") is not None]
    elif isinstance(kinds, list) and len(kinds) == layers and set(kinds) <= {"chunked_attention", "full_attention"}:
        chunked = [i for i in range(layers) if kinds[i] == "chunked_attention"]
    else:
        raise ConfigError(f"config.json: layer_types is not {layers} of 'chunked_attention', 'full_attention'")
    return [i for i in range(layers) if rotated[i]], chunked


class Llama4(Adapter):
    model_types = ("llama4_text",)
    tiny_models = {"llama4_text": TinyModel(TINY, "chatml")}
    gguf_arch = gguf.MODEL_ARCH.LLAMA4
    moe_block = "feed_forward"
    dense_block = "feed_forward"
    router_leaf = "router.weight"
    shared_block = "shared_expert"
    fused_expert_layout = "transposed_halves"
    gguf_rope_interleaved = True
    gguf_rope_freqs = True
    gguf_interleaved_moe = True

    def normalize(self, hf: dict) -> ModelConfig:
        experts, used, ffn, layers = require(hf, "num_local_experts", "num_experts_per_tok", "intermediate_size",
                                             "num_hidden_layers")
        if hf.get("attention_bias"):
            raise ConfigError("config.json: attention_bias true is not supported (no Llama 4 release has it)")
        rotated, chunked = _layer_kinds(hf, layers)
        nope = [i for i in range(layers) if i not in rotated]
        chunk = hf.get("attention_chunk_size") if chunked else 0
        if chunked and not (isinstance(chunk, int) and chunk > 0):
            raise ConfigError(f"config.json: attention_chunk_size {chunk!r} is not a positive whole number")
        step = hf.get("interleave_moe_layer_step") or 1
        moe = hf.get("moe_layers")
        moe = list(range(step - 1, layers, step)) if moe is None else moe
        tuned = bool(hf.get("attn_temperature_tuning", True)) and bool(nope)
        fields = common_fields(hf, "llama4_text", self.gguf_arch, windows=True)
        return ModelConfig(
            **{**fields, "norm_eps": float(hf.get("rms_norm_eps", 1e-5))},
            rope_interleaved=True,
            qk_norm="weightless" if hf.get("use_qk_norm", True) else "none",
            qk_norm_after_rope=True,
            attention_chunk=chunk or 0,
            chunked_layers=chunked,
            nope_layers=nope,
            attn_temperature_scale=float(hf.get("attn_scale", 0.1)) if tuned else 0.0,
            attn_temperature_floor=int(hf.get("floor_scale", 8192)) if tuned else 0,
            dense_ffn=hf.get("intermediate_size_mlp") or 0,
            moe_layers=moe,
            n_experts=experts,
            n_experts_used=used,
            expert_ffn=ffn,
            expert_input_scaled=True,
            router="sigmoid",
            n_shared_experts=1,
            shared_expert_ffn=ffn,
        )

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        step = c.moe_layers[0] + 1
        writer.add_interleave_moe_layer_step(step)

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        layers, experts = fields["n_layers"], fields["n_experts"]
        if meta.get(gguf.Keys.Attention.SLIDING_WINDOW) == 0:
            raise GGUFError(f"{meta.file}: llama4 with sliding_window 0 (every layer rotated but the last, "
                            "MobileLLM's) is not supported")
        key = gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=meta.arch)
        pattern = meta.source.get(key, NOPE_INTERVAL)  # as llama.cpp's set_swa_pattern reads it
        if isinstance(pattern, list) and len(pattern) == layers:
            chunked = [i for i in range(layers) if pattern[i]]
        elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
            chunked = [i for i in range(layers) if i % pattern < pattern - 1]
        else:
            raise GGUFError(f"{meta.file}: {key} is {pattern!r:.40}, neither a positive whole number nor {layers} flags")
        nope = [i for i in range(layers) if (i + 1) % NOPE_INTERVAL == 0]
        scale, floor = LLAMA_CPP_TEMPERATURE
        return {"attention_chunk": LLAMA_CPP_CHUNK if chunked else 0, "chunked_layers": chunked, "nope_layers": nope,
                "attn_temperature_scale": scale if nope else 0.0, "attn_temperature_floor": floor if nope else 0,
                "qk_norm": "none" if experts == LLAMA_CPP_NO_QK_NORM_EXPERTS else "weightless", "qk_norm_after_rope": True,
                "router": "sigmoid", "expert_input_scaled": True,
                "n_shared_experts": 1, "shared_expert_ffn": fields["expert_ffn"]}

    def gguf_problems(self, c: ModelConfig) -> list[str]:
        problems, layers = [], range(c.n_layers)
        nope = [i for i in layers if (i + 1) % NOPE_INTERVAL == 0]
        step = c.moe_layers[0] + 1 if c.moe_layers else 0
        if not step or c.moe_layers != list(range(step - 1, c.n_layers, step)):
            problems.append(f"llama.cpp's llama4 has MoE on every n-th layer, not on {c.moe_layers}")
        if c.nope_layers != nope or c.chunked_layers != [i for i in layers if i not in nope] \
                or c.attention_chunk != LLAMA_CPP_CHUNK:
            problems.append(f"llama.cpp's llama4 keeps chunks of {LLAMA_CPP_CHUNK} in every layer but each fourth, "
                            "which is position-free")
        if nope and (c.attn_temperature_scale, c.attn_temperature_floor) != LLAMA_CPP_TEMPERATURE:
            problems.append(f"llama.cpp's llama4 tunes the temperature with (scale, floor) {LLAMA_CPP_TEMPERATURE}")
        if (c.qk_norm == "weightless") != (c.n_experts != LLAMA_CPP_NO_QK_NORM_EXPERTS):
            problems.append(f"llama.cpp's llama4 has the q/k norm exactly when there are not "
                            f"{LLAMA_CPP_NO_QK_NORM_EXPERTS} experts")
        scaling = c.rope_scaling or {}
        if scaling and scaling.get("rope_type", scaling.get("type")) not in ("llama3", "factors"):
            problems.append("llama.cpp's llama4 reads a llama3 rope scaling (rope_freqs) only")
        return problems
