"""Reference checkpoints built by ``transformers`` itself (test helper, oracle extra).

``build_with_transformers`` instantiates the tiny model of ``convert.synthetic.tiny_config``
with the transformers model class, re-initialises it (normal(0, 0.02) weights, routers
with std 2/sqrt(hidden), norms near 1, small random ``e_score_correction_bias``) and saves
it with ``save_pretrained`` (safetensors, >= 2 shards), then adds the synthetic tokenizer
files so the folder is a complete hub-like checkpoint.  Options rewrite the saved tensors
into the fused-expert form and/or DeepSeek-style block FP8.

torch and transformers are imported lazily: importing this module is always cheap.

Facts about transformers 5.24 this relies on (checked when this was written):

* ``save_pretrained`` writes per-expert tensors in the hub naming for every architecture
  here (it reverses the load-time conversion of the fused in-memory
  ``experts.gate_up_proj``/``down_proj``), including Mixtral's
  ``block_sparse_moe.experts.E.w1/w2/w3`` prefix; config.json is written in the v5 style
  (``rope_parameters``, ``dtype``) rather than the hub's ``rope_theta``/``rope_scaling``.
* The models have no MTP modules: a DeepSeek-V3 / GLM-4.5 checkpoint's
  ``model.layers.{num_hidden_layers}.*`` tensors are never built and are reported as
  unexpected on load unless the index is 61 (V3) or 46/92 (GLM), which are hard-coded.
* FP8 (``quantization_config.quant_method == "fp8"``) checkpoints cannot be loaded on this
  CPU-only setup: the fine-grained FP8 quantizer requires ``accelerate`` (not part of the
  oracle extra), and its CPU fallback dequantizes with a block size of
  ``rows // scale_rows``, which is wrong when a dimension is not a multiple of 128
  (``kv_a_proj_with_mqa``: 576 rows in V3, 320 here).  ``load_reference`` therefore
  dequantizes FP8 checkpoints itself (weight x ``weight_scale_inv`` per 128x128 block)
  and loads the dequantized copy.
"""

from __future__ import annotations

import json
import math
import pathlib
import re
import tempfile

from colibri.convert import synthetic
from colibri.convert.arch import ADAPTERS
from colibri.convert.synthetic import FP8_BLOCK, FP8_QUANTIZATION_CONFIG

# 2-D ``*.weight`` tensors that are NOT linear projections quantized to FP8 in the
# DeepSeek-V3 / Kimi-K2 hub checkpoints
_NOT_FP8 = re.compile(
    r"(embed_tokens|lm_head|norm|layernorm|\.gate\.weight$|shared_expert_gate|eh_proj|shared_head)"
)
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<e>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")


def _torch():
    import torch

    return torch


def oracle_available() -> tuple[bool, str]:
    """(True, "") when torch + transformers import, else (False, reason)."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        return False, f"oracle extra not installed ({exc.__class__.__name__}: {exc})"
    return True, ""


# text models transformers builds only inside their multimodal class: text model type → (the
# wrapper's model type, its class, a tiny vision tower's config, the text width its output takes)
MULTIMODAL_ONLY = {
    "glm5_next_text": ("glm5_next", "Glm5NextForConditionalGeneration",
                       {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64,
                        "projection_intermediate_size": 64}, "out_hidden_size"),
}


def _hf_config(cfg: dict):
    """transformers config object for a hub-style config dict (Kimi-K2 -> DeepseekV3Config; a
    text model of MULTIMODAL_ONLY inside its wrapper's config, with a tiny vision tower)."""
    from transformers import AutoConfig

    d = dict(cfg)
    model_type = d.pop("model_type")
    if model_type == "kimi_k2":  # not a transformers model type: it is DeepSeek-V3
        model_type = "deepseek_v3"
    if model_type == "qwen3_5_moe":  # the multimodal wrapper's; the text model is its own type
        model_type = "qwen3_5_moe_text"
    for key in ("transformers_version", "quantization_config"):
        d.pop(key, None)
    if model_type in MULTIMODAL_ONLY:
        wrapper, _, vision, width = MULTIMODAL_ONLY[model_type]
        return AutoConfig.for_model(wrapper, text_config={**d, "model_type": model_type},
                                    vision_config={**vision, width: d["hidden_size"]})
    return AutoConfig.for_model(model_type, **d)


def causal_lm_class(config):
    """The transformers class that gives `config`'s logits: AutoModelForCausalLM, or a
    MULTIMODAL_ONLY wrapper's class."""
    import transformers

    wrapped = {wrapper: name for wrapper, name, *_ in MULTIMODAL_ONLY.values()}
    return getattr(transformers, wrapped[config.model_type]) if config.model_type in wrapped \
        else transformers.AutoModelForCausalLM


def _reinit(model, seed: int, hidden: int, zero_centred: bool = False) -> None:
    """`zero_centred`: the model's RMSNorms apply 1 + w (but a DeltaNet's gated norm)."""
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    router_std = 2.0 / math.sqrt(hidden)
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    with torch.no_grad():
        for name, t in tensors:
            if name.endswith("tid2eid"):  # DeepSeek-V4's token -> experts table: distinct ids per token
                experts = model.config.n_routed_experts
                t.copy_(torch.argsort(torch.rand(t.shape[0], experts, generator=gen), dim=1)[:, :t.shape[1]])
                continue
            if not t.is_floating_point():
                continue
            if name.endswith("inv_freq"):
                continue  # rotary buffers are not persistent, keep them
            if name.endswith("e_score_correction_bias"):
                std, mean = 0.05, 0.0
            elif re.search(r"\.(gate|router|gate\.wg)\.weight$", name):
                std, mean = router_std, 0.0
            elif name.endswith(".sinks"):  # gpt-oss's attention sinks: logits the scores compete with
                std, mean = 1.0, 0.0
            elif re.search(r"(_hc\.(base|scale)|hc_head\.hc_(base|scale)|position_bias)$", name):
                std, mean = 0.5, 0.0  # DeepSeek-V4's stream mixing and compressor position biases
            elif name.endswith(("conv1d.weight", ".A_log", ".dt_bias")):  # a DeltaNet's taps and decays
                std, mean = 0.5, 0.0
            elif name.endswith("index_kpool_compress_ape"):  # GLM-5-Next's pools: logits of their softmax
                std, mean = 0.5, 0.0
            elif name.endswith("index_kpool_compress_gate"):
                std, mean = 0.1, 0.0
            elif t.ndim == 1 and "norm" in name:
                std, mean = 0.1, 0.0 if zero_centred and not name.endswith("linear_attn.norm.weight") else 1.0
            else:  # projections, experts (2-D / 3-D), embeddings, biases
                std, mean = 0.02, 0.0
            val = torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean
            t.copy_(val.to(t.dtype))


def _read_all(path: pathlib.Path) -> dict:
    """All tensors of a checkpoint folder, in index (file) order."""
    from safetensors.torch import load_file

    idx = path / "model.safetensors.index.json"
    files = (
        list(dict.fromkeys(json.loads(idx.read_text())["weight_map"].values()))
        if idx.exists()
        else ["model.safetensors"]
    )
    out = {}
    for f in sorted(files):
        out.update(load_file(str(path / f)))
    return out


def _write_all(path: pathlib.Path, tensors: dict, shards: int = 2) -> None:
    """Replace the checkpoint's safetensors files by ``tensors`` in ``shards`` files."""
    from safetensors.torch import save_file

    for p in list(path.glob("model*.safetensors")) + [path / "model.safetensors.index.json"]:
        if p.exists():
            p.unlink()
    names = list(tensors)
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total = sum(sizes)
    groups = [[] for _ in range(shards)]
    cum = 0
    for n, s in zip(names, sizes):
        groups[min(shards - 1, int((cum + s / 2) / (total / shards)))].append(n)
        cum += s
    groups = [g for g in groups if g]
    weight_map = {}
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in g}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in g})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _fuse_experts(tensors: dict) -> dict:
    """Per-expert tensors -> ``experts.gate_up_proj`` [E, 2I, D] / ``experts.down_proj`` [E, D, I]."""
    torch = _torch()
    groups: dict = {}
    out = {}
    for name, t in tensors.items():
        m = _EXPERT.match(name)
        if not m:
            out[name] = t
            continue
        prefix = m["prefix"]
        if prefix not in groups:
            groups[prefix] = {}
            out[prefix + ".gate_up_proj"] = None  # keep the position in file order
            out[prefix + ".down_proj"] = None
        groups[prefix][(int(m["e"]), m["proj"])] = t
    for prefix, g in groups.items():
        n = 1 + max(e for e, _ in g)
        gate, up, down = ("w1", "w3", "w2") if (0, "w1") in g else ("gate_proj", "up_proj", "down_proj")
        out[prefix + ".gate_up_proj"] = torch.stack([torch.cat([g[(e, gate)], g[(e, up)]], dim=0) for e in range(n)])
        out[prefix + ".down_proj"] = torch.stack([g[(e, down)] for e in range(n)])
    return out


def _quantize_fp8_2d(w):
    torch = _torch()
    rows, cols = w.shape
    R, C = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    x = torch.zeros(R * FP8_BLOCK, C * FP8_BLOCK, dtype=torch.float32)
    x[:rows, :cols] = w.float()
    blocks = x.view(R, FP8_BLOCK, C, FP8_BLOCK)
    scale = blocks.abs().amax(dim=(1, 3)) / 448.0
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = (blocks / scale[:, None, :, None]).view(R * FP8_BLOCK, C * FP8_BLOCK)[:rows, :cols]
    return q.contiguous().to(torch.float8_e4m3fn), scale.float().contiguous()


def _is_fp8_target(name: str, t) -> bool:
    if name.endswith(".gate_up_proj") or (name.endswith(".down_proj") and t.ndim == 3):
        return True
    return name.endswith(".weight") and t.ndim == 2 and not _NOT_FP8.search(name)


def _to_fp8(tensors: dict) -> dict:
    torch = _torch()
    out = {}
    for name, t in tensors.items():
        if not _is_fp8_target(name, t):
            out[name] = t
            continue
        if t.ndim == 2:
            q, s = _quantize_fp8_2d(t)
        else:
            pairs = [_quantize_fp8_2d(m) for m in t]
            q, s = torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
        out[name] = q
        out[name + "_scale_inv"] = s
    return out


def _dequantize_fp8(tensors: dict, dtype) -> dict:
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        s = tensors.get(name + "_scale_inv")
        if s is None:
            out[name] = t
            continue
        w = t.float()
        rows, cols = w.shape[-2:]
        full = s.float().repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
        out[name] = (w * full[..., :rows, :cols]).to(dtype)
    return out


def build_with_transformers(
    out_dir,
    arch: str,
    *,
    dtype: str = "f32",
    fused_experts: bool = False,
    fp8: bool = False,
    seed: int = 0,
    overrides: dict | None = None,
) -> pathlib.Path:
    """Save the tiny ``arch`` model (its config.json keys changed as ``overrides`` say) with
    transformers' ``save_pretrained`` (see module doc)."""
    torch = _torch()

    if dtype not in ("f32", "bf16"):
        raise ValueError("dtype must be 'f32' or 'bf16'")
    torch_dtype = torch.float32 if dtype == "f32" else torch.bfloat16
    cfg = synthetic.tiny_config(arch, **(overrides or {}))
    config = _hf_config(cfg)
    torch.manual_seed(seed)
    # dtype at construction so transformers' own keep-in-fp32 rules (DeepSeek routers) apply
    model_class = causal_lm_class(config)
    build = model_class.from_config if hasattr(model_class, "from_config") else model_class._from_config
    model = build(config, dtype=torch_dtype)
    _reinit(model, seed, int(cfg["hidden_size"]), ADAPTERS[arch].zero_centred_norms)
    model.eval()

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    model.save_pretrained(out, max_shard_size=total // 2 + 1)
    gen_cfg = (out / "generation_config.json").read_text()
    synthetic.write_tokenizer_files(out, arch, cfg)
    (out / "generation_config.json").write_text(gen_cfg)  # keep transformers' own

    conf = json.loads((out / "config.json").read_text())
    if arch == "kimi_k2":
        conf["model_type"] = "kimi_k2"
    if fused_experts or fp8:
        tensors = _read_all(out)
        if fused_experts:
            tensors = _fuse_experts(tensors)
        if fp8:
            tensors = _to_fp8(tensors)
            conf["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
        _write_all(out, tensors)
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    return out


MXFP4_QUANTIZATION_CONFIG = {  # openai/gpt-oss-20b's
    "quant_method": "mxfp4",
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
}


def to_mxfp4(src, out) -> pathlib.Path:
    """A copy of the gpt-oss checkpoint ``src`` with its experts as the hub ships them: MXFP4
    ``gate_up_proj_blocks`` [E, 2I, D / 32, 16] and ``_scales`` [E, 2I, D / 32] (rows, gate and
    up interleaved), ``down_proj_blocks`` [E, D, I / 32, 16] and ``_scales``; quantized by
    colibri's MXFP4 quantizer (ggml's), laid out as the hub does (``formats.mxfp4``)."""
    import numpy as np

    from colibri.convert.quantize_q4k import quantize
    from colibri.formats import mxfp4

    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (pathlib.Path(src) / name).exists():
            (out / name).write_bytes((pathlib.Path(src) / name).read_bytes())
    torch, tensors = _torch(), {}
    for name, t in _read_all(pathlib.Path(src)).items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = t
            continue
        rows = np.ascontiguousarray(t.float().numpy().swapaxes(1, 2))  # [E, out, in]
        encoded = quantize(rows.reshape(-1, rows.shape[-1]), "MXFP4").reshape(*rows.shape[:2], -1)
        blocks, scales = mxfp4.checkpoint_blocks(encoded)
        tensors[name + "_blocks"], tensors[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
    _write_all(out, tensors)
    conf = json.loads((pathlib.Path(src) / "config.json").read_text())
    conf["quantization_config"] = dict(MXFP4_QUANTIZATION_CONFIG)
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    return out


def _dequantize_mxfp4(tensors: dict) -> dict:
    """Experts' MXFP4 blocks to float32 by transformers' own dequantizer (what its loader runs
    with ``dequantize=True``), in the layout GptOssExperts holds."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch, out = _torch(), {}
    for name, t in tensors.items():
        if name.endswith("_blocks"):
            base = name.removesuffix("_blocks")
            out[base] = convert_moe_packed_tensors(t, tensors[base + "_scales"], dtype=torch.float32)
        elif not name.endswith("_scales"):
            out[name] = t
    return out


def load_reference(path):
    """The checkpoint at ``path`` loaded by transformers, float32, eval mode.

    Kimi-K2 goes through ``DeepseekV3ForCausalLM``; FP8 checkpoints are dequantized here
    (see module doc), MXFP4 ones by transformers' own dequantizer (its MXFP4 loader needs
    ``accelerate``), and the dequantized copy is loaded.
    """
    torch = _torch()

    path = pathlib.Path(path)
    cfg = json.loads((path / "config.json").read_text())
    config = _hf_config(cfg)
    quant = cfg.get("quantization_config") or {}
    if quant.get("quant_method") not in ("fp8", "mxfp4"):
        model = causal_lm_class(config).from_pretrained(path, config=config, dtype=torch.float32)
        return model.float().eval()
    tensors = _read_all(path)
    tensors = _dequantize_fp8(tensors, torch.float32) if quant["quant_method"] == "fp8" else _dequantize_mxfp4(tensors)
    with tempfile.TemporaryDirectory(prefix="colibri-oracle-") as tmp:
        tmp = pathlib.Path(tmp)
        _write_all(tmp, tensors, shards=1)
        gen = path / "generation_config.json"
        if gen.exists():
            (tmp / gen.name).write_text(gen.read_text())
        model = causal_lm_class(config).from_pretrained(tmp, config=config, dtype=torch.float32)
        # materialise every tensor before the temporary files go away
        model = model.float()
        for p in model.parameters():
            p.data = p.data.clone()
        for b in model.buffers():
            b.data = b.data.clone()
    return model.eval()


# DeepSeek-V4's release: which of transformers' tensors it stores in FP8 (the rest as saved)
_V4_FP8 = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)\.weight$|\.shared_experts\.w[123]\.weight$")
V4_RELEASE_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
                           "activation_scheme": "dynamic"}


def _release_name(name: str) -> str:
    for old, new in (("model.embed_tokens.weight", "embed.weight"), ("model.norm.weight", "norm.weight"),
                     ("model.hc_head.hc_", "hc_head_"), (".attn.norm.weight", ".attn.kv_norm.weight"), ("model.layers.", "layers.")):
        name = name.replace(old, new)
    return name


def _e8m0_fp8(w):
    """FP8 e4m3 codes of w [rows, cols] and power-of-two block scales (E8M0 bytes), 128 × 128."""
    import numpy as np

    from colibri.convert.synthetic.storage import encode_e4m3

    rows, cols = w.shape
    R, C = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    padded = np.zeros((R * FP8_BLOCK, C * FP8_BLOCK), np.float32)
    padded[:rows, :cols] = w
    amax = np.abs(padded.reshape(R, FP8_BLOCK, C, FP8_BLOCK)).max(axis=(1, 3))
    exponent = np.ceil(np.log2(np.maximum(amax, 1e-30) / 448)).astype(np.int32)
    scale = np.repeat(np.repeat(np.ldexp(np.float32(1), exponent), FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
    return encode_e4m3(w / scale), (exponent + 127).astype(np.uint8)


def _fp4(w):
    """DeepSeek-V4's FP4 of w [rows, cols]: E2M1 codes two a byte (the even element low) and a
    power-of-two scale per 32 (E8M0 bytes)."""
    import numpy as np

    values = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    groups = w.reshape(w.shape[0], -1, 32)
    exponent = np.ceil(np.log2(np.maximum(np.abs(groups).max(axis=2), 1e-30) / 6)).astype(np.int32)
    scaled = groups / np.ldexp(np.float32(1), exponent)[..., None]
    codes = np.abs(np.abs(scaled)[..., None] - values).argmin(-1).astype(np.uint8) | (np.signbit(scaled) << 3).astype(np.uint8)
    codes = codes.reshape(w.shape[0], -1)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).view(np.int8), (exponent + 127).astype(np.uint8)


def _release_config(conf: dict) -> dict:
    """transformers' DeepSeek-V4 config.json as the release writes it: compress_ratios,
    num_hash_layers, rope_theta, compress_rope_theta and rope_scaling."""
    rates, rope = conf.pop("compress_rates"), conf.pop("rope_parameters")
    conf["compress_ratios"] = [rates.get(kind, 0) for kind in conf.pop("layer_types")] + [0]  # and the MTP block's
    conf["num_hash_layers"] = conf.pop("mlp_layer_types").count("hash_moe")
    compress = {k: v for k, v in rope["compress"].items() if k not in ("rope_theta", "partial_rotary_factor", "rope_type",
                                                                       "attention_factor")}
    conf.update(rope_theta=rope["main"]["rope_theta"], compress_rope_theta=rope["compress"]["rope_theta"], rope_scaling=compress)
    return conf


def to_deepseek_v4_release(src, out) -> pathlib.Path:
    """A copy of the transformers-format DeepSeek-V4 checkpoint `src` as the release stores it:
    its names, FP8 attention and shared experts with E8M0 block scales, FP4 routed experts, the
    hash layers' unused router bias, and an MTP tensor (both skipped on conversion)."""
    import numpy as np
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    torch = _torch()
    src, out = pathlib.Path(src), pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((src / name).read_bytes())
    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(file))
    release = {}
    for name, w in tensors.items():
        new = _release_name(name)
        scale = new.removesuffix(".weight") + ".scale"
        if _V4_FP8.search(name):
            codes, exponents = _e8m0_fp8(w)
            release[new] = torch.from_numpy(codes).view(torch.float8_e4m3fn)
            release[scale] = torch.from_numpy(exponents).view(torch.float8_e8m0fnu)
        elif _EXPERT.match(name):
            packed, exponents = _fp4(w)
            release[new], release[scale] = torch.from_numpy(packed), torch.from_numpy(exponents).view(torch.float8_e8m0fnu)
        else:
            release[new] = torch.from_numpy(w)
    conf = _release_config(json.loads((src / "config.json").read_text()))
    for layer in range(conf["num_hash_layers"]):
        release[f"layers.{layer}.ffn.gate.bias"] = torch.zeros(conf["n_routed_experts"])
    release["mtp.0.norm.weight"] = torch.ones(conf["hidden_size"])
    names = list(release)
    halves = names[:len(names) // 2], names[len(names) // 2:]
    weight_map = {}
    for i, part in enumerate(halves):
        file = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: release[n].contiguous() for n in part}, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    conf.update(quantization_config=V4_RELEASE_QUANTIZATION, expert_dtype="fp4")
    (out / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    return out
