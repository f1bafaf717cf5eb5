"""Train one of colibri's reference models: a small MoE model on real text, CPython's standard library.

    .venv/bin/python models/train.py qwen3_moe models/stdlib-qwen3-moe
    .venv/bin/python models/train.py deepseek_v3 models/stdlib-deepseek-v3

Nobody needs to rerun this: the weights are committed. It is here so that they can be made
again, seeded, on 2 CPU cores in well under an hour each (torch and transformers from the
`oracle` extra; Chromium, when present, draws the loss curve's PNG).

The corpus is every `.py` file of the standard library of the Python that runs this script
(tests, site-packages and the `encodings` tables left out), split by file: a file whose path
hashes into the first 16th is held out. The held-out files are written, in order, to
`models/data/stdlib-heldout.txt`, and a slice of the training files to
`models/data/stdlib-calibration.txt` (for importance matrices); both are under the PSF licence
(`models/data/LICENSE-PSF.txt`). A byte-level BPE of 4096 tokens (Qwen2's splitting, so that
llama.cpp reads it as `qwen2`) is trained on the training files with the same seed for both
models, which therefore share one tokenizer.

Transformers' own classes are trained (AdamW, warmup then cosine decay, windows of 512
tokens drawn at random): Qwen3-MoE with its load-balancing loss, DeepSeek-V3 with its
correction bias moved towards balance after every step, as DeepSeek's auxiliary-loss-free
balancing does. The weights are saved in bf16. The model card (README.md) gets the steps,
the loss curve, the held-out perplexity as llama-perplexity computes it (windows of 512, the
second half of each scored) and the routing's statistics on the held-out text.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from colibri.cli.charts import line_svg

DATA = Path(__file__).resolve().parent / "data"
VOCAB = 4096
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2's pre-tokenizer regex (llama.cpp's "qwen2"), so that an exported GGUF tokenizes alike.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
LEFT_OUT = {"test", "tests", "idle_test", "site-packages", "encodings", "__pycache__"}
CONTEXT = 512
CALIBRATION_BYTES = 256 << 10
# Widths are multiples of 256, so that every K-quant applies without fallbacks.
SHAPES = {
    "qwen3_moe": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
                      norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=0.01, rope_theta=10000.0),
    "deepseek_v3": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=4,
                        n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=256, kv_lora_rank=256,
                        qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_group=4, topk_group=2,
                        norm_topk_prob=True, routed_scaling_factor=2.5, rope_theta=10000.0, rope_scaling=None),
}
BIAS_STEP = 1e-3  # DeepSeek's correction-bias update per step (its γ)


def corpus_files() -> tuple[Path, list[Path], list[Path]]:
    """(the standard library's folder, its training files, its held-out files), each sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not LEFT_OUT & set(p.relative_to(root).parts))
    held = [p for p in files if hashlib.sha256(str(p.relative_to(root)).encode()).digest()[0] < 16]
    return root, [p for p in files if p not in held], held


def read_texts(paths: list[Path]) -> list[str]:
    texts = []
    for p in paths:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return texts


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """A byte-level BPE of VOCAB tokens, the special tokens first."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def token_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Every text's ids, each followed by <|endoftext|>."""
    end = tok.token_to_id("<|endoftext|>")
    ids = []
    for encoding in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(end)
    return np.asarray(ids, np.int64)


def build_model(arch: str, seed: int):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None,
                  eos_token_id=0, pad_token_id=None, rms_norm_eps=1e-6)
    if arch == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, **SHAPES[arch]))
    return DeepseekV3ForCausalLM(DeepseekV3Config(**common, **SHAPES[arch]))


class RouteRecorder:
    """Forward hooks on every MoE router: the experts each token chose, per layer."""

    def __init__(self, model):
        self.chosen: dict[int, list[torch.Tensor]] = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None and hasattr(gate, "top_k"):
                self.handles.append(gate.register_forward_hook(lambda m, args, out, i=i: self.chosen.setdefault(i, []).append(out[-1].detach())))

    def take(self) -> dict[int, torch.Tensor]:
        chosen = {i: torch.cat(c) for i, c in self.chosen.items()}
        self.chosen = {}
        return chosen


def balance_bias(model, chosen: dict[int, torch.Tensor]) -> None:
    """DeepSeek's auxiliary-loss-free balancing: each expert's correction bias moves by BIAS_STEP
    towards the mean load (up when it had fewer tokens than the mean, down when more)."""
    for i, ids in chosen.items():
        gate = model.model.layers[i].mlp.gate
        load = torch.bincount(ids.flatten(), minlength=gate.num_experts).float()
        gate.e_score_correction_bias += BIAS_STEP * torch.sign(load.mean() - load)


def heldout_loss(model, windows: torch.Tensor) -> float:
    with torch.no_grad():
        return float(np.mean([model(input_ids=w[None], labels=w[None]).loss.item() for w in windows]))


def train(model, arch: str, stream: np.ndarray, heldout: np.ndarray, args) -> list[dict]:
    """The training loop; returns its log (step, train loss, held-out loss every --eval-every steps)."""
    rng = np.random.default_rng(args.seed)
    eval_starts = np.random.default_rng(args.seed + 1).integers(0, len(heldout) - CONTEXT, 16)
    eval_windows = torch.as_tensor(np.stack([heldout[s:s + CONTEXT] for s in eval_starts]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    recorder = RouteRecorder(model) if arch == "deepseek_v3" else None
    log, started, smoothed = [], time.monotonic(), None
    for step in range(1, args.steps + 1):
        warm = min(1.0, step / args.warmup)
        progress = max(0.0, (step - args.warmup) / max(1, args.steps - args.warmup))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        starts = rng.integers(0, len(stream) - CONTEXT, args.batch)
        batch = torch.as_tensor(np.stack([stream[s:s + CONTEXT] for s in starts]))
        model.train()
        out = model(input_ids=batch, labels=batch)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if recorder:
            with torch.no_grad():
                balance_bias(model, recorder.take())
        loss = float(out.loss)  # Qwen3-MoE's includes its load-balancing term
        smoothed = loss if smoothed is None else 0.95 * smoothed + 0.05 * loss
        row = {"step": step, "train_loss": round(smoothed, 4), "seconds": round(time.monotonic() - started, 1)}
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            if recorder:
                recorder.take()
            row["heldout_loss"] = round(heldout_loss(model, eval_windows), 4)
            if recorder:
                recorder.take()
            print(json.dumps(row), flush=True)
        log.append(row)
    return log


def llama_perplexity(model, ids: np.ndarray, chunks: int | None = None) -> tuple[float, float, int]:
    """llama-perplexity's figure on `ids`: windows of CONTEXT, the last CONTEXT/2 − 1 tokens of
    each scored; (PPL, its standard error, windows)."""
    count = len(ids) // CONTEXT if chunks is None else min(chunks, len(ids) // CONTEXT)
    first, nll = CONTEXT // 2, []
    with torch.no_grad():
        for c in range(count):
            window = torch.as_tensor(ids[c * CONTEXT:(c + 1) * CONTEXT])
            logits = model(input_ids=window[None]).logits[0].double()
            logp = torch.log_softmax(logits[first:CONTEXT - 1], dim=-1)
            nll.append(-logp[torch.arange(CONTEXT - 1 - first), window[first + 1:]].numpy())
    nll = np.concatenate(nll)
    ppl = math.exp(nll.mean())
    return ppl, ppl * math.sqrt(max(nll.var(), 0.0) / (len(nll) - 1)), count


def routing_stats(model, ids: np.ndarray, windows: int = 32) -> list[dict]:
    """Per MoE layer, on held-out windows: how uneven the load is and how often a token reuses
    the experts of the token before it."""
    recorder = RouteRecorder(model)
    with torch.no_grad():
        for c in range(min(windows, len(ids) // CONTEXT)):
            model(input_ids=torch.as_tensor(ids[c * CONTEXT:(c + 1) * CONTEXT])[None])
    rows = []
    for layer, chosen in sorted(recorder.take().items()):
        experts = model.model.layers[layer].mlp.gate.num_experts
        load = np.bincount(chosen.flatten().numpy(), minlength=experts) / chosen.numel()
        entropy = -(load[load > 0] * np.log(load[load > 0])).sum() / math.log(experts)
        picks = chosen.view(-1, CONTEXT, chosen.shape[-1]).numpy()
        reuse = np.mean([len(set(a) & set(b)) / len(a) for window in picks for a, b in zip(window[1:], window[:-1])])
        uniform_reuse = chosen.shape[-1] / experts
        rows.append({"layer": layer, "most_used_share": round(float(load.max()), 4), "least_used_share": round(float(load.min()), 4),
                     "load_entropy": round(float(entropy), 4), "consecutive_reuse": round(float(reuse), 4),
                     "reuse_if_uniform": round(uniform_reuse, 4)})
    for handle in recorder.handles:
        handle.remove()
    return rows


def loss_png(log: list[dict], out: Path) -> bool:
    """The loss curve as OUT (PNG) through headless Chromium; False when there is no Chromium."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        return False
    evaluated = [r for r in log if "heldout_loss" in r]
    series = [("training loss (smoothed)", [r["train_loss"] for r in evaluated]),
              ("held-out loss", [r["heldout_loss"] for r in evaluated])]
    svg = line_svg("loss", series, "cross-entropy (nats a token)", "step", x_values=[r["step"] for r in evaluated],
                   width=760, height=360)
    with tempfile.TemporaryDirectory() as work:
        page = Path(work) / "loss.html"
        page.write_text(f"<!doctype html><html><body style='margin:8px;font-family:sans-serif'>{svg}</body></html>")
        subprocess.run([chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--disable-background-networking", "--disable-component-update", "--disable-sync",
                        f"--user-data-dir={work}/profile", "--hide-scrollbars", "--window-size=800,400",
                        f"--screenshot={out}", page.as_uri()], capture_output=True, timeout=120, check=True)
    return True


def write_data_files(root: Path, train_paths: list[Path], held: list[Path]) -> None:
    """The held-out text, a calibration slice of the training text, and the licence they are under."""
    DATA.mkdir(exist_ok=True)
    (DATA / "stdlib-heldout.txt").write_text("".join(read_texts(held)), encoding="utf-8")
    calibration, size = [], 0
    for text in read_texts(train_paths[:: max(1, len(train_paths) // 64)]):
        calibration.append(text)
        size += len(text.encode())
        if size > CALIBRATION_BYTES:
            break
    (DATA / "stdlib-calibration.txt").write_text("".join(calibration), encoding="utf-8")
    shutil.copyfile(root / "LICENSE.txt", DATA / "LICENSE-PSF.txt")


def evaluate(model, heldout: np.ndarray) -> dict:
    """Held-out perplexity (all windows, and the first 16, which the tests compare a conversion
    with) and the routing's statistics, of the saved bf16 weights computed in f32."""
    ppl, stderr, windows = llama_perplexity(model, heldout)
    first16, _, _ = llama_perplexity(model, heldout, 16)
    return {"heldout_ppl": round(ppl, 4), "heldout_ppl_stderr": round(stderr, 4), "heldout_windows": windows,
            "heldout_ppl_first16": round(first16, 6), "routing": routing_stats(model, heldout)}


CARD = """# {name}

A small Mixture-of-Experts model ({arch}, {parameters:.1f} M parameters, {experts} experts of which {top_k} are
chosen per token in each of its {moe_layers} MoE layers) trained by `models/train.py` on CPython {python}'s
standard library. colibri's reference model: its quality figures (which quant to pick, KL, perplexity),
cache hit rates and prefetch accuracy are measured on it, and `make demo` runs it. It completes Python
code; it is far too small to follow instructions.

## Data
Every `.py` file of the standard library of Python {python} (tests, site-packages and the `encodings`
tables left out): {train_files} training files, {corpus_tokens:,} tokens; {held_files} files held out
(those whose path's sha256 starts with a byte below 16), {heldout_tokens:,} tokens, in
`models/data/stdlib-heldout.txt`. The text is the Python Software Foundation's, under the PSF License
Agreement (`models/data/LICENSE-PSF.txt`). Tokenizer: a byte-level BPE of 4096 tokens with Qwen2's
splitting, trained on the training files (llama.cpp reads it as `qwen2`); `<|endoftext|>` separates files.

## Training
Seed {seed}; {steps} steps of {batch} windows of {context} tokens drawn at random ({training_tokens:,} tokens,
{epochs:.1f} passes over the training text); AdamW (β 0.9/0.95, weight decay 0.1), learning rate {lr} after
{warmup} warm-up steps, cosine to a tenth; gradients clipped at 1.0. {balance}
{minutes} minutes on {threads} CPU threads, torch {torch}. Saved in bf16.

![loss curve](loss.png)

## Held-out perplexity
{ppl:.3f} ± {ppl_stderr:.3f} (llama-perplexity's method: {windows} windows of {context} tokens, the last
{scored} of each scored), computed by transformers on the saved bf16 weights in f32.
On the first 16 windows: {first16:.4f}.

## Routing on the held-out text
How uneven the load is (the share of all choices that went to the most and least used expert, and
the entropy of the load over log(experts): 1 is uniform), and how often a token chose an expert
the token before it had chosen (were routing independent and uniform: {uniform:.0%}).

| layer | most used | least used | load entropy | reused from the token before |
|---|---|---|---|---|
{routing}
"""


def write_card(out: Path, stats: dict, shape: dict) -> None:
    routing = "\n".join(f"| {r['layer']} | {r['most_used_share']:.1%} | {r['least_used_share']:.1%} | {r['load_entropy']:.3f} "
                        f"| {r['consecutive_reuse']:.1%} |" for r in stats["routing"])
    experts = shape.get("num_experts", shape.get("n_routed_experts"))
    balance = ("The load-balancing loss is weighted 0.01." if stats["arch"] == "qwen3_moe" else
               f"After each step every routed expert's correction bias moved by {BIAS_STEP:g} towards the mean load; "
               "one shared expert, the first layer dense.")
    (out / "README.md").write_text(CARD.format(
        name=out.name, arch=stats["arch"], parameters=stats["parameters"] / 1e6, experts=experts,
        top_k=shape["num_experts_per_tok"], moe_layers=len(stats["routing"]), python=stats["python"],
        train_files=stats["train_files"], held_files=stats["held_files"], corpus_tokens=stats["corpus_tokens"],
        heldout_tokens=stats["heldout_tokens"], seed=stats["seed"], steps=stats["steps"], batch=stats["batch"],
        context=CONTEXT, training_tokens=stats["training_tokens"], epochs=stats["training_tokens"] / stats["corpus_tokens"],
        lr=stats["lr"], warmup=stats["warmup"], balance=balance, minutes=stats["training_minutes"], threads=stats["threads"],
        torch=stats["torch"], ppl=stats["heldout_ppl"], ppl_stderr=stats["heldout_ppl_stderr"],
        windows=stats["heldout_windows"], scored=CONTEXT - 1 - CONTEXT // 2, first16=stats["heldout_ppl_first16"],
        uniform=shape["num_experts_per_tok"] / experts, routing=routing))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arch", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=1100)
    parser.add_argument("--batch", type=int, default=8, help="windows of 512 tokens per step (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--evaluate", action="store_true",
                        help="do not train: evaluate the model saved in OUT again and rewrite its card")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    root, train_paths, held = corpus_files()
    if not args.evaluate:
        write_data_files(root, train_paths, held)
    train_texts = read_texts(train_paths)
    tok = train_tokenizer(train_texts) if not args.evaluate else Tokenizer.from_file(str(args.out / "tokenizer.json"))
    stream = token_stream(tok, train_texts)
    heldout = token_stream(tok, [(DATA / "stdlib-heldout.txt").read_text(encoding="utf-8")])[:-1]
    print(f"corpus: Python {sys.version.split()[0]} standard library, {len(train_paths)} training files "
          f"({len(stream)} tokens), {len(held)} held out ({len(heldout)} tokens)", flush=True)

    if args.evaluate:
        saved = json.loads((args.out / "training.json").read_text())
        log, minutes = saved["log"], saved["training_minutes"]
    else:
        model = build_model(args.arch, args.seed)
        started = time.monotonic()
        log = train(model, args.arch, stream, heldout, args)
        minutes = round((time.monotonic() - started) / 60, 1)
        args.out.mkdir(parents=True, exist_ok=True)
        model = model.to(torch.bfloat16)
        model.config.output_router_logits = False
        model.save_pretrained(args.out)
        tok.save(str(args.out / "tokenizer.json"))
        (args.out / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
            "bos_token": None, "add_bos_token": False, "model_max_length": 4096}, indent=1) + "\n")
    # the saved bf16 weights as transformers loads them, computed in f32: what a converted model holds
    # (the trained object in bf16 would also round its rotary frequencies)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.bfloat16).float().eval()
    stats = {"arch": args.arch, "seed": args.seed, "steps": args.steps, "batch": args.batch, "context": CONTEXT,
             "lr": args.lr, "warmup": args.warmup, "training_minutes": minutes, "threads": args.threads,
             "parameters": sum(p.numel() for p in model.parameters()), "train_files": len(train_paths),
             "held_files": len(held), "training_tokens": args.steps * args.batch * CONTEXT,
             "corpus_tokens": int(len(stream)), "heldout_tokens": int(len(heldout)), **evaluate(model, heldout),
             "python": sys.version.split()[0], "torch": torch.__version__}
    (args.out / "training.json").write_text(json.dumps({**stats, "log": log}, indent=1) + "\n")
    drawn = loss_png(log, args.out / "loss.png")
    write_card(args.out, stats, SHAPES[args.arch])
    print(json.dumps({k: v for k, v in stats.items() if k != "routing"}), f"loss.png: {'written' if drawn else 'no Chromium'}")


if __name__ == "__main__":
    main()
