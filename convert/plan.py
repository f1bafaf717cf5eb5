"""Check a checkpoint against what its config implies, and list the work of converting it.

Everything a conversion could trip on later — a missing, unexpected or misshapen
tensor, a non-float weight, an FP8 weight without its scale — is found here, before
a single byte of output is written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from colibri.convert.arch import Adapter, adapter_for
from colibri.convert.arch.base import ExpertNames, normalized_config
from colibri.formats.checkpoint import CONVERTIBLE_DTYPES, INTEGER_DTYPES, MXFP4_DTYPE, Checkpoint, CheckpointError
from colibri.formats.layout import EXPERT_MATRICES
from colibri.formats.messages import some
from colibri.formats.model_config import ModelConfig

IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@dataclass(frozen=True)
class ResidentTensor:
    name: str  # canonical (gguf) name
    source: str  # Hugging Face name
    shape: tuple[int, ...]
    columns: tuple[int, ...] | None = None  # the source's columns this is, in order, when not all
    rows: tuple[int, ...] | None = None  # the source's rows this is, in order, when not all (read whole)
    transform: str | None = None  # convert.arch.base.ResidentView.transform

    def select(self, values: np.ndarray) -> np.ndarray:
        """This tensor's part of rows of its source (all of them when `rows` is set), in its shape."""
        if values.ndim != len(self.shape):  # a DeltaNet's convolution [channels, 1, kernel]
            values = values.reshape(-1, *self.shape[1:])
        if self.rows is not None:
            values = values[np.asarray(self.rows)]
        if self.columns is not None:
            values = np.ascontiguousarray(values[..., np.asarray(self.columns)])
        if self.transform == "plus_one":
            return values + np.float32(1)
        if self.transform == "neg_exp":
            return -np.exp(values)
        return values


@dataclass(frozen=True)
class ExpertLayerSource:
    layer: int
    count: int
    shapes: dict[str, tuple[int, int]]  # gate/up/down → (rows, row length)
    names: ExpertNames
    fused: bool  # gate_up_proj + down_proj (in names.fused_layout) instead of per-expert tensors

    @property
    def canonical(self) -> dict[str, str]:
        return {m: f"blk.{self.layer}.ffn_{m}_exps.weight" for m in EXPERT_MATRICES}


@dataclass
class ConversionPlan:
    config: ModelConfig
    resident: list[ResidentTensor]
    expert_layers: list[ExpertLayerSource]
    skipped: list[str]  # tensors deliberately left out (multi-token prediction layers, a vision tower)


def expected_expert_tensors(src: ExpertLayerSource) -> dict[str, tuple]:
    shapes, count = src.shapes, src.count
    if src.fused:
        return dict(zip(src.names.fused_names, src.names.fused_shapes(count, *shapes["gate"])))
    tensors = {}
    for e in range(count):
        for matrix, name in zip(EXPERT_MATRICES, src.names.per_expert_names(e)):
            tensors[name] = shapes[matrix]
    return tensors


def make_plan(checkpoint: Checkpoint, adapter: Adapter | None = None) -> ConversionPlan:
    """Validate `checkpoint` against its config.json and return the conversion plan."""
    adapter = adapter or adapter_for(checkpoint.config)
    config = normalized_config(adapter, checkpoint.config)
    present = dict(checkpoint.tensors)
    mtp_layers = range(config.n_layers, config.n_layers + adapter.mtp_layers(checkpoint.config))
    skipped = sorted(n for n in present if _layer_of(n) in mtp_layers or IGNORED.search(n) or adapter.skips(n, config))
    for name in skipped:
        present.pop(name)
    skipped += checkpoint.other_model_tensors  # a multimodal checkpoint's vision tower and projector
    for name in [n for n in present if n.endswith(".weight_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        if weight not in present or present[weight].dtype != "F8_E4M3":
            raise CheckpointError(f"{present[name].file.name}: {name} scales no FP8 weight {weight}")
        present.pop(name)
    # compressed-tensors' FP8 scales (`.weight_scale`) and DeepSeek-V4's block scales (`.scale`)
    for name in [n for n in present if n.endswith((".weight_scale", ".scale"))]:
        weight = name.removesuffix("_scale") if name.endswith(".weight_scale") else name.removesuffix(".scale") + ".weight"
        if present.get(weight) is not None and present[weight].dtype == "F8_E4M3":
            present.pop(name)

    expected: dict[str, tuple] = dict(adapter.global_tensors(config))
    for layer in range(config.n_layers):
        expected.update(adapter.layer_tensors(config, layer))
    expert_layers = []
    for layer in config.moe_layers:
        fused = adapter.experts(layer).fused_names[0]
        names = adapter.experts(layer, packed=fused in present and present[fused].dtype == MXFP4_DTYPE)
        src = ExpertLayerSource(layer, config.n_experts, adapter.expert_shapes(config), names, fused in present)
        expected.update(expected_expert_tensors(src))
        expert_layers.append(src)

    _compare(present, expected, config.architecture, adapter.integer_tensors)
    resident = []
    expert_tensor_names = {n for src in expert_layers for n in expected_expert_tensors(src)}
    for name, shape in expected.items():
        if name in expert_tensor_names:
            continue
        views = adapter.resident_views(name, shape, config)
        if not views:
            raise CheckpointError(f"{name}: no canonical gguf name for this {config.architecture} tensor")
        resident += [ResidentTensor(v.name, name, tuple(v.shape), v.columns, v.rows, v.transform) for v in views]
    return ConversionPlan(config, resident, expert_layers, skipped)


def _layer_of(name: str) -> int | None:
    match = re.match(r"model\.layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def _compare(present: dict, expected: dict[str, tuple], architecture: str, integers: tuple[str, ...] = ()) -> None:
    missing = [n for n in expected if n not in present]
    if missing:
        raise CheckpointError(f"checkpoint lacks tensor {some(missing, 1)}, which config.json implies")
    unexpected = [n for n in present if n not in expected]
    if unexpected:
        file = present[unexpected[0]].file.name
        raise CheckpointError(f"{file}: unexpected tensor {some(unexpected, 1)} for {architecture} as config.json describes it")
    for name, shape in expected.items():
        entry = present[name]
        if entry.shape != tuple(shape):
            raise CheckpointError(f"{entry.file.name}: tensor {name} has shape {list(entry.shape)}, config.json implies {list(shape)}")
        if name.endswith(integers) and entry.dtype in INTEGER_DTYPES:
            continue
        if entry.dtype not in CONVERTIBLE_DTYPES:
            raise CheckpointError(f"{entry.file.name}: tensor {name} has dtype {entry.dtype}, expected a float type, packed "
                                  "INT4 or MXFP4")
