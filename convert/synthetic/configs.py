"""The tiny hub-style config.json of each architecture, from its adapter's tiny model."""

from __future__ import annotations

import copy

from colibri.convert.arch import TINY_MODELS, tiny_model
from colibri.convert.synthetic.tokenizer import special_token_config_ids

ARCHITECTURES = tuple(TINY_MODELS)


def tiny_config(arch: str, **overrides) -> dict:
    """A complete hub-style ``config.json`` dict for a tiny model of ``arch``.

    Every weight matrix's input dimension is a multiple of 256 (K-quant friendly).
    ``overrides`` replace top-level keys; the special-token ids are derived from the
    synthetic tokenizer for the final ``vocab_size`` unless overridden explicitly.
    """
    cfg = copy.deepcopy(tiny_model(arch).config)
    cfg.update(copy.deepcopy(overrides))
    ids = special_token_config_ids(arch, int(cfg["vocab_size"]))
    for key, value in ids.items():
        if key not in overrides:
            cfg[key] = value
    if "torch_dtype" not in overrides and "dtype" not in overrides:
        cfg["torch_dtype"] = "bfloat16"
    cfg.setdefault("transformers_version", "4.57.1")
    return dict(sorted(cfg.items()))


def resolve_config(arch: str, config: dict | None) -> dict:
    """``config`` (default: the tiny one) as a copy whose model_type is ``arch``."""
    tiny_model(arch)
    cfg = tiny_config(arch) if config is None else copy.deepcopy(config)
    mt = cfg.get("model_type")
    if mt is not None and mt != arch:
        raise ValueError(f"config model_type {mt!r} does not match architecture {arch!r}")
    cfg["model_type"] = arch
    return cfg
