"""Quantization recipes: which encoding each canonical tensor gets.

The mixes (`Q2_K` ... `Q6_K`, `Q4_0` ... `Q5_1`, `IQ4_NL`, `IQ4_XS`, `MXFP4_MOE`, `TQ1_0`,
`TQ2_0`) follow llama.cpp's
`llama_tensor_get_type_impl` (src/llama-quant.cpp) for their file types, so the same
checkpoint gets the same type per tensor as `llama-quantize ... TYPE` (with or without an
importance matrix); `Q8_0`, `BF16`, `F16` and `F32` are uniform. Names are gguf's canonical tensor names
(`blk.3.ffn_down_exps.weight`); shapes are row-major with the row length last.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

try:  # Python 3.11+
    import re._constants as _regex_constants
    import re._parser as _regex_parser
except ImportError:  # Python 3.10
    import sre_constants as _regex_constants
    import sre_parse as _regex_parser

from colibri.formats.encodings import ENCODINGS, READ_ONLY_ENCODINGS, fits

MADE_ENCODINGS = tuple(e for e in ENCODINGS if e not in READ_ONLY_ENCODINGS)

# each mix and the type most of its tensors get (llama.cpp's default type of the file type)
MIXES = {"Q2_K": "Q2_K", "Q2_K_S": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
         "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
         "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS",
         "MXFP4_MOE": "MXFP4", "TQ1_0": "TQ1_0", "TQ2_0": "TQ2_0"}
RECIPES = (*MIXES, "Q8_0", "BF16", "F16", "F32")
IMATRIX_REQUIRED = ("Q2_K_S",)  # llama-quantize refuses these without an importance matrix
# llama-quantize's mixes of the grid types, which colibri-convert does not make (READ_ONLY_ENCODINGS)
UNMADE_MIXES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M")

# llama.cpp's fallback when a row is not a whole number of 256-weight super-blocks.
K_QUANT_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL",
                    "TQ1_0": "Q4_0", "TQ2_0": "Q4_0"}

_LAYER = re.compile(r"^blk\.(\d+)\.")


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get a more precise type."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def parse_override(text: str) -> tuple[str, str]:
    """'REGEX=TYPE' → (regex, TYPE), checking both."""
    pattern, sep, encoding = text.rpartition("=")
    if not sep or not pattern:
        raise ValueError(f"override {text!r} is not of the form REGEX=TYPE")
    encoding = encoding.upper()
    if encoding in READ_ONLY_ENCODINGS:
        raise ValueError(f"override {text!r}: colibri-convert does not make {encoding} yet (its kernels read it from "
                         "a GGUF; the converter does not place the grid types)")
    if encoding not in ENCODINGS:
        raise ValueError(f"override {text!r}: unknown type {encoding} (known: {', '.join(MADE_ENCODINGS)})")
    problem = pattern_problem(pattern)
    if problem:
        raise ValueError(f"override {text!r}: {problem}")
    return pattern, encoding


MAX_PATTERN = 256  # characters of an override regex


def pattern_problem(pattern) -> str | None:
    """Why an override regex may not be used, or None. Names are matched with Python's
    backtracking `re`, so a repetition inside a repetition (`(.*.*)*Z`), which can take
    exponential time, is refused (so are alternatives under a repetition) along with anything that
    does not compile."""
    if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN:
        return f"not a regex of at most {MAX_PATTERN} characters"
    try:
        parsed = _regex_parser.parse(pattern)
    except (re.error, RecursionError, OverflowError) as e:
        return f"bad regex ({e})"
    if _nested_repeat(parsed, inside=False):
        return "a repetition of a repetition or of alternatives (e.g. (a+)*, (a|b)*) can take exponential time; write it without"
    return None


_REPEATS = {getattr(_regex_constants, n) for n in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(_regex_constants, n)}


def _nested_repeat(parsed, inside: bool) -> bool:
    for op, value in parsed:
        if op in _REPEATS:
            low, high, sub = value
            if inside and high != low:
                return True
            if _nested_repeat(sub, inside or high > 1):
                return True
        elif op == _regex_constants.SUBPATTERN and _nested_repeat(value[-1], inside):
            return True
        elif op == _regex_constants.BRANCH and (inside or any(_nested_repeat(b, inside) for b in value[1])):
            return True  # alternatives under a repetition backtrack as badly when they overlap
        elif op in (_regex_constants.ASSERT, _regex_constants.ASSERT_NOT) and _nested_repeat(value[1], inside):
            return True
    return False


def is_quantizable(name: str, shape) -> bool:
    """2-D weights are quantized; 1-D tensors, biases, the router gate and the DeltaNet
    convolution (llama.cpp's rule: rows of a few taps) stay F32."""
    return name.endswith(".weight") and len(shape) >= 2 and "ffn_gate_inp.weight" not in name and "ssm_conv1d" not in name


@dataclass
class Recipe:
    name: str
    n_layers: int
    n_experts: int
    tied_embeddings: bool
    overrides: list[tuple[str, str]] = field(default_factory=list)
    n_gqa: int = 1  # query heads per KV head
    has_imatrix: bool = False

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(f"unknown quantization {self.name!r} (known: {', '.join(RECIPES)})")
        for pattern, _ in self.overrides:
            problem = pattern_problem(pattern)
            if problem:
                raise ValueError(f"override {pattern!r}: {problem}")

    def encoding(self, name: str, shape, kept: str | None = None) -> str:
        """The encoding of tensor `name` with row-major `shape`; `kept`, when the source tensor
        already is exactly that encoding (packed INT4 is Q4_0), unless an override says otherwise."""
        if kept is not None:
            return next((encoding for pattern, encoding in self.overrides if re.search(pattern, name)), kept)
        if self.name == "F32" or not is_quantizable(name, shape):
            return "F32"
        if self.name in ("BF16", "F16"):
            return self.name
        chosen = self._mix(name, shape) if self.name in MIXES else "Q8_0"
        row = shape[-1]
        if not fits(chosen, row):
            chosen = K_QUANT_FALLBACK.get(chosen, chosen)
            if not fits(chosen, row):
                chosen = "F16"
            return chosen  # llama.cpp applies no user override to a tensor that needed a fallback
        for pattern, encoding in self.overrides:
            if re.search(pattern, name):
                if not fits(encoding, row):
                    raise ValueError(f"override {pattern}={encoding}: {name} has rows of {row} weights, not a multiple of the {encoding} block")
                return encoding
        return chosen

    def _mix(self, name: str, shape) -> str:
        """llama_tensor_get_type_impl for the mixes (one type per layer counted by the layer
        index, as llama.cpp does for models with experts)."""
        mix, chosen = self.name, MIXES[self.name]
        layer_match = _LAYER.match(name)
        layer, n = (int(layer_match.group(1)) if layer_match else -1), self.n_layers
        eight_experts = self.n_experts == 8
        if name == "output.weight" or (self.tied_embeddings and name == "token_embd.weight"):
            if mix == "MXFP4_MOE" or not fits(chosen, shape[-1]):
                return "Q8_0"
            return "Q6_K"
        if mix == "MXFP4_MOE":  # routed experts in MXFP4, everything else Q8_0
            return chosen if "_exps." in name else "Q8_0"
        if name == "token_embd.weight" and mix in ("TQ1_0", "TQ2_0"):
            return "Q4_K"
        if any(k in name for k in ("attn_v.weight", "attn_qkv.weight", "attn_kv_b.weight")):
            if eight_experts:
                return "Q8_0"
            if mix == "Q2_K":
                return "Q4_K" if self.n_gqa >= 4 else "Q3_K"
            if mix == "Q2_K_S" and self.n_gqa >= 4:
                return "Q4_K"
            if mix == "Q3_K_M":
                return "Q5_K" if layer < 2 else "Q4_K"
            if mix == "Q3_K_L":
                return "Q5_K"
            if mix in ("IQ4_NL", "IQ4_XS") and self.n_gqa >= 4:
                return "Q5_K"
            if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(layer, n):
                return "Q6_K"
            if mix == "Q4_K_S" and layer < 4:
                return "Q5_K"
            return chosen
        if "attn_k.weight" in name:
            return "Q8_0" if eight_experts else chosen
        if "ffn_down" in name:
            return {"Q2_K": "Q3_K",
                    "Q2_K_S": "Q4_K" if layer < n // 8 else chosen,
                    "Q3_K_M": "Q5_K" if layer < n // 16 else "Q4_K",
                    "Q3_K_L": "Q5_K",
                    "Q4_K_M": "Q6_K" if use_more_bits(layer, n) else chosen,
                    "IQ4_NL": "Q5_K" if layer < n // 8 and not self.has_imatrix else chosen,
                    "IQ4_XS": "Q5_K" if layer < n // 8 and not self.has_imatrix else chosen,
                    "Q5_K_M": "Q6_K" if use_more_bits(layer, n) else chosen,
                    "Q4_K_S": "Q5_K" if layer < n // 8 else chosen,
                    # with an imatrix, llama.cpp guards the first ffn_down layers of Q4_0 / Q5_0
                    "Q4_0": "Q4_1" if self.has_imatrix and layer < n // 8 else chosen,
                    "Q5_0": "Q5_1" if self.has_imatrix and layer < n // 8 else chosen}.get(mix, chosen)
        if "attn_output" in name:
            if eight_experts:
                return "Q5_K" if mix in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M", "IQ4_NL", "IQ4_XS") else chosen
            return {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(mix, chosen)
        return chosen
