"""Synthetic Mixture-of-Experts checkpoints in the exact Hugging Face hub layout.

``write_checkpoint`` writes a folder that looks like a hub repository of a real MoE
architecture (config.json, sharded safetensors + index, tokenizer.json,
tokenizer_config.json, generation_config.json) filled with deterministic random
weights.  Tensor names, shapes and the set of tensors follow what the real hub
checkpoints hold, which is also what ``transformers`` ``save_pretrained`` writes for
the model type (per-expert tensors, Mixtral's ``block_sparse_moe`` prefix, ...).  Each
architecture's tiny config and tokenizer family are data in its adapter (`convert.arch`).

Only numpy, safetensors' *format* (written by hand) and the ``tokenizers`` library are
used: no torch and no transformers, so this package ships (``colibri demo``, fast tests,
benchmarks).

- ``configs``: the tiny config.json of each architecture;
- ``tensor_plan``: which tensors a checkpoint holds (``TensorSpec``), named by the adapters;
- ``values``: the value definition, a tensor's float32 values from its name and seed (a
  fused expert tensor concatenates the per-expert parts, so fused and per-expert
  checkpoints of one seed hold the same weights);
- ``storage``: bf16 rounding and DeepSeek-V3's block FP8 (e4m3, ``<weight>_scale_inv``);
- ``tokenizer``: the byte-level BPE tokenizer files of each tokenizer family;
- ``writer``: shards, index and ``write_checkpoint``.
"""

from colibri.convert.synthetic.configs import ARCHITECTURES, tiny_config
from colibri.convert.synthetic.tensor_plan import TensorSpec, checkpoint_plan, mtp_layer_indices
from colibri.convert.synthetic.storage import bf16_bits_to_float32, float32_to_bf16_bits, fp8_e4m3_to_float32
from colibri.convert.synthetic.tokenizer import build_tokenizer, write_tokenizer_files
from colibri.convert.synthetic.values import stored_values, tensor_values
from colibri.convert.synthetic.writer import FP8_QUANTIZATION_CONFIG, write_checkpoint
from colibri.formats.checkpoint import FP8_BLOCK

#: bumped whenever the generated values or the file layout change (benchmark stamps)
GENERATOR_VERSION = 1

__all__ = [
    "ARCHITECTURES",
    "FP8_BLOCK",
    "FP8_QUANTIZATION_CONFIG",
    "GENERATOR_VERSION",
    "TensorSpec",
    "bf16_bits_to_float32",
    "build_tokenizer",
    "checkpoint_plan",
    "float32_to_bf16_bits",
    "fp8_e4m3_to_float32",
    "mtp_layer_indices",
    "stored_values",
    "tensor_values",
    "tiny_config",
    "write_checkpoint",
    "write_tokenizer_files",
]
