"""Which tensors a synthetic checkpoint holds, in file order: the hub checkpoint's names
(from the architecture's adapter, `convert.arch`) and shapes (from its normalized config)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from colibri.convert.arch import ADAPTERS
from colibri.convert.synthetic.configs import resolve_config
from colibri.formats.checkpoint import FP8_BLOCK

DTYPES = {
    # name: (safetensors dtype of the weights, bytes per element, config torch_dtype)
    "f32": ("F32", 4, "float32"),
    "f16": ("F16", 2, "float16"),
    "bf16": ("BF16", 2, "bfloat16"),
    "fp8": ("F8_E4M3", 1, "bfloat16"),
}
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "I64": 8}
#: std of the noise added to 1.0 for RMSNorm weights
NORM_NOISE_STD = 0.1
#: std of DeepSeek-V3/GLM ``e_score_correction_bias``
SCORE_BIAS_STD = 0.05
#: std of gpt-oss's attention sinks (logits the scores compete with)
SINK_STD = 1.0
#: std of a DeltaNet convolution's taps (a few per channel: their sum scales q, k and v)
CONV_STD = 0.5
#: std of a DeltaNet's A_log and dt_bias (decays exp(-exp(A_log) softplus(a + dt_bias)) around 1/2)
DECAY_STD = 0.5
#: std of DeepSeek-V4's hyper-connection biases and scales, and of its compressors' position biases
MIXING_STD = 0.5


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of a checkpoint.

    ``parts`` are the value-stream names concatenated (in row-major order) to form the
    tensor; ``kind`` is one of ``linear`` (2-D projection weight, FP8-eligible),
    ``experts`` (fused 3-D expert weight, FP8-eligible), ``embed``, ``head``, ``norm``,
    ``router``, ``gate`` (other tiny gating projections), ``mtp_proj`` (MTP ``eh_proj``),
    ``bias``, ``position_bias`` (a bias per place in a pool, [places, width]), ``score_bias``, ``scale_inv`` (FP8 block scales of ``source``) and ``table`` (I64
    rows of distinct ids below ``choices``: DeepSeek-V4's token → experts table).
    """

    name: str
    shape: tuple
    kind: str
    dtype: str  # safetensors dtype: F32, F16, BF16, F8_E4M3
    std: float = 0.0
    mean: float = 0.0
    parts: tuple = ()
    source: str | None = None  # for scale_inv: the weight tensor name
    choices: int = 0  # for table: the ids each row chooses among

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    @property
    def nbytes(self) -> int:
        return self.numel * ITEMSIZE[self.dtype]


def mtp_layer_indices(config: dict) -> list[int]:
    """Layer indices of the multi-token-prediction layers a checkpoint of ``config`` holds."""
    adapter = ADAPTERS.get(config.get("model_type"))
    if adapter is None:
        return []
    base = int(config["num_hidden_layers"])
    return list(range(base, base + adapter.mtp_layers(config)))


class _Planner:
    def __init__(self, arch, cfg, dtype, fused, init_std, router_std):
        self.adapter = ADAPTERS[arch]
        self.cfg = cfg
        self.c = self.adapter.normalize(cfg)
        self.wdt = DTYPES[dtype][0]
        self.fp8 = dtype == "fp8"
        # tensors that are never FP8 are bf16 in an FP8 checkpoint
        self.odt = "BF16" if self.fp8 else self.wdt
        self.fused = fused
        self.std = float(init_std)
        self.router_std = float(router_std) if router_std is not None else 2.0 / math.sqrt(self.c.hidden_size)
        self.specs: list[TensorSpec] = []

    # -- primitives --------------------------------------------------------------------
    def _add(self, spec: TensorSpec) -> None:
        self.specs.append(spec)

    def linear(self, name, rows, cols, bias=False):
        shape = (int(rows), int(cols))
        if self.fp8:
            self._add(TensorSpec(name + ".weight", shape, "linear", "F8_E4M3", self.std, parts=(name + ".weight",)))
            scales = (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))
            self._add(TensorSpec(name + ".weight_scale_inv", scales, "scale_inv", "F32", source=name + ".weight"))
        else:
            self._add(TensorSpec(name + ".weight", shape, "linear", self.wdt, self.std, parts=(name + ".weight",)))
        if bias:
            self._add(TensorSpec(name + ".bias", (int(rows),), "bias", self.odt, self.std, parts=(name + ".bias",)))

    def plain(self, name, shape, kind, std, mean=0.0, dtype=None):
        self._add(TensorSpec(name, tuple(int(s) for s in shape), kind, dtype or self.odt, std, mean, parts=(name,)))

    def norm(self, name, size, zero_centred=None):
        zero_centred = self.adapter.zero_centred_norms if zero_centred is None else zero_centred
        self.plain(name + ".weight", (size,), "norm", NORM_NOISE_STD, 0.0 if zero_centred else 1.0)

    # -- blocks ------------------------------------------------------------------------
    def attention(self, p, i):
        c, a, D, H = self.c, p + "self_attn.", self.c.hidden_size, self.c.n_heads
        if c.is_linear_layer(i):
            self.linear_attention(p + self.adapter.linear_block)
            return
        if c.attention == "mla":
            bias = bool(self.cfg.get("attention_bias", False))  # on q_a, kv_a and o (false in every hub config)
            if c.q_lora_rank is None:
                self.linear(a + "q_proj", H * c.head_dim, D)
            else:
                self.linear(a + "q_a_proj", c.q_lora_rank, D, bias=bias)
                self.norm(a + "q_a_layernorm", c.q_lora_rank)
                self.linear(a + "q_b_proj", H * c.head_dim, c.q_lora_rank)
            self.linear(a + "kv_a_proj_with_mqa", c.kv_lora_rank + c.qk_rope_head_dim, D, bias=bias)
            self.norm(a + "kv_a_layernorm", c.kv_lora_rank)
            self.linear(a + "kv_b_proj", H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
            self.linear(a + "o_proj", D, H * c.v_head_dim, bias=bias)
            if i in c.index_layers or (c.index_topk and i >= c.n_layers):  # the sparse attention's indexer (MTP: too)
                self.linear(a + "indexer.wq_b", c.index_heads * c.index_head_dim, c.q_lora_rank)
                self.linear(a + "indexer.wk", c.index_head_dim, D)
                self.norm(a + "indexer.k_norm", c.index_head_dim)
                self.plain(a + "indexer.k_norm.bias", (c.index_head_dim,), "bias", self.std)
                self.linear(a + "indexer.weights_proj", c.index_heads, D)
            return
        q, k, v = H * c.head_dim, c.kv_heads_of(i) * c.head_dim, c.kv_heads_of(i) * c.v_head_dim
        self.linear(a + "q_proj", 2 * q if c.attn_output_gate else q, D, bias=c.attn_bias)
        self.linear(a + "k_proj", k, D, bias=c.attn_bias)
        self.linear(a + "v_proj", v, D, bias=c.attn_bias)
        self.linear(a + "o_proj", D, H * c.v_head_dim, bias=c.attn_bias and self.adapter.o_proj_bias)
        if c.has_sinks(i):
            self.plain(a + self.adapter.sinks_leaf, (H,), "sink", SINK_STD)
        if c.qk_norm in ("head", "full"):  # (Llama 4's weightless norms have no tensors)
            head = c.qk_norm == "head"
            q_norm, k_norm = self.adapter.qk_norm_leaves
            self.norm(a + q_norm, c.head_dim if head else q)
            self.norm(a + k_norm, c.head_dim if head else k)
        if c.index_block and i in c.index_layers:  # MiniMax-M3's indexer of blocks
            self.linear(a + "index_q_proj", c.index_heads * c.index_head_dim, D)
            self.linear(a + "index_k_proj", c.index_head_dim, D)
            self.norm(a + "index_q_norm", c.index_head_dim)
            self.norm(a + "index_k_norm", c.index_head_dim)

    def linear_attention(self, a):
        """A gated DeltaNet's tensors, as the adapter names them."""
        for name, shape in self.adapter.linear_attention_tensors(self.c, a).items():
            if name.endswith("norm.weight"):
                self.norm(name.removesuffix(".weight"), shape[0], zero_centred=False)
            elif name.endswith("conv1d.weight"):
                self.plain(name, shape, "conv", CONV_STD)
            elif name.endswith(("A_log", "dt_bias")):
                self.plain(name, shape, "bias", DECAY_STD, dtype="F32")
            else:
                self.linear(name.removesuffix(".weight"), *shape)

    def dense_mlp(self, prefix, inter):
        D = self.c.hidden_size
        self.linear(prefix + "gate_proj", inter, D)
        self.linear(prefix + "up_proj", inter, D)
        self.linear(prefix + "down_proj", D, inter)

    def experts(self, prefix, n_exp, inter):
        D = self.c.hidden_size
        names = self.adapter.experts(0)
        if names.transposed:  # only ever fused (gpt-oss, Llama 4), gpt-oss's biases beside
            for name, shape in zip(("gate_up_proj", "down_proj"), names.fused_shapes(n_exp, inter, D)):
                self.plain(f"{prefix}experts.{name}", shape, "experts", self.std)
            if self.c.expert_bias:
                self.plain(f"{prefix}experts.gate_up_proj_bias", (n_exp, 2 * inter), "bias", self.std)
                self.plain(f"{prefix}experts.down_proj_bias", (n_exp, D), "bias", self.std)
            return
        g, u, d = self.adapter.expert_leaves
        if not self.fused:
            for e in range(n_exp):
                self.linear(f"{prefix}experts.{e}.{g}", inter, D)
                self.linear(f"{prefix}experts.{e}.{u}", inter, D)
                self.linear(f"{prefix}experts.{e}.{d}", D, inter)
            return
        gu_parts = tuple(
            name for e in range(n_exp) for name in (f"{prefix}experts.{e}.{g}.weight", f"{prefix}experts.{e}.{u}.weight")
        )
        dn_parts = tuple(f"{prefix}experts.{e}.{d}.weight" for e in range(n_exp))
        for name, shape, parts in (
            (prefix + "experts.gate_up_proj", (n_exp, 2 * inter, D), gu_parts),
            (prefix + "experts.down_proj", (n_exp, D, inter), dn_parts),
        ):
            self._add(TensorSpec(name, shape, "experts", self.wdt, self.std, parts=parts))
            if self.fp8:
                scales = (shape[0], -(-shape[1] // FP8_BLOCK), -(-shape[2] // FP8_BLOCK))
                self._add(TensorSpec(name + "_scale_inv", scales, "scale_inv", "F32", source=name))

    def mlp(self, p, i):
        c, D = self.c, self.c.hidden_size
        if not (c.is_moe_layer(i) or i >= c.n_layers):  # multi-token-prediction layers are MoE layers
            self.dense_mlp(f"{p}{self.adapter.dense_block}.", c.dense_ffn)
            return
        m = f"{p}{self.adapter.moe_block}."
        if c.router_logit_bias:  # gpt-oss: the router is a linear layer of its own, with a bias
            self.plain(m + "router.weight", (c.n_experts, D), "router", self.router_std)
            self.plain(m + "router.bias", (c.n_experts,), "bias", self.std)
        else:
            self.plain(m + self.adapter.router_leaf, (c.n_experts, D), "router", self.router_std)
        if c.router_bias:  # its shape as the adapter lists it (ERNIE-4.5 stores one group's, [1, experts])
            bias = m + self.adapter.router_bias_leaf
            self.plain(bias, self.adapter.router_tensors(c, p.removesuffix("."))[bias], "score_bias", SCORE_BIAS_STD,
                       dtype="F32")
        self.experts(m, c.n_experts, c.expert_ffn)
        if c.n_shared_experts:
            self.dense_mlp(f"{m}{self.adapter.shared_block}.", c.shared_expert_ffn)
        if c.shared_expert_gate:
            self.plain(m + "shared_expert_gate.weight", (1, D), "gate", self.std)

    def decoder_layer(self, i):
        p = f"model.layers.{i}."
        self.norm(p + "input_layernorm", self.c.hidden_size)
        self.attention(p, i)
        self.norm(p + "post_attention_layernorm", self.c.hidden_size)
        self.mlp(p, i)

    def hyper_model(self) -> list[TensorSpec]:
        """A hyper-connected model's tensors (DeepSeek-V4's, GLM-5-Next's), by the adapter's
        names: its attention or KDA, hyper-connections (float32, as transformers keeps them),
        hash tables; each MoE layer's experts after it."""
        c, adapter = self.c, self.adapter
        for name, shape in adapter.global_tensors(c).items():
            self.hyper_tensor(name, shape)
        for i in range(c.n_layers):
            for name, shape in adapter.layer_tensors(c, i).items():
                self.hyper_tensor(name, shape)
            if c.is_moe_layer(i):
                self.experts(adapter.experts(i).prefix.removesuffix("experts"), c.n_experts, c.expert_ffn)
        last = c.n_layers - 1
        for i in mtp_layer_indices(self.cfg):  # the last layer's tensors, MoE, under the MTP layer's number
            self.mtp_inputs(i)
            for name, shape in adapter.layer_tensors(c, last).items():
                self.hyper_tensor(name.replace(f"model.layers.{last}.", f"model.layers.{i}.", 1), shape)
            self.experts(adapter.experts(i).prefix.removesuffix("experts"), c.n_experts, c.expert_ffn)
            self.mtp_head(i)
        return self.specs

    def hyper_tensor(self, name: str, shape: tuple) -> None:
        base = name.removesuffix(".weight")
        if name.endswith("norm.weight"):
            self.norm(base, shape[0], zero_centred=False)
        elif name.endswith("tid2eid"):
            self._add(TensorSpec(name, shape, "table", "I64", parts=(name,), choices=self.c.n_experts))
        elif name.endswith("_fn"):
            self.plain(name, shape, "gate", self.std, dtype="F32")
        elif name.endswith("ape"):  # added to a softmax's logits per place in a pool: not a matrix
            self.plain(name, shape, "position_bias", MIXING_STD, dtype="F32")
        elif name.endswith(("_base", "_scale", "attn_sink")):
            self.plain(name, shape, "bias", SINK_STD if name.endswith("attn_sink") else MIXING_STD, dtype="F32")
        elif name.endswith(("gate.bias", "e_score_correction_bias")):
            self.plain(name, shape, "score_bias", SCORE_BIAS_STD, dtype="F32")
        elif name.endswith(("A_log", "dt_bias")):
            self.plain(name, shape, "bias", DECAY_STD, dtype="F32")
        elif name.endswith("conv1d.weight"):
            self.plain(name, shape, "conv", CONV_STD)
        elif name.endswith(".bias"):
            self.plain(name, shape, "bias", self.std)
        elif name.endswith("_compress_gate"):  # the pools' softmax logits
            self.plain(name, shape, "gate", MIXING_STD / 4)
        elif name.endswith("gate.weight"):
            self.plain(name, shape, "router", self.router_std)
        elif name in ("model.embed_tokens.weight", "head.weight", "lm_head.weight"):
            self.plain(name, shape, "embed" if name.startswith("model.") else "head", self.std)
        else:
            self.linear(base, *shape)

    def build(self) -> list[TensorSpec]:
        if self.c.hyper_streams:
            return self.hyper_model()
        D, V = self.c.hidden_size, self.c.vocab_size
        self.plain("model.embed_tokens.weight", (V, D), "embed", self.std)
        for i in range(self.c.n_layers):
            self.decoder_layer(i)
        self.norm("model.norm", D)
        if not self.c.tie_word_embeddings:
            self.plain("lm_head.weight", (V, D), "head", self.std)
        for i in mtp_layer_indices(self.cfg):
            self.mtp_inputs(i)
            self.decoder_layer(i)
            self.mtp_head(i)
        return self.specs

    # DeepSeek-V3 / GLM-4.5 / GLM-5-Next multi-token-prediction layer: a full decoder layer plus its
    # own embedding, projections and shared head (eh_proj stays bf16 in the FP8 hub checkpoints,
    # like the embeddings and the head)
    def mtp_inputs(self, i):
        p, D = f"model.layers.{i}.", self.c.hidden_size
        self.plain(p + "embed_tokens.weight", (self.c.vocab_size, D), "embed", self.std)
        self.norm(p + "enorm", D)
        self.norm(p + "hnorm", D)
        self.plain(p + "eh_proj.weight", (D, 2 * D), "mtp_proj", self.std)

    def mtp_head(self, i):
        p = f"model.layers.{i}."
        self.norm(p + "shared_head.norm", self.c.hidden_size)
        self.plain(p + "shared_head.head.weight", (self.c.vocab_size, self.c.hidden_size), "head", self.std)


def checkpoint_plan(
    arch: str,
    config: dict | None = None,
    *,
    dtype: str = "bf16",
    fused_experts: bool = False,
    init_std: float = 0.02,
    router_std: float | None = None,
) -> list[TensorSpec]:
    """Every tensor ``write_checkpoint`` writes for these arguments, in file order."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    cfg = resolve_config(arch, config)
    specs = _Planner(arch, cfg, dtype, fused_experts, init_std, router_std).build()
    names = [s.name for s in specs]
    if len(set(names)) != len(names):  # pragma: no cover - planner invariant
        raise AssertionError("duplicate tensor names in plan")
    return specs
