"""DeepSeek-V3.2 and GLM-5 (GLM-MoE-DSA): DeepSeek-V3's MLA and MoE, plus DeepSeek's sparse
attention indexer in each layer (GLM-5: in the layers `indexer_types` calls "full"; the others
reuse the last one's choice). GLM-5's indexer rotates pairs, DeepSeek-V3.2's halves. llama.cpp
stores them as `glm-dsa` and `deepseek32`, with the same tensor names."""

import dataclasses

import gguf

from colibri.convert.arch.base import ConfigError, TinyModel, require
from colibri.convert.arch.deepseek import TINY_V3, Deepseek
from colibri.convert.gguf_source import GGUFError
from colibri.formats.model_config import ModelConfig

INDEXER = "{arch}.attention.indexer."  # llama.cpp's keys (the gguf package here predates them)

TINY_V32 = {  # deepseek-ai/DeepSeek-V3.2: V3 with an indexer (a top-k the tiny model's prompts pass)
    **{key: value for key, value in TINY_V3.items() if key != "auto_map"},
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_head_dim": 128,
    "index_n_heads": 8,
    "index_topk": 16,
}
TINY_GLM5 = {  # zai-org/GLM-5: MLA, one expert group, a layer that shares the indexer before it
    **{key: value for key, value in TINY_V32.items() if key not in ("rope_scaling", "topk_method", "seq_aux")},
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "indexer_types": ["full", "shared", "full"],
    "max_position_embeddings": 202752,
    "n_group": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000,
    "topk_group": 1,
}


def indexer_layers(hf: dict, n_layers: int) -> list[int]:
    """The layers with an indexer of their own: config.json's `indexer_types` ("full" / "shared"),
    else the schedule transformers derives from `index_topk_freq` and `index_skip_topk_offset`."""
    kinds = hf.get("indexer_types")
    if kinds is None:
        freq, offset = max(hf.get("index_topk_freq", 1), 1), hf.get("index_skip_topk_offset", 2)
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    if not (isinstance(kinds, list) and len(kinds) == n_layers and set(kinds) <= {"full", "shared"}):
        raise ConfigError(f"config.json: indexer_types is not {n_layers} of full, shared")
    return [i for i, kind in enumerate(kinds) if kind == "full"]


class DeepseekSparse(Deepseek):
    """What DeepSeek-V3.2 and GLM-5 share; llama.cpp names both's tensors as its glm-dsa."""

    model_types, tiny_models = (), {}  # not DeepSeek-V3's: only its subclasses are architectures
    gguf_arch = gguf.MODEL_ARCH.GLM_DSA
    gguf_keeps_mtp = True
    gguf_split_kv_b = True  # llama.cpp's glm-dsa and deepseek32 load MLA only so
    index_rope_interleaved: bool  # the indexer rotates pairs, not halves
    shared_indexers: bool  # config.json's indexer_types say which layers reuse the last one's choice

    def normalize(self, hf: dict) -> ModelConfig:
        topk, heads, width = require(hf, "index_topk", "index_n_heads", "index_head_dim")
        c = super().normalize(hf)
        layers = indexer_layers(hf, c.n_layers) if self.shared_indexers else list(range(c.n_layers))
        return dataclasses.replace(c, index_topk=topk, index_heads=heads, index_head_dim=width,
                                   index_rope_interleaved=self.index_rope_interleaved, index_layers=layers)

    def layer_tensors(self, c: ModelConfig, layer: int) -> dict[str, tuple]:
        tensors = super().layer_tensors(c, layer)
        if layer in c.index_layers:
            a, d, i, w = f"model.layers.{layer}.self_attn.indexer", c.hidden_size, c.index_heads, c.index_head_dim
            tensors.update({f"{a}.wq_b.weight": (i * w, c.q_lora_rank), f"{a}.wk.weight": (w, d),
                            f"{a}.k_norm.weight": (w,), f"{a}.k_norm.bias": (w,), f"{a}.weights_proj.weight": (i, d)})
        return tensors

    def from_gguf(self, meta, shapes: dict[str, tuple], fields: dict) -> dict:
        own = super().from_gguf(meta, shapes, fields)
        n_layers = fields["n_layers"]
        full = meta.source.get(INDEXER.format(arch=meta.arch) + "types")  # per layer, true for "full"
        if full is not None and not (isinstance(full, list) and len(full) == n_layers):
            raise GGUFError(f"{meta.file}: {INDEXER.format(arch=meta.arch)}types is not one flag per layer")
        layers = [i for i, own_indexer in enumerate(full) if own_indexer] if full is not None else list(range(n_layers))
        return {**own, "architecture": self.model_types[0], "index_topk": int(meta.require(INDEXER + "top_k")),
                "index_heads": int(meta.require(INDEXER + "head_count")),
                "index_head_dim": int(meta.require(INDEXER + "key_length")),
                "index_rope_interleaved": self.index_rope_interleaved, "index_layers": layers}

    def to_gguf(self, writer: gguf.GGUFWriter, c: ModelConfig) -> None:
        super().to_gguf(writer, c)
        keys = INDEXER.format(arch=self.gguf_arch_name)
        writer.add_uint32(keys + "head_count", c.index_heads)
        writer.add_uint32(keys + "key_length", c.index_head_dim)
        writer.add_uint32(keys + "top_k", c.index_topk)
        writer.add_array(keys + "types", [layer in c.index_layers for layer in range(c.n_layers)])

    def gguf_problems(self, c: ModelConfig) -> list[str]:
        problems = super().gguf_problems(c)
        if c.index_rope_interleaved != self.index_rope_interleaved:
            problems.append(f"its indexer rotates {'pairs' if c.index_rope_interleaved else 'halves'}, llama.cpp's "
                            f"{self.gguf_arch_name} does not")
        return problems


class DeepseekV32(DeepseekSparse):
    model_types = ("deepseek_v32",)
    tiny_models = {"deepseek_v32": TinyModel(TINY_V32, "deepseek")}
    index_rope_interleaved = False  # its indexer rotates halves
    shared_indexers = False  # one in every layer

    @property
    def gguf_arch_name(self) -> str:
        return "deepseek32"  # llama.cpp's, newer than the gguf package's MODEL_ARCH (its tensors glm-dsa's)


class GlmMoeDsa(DeepseekSparse):
    model_types = ("glm_moe_dsa",)
    tiny_models = {"glm_moe_dsa": TinyModel(TINY_GLM5, "glm")}
    index_rope_interleaved = True
    shared_indexers = True
