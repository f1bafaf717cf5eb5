"""Quantization recipes: which encoding each canonical tensor gets.

The mixes (`Q2_K` ... `Q6_K`, `Q4_0` ... `Q5_1`, `IQ4_NL`, `IQ4_XS`, `MXFP4_MOE`, `TQ1_0`,
`TQ2_0`, and the grid mixes `IQ1_S` ... `IQ3_M`) follow llama.cpp's `llama_tensor_get_type_impl`
(src/llama-quant.cpp) for their file types, so the same checkpoint gets the same type per tensor
as `llama-quantize ... TYPE` (with or without an importance matrix); `Q8_0`, `BF16`, `F16` and
`F32` are uniform. Names are gguf's canonical tensor names (`blk.3.ffn_down_exps.weight`); shapes
are row-major with the row length last.

Some of llama.cpp's rules count tensors, not layers: the attention-V-like tensors (`attn_v`,
`attn_qkv`, `attn_kv_b`) and, in the IQ1/IQ2 mixes, the `ffn_down` ones, in llama.cpp's order
(by layer, then by name). A recipe given the model's tensor names (`Recipe.for_model`) counts as
it does; without them it takes a tensor's layer for its count, which is the same when every layer
holds one such tensor.
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

from colibri.formats.config_check import EXPERT_ID_TABLE
from colibri.formats.encodings import ENCODINGS, fits

# each mix and the type most of its tensors get (llama.cpp's default type of the file type)
MIXES = {"Q2_K": "Q2_K", "Q2_K_S": "Q2_K", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
         "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K", "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K",
         "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0", "Q5_1": "Q5_1", "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS",
         "MXFP4_MOE": "MXFP4", "TQ1_0": "TQ1_0", "TQ2_0": "TQ2_0",
         "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M", "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_XS",
         "IQ2_M": "IQ2_S", "IQ3_XXS": "IQ3_XXS", "IQ3_XS": "IQ3_S", "IQ3_S": "IQ3_S", "IQ3_M": "IQ3_S"}
RECIPES = (*MIXES, "Q8_0", "BF16", "F16", "F32")
# kept float32 by the BF16 and F16 recipes, as transformers keeps them (DeepSeek-V4's stream
# mixing); llama-quantize's mixes quantize them
FLOAT32_IN_FLOAT_RECIPES = ("_hc_fn.weight", "hc_attn_fn.weight", "hc_ffn_fn.weight")
# llama.cpp's rules for one architecture (llama-quant.cpp), by colibri's model type: (the name parts
# of tensors it never quantizes, those of tensors it never quantizes below Q8_0); GLM-5-Next's MLA
# key and value halves are colibri's attn_kv_b
ARCHITECTURE_RULES = {
    "glm5_next_text": (("hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_",
                        "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight", "ssm_g_b.weight", "ssm_beta.weight",
                        "attn_kv_a_mqa.weight", "attn_kv_b.weight"), ("attn_q_a", "attn_q_b")),
}
# the types whose tensors llama-quantize quantizes only with an importance matrix entry (not the
# token embeddings or the output); Q2_K tensors need one too in a Q2_K_S file
IMATRIX_TYPES = ("IQ3_XXS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_M", "IQ1_S")
# the mixes whose rules llama.cpp groups as its 1- and 2-bit ones
LOW_BIT_MIXES = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")

# llama.cpp's fallback when a row is not a whole number of 256-weight super-blocks.
K_QUANT_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL",
                    "TQ1_0": "Q4_0", "TQ2_0": "Q4_0",
                    **{grid: "IQ4_NL" for grid in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S")}}
# llama.cpp's tensor categories (tensor_get_category), tested in this order by what a name contains
CATEGORIES = (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"), ("attn_v.weight", "attn_v"),
              ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
              ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down"))
ATTN_V_LIKE = ("attn_v", "attn_qkv", "attn_kv_b")

_LAYER = re.compile(r"^blk\.(\d+)\.")


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get a more precise type."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_category(name: str) -> str:
    """llama-quant.cpp's tensor_get_category, by name."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    return next((category for part, category in CATEGORIES if part in name), "other")


def layer_of(name: str) -> int:
    match = _LAYER.match(name)
    return int(match.group(1)) if match else -1


def counted_positions(names) -> dict[str, int]:
    """Each attention-V-like and each ffn_down tensor's place among its kind in llama.cpp's order
    (by layer, then by name: llama_model_loader's weight_name_comparer)."""
    places, counts = {}, {"attn_v": 0, "ffn_down": 0}
    for name in sorted(names, key=lambda n: (layer_of(n), n)):
        kind = tensor_category(name)
        kind = "attn_v" if kind in ATTN_V_LIKE else kind
        if kind in counts:
            places[name] = counts[kind]
            counts[kind] += 1
    return places


def parse_override(text: str) -> tuple[str, str]:
    """'REGEX=TYPE' → (regex, TYPE), checking both."""
    pattern, sep, encoding = text.rpartition("=")
    if not sep or not pattern:
        raise ValueError(f"override {text!r} is not of the form REGEX=TYPE")
    encoding = encoding.upper()
    if encoding not in ENCODINGS:
        raise ValueError(f"override {text!r}: unknown type {encoding} (known: {', '.join(ENCODINGS)})")
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
    """2-D weights are quantized; 1-D tensors, biases, the router gate, DeepSeek-V4's token →
    experts table and the DeltaNet convolution (llama.cpp's rule: rows of a few taps) stay F32;
    so do DeepSeek-V4's compressor position biases, which llama-quantize would quantize (they are
    added to logits, not multiplied: no importance matrix has them, so no low-bit mix could);
    and MiniMax-M3's indexer projections (llama.cpp's rule)."""
    return name.endswith(".weight") and len(shape) >= 2 and not any(
        part in name for part in ("ffn_gate_inp.weight", EXPERT_ID_TABLE, "ssm_conv1d", "compressor_ape.weight",
                                  "indexer.q_proj.weight", "indexer.k_proj.weight"))


@dataclass
class Recipe:
    name: str
    n_layers: int
    n_experts: int
    tied_embeddings: bool
    overrides: list[tuple[str, str]] = field(default_factory=list)
    n_gqa: int = 1  # query heads per KV head
    has_imatrix: bool = False
    names: tuple[str, ...] = ()  # every tensor of the model, for llama.cpp's counts (empty: layers count)
    architecture: str = ""  # the model type, for its ARCHITECTURE_RULES

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(f"unknown quantization {self.name!r} (known: {', '.join(RECIPES)})")
        for pattern, _ in self.overrides:
            problem = pattern_problem(pattern)
            if problem:
                raise ValueError(f"override {pattern!r}: {problem}")
        self._places = counted_positions(self.names)
        self._n_attn_v = sum(tensor_category(n) in ATTN_V_LIKE for n in self.names) or self.n_layers

    @classmethod
    def for_model(cls, name: str, config, names, overrides=(), has_imatrix: bool = False) -> "Recipe":
        """The recipe of a model (a normalized config and its tensors' canonical names)."""
        return cls(name, config.n_layers, config.n_experts, config.tie_word_embeddings, list(overrides),
                   n_gqa=config.n_heads // max(config.n_kv_heads, 1), has_imatrix=has_imatrix, names=tuple(names),
                   architecture=config.architecture)

    def encoding(self, name: str, shape, kept: str | None = None) -> str:
        """The encoding of tensor `name` with row-major `shape`; `kept`, when the source tensor
        already is exactly that encoding (packed INT4 is Q4_0), unless an override says otherwise."""
        if kept is not None:
            return next((encoding for pattern, encoding in self.overrides if re.search(pattern, name)), kept)
        kept_float, at_least_q8 = ARCHITECTURE_RULES.get(self.architecture, ((), ()))
        if self.name == "F32" or not is_quantizable(name, shape) or any(part in name for part in kept_float):
            return "F32"
        if self.name in ("BF16", "F16"):
            return "F32" if name.endswith(FLOAT32_IN_FLOAT_RECIPES) else self.name
        chosen = self._mix(name, shape) if self.name in MIXES else "Q8_0"
        if any(part in name for part in at_least_q8):
            chosen = "Q8_0"
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

    def needs_imatrix(self, name: str, encoding: str) -> bool:
        """Whether llama-quantize refuses tensor `name` in `encoding` without an importance matrix
        entry (tensor_requires_imatrix)."""
        if tensor_category(name) in ("token_embd", "output"):
            return False
        return encoding in IMATRIX_TYPES or (encoding == "Q2_K" and self.name == "Q2_K_S")

    def _place(self, name: str) -> int:
        """The tensor's count among its kind (attn_v, ffn_down) in llama.cpp's order; its layer without names."""
        return self._places.get(name, layer_of(name))

    def _mix(self, name: str, shape) -> str:
        """llama_tensor_get_type_impl for the mixes."""
        mix, chosen = self.name, MIXES[self.name]
        category, layer, n = tensor_category(name), layer_of(name), self.n_layers
        eight_experts, gqa4 = self.n_experts == 8, self.n_gqa >= 4
        if category == "output" or (self.tied_embeddings and category == "token_embd"):
            if mix == "MXFP4_MOE" or not fits(chosen, shape[-1]):
                return "Q8_0"
            if mix in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"):
                return "Q5_K"
            return "Q6_K" if chosen != "Q8_0" else chosen
        if mix == "MXFP4_MOE":  # routed experts in MXFP4, everything else Q8_0
            return chosen if "_exps." in name else "Q8_0"
        if category == "token_embd":
            return {"IQ2_XXS": "Q2_K", "IQ2_XS": "Q2_K", "IQ1_S": "Q2_K", "IQ1_M": "Q2_K", "IQ2_S": "IQ3_S",
                    "IQ2_M": "IQ3_S", "IQ3_XXS": "IQ3_S", "TQ1_0": "Q4_K", "TQ2_0": "Q4_K"}.get(mix, chosen)
        if mix in LOW_BIT_MIXES:
            return self._low_bit(mix, chosen, category, name)
        if category in ATTN_V_LIKE:
            return self._attn_v(mix, chosen, self._place(name), gqa4, eight_experts)
        if category == "attn_k":
            return "Q8_0" if eight_experts else {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(mix, chosen)
        if category == "attn_q":
            return {"IQ3_XS": "IQ3_XXS", "IQ3_XXS": "IQ2_S"}.get(mix, chosen)
        if category == "ffn_down":
            return self._ffn_down(mix, chosen, layer, n, eight_experts)
        if category == "attn_output":
            if eight_experts:
                return "Q5_K" if mix in ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M",
                                         "IQ3_S", "IQ3_M", "IQ4_XS") else chosen
            return {"Q2_K": "Q3_K", "IQ3_XXS": "IQ3_S", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K", "IQ3_M": "Q4_K"}.get(mix, chosen)
        if category in ("ffn_gate", "ffn_up") and mix == "IQ3_XS" and n // 8 <= layer < 7 * n // 8:
            return "IQ3_XXS"
        return chosen

    def _low_bit(self, mix: str, chosen: str, category: str, name: str) -> str:
        """The rules of the IQ1/IQ2 mixes, which take the place of every other rule for them."""
        two_s = mix in ("IQ2_S", "IQ2_M")
        if category in ATTN_V_LIKE:
            return "Q4_K" if self.n_gqa >= 4 or self.n_experts >= 4 else "IQ3_S" if two_s else "Q2_K"
        if self.n_experts == 8 and category == "attn_k":
            return "Q4_K"
        if category == "ffn_down":  # counted over every ffn_down tensor against the layer count
            return ("IQ3_S" if two_s else "Q2_K") if self._place(name) < self.n_layers // 8 else chosen
        if category == "attn_output":
            if self.n_experts == 8:
                return "Q5_K"
            return "IQ2_XXS" if mix in ("IQ1_S", "IQ1_M") else "IQ3_S" if two_s else chosen
        return chosen

    def _attn_v(self, mix: str, chosen: str, i: int, gqa4: bool, eight_experts: bool) -> str:
        """attn_v, attn_qkv and attn_kv_b: the `i`-th of the model's `_n_attn_v`."""
        if eight_experts:
            return "Q8_0"
        if mix == "Q2_K":
            return "Q4_K" if gqa4 else "Q3_K"
        if mix == "Q2_K_S" and gqa4:
            return "Q4_K"
        if mix == "IQ3_XXS":
            return "Q4_K" if gqa4 else "IQ3_XXS" if self.has_imatrix else "IQ3_S"
        if mix in ("IQ3_XS", "IQ3_S") and gqa4:
            return "Q4_K"
        if mix == "IQ3_M":
            return "Q4_K"
        if mix == "Q3_K_M":
            return "Q5_K" if i < 2 else "Q4_K"
        if mix == "Q3_K_L":
            return "Q5_K"
        if mix in ("IQ4_NL", "IQ4_XS") and gqa4:
            return "Q5_K"
        if mix in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, self._n_attn_v):
            return "Q6_K"
        if mix == "Q4_K_S" and i < 4:
            return "Q5_K"
        return chosen

    def _ffn_down(self, mix: str, chosen: str, layer: int, n: int, eight_experts: bool) -> str:
        """ffn_down, by its layer (a model with experts: llama.cpp's layer_info reads it from the name)."""
        imatrix = self.has_imatrix
        if mix == "Q2_K":
            return "Q3_K"
        if mix == "Q2_K_S":
            return "Q4_K" if layer < n // 8 else chosen
        if mix == "IQ3_XXS" and not imatrix:
            return "Q4_K" if layer < n // 8 else "Q3_K"
        if mix == "Q3_K_M":
            return "Q5_K" if layer < n // 16 else "Q4_K"
        if mix == "IQ3_M" and (layer < n // 8 or (eight_experts and use_more_bits(layer, n))):
            return "Q4_K"
        if mix == "Q3_K_L":
            return "Q5_K"
        if mix == "Q4_K_M":
            return "Q6_K" if use_more_bits(layer, n) else chosen
        if layer < n // 8 and mix in ("IQ4_NL", "IQ4_XS") and not imatrix:
            return "Q5_K"
        if mix == "Q5_K_M" and use_more_bits(layer, n):
            return "Q6_K"
        if mix == "Q4_K_S" and layer < n // 8:
            return "Q5_K"
        if mix in ("Q4_0", "Q5_0") and imatrix and layer < n // 8:  # llama.cpp guards the first layers with an imatrix
            return "Q4_1" if mix == "Q4_0" else "Q5_1"
        return chosen
