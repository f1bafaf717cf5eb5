"""Check: colibri-convert's mixes against llama-quantize's, tensor by tensor, on tiny models.

For each architecture a tiny F32 checkpoint is written (`convert.synthetic`), converted to F32
and exported as GGUF (`colibri export-gguf`), then quantized by llama.cpp's `llama-quantize`
(with and without an importance matrix written here in llama-imatrix's format) and converted
by `colibri-convert --quant MIX [--imatrix]`. Every tensor both hold is compared: its type and
its bytes. A mix both refuse without an importance matrix (the grid mixes, Q2_K_S) counts as
agreeing; one only one of them refuses does not. (llama.cpp's GGUF stores Mixtral's q/k rows permuted, so their bytes are compared
only for types that differ; MLA's kv_b is split in llama.cpp's and not compared.)

    python bench/llama_quantize.py --llama-bin DIR [--archs qwen3_moe,deepseek_v3,mixtral] [--mixes Q2_K,...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

from colibri.convert.hf_to_colibri import ConvertOptions, convert
from colibri.convert.pipeline import ConvertError
from colibri.convert.plan import make_plan
from colibri.convert.synthetic import tiny_config, write_checkpoint
from colibri.formats.checkpoint import Checkpoint
from colibri.formats.layout import ModelLayout
from colibri.formats.recipe import MIXES
from colibri.runtime.imatrix_collect import ActivationSums

PERMUTED = ("attn_q.weight", "attn_k.weight")  # llama's GGUF row order differs from the checkpoint's
EXPERT_KEYS = {"qwen3_moe": "num_experts", "mixtral": "num_local_experts", "deepseek_v3": "n_routed_experts"}
# the tiny models (2-3 layers, 8 experts: llama.cpp's 8-expert rules) and a deeper one with 16
# experts, where the layer-dependent rules (use_more_bits, the first n/8 and n/16 layers) apply
VARIANTS = {"tiny": {}, "16 layers, 16 experts": {"num_hidden_layers": 16, "experts": 16}}


def ours(layout: ModelLayout, name: str):
    """(encoding, bytes) of tensor `name` in a colibri model, experts concatenated as in GGUF."""
    if name in layout.tensors:
        return layout.tensors[name].encoding, layout.tensor_data(name).reshape(-1)
    layer, matrix = int(name.split(".")[1]), name.split(".")[2].split("_")[1]
    table = layout.expert_layers[layer]
    data = [layout.expert_matrix_data(layer, e, matrix).reshape(-1) for e in range(table.count)]
    return table.matrices[matrix].encoding, np.concatenate(data)


def compare(arch: str, variant: str, mixes: list[str], llama_bin: Path, work: Path) -> list[str]:
    options = dict(VARIANTS[variant])
    if "experts" in options:
        options[EXPERT_KEYS[arch]] = options.pop("experts")
    work = work / f"{arch}-{variant.split()[0]}"
    work.mkdir()
    src = write_checkpoint(work / f"src-{arch}", arch, dtype="f32", config=tiny_config(arch, **options))
    convert(str(src), work / f"f32-{arch}", ConvertOptions(quant="F32", progress=False))
    f32_gguf = work / f"{arch}-f32.gguf"
    subprocess.run([sys.executable, "-m", "colibri.cli", "export-gguf", str(work / f"f32-{arch}"), str(f32_gguf),
                    "--no-progress"], check=True, capture_output=True)
    plan, rng = make_plan(Checkpoint(src)), np.random.default_rng(0)
    entries = {t.name: rng.uniform(0.1, 5.0, (1, t.shape[-1])) for t in plan.resident if len(t.shape) == 2}
    for layer in plan.expert_layers:
        for m, name in layer.canonical.items():
            entries[name] = rng.uniform(0.1, 5.0, (layer.count, layer.shapes[m][1]))
    imatrix = work / f"imatrix-{arch}.gguf"
    sums = ActivationSums()
    sums.sums = entries
    sums.counts = {name: np.full(len(rows), 7) for name, rows in entries.items()}
    sums.write(imatrix, ["bench"], chunk_count=4, chunk_size=512)
    lines = []
    for mix in mixes:
        for use_imatrix in (False, True):
            theirs = work / f"llama-{arch}-{mix}-{use_imatrix}.gguf"
            done = subprocess.run([str(llama_bin / "llama-quantize"), *(["--imatrix", str(imatrix)] if use_imatrix else []),
                                   str(f32_gguf), str(theirs), mix, "2"], capture_output=True, text=True, errors="replace")
            mine = work / f"ours-{arch}-{mix}-{use_imatrix}"
            try:
                convert(str(src), mine, ConvertOptions(quant=mix, imatrix=imatrix if use_imatrix else None, progress=False))
            except ConvertError as e:  # both must refuse it (a grid mix, or Q2_K_S, without an importance matrix)
                agreed = done.returncode != 0 and ("importance matrix" in done.stdout + done.stderr or "imatrix" in done.stderr)
                lines.append(f"{arch:<12} {variant:<22} {mix:<7} {'imatrix' if use_imatrix else 'plain':<8} "
                             f"{'both refuse' if agreed else 'ONLY OURS REFUSES'}: {e}"[:160])
                print(lines[-1], flush=True)
                continue
            if done.returncode:
                raise SystemExit(f"llama-quantize {mix} failed where colibri-convert did not:\n{done.stderr[-2000:]}")
            layout = ModelLayout(mine)
            names = set(layout.tensors) | {f"blk.{layer}.ffn_{m}_exps.weight"
                                           for layer, t in layout.expert_layers.items() for m in t.matrices}
            types = data = compared = 0
            for t in gguf.GGUFReader(theirs).tensors:
                if t.name not in names:
                    continue
                compared += 1
                encoding, stored = ours(layout, t.name)
                if t.tensor_type.name != encoding:
                    types += 1
                elif not t.name.endswith(PERMUTED) or arch != "mixtral":
                    data += not np.array_equal(np.asarray(t.data).view(np.uint8).reshape(-1), stored)
            lines.append(f"{arch:<12} {variant:<22} {mix:<7} {'imatrix' if use_imatrix else 'plain':<8} {compared:>3} tensors: "
                         f"{types} types differ, {data} differ in bytes")
            print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder with llama.cpp's llama-quantize")
    parser.add_argument("--archs", default="qwen3_moe,deepseek_v3,mixtral")
    parser.add_argument("--mixes", default=",".join(MIXES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        lines = [line for arch in args.archs.split(",") for variant in VARIANTS
                 for line in compare(arch, variant, args.mixes.split(","), args.llama_bin, Path(work))]
    same = sum(' 0 types differ, 0 differ' in line or 'both refuse' in line for line in lines)
    print(f"{same} of {len(lines)} conversions identical or refused by both")


if __name__ == "__main__":
    main()
