#!/usr/bin/env python
"""Costs as the model widens: the manifest's open time at real shapes, and (given a converted
model) decode and prompt speed with the Python time per layer.

    python bench/scale.py                        # manifest open times at real shapes
    python bench/scale.py --model DIR            # and decode / prompt speed of a converted model
    python bench/scale.py --replicate FROM OUT 48   # OUT: FROM's layers repeated to 48 layers

Manifest shapes (written as manifests only: the reader opens and checks a manifest without
reading the data files): DeepSeek-V3's layout (61 layers, 3 dense, 256 experts top-8, MLA),
Qwen3-30B-A3B's (48 layers, 128 experts top-8, hidden 2048, expert FFN 768), and DeepSeek's
with twice the layers, to show the cost stays linear. Encodings follow the Q4_K_M recipe.

Models for `--model`:
- the wide DeepSeek layout at hidden 256, as issue 22 measured it: `tiny_config("deepseek_v3",
  num_hidden_layers=61, n_routed_experts=256, num_experts_per_tok=8, first_k_dense_replace=3,
  n_group=8, topk_group=4)` written by `convert.synthetic` and converted to Q4_K_M;
- the Qwen3-30B-A3B shape: a converted Qwen3-MoE of that hidden size, expert count and FFN
  with a few layers, repeated to 48 by `--replicate` (hard links; the output means nothing,
  the bytes and calls per token are the real shape's).

Every expert is read into the cache first, then decode is timed in RAM with 2 threads (the
median of 5 runs), fed seeded random token ids as llama-bench feeds them, and then greedily
(a second row: a random model's greedy loop revisits a few experts), against the ceiling of
the bytes a token reads at this machine's read bandwidth. The calls from Python into numba
kernels, and the time outside them (the Python per layer, a slight overcount: the counter's
own cost is in it), come from a separate pass on random ids with each compiled function of
the runtime wrapped by a counter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import statistics
import tempfile
import time

import numpy as np

from colibri.convert.arch import ADAPTERS, tiny_model
from colibri.convert.arch.base import normalized_config
from colibri.formats.config_check import expected_expert_shapes, expected_tensors
from colibri.formats.encodings import tensor_bytes
from colibri.formats.layout import (EXPERT_ALIGN, EXPERT_MATRICES, FORMAT_VERSION, TENSOR_ALIGN, AlignedFileWriter, ModelLayout,
                                    write_manifest)
from colibri.formats.recipe import Recipe
from colibri.runtime import kernels
from colibri.runtime.kernels.emitter import TARGET_CPUS, restart_for

SHAPES = {
    "deepseek-v3 (61 x 256)": ("deepseek_v3", {"num_hidden_layers": 61, "n_routed_experts": 256, "num_experts_per_tok": 8,
                                               "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
                                               "hidden_size": 7168, "moe_intermediate_size": 2048,
                                               "intermediate_size": 18432, "vocab_size": 129280}),
    "qwen3-30b-a3b (48 x 128)": ("qwen3_moe", {"num_hidden_layers": 48, "num_experts": 128, "num_experts_per_tok": 8,
                                                "hidden_size": 2048, "moe_intermediate_size": 768, "vocab_size": 151936,
                                                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}),
    "deepseek-v3, 122 layers": ("deepseek_v3", {"num_hidden_layers": 122, "n_routed_experts": 256, "num_experts_per_tok": 8,
                                                "first_k_dense_replace": 3, "n_group": 8, "topk_group": 4,
                                                "hidden_size": 7168, "moe_intermediate_size": 2048,
                                                "intermediate_size": 18432, "vocab_size": 129280}),
}
DIGEST = "ab" * 32


def write_wide_manifest(directory: pathlib.Path, arch: str, overrides: dict) -> int:
    """A manifest of the shape, with Q4_K_M's encodings; returns the number of expert records."""
    config = normalized_config(ADAPTERS[arch], {**tiny_model(arch).config, **overrides})
    recipe = Recipe("Q4_K_M", config.n_layers, config.n_experts, config.tie_word_embeddings)
    tensors, offset = {}, 0
    for name, shape in expected_tensors(config).items():
        encoding = recipe.encoding(name, shape)
        nbytes = tensor_bytes(encoding, shape)
        tensors[name] = {"file": "resident.bin", "offset": offset, "nbytes": nbytes, "encoding": encoding,
                         "shape": list(shape), "sha256": DIGEST}
        offset += -(-nbytes // 64) * 64
    files, layers = {"resident.bin": {"size": offset}}, []
    for layer in config.moe_layers:
        matrices, record = {}, 0
        for m, shape in zip(EXPERT_MATRICES, expected_expert_shapes(config).values()):
            encoding = recipe.encoding(f"blk.{layer}.ffn_{m}_exps.weight", shape)
            nbytes = tensor_bytes(encoding, shape)
            matrices[m] = {"encoding": encoding, "shape": list(shape), "offset": record, "nbytes": nbytes}
            record += nbytes
        stride = -(-record // EXPERT_ALIGN) * EXPERT_ALIGN
        file = f"experts/blk.{layer:03d}.bin"
        layers.append({"layer": layer, "file": file, "offset": 0, "stride": stride, "count": config.n_experts,
                       "expert_bytes": record, "matrices": matrices, "sha256": [DIGEST] * config.n_experts})
        files[file] = {"size": stride * config.n_experts}
    write_manifest(directory, {
        "format": "colibri", "format_version": FORMAT_VERSION, "converter": {"name": "bench/scale.py", "version": "0"},
        "config": config.to_dict(), "quant": {"recipe": "Q4_K_M", "overrides": [], "imatrix": None},
        "provenance": {"source": "synthetic", "revision": None, "source_files": {}, "skipped_tensors": []},
        "files": files, "tensors": tensors, "expert_layers": layers, "tokenizer_files": [],
    })
    return sum(entry["count"] for entry in layers)


def manifest_open_times(repeat: int) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for label, (arch, overrides) in SHAPES.items():
            directory = pathlib.Path(root) / arch / str(len(rows))
            directory.mkdir(parents=True)
            records = write_wide_manifest(directory, arch, overrides)
            ModelLayout(directory)  # warm: the schema and imports
            times = []
            for _ in range(repeat):
                started = time.perf_counter()
                ModelLayout(directory)
                times.append(time.perf_counter() - started)
            rows.append({"shape": label, "expert_records": records,
                         "manifest_bytes": (directory / "colibri.json").stat().st_size,
                         "open_s_median": statistics.median(times), "open_s_min": min(times)})
    return rows


@contextlib.contextmanager
def counted_numba_calls():
    """Count the calls Python makes into numba-compiled functions while the block runs, and
    the seconds spent in them under "seconds in numba" (the dispatcher class's call is wrapped;
    calls between compiled functions are not calls; a `DirectCall` goes through the dispatcher
    meanwhile, so its calls count, timed with the typing they otherwise skip)."""
    from numba.core.registry import CPUDispatcher

    from colibri.runtime.kernels.direct_call import DirectCall

    calls: dict[str, float] = {"seconds in numba": 0.0}
    original, direct = CPUDispatcher.__call__, DirectCall.__call__
    own = "__call__" in CPUDispatcher.__dict__

    def counting(self, *args, **kwargs):
        name = self.py_func.__qualname__
        calls[name] = calls.get(name, 0) + 1
        started = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            calls["seconds in numba"] += time.perf_counter() - started

    CPUDispatcher.__call__ = counting
    DirectCall.__call__ = lambda self, *args: self.kernel(*args)  # past the dispatcher no more: counted
    try:
        yield calls
    finally:
        DirectCall.__call__ = direct
        if own:
            CPUDispatcher.__call__ = original
        else:
            del CPUDispatcher.__call__


def model_speed(model: pathlib.Path, threads: int, tokens: int, prompts: tuple[int, ...], ram_budget: str) -> dict:
    from colibri.runtime import open_model

    m = open_model(model, threads=threads, ctx=max(prompts) + 11 * tokens + 16, ram_budget=ram_budget)
    layers = m.config.n_layers
    if m.store.index.capacity >= m.config.n_experts * len(m.config.moe_layers):  # every expert read in first
        for layer in m.config.moe_layers:
            m.store.fetch(layer, np.arange(m.config.n_experts))
    rng = np.random.default_rng(0)
    result = {"layers": layers, "moe_layers": len(m.config.moe_layers), "prompt_tok_per_s": {}}
    for n in prompts:
        ids = rng.integers(0, m.config.vocab_size, n).tolist()
        m.reset()
        m.prefill(ids[:2], all_logits=False)  # compile and fill the cache
        runs = []
        for _ in range(3):
            m.reset()
            started = time.perf_counter()
            m.prefill(ids, all_logits=False)
            runs.append(time.perf_counter() - started)
        result["prompt_tok_per_s"][n] = n / statistics.median(runs)
    m.reset()
    with counted_numba_calls() as calls:
        m.prefill(ids, all_logits=False)
    calls.pop("seconds in numba")
    result["numba_calls_per_layer_of_a_prompt"] = sum(calls.values()) / layers
    m.reset()
    token = int(np.argmax(m.prefill([1, 2, 3], all_logits=False)[-1]))
    for _ in range(4):
        token = int(np.argmax(m.decode(token)))
    fed = rng.integers(0, m.config.vocab_size, 6 * tokens).tolist()  # 5 timed runs and the counted pass
    runs = {"random": [], "greedy": []}
    for run in range(5):  # the median of five runs of `tokens` each way (a shared machine is noisy)
        started = time.perf_counter()
        for token in fed[run * tokens:(run + 1) * tokens]:
            m.decode(token)
        runs["random"].append(time.perf_counter() - started)
        started = time.perf_counter()
        for _ in range(tokens):
            token = int(np.argmax(m.decode(token)))
        runs["greedy"].append(time.perf_counter() - started)
    elapsed, greedy = statistics.median(runs["random"]), statistics.median(runs["greedy"])
    started = time.perf_counter()
    with counted_numba_calls() as calls:
        for token in fed[5 * tokens:]:
            m.decode(token)
    outside = time.perf_counter() - started - calls.pop("seconds in numba")
    # the bytes a token reads: every resident tensor but the embedding table (one row of it),
    # and k experts of each MoE layer; the ceiling is that at this machine's read bandwidth
    c, layout = m.config, m.layout
    resident = sum(t.nbytes for name, t in layout.tensors.items() if name != "token_embd.weight")
    experts = sum(c.n_experts_used * layout.expert_layers[i].expert_bytes for i in c.moe_layers)
    bandwidth = kernels.measure_read_bandwidth()
    result.update({"decode_tok_per_s": tokens / elapsed, "ms_per_token": 1e3 * elapsed / tokens,
                   "greedy_decode_tok_per_s": tokens / greedy,
                   "bytes_per_token": resident + experts, "read_bandwidth_gb_s": bandwidth / 1e9,
                   "ceiling_tok_per_s": bandwidth / (resident + experts),
                   "python_us_per_layer": 1e6 * outside / tokens / layers,
                   "numba_calls_per_token_per_layer": sum(calls.values()) / tokens / layers,
                   "numba_calls_per_token": {name: n / tokens for name, n in sorted(calls.items(), key=lambda kv: -kv[1])}})
    return result


def replicate_layers(source: pathlib.Path, out: pathlib.Path, layers: int) -> None:
    """A model of `layers` layers made of a converted model's own (layer i is layer i mod n's
    tensors, copied into a resident file of its own, and expert file, hard-linked): a real
    shape's per-token bytes and calls without converting a checkpoint of that size. Speed only:
    its output means nothing."""
    manifest = json.loads((source / "colibri.json").read_text())
    n = manifest["config"]["n_layers"]
    copies = []  # (new name, the source's entry)
    for name, info in manifest["tensors"].items():
        if not name.startswith("blk."):
            copies.append((name, info))
            continue
        layer, rest = name[4:].split(".", 1)
        copies += [(f"blk.{target}.{rest}", info) for target in range(int(layer), layers, n)]
    tensors, files, expert_layers = {}, {}, []
    resident = AlignedFileWriter(out / "resident.bin")
    with open(source / "resident.bin", "rb") as f:
        for name, info in copies:
            f.seek(info["offset"])
            tensors[name] = dict(info, offset=resident.start(TENSOR_ALIGN))
            resident.write(f.read(info["nbytes"]))
    files["resident.bin"] = {"size": resident.commit()}
    by_layer = {entry["layer"]: entry for entry in manifest["expert_layers"]}
    for target in range(layers):
        if target % n in by_layer:
            entry = dict(by_layer[target % n], layer=target, file=f"experts/blk.{target:03d}.bin")
            expert_layers.append(entry)
            files[entry["file"]] = manifest["files"][by_layer[target % n]["file"]]
            (out / "experts").mkdir(parents=True, exist_ok=True)
            os.link(source / by_layer[target % n]["file"], out / entry["file"])
    for name, info in manifest["files"].items():
        if not name.startswith("experts/") and name != "resident.bin":
            files[name] = info
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            os.link(source / name, out / name)
    config = dict(manifest["config"], n_layers=layers)
    for field in ("moe_layers", "sliding_layers", "index_layers", "linear_layers", "hash_layers"):  # the lists of
        config[field] = [i for i in range(layers) if i % n in manifest["config"].get(field, [])]  # layers, repeated too
    if config.get("compress_ratios"):  # and the values per layer (DeepSeek-V4's)
        config["compress_ratios"] = [manifest["config"]["compress_ratios"][i % n] for i in range(layers)]
    manifest.update(tensors=tensors, files=files, expert_layers=expert_layers, config=config)
    manifest.pop("self_sha256", None)
    write_manifest(out, manifest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=pathlib.Path, help="a converted wide model to time decode and prompts on")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", choices=("native", *TARGET_CPUS), default="native",
                        help="compile the kernels for this target (avx2: this CPU without AVX-512, AMX or AVX-VNNI)")
    parser.add_argument("--ram-budget", default="16G", help="open_model's RAM budget (default: %(default)s; "
                        "the decode is meant to run with every expert cached)")
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per timed run, median of 5 runs (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=7, help="manifest opens timed per shape (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--replicate", nargs=3, metavar=("FROM", "OUT", "LAYERS"),
                        help="write OUT, a model of LAYERS layers made of converted model FROM's (hard links), and stop")
    args = parser.parse_args()
    restart_for(args.isa)
    if args.replicate:
        replicate_layers(pathlib.Path(args.replicate[0]), pathlib.Path(args.replicate[1]), int(args.replicate[2]))
        return
    result = {"manifest": manifest_open_times(args.repeat)}
    if args.model:
        result["model"] = model_speed(args.model, args.threads, args.tokens, (16, 64, 256), args.ram_budget)
        result["model"]["kernels"] = kernels.kernel_paths()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    for row in result["manifest"]:
        print(f"{row['shape']:<28} {row['expert_records']:>6} expert records, {row['manifest_bytes'] / 1e6:.2f} MB: "
              f"open {1e3 * row['open_s_median']:.0f} ms (median of {args.repeat}, min {1e3 * row['open_s_min']:.0f})")
    if "model" in result:
        r = result["model"]
        print(f"kernels: {r['kernels']}")
        print(f"decode, random ids {r['decode_tok_per_s']:.1f} tok/s ({r['ms_per_token']:.1f} ms a token), "
              f"{r['numba_calls_per_token_per_layer']:.1f} numba calls and {r['python_us_per_layer']:.0f} us of Python "
              f"per layer per token; ceiling {r['ceiling_tok_per_s']:.0f} tok/s ({r['bytes_per_token'] / 1e6:.0f} MB a "
              f"token at {r['read_bandwidth_gb_s']:.1f} GB/s): {r['decode_tok_per_s'] / r['ceiling_tok_per_s']:.0%} of it")
        print(f"decode, greedy {r['greedy_decode_tok_per_s']:.1f} tok/s")
        print("prompt " + ", ".join(f"{n} tokens {v:.1f} tok/s" for n, v in r["prompt_tok_per_s"].items())
              + f"; {r['numba_calls_per_layer_of_a_prompt']:.1f} numba calls per layer for the {max(r['prompt_tok_per_s'])}-token one")


if __name__ == "__main__":
    main()
