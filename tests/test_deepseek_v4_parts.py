"""DeepSeek-V4's runtime parts against transformers' own modules (oracle extra): the
hyper-connections, the three attention layer kinds with their compressors and indexer (at
ratios and windows the releases do not use: HCA pooling 8, a window narrower than it), the
sqrt-softplus and hash routers, the clamped SwiGLU; a cached decode equal to one prefill. The
parts take transformers' in-memory weights by the names the layout stores (llama.cpp's).

Then the whole tiny model, converted, over a prompt long enough for HCA's entries of 128."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from colibri.formats.config_check import config_problems
from colibri.formats.model_config import ModelConfig
from colibri.runtime import hyper_connections, kernels
from colibri.runtime.compressed_attention import CompressedAttention
from colibri.runtime.kernels.numerics import GLU_KINDS, glu
from colibri.runtime.kernels.routing import SCORINGS, RouteRule, route_by, weigh_chosen
from colibri.runtime.kv_cache import KVCache
from colibri.runtime.model import Segment, compressed_cache_shape
from colibri.runtime.rope import Rope
from oracle_models import build_with_transformers, load_reference, oracle_available

ok, why = oracle_available()
pytestmark = pytest.mark.skipif(not ok, reason=why)

WINDOW, CSA, HCA, LENGTH = 6, 4, 8, 44  # a window narrower than the positions HCA pools
LONG = 560  # beyond a window's rows (kv_cache.WRITE_ROOM past the window): the window moves
YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1}
LAYER_KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
# transformers' names in a layer's self_attn → the layout's (llama.cpp's), after "blk.N."
ATTENTION_NAMES = {
    "q_a_proj.weight": "attn_q_a.weight", "q_a_norm.weight": "attn_q_a_norm.weight", "q_b_proj.weight": "attn_q_b.weight",
    "kv_proj.weight": "attn_kv.weight", "kv_norm.weight": "attn_kv_a_norm.weight", "sinks": "attn_sinks.weight",
    "o_a_proj.weight": "attn_output_a.weight", "o_b_proj.weight": "attn_output_b.weight",
    "compressor.kv_proj.weight": "attn_compressor_kv.weight", "compressor.gate_proj.weight": "attn_compressor_gate.weight",
    "compressor.position_bias": "attn_compressor_ape.weight", "compressor.kv_norm.weight": "attn_compressor_norm.weight",
    "compressor.indexer.kv_proj.weight": "indexer_compressor_kv.weight",
    "compressor.indexer.gate_proj.weight": "indexer_compressor_gate.weight",
    "compressor.indexer.position_bias": "indexer_compressor_ape.weight",
    "compressor.indexer.kv_norm.weight": "indexer_compressor_norm.weight",
    "compressor.indexer.q_b_proj.weight": "indexer.attn_q_b.weight",
    "compressor.indexer.scorer.weights_proj.weight": "indexer.proj.weight",
}


class TensorWeights:
    """`model.Weights`' readers over float32 arrays by name."""

    def __init__(self, tensors: dict[str, np.ndarray]):
        self.tensors = {name: np.ascontiguousarray(a, dtype=np.float32) for name, a in tensors.items()}

    def linear(self, name: str) -> kernels.Matrix:
        a = self.tensors[name]
        return kernels.Matrix(a.reshape(-1).view(np.uint8), "F32", *a.shape)

    def vector(self, name: str) -> np.ndarray:
        return self.tensors[name].reshape(-1)

    def array(self, name: str) -> np.ndarray:
        return self.tensors[name]


@pytest.fixture(scope="module")
def reference():
    """A tiny DeepSeek-V4 of transformers with random weights: a window, a CSA and an HCA layer."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    hf = DeepseekV4Config(vocab_size=64, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
                          num_attention_heads=4, head_dim=32, q_lora_rank=32, qk_rope_head_dim=8, num_experts_per_tok=2,
                          n_routed_experts=4, n_shared_experts=1, layer_types=LAYER_KINDS,
                          compress_rates={LAYER_KINDS[1]: CSA, LAYER_KINDS[2]: HCA}, num_hash_layers=1,
                          sliding_window=WINDOW, o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=16,
                          index_topk=3, max_position_embeddings=4096, rope_scaling=YARN, attn_implementation="eager")
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hf).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if t.ndim == 1 and "norm" in name:
                t.copy_(1 + 0.1 * torch.randn(t.shape))
            else:
                t.copy_(torch.randn(t.shape) * (1.0 if t.ndim == 1 else 2.0 / t.shape[-1] ** 0.5))
    c = ModelConfig(
        architecture="deepseek_v4", gguf_architecture="DEEPSEEK2", vocab_size=64, hidden_size=64, n_layers=3, n_heads=4,
        n_kv_heads=1, head_dim=32, v_head_dim=32, norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False,
        attention="compressed", attn_sinks=True, sliding_window=WINDOW, sliding_layers=[0, 1, 2], q_lora_rank=32,
        qk_rope_head_dim=8, index_topk=3, index_heads=4, index_head_dim=16, index_layers=[1],
        compress_ratios=[0, CSA, HCA], compress_rope_theta=160000.0,
        compress_rope_scaling={**YARN, "attention_factor": 1.0}, output_groups=2, output_lora_rank=16, hyper_streams=4,
        hyper_sinkhorn_iters=20, hyper_eps=1e-6, rope_theta=10000.0, rope_dim=8, rope_interleaved=True,
        moe_layers=[0, 1, 2], n_experts=4, n_experts_used=2, expert_ffn=32, expert_glu="clamped_silu", swiglu_limit=10.0,
        router="sqrtsoftplus", router_norm_topk=True, router_bias=True, hash_layers=[0], routed_scaling_factor=1.5,
        n_shared_experts=1, shared_expert_ffn=32)
    return model, c


def ropes(c: ModelConfig, ctx: int) -> tuple[Rope, Rope]:
    compress = dataclasses.replace(c, rope_theta=c.compress_rope_theta, rope_scaling=c.compress_rope_scaling)
    return Rope(c, ctx), Rope(compress, ctx)


def attention_of(model, c: ModelConfig, layer: int) -> CompressedAttention:
    module = model.model.layers[layer].self_attn
    tensors = {f"blk.{layer}.{ATTENTION_NAMES[name]}": t.detach().numpy() for name, t in module.state_dict().items()}
    return CompressedAttention(c, TensorWeights(tensors), layer, *ropes(c, LONG))


def run(attention: CompressedAttention, c: ModelConfig, h: np.ndarray, chunks: list[int]) -> np.ndarray:
    """The attention's output of h [n, hidden] fed in `chunks` of rows, over one new cache."""
    cache, outputs, start = KVCache(compressed_cache_shape(c), h.shape[0], "f32"), [], 0
    for count in chunks:
        outputs.append(attention(h[start:start + count], np.arange(start, start + count),
                                 [Segment(0, count, start, cache)]))
        start += count
    return np.concatenate(outputs)


def test_the_tiny_config_is_sound_and_its_limits_are_checked(reference):
    _, c = reference
    assert config_problems(c) == []
    assert config_problems(dataclasses.replace(c, sliding_window=0)) != []
    assert config_problems(dataclasses.replace(c, index_layers=[2])) != []
    assert config_problems(dataclasses.replace(c, output_groups=3)) != []


@pytest.mark.parametrize("layer", [0, 1, 2], ids=LAYER_KINDS)
def test_attention_layers_match_transformers(reference, layer):
    import torch
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    model, c = reference
    h = np.random.default_rng(layer).standard_normal((LENGTH, c.hidden_size)).astype(np.float32)
    positions = torch.arange(LENGTH)[None]
    rotary = DeepseekV4RotaryEmbedding(model.config)
    x = torch.from_numpy(h)[None]
    embeddings = {kind: rotary(x, position_ids=positions, layer_type=kind) for kind in ("main", "compress")}
    q, k = torch.arange(LENGTH)[:, None], torch.arange(LENGTH)[None, :]
    mask = torch.where((k <= q) & (k > q - WINDOW), 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        want = model.model.layers[layer].self_attn(x, embeddings, positions, mask)[0][0].numpy()
    got = run(attention_of(model, c, layer), c, h, [LENGTH])
    assert np.abs(got - want).max() <= 1e-4 * want.std()


@pytest.mark.parametrize("layer", [0, 1, 2], ids=LAYER_KINDS)
def test_a_cached_decode_equals_one_prefill(reference, layer):
    """Token by token and in uneven chunks (entries made mid-chunk, the window moved) as one pass."""
    model, c = reference
    attention = attention_of(model, c, layer)
    h = np.random.default_rng(10 + layer).standard_normal((LONG, c.hidden_size)).astype(np.float32)
    whole = run(attention, c, h, [LONG])
    assert np.abs(run(attention, c, h, [1] * LONG) - whole).max() <= 1e-5 * whole.std()
    assert np.abs(run(attention, c, h, [5, 1, 11, 3, 300, 240]) - whole).max() <= 1e-5 * whole.std()


def test_hyper_connections_match_transformers(reference):
    import torch

    model, c = reference
    streams = np.random.default_rng(3).standard_normal((6, c.hyper_streams, c.hidden_size)).astype(np.float32)
    layer = model.model.layers[1]
    block = np.random.default_rng(4).standard_normal((6, c.hidden_size)).astype(np.float32)
    with torch.no_grad():
        post, comb, collapsed = (t[0].numpy() for t in layer.attn_hc(torch.from_numpy(streams)[None]))
        merged = (torch.from_numpy(post)[..., None] * torch.from_numpy(block)[:, None]
                  + torch.matmul(torch.from_numpy(comb).transpose(-1, -2), torch.from_numpy(streams))).numpy()
        head = model.model.hc_head(torch.from_numpy(streams)[None])[0].numpy()
    hc = layer.attn_hc
    weights = hyper_connections.HyperWeights(TensorWeights({"fn": hc.fn.detach().numpy()}).linear("fn"),
                                             hc.base.detach().numpy(), hc.scale.detach().numpy())
    mixing = hyper_connections.Mixing(c.hyper_sinkhorn_iters, np.float32(c.hyper_eps), np.float32(c.norm_eps))
    got_collapsed, got_post, got_comb = hyper_connections.mix(streams, weights, mixing)
    for got, want in ((got_collapsed, collapsed), (got_post, post), (got_comb, comb)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got_comb.sum(axis=1), 1, atol=1e-4)  # columns normalized last; rows nearly
    np.testing.assert_allclose(got_comb.sum(axis=2), 1, atol=1e-2)
    np.testing.assert_allclose(hyper_connections.merge(streams, block, got_post, got_comb), merged, rtol=1e-5, atol=1e-5)
    hh = model.model.hc_head
    head_weights = hyper_connections.HyperWeights(TensorWeights({"fn": hh.hc_fn.detach().numpy()}).linear("fn"),
                                                  hh.hc_base.detach().numpy(), hh.hc_scale.detach().numpy())
    np.testing.assert_allclose(hyper_connections.head(streams, head_weights, mixing), head,
                               rtol=1e-5, atol=1e-6)


def test_sqrt_softplus_and_hash_routers_match_transformers(reference):
    import torch

    model, c = reference
    h = torch.from_numpy(np.random.default_rng(5).standard_normal((9, c.hidden_size)).astype(np.float32) * 3)
    rule = RouteRule(SCORINGS["sqrtsoftplus"], 1, 1, True, True, np.float32(c.routed_scaling_factor))
    topk, hashed = model.model.layers[1].mlp.gate, model.model.layers[0].mlp.gate
    with torch.no_grad():
        logits, want_weights, want_ids = topk(h)
        hash_logits, hash_weights, hash_ids = hashed(h, torch.arange(9))
    ids, weights = route_by(logits.numpy(), topk.e_score_correction_bias.numpy(), c.n_experts_used, rule)
    order = np.argsort(want_ids.numpy(), axis=1)
    assert (np.sort(ids, axis=1) == np.take_along_axis(want_ids.numpy(), order, 1)).all()
    np.testing.assert_allclose(np.take_along_axis(weights, np.argsort(ids, axis=1), 1),
                               np.take_along_axis(want_weights.numpy(), order, 1), rtol=1e-6)
    np.testing.assert_allclose(weigh_chosen(hash_logits.numpy(), hash_ids.numpy(), rule), hash_weights.numpy(), rtol=1e-6)
    large = np.array([[25.0, -30.0, 0.5, 2.0]], np.float32)  # softplus's linear and vanishing ends
    _, large_weights = route_by(large, None, 4, rule._replace(norm=False, scale=np.float32(1)))
    want = torch.sqrt(torch.nn.functional.softplus(torch.from_numpy(large)))[0].numpy()
    np.testing.assert_allclose(np.sort(large_weights[0]), np.sort(want), rtol=1e-6)


def test_clamped_silu_matches_transformers(reference):
    import torch

    model, c = reference
    experts = model.model.layers[1].mlp.experts
    gate_up = torch.linspace(-14, 14, 2 * 57)[None]
    with torch.no_grad():
        want = experts._apply_gate(gate_up)[0].numpy()
    gate, up = gate_up[0, :57].numpy(), gate_up[0, 57:].numpy()
    kind, limit = GLU_KINDS[c.expert_glu], np.float32(c.swiglu_limit)
    got = np.array([glu(g, u, kind, np.float32(1), limit) for g, u in zip(gate, up)], np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_the_cache_counts_what_it_holds(reference):
    _, c = reference
    shape = compressed_cache_shape(c)
    for kind in ("f32", "f16"):
        assert KVCache(shape, 256, kind).nbytes == shape.nbytes(256, kind)
    # entries grow with the context: a CSA layer's comp and index entries, an HCA layer's comp entries
    assert shape.nbytes(2048, "f32") - shape.nbytes(1024, "f32") == 4 * 1024 * (32 // CSA + 16 // CSA + 32 // HCA)


def test_a_long_prompt_and_its_decode_match_transformers(tmp_path):
    """300 tokens: two HCA entries of 128 and 75 CSA entries, of which the indexer keeps 4."""
    import torch

    from colibri.convert.hf_to_colibri import ConvertOptions, convert
    from colibri.runtime import open_model

    src = build_with_transformers(tmp_path / "src", "deepseek_v4")
    convert(str(src), tmp_path / "f32", ConvertOptions(quant="F32", progress=False))
    ids = [int(t) for t in np.random.default_rng(300).integers(0, 512, 300)]
    with torch.no_grad():
        want = load_reference(src)(torch.tensor([ids])).logits[0].numpy()
    model = open_model(tmp_path / "f32", ctx=320, kv_quant="f32", ram_budget="8G")
    got = model.prefill(ids)
    assert np.abs(got - want).max() <= 1e-4 * want.std()
    model.reset()
    model.prefill(ids[:250])
    decoded = np.concatenate([model.prefill([t]) for t in ids[250:]])  # one token at a time, past entry 1's end
    assert np.abs(decoded - want[250:]).max() <= 1e-4 * want.std()


def test_the_release_keeps_its_fp4_experts_as_mxfp4_bytes_and_scales_fp8_exactly(tmp_path):
    """The release's files (its names, FP8 with power-of-two block scales, FP4 experts): each
    expert's GGML MXFP4 blocks hold exactly its FP4 values (gguf-py decodes them), each FP8
    weight is its codes times its scales, and the model computes what the same values in F32 do."""
    import gguf
    import torch
    from safetensors.torch import load_file, save_file

    from colibri.convert.hf_to_colibri import ConvertOptions, convert
    from colibri.formats.layout import ModelLayout
    from colibri.runtime import open_model
    from oracle_models import to_deepseek_v4_release

    src = build_with_transformers(tmp_path / "src", "deepseek_v4")
    release = to_deepseek_v4_release(src, tmp_path / "release")
    summary = convert(str(release), tmp_path / "out", ConvertOptions(quant="F32", progress=False))
    assert summary["skipped_tensors"] == 2  # the hash layer's router bias, the MTP block
    stored = {}
    for file in release.glob("*.safetensors"):
        stored.update(load_file(file))
    e2m1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])

    def fp4(name):  # the release's values of an FP4 weight
        packed = stored[name + ".weight"].view(torch.uint8)
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1).long()
        scales = torch.exp2(stored[name + ".scale"].view(torch.uint8).float() - 127).repeat_interleave(32, dim=1)
        return (e2m1[codes] * scales).numpy()

    def fp8(name):
        codes, scales = stored[name + ".weight"].float(), torch.exp2(stored[name + ".scale"].view(torch.uint8).float() - 127)
        return (codes * scales.repeat_interleave(128, 0).repeat_interleave(128, 1)[:codes.shape[0], :codes.shape[1]]).numpy()

    layout = ModelLayout(tmp_path / "out")
    table = layout.expert_layers[2]
    for e in (0, 7):
        for matrix, leaf in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            m = table.matrices[matrix]
            assert m.encoding == "MXFP4"
            data = np.asarray(layout.expert_matrix_data(2, e, matrix)).reshape(m.shape[0], -1)
            values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType.MXFP4)
            assert np.array_equal(values, fp4(f"layers.2.ffn.experts.{e}.{leaf}"))
    q_a = layout.tensor_data("blk.1.attn_q_a.weight").view(np.float32).reshape(layout.tensors["blk.1.attn_q_a.weight"].shape)
    assert np.array_equal(q_a, fp8("layers.1.attn.wq_a"))

    # the same values as a transformers-format F32 checkpoint: the same logits, but for the
    # int8 activations the MXFP4 experts are multiplied with
    tensors = {}
    for file in src.glob("*.safetensors"):
        tensors.update(load_file(file))
    for name in tensors:
        base = name.removesuffix(".weight").replace("model.layers.", "layers.").replace(".attn.norm", ".attn.kv_norm")
        if base + ".scale" in stored:
            tensors[name] = torch.from_numpy(fp4(base) if ".experts." in name else fp8(base))
    dense = tmp_path / "dense"
    dense.mkdir()
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (dense / name).write_bytes((src / name).read_bytes())
    save_file(tensors, str(dense / "model.safetensors"), metadata={"format": "pt"})
    convert(str(dense), tmp_path / "dense-f32", ConvertOptions(quant="F32", progress=False))
    ids = [int(t) for t in np.random.default_rng(3).integers(0, 512, 40)]
    got = open_model(tmp_path / "out", ctx=64, kv_quant="f32", ram_budget="8G").prefill(ids)
    want = open_model(tmp_path / "dense-f32", ctx=64, kv_quant="f32", ram_budget="8G").prefill(ids)
    cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert np.median(cos) >= 0.999, np.median(cos)
