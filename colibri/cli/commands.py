"""The command-line face of colibri: `colibri <command>` and `colibri-convert`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import traceback
from dataclasses import replace
from pathlib import Path

from colibri.version import __version__

# Errors that are the user's input, not our bug: one line, no traceback (unless --debug).
def _user_errors() -> tuple[type[BaseException], ...]:
    from colibri.convert.arch import ConfigError
    from colibri.convert.hf_to_colibri import ConvertError
    from colibri.formats.checkpoint import CheckpointError
    from colibri.formats.encodings import EncodingError
    from colibri.formats.layout import FormatError
    from colibri.cli.imatrix_command import ImatrixInputError
    from colibri.runtime.engine import BudgetError, PromptError
    from colibri.runtime.kv_cache import ContextOverflow
    from colibri.runtime.plan import TraceError
    from colibri.runtime.text import TokenizerError
    from colibri.verify.perplexity import PerplexityError

    return (ConfigError, ConvertError, CheckpointError, EncodingError, FormatError, BudgetError, ContextOverflow,
            TokenizerError, PromptError, TraceError, ImatrixInputError, PerplexityError)


def _size(text: str) -> int:
    from colibri.runtime.memory import size_argument

    return size_argument(text)


def _recipe(text: str) -> str:
    from colibri.formats.recipe import RECIPES

    name = text.upper()
    if name not in RECIPES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a recipe (choose from {', '.join(RECIPES)})")
    return name


def _override(text: str) -> tuple[str, str]:
    from colibri.formats.recipe import parse_override

    try:
        return parse_override(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC",
                   help="checkpoint folder (config.json + safetensors), a Hugging Face repo id, or a .gguf file "
                        "(for a split GGUF, any part: the others are found next to it)")
    p.add_argument("out", metavar="OUT", help="output folder; an unfinished conversion there is resumed")
    p.add_argument("--quant", default=None, type=_recipe, metavar="RECIPE",
                   help="quantization recipe: one of llama-quantize's mixes (Q2_K ... Q6_K, Q4_0 ... Q5_1, IQ4_NL, "
                        "IQ4_XS, MXFP4_MOE, TQ1_0, TQ2_0, and IQ1_S ... IQ3_M, most of which need --imatrix: its "
                        "per-tensor choices, about 1.6 to 6.6 bits a weight) or a uniform Q8_0/BF16/F16/F32 "
                        "(default: Q4_K_M; a GGUF keeps its own types and takes no --quant)")
    p.add_argument("--override", action="append", default=[], type=_override, metavar="REGEX=TYPE",
                   help="force TYPE for tensors whose canonical name matches REGEX (first match wins; repeatable)")
    p.add_argument("--imatrix", type=Path, default=None, metavar="FILE",
                   help="an importance matrix (llama-imatrix's GGUF output) for ggml's weighted quantizers, as "
                        "llama-quantize --imatrix; tensors it has no entry for are quantized without")
    p.add_argument("--target-size", type=_size, default=None, metavar="SIZE",
                   help="choose each matrix's type, from the IQ1-IQ3 grid types and the K-quants, for the least "
                        "measured damage (its importance-weighted squared error on a sample of its rows) within SIZE "
                        "of weight files (binary units: 96G = 96 GiB); with --imatrix the grid types that need one "
                        "are candidates and damage is weighted by the activations; prints the table chosen and "
                        "records it as overrides (--quant's recipe types the rest)")
    p.add_argument("--max-read-per-token", type=_size, default=None, metavar="SIZE",
                   help="with --target-size, also bound the routed experts' bytes a token reads (e.g. 2G)")
    p.add_argument("--kl-base", type=Path, default=None, metavar="FILE",
                   help="with --target-size, check the choice through the model: a reference's log-probabilities on "
                        "calibration text (colibri perplexity REF --text FILE --save-base FILE, REF a BF16 or Q8_0 "
                        "conversion, or llama-perplexity --kl-divergence-base); each kind of tensor's damage is "
                        "weighed up and down, and the table whose conversion has the least mean KL divergence from it "
                        "is kept. Costs a conversion and a scoring run per table tried (--kl-tables at most), in a "
                        "scratch folder beside OUT; each score is journalled beside OUT (.OUT-scores.json), so a rerun "
                        "after a crash scores only the tables it has not")
    p.add_argument("--kl-chunks", type=int, default=None, metavar="K",
                   help="with --kl-base, score at most K of its chunks (default: all)")
    p.add_argument("--kl-tables", type=int, default=None, metavar="N",
                   help="with --kl-base, score at most N tables, the measured one first; each is a conversion and a "
                        "scoring run, and the search stops sooner when no weighting improves (default: 12)")
    p.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                   help="processes converting layers in parallel, ~0.3-0.6 GB of RAM each; a GGUF import uses "
                        "threads (default: %(default)s)")
    p.add_argument("--revision", help="hub revision (branch, tag or commit) when SRC is a repo id (default: main)")
    p.add_argument("--force", action="store_true", help="replace a different conversion already in OUT")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_convert(args: argparse.Namespace) -> int:
    from colibri.convert.hf_to_colibri import ConvertError, ConvertOptions, convert, format_summary

    options = ConvertOptions(
        quant=args.quant, overrides=args.override, imatrix=args.imatrix, workers=max(1, args.workers), force=args.force,
        revision=args.revision, progress=not args.no_progress and not args.json, target_size=args.target_size,
        max_read_per_token=args.max_read_per_token,
    )
    if args.kl_tables is not None:
        if args.kl_base is None:
            raise ConvertError("--kl-tables bounds the tables --kl-base scores; give --kl-base too")
        if args.kl_tables < 1:
            raise ConvertError(f"--kl-tables {args.kl_tables}: must be at least 1")
        options = replace(options, max_tables=args.kl_tables)
    if args.kl_base is None:
        summary = convert(args.src, args.out, options)
    elif args.target_size is None:
        raise ConvertError("--kl-base checks what --target-size chooses; give --target-size too")
    else:
        from colibri.cli.kl_scorer import KlScorer, journal_beside, scratch_beside

        with scratch_beside(Path(args.out)) as work:
            report = (lambda line: print(line, file=sys.stderr, flush=True)) if options.progress else None
            scorer = KlScorer(args.src, args.kl_base, options, work, journal_beside(Path(args.out)), args.kl_chunks,
                              report)
            summary = convert(args.src, args.out, replace(options, scorer=scorer))
            scorer.journal.remove()
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary, args.out))
    return 0


def add_export_gguf_arguments(p: argparse.ArgumentParser) -> None:
    from colibri.runtime.memory import size_argument

    p.add_argument("model", metavar="DIR", help="a converted colibri model folder")
    p.add_argument("out", metavar="OUT.gguf", help="the GGUF to write (with --split-max-size: OUT-00001-of-0000N.gguf, ...)")
    p.add_argument("--split-max-size", type=size_argument, default=0, metavar="SIZE",
                   help="split into parts of at most SIZE, e.g. 2G, named as llama.cpp's gguf-split does (default: one file)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_export_gguf(args: argparse.Namespace) -> int:
    from colibri.convert.colibri_to_gguf import export_gguf, format_export_summary

    summary = export_gguf(args.model, args.out, split_max_size=args.split_max_size, progress=not args.no_progress and not args.json)
    print(json.dumps(summary, indent=1) if args.json else format_export_summary(summary))
    return 0


REFERENCE_MODEL = Path(__file__).resolve().parents[2] / "models" / "stdlib-qwen3-moe"  # in a clone of the repository
DEMO_PROMPTS = ("def read_config(path):\n", "class Stack:\n    \"\"\"", "import os\n\n\ndef walk_files(root):\n",
                "    def __repr__(self):\n", "def parse_args(argv=None):\n    parser = ", "# Copy the file\n")


def run_demo(args: argparse.Namespace) -> int:
    """The whole path on a small model: convert → plan → run with stats → a batch folder. The model
    is the repository's trained reference model (Python's standard library is its text), or
    --source, or, outside a clone, a tiny random one built on the spot."""
    from colibri.cli.run import format_plan, format_stats
    from colibri.convert.hf_to_colibri import ConvertOptions, convert, format_summary
    from colibri.convert.synthetic import write_checkpoint
    from colibri.formats.layout import ModelLayout
    from colibri.runtime import open_model
    from colibri.runtime.memory import total_ram
    from colibri.runtime.plan import measure_disk_bandwidth, plan

    source = args.source or (str(REFERENCE_MODEL) if (REFERENCE_MODEL / "config.json").is_file() else None)
    out = os.path.join(args.dir, "model")
    if source is None:
        source = os.path.join(args.dir, "source")
        print(f"1. building a tiny {args.arch} checkpoint (random weights: its text is noise) in {source}", flush=True)
        write_checkpoint(source, args.arch)
    else:
        print(f"1. the checkpoint: {source}", flush=True)
    print("2. converting it to Q4_K_M (the first run compiles the kernels, ~30 s; later runs reuse numba's cache)", flush=True)
    summary = convert(source, out, ConvertOptions(quant="Q4_K_M", force=True, progress=False))
    print(format_summary(summary, out))
    print("3. planning for this machine", flush=True)
    layout = ModelLayout(out)
    print(format_plan(plan(layout, total_ram(), ctx=512, disk_bw=measure_disk_bandwidth(layout)), out))
    print(f"4. generating, greedy, from {DEMO_PROMPTS[0]!r}", flush=True)
    model = open_model(out, ctx=512)
    print(DEMO_PROMPTS[0], end="")
    for piece in model.generate(DEMO_PROMPTS[0], max_tokens=args.max_tokens):
        print(piece, end="", flush=True)
    print()
    print(format_stats(model.stats()))
    model.close()
    print(f"5. the nightly job: a folder of {len(DEMO_PROMPTS)} prompts, 3 decoded together, one answer file each", flush=True)
    prompts, answers = os.path.join(args.dir, "prompts"), os.path.join(args.dir, "answers")
    os.makedirs(prompts, exist_ok=True)
    shutil.rmtree(answers, ignore_errors=True)  # a rerun of the demo answers them again
    for i, opening in enumerate(DEMO_PROMPTS):
        with open(os.path.join(prompts, f"doc{i}.txt"), "w") as f:
            f.write(opening)
    return main(["run", "--model", out, "--prompt-dir", prompts, "--out-dir", answers, "--parallel", "3",
                 "--ctx", "512", "--max-tokens", str(args.max_tokens)])


def add_report_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE.jsonl", help="routing written by colibri run --trace-routing")
    p.add_argument("--stats", metavar="RUN.json", help="the stats colibri run --prompt-dir --stats wrote for the same run")
    p.add_argument("-o", "--output", required=True, metavar="report.html", help="the HTML file to write")


def report_main(args: argparse.Namespace) -> int:
    from colibri.cli.report import report_command

    return report_command(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="colibri", description=__doc__)
    parser.add_argument("--version", action="version", version=f"colibri {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from colibri.cli.run import add_plan_arguments, add_run_arguments, plan_command, run_command
    from colibri.verify.cli import add_verify_arguments, add_verify_source_arguments, verify_command, verify_source_command
    from colibri.cli.server.command import add_serve_arguments, serve_command
    from colibri.verify.smoke import add_smoke_arguments, smoke_command
    from colibri.cli.imatrix_command import add_imatrix_arguments, imatrix_command
    from colibri.verify.perplexity import add_perplexity_arguments, perplexity_command

    for name, help_text, add_arguments, command in (
        ("convert", "convert a Hugging Face checkpoint or a GGUF file to the colibri layout", add_convert_arguments, run_convert),
        ("export-gguf", "write a converted model as a GGUF file that llama.cpp runs (blocks copied, not re-quantized)",
         add_export_gguf_arguments, run_export_gguf),
        ("run", "generate text with a converted model (prompt, prompt file, chat or a folder of prompts)", add_run_arguments, run_command),
        ("plan", "the RAM budget and expected speed for a model on this machine", add_plan_arguments, plan_command),
        ("serve", "an OpenAI-compatible HTTP server (completions, chat, streaming) on the batch engine",
         add_serve_arguments, serve_command),
        ("verify-source", "check a downloaded checkpoint: shards, headers, tensors, sha256", add_verify_source_arguments, verify_source_command),
        ("verify", "check a converted model: manifest, sizes, every tensor and expert checksum", add_verify_arguments, verify_command),
        ("smoke", "fixed-prompt baseline: --record FILE, or --compare FILE (KL, top-1, agreement, speed)", add_smoke_arguments, smoke_command),
        ("imatrix", "an importance matrix from a text (llama-imatrix's GGUF, for colibri-convert --imatrix)",
         add_imatrix_arguments, imatrix_command),
        ("perplexity", "perplexity over a text as llama-perplexity computes it, and the KL divergence from a base "
                       "(--save-base / --kl-base)", add_perplexity_arguments, perplexity_command),
        ("report", "a self-contained HTML report of a run: routing heat map, cache hit rate, policy replay, the job",
         add_report_arguments, report_main),
    ):
        sub = commands.add_parser(name, help=help_text, description=help_text)
        add_arguments(sub)
        sub.set_defaults(run=command)

    demo = commands.add_parser("demo", help="the whole path on a small model: convert, plan, run, a batch folder")
    demo.add_argument("--dir", default="demo-out", help="working folder (default: %(default)s)")
    demo.add_argument("--source", default=None, metavar="DIR",
                      help="checkpoint to convert (default: the repository's trained reference model, "
                           "models/stdlib-qwen3-moe; outside a clone, a tiny random model of --arch)")
    demo.add_argument("--arch", default="qwen3_moe", help="architecture of the tiny random model (default: %(default)s)")
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens to generate (default: %(default)s)")
    demo.set_defaults(run=run_demo)
    return parser


def _one_line(error: BaseException) -> str:
    """An error as one line; an OSError names its file first (`--trace-routing /ro/t.jsonl:
    Permission denied`), as a user would look for it."""
    if isinstance(error, OSError) and error.filename is not None:
        return f"{error.filename}: {error.strerror or error}"
    return " ".join(str(error).split())


def _dispatch(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    args = parser.parse_args(argv)
    args.restartable = argv is None  # started from a shell: --isa may run it again (cli/isa_flag.py)
    try:
        return args.run(args)
    except (*_user_errors(), OSError) as e:
        if args.debug:
            traceback.print_exc()
        print(f"{parser.prog}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None) -> int:
    return _dispatch(build_parser(), argv)


def convert_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="colibri-convert", description="Convert a Hugging Face MoE checkpoint or a GGUF file to the colibri layout.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    add_convert_arguments(parser)
    parser.set_defaults(run=run_convert)
    return _dispatch(parser, argv)

