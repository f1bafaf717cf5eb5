"""Tokenizers between a colibri model folder and GGUF tokenizer metadata, both ways.

``add_tokenizer_metadata`` writes the ``tokenizer.ggml.*`` keys and the chat template for the
Hugging Face tokenizer files of a model folder, the way llama.cpp's ``convert_hf_to_gguf.py``
does; ``tokenizer_files_from_gguf`` rebuilds ``tokenizer.json``, ``tokenizer_config.json`` and
``generation_config.json`` from them, so that ``runtime.text.Tokenizer`` reads the same ids,
special tokens, stop tokens and chat template.

Two tokenizer kinds travel, in both directions:

- byte-level BPE (GGUF model ``gpt2``): vocabulary, merges, and the pre-tokenizer by its
  llama.cpp name (``tokenizer.ggml.pre``). Import knows the names in ``_BYTE_LEVEL_PRE`` (and
  ``_PRE_ALIASES``) and refuses others, since guessing would silently change every token id;
  a GGUF without a name gets what llama.cpp runs then, its ``default`` splitting. Export names
  the pre-tokenizer whose splitting of ``_CHECK_TEXT`` matches the tokenizer.json's, or writes
  ``default`` when none does.
- SentencePiece-style BPE (GGUF model ``llama``, tokenizer.json BPE with byte fallback):
  vocabulary with scores and token types. Import derives the merges from the scores as
  transformers does and rebuilds the tokenizer.json of Llama-2 / Mixtral (a space prefix on
  every text between special tokens, which is also what llama.cpp does; a tokenizer.json
  whose Metaspace prepends only at the very start comes back in this form, which differs
  from it on text after special tokens and on leading spaces); export derives scores from
  the merge order.

Stop tokens: a GGUF has ``eos`` plus ``eot`` and ``eom``, and llama.cpp also stops on the
tokens whose text it knows as end-of-generation (``_LLAMA_CPP_EOG_TEXTS``). Import lists all
of them in ``generation_config.json`` (so a folder whose vocabulary has, say, <|endoftext|>
without stopping on it comes back stopping on it, as llama.cpp does); export puts the stop
tokens that llama.cpp would not find on its own in ``eot`` and ``eom``.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections import Counter
from dataclasses import dataclass

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from colibri.formats.messages import one_line
from colibri.formats.safe_json import read_json_object

__all__ = ["GGUFTokenizerError", "add_tokenizer_metadata", "tokenizer_files_from_gguf"]

_KEY = gguf.Keys.Tokenizer
_TYPE = gguf.TokenType


class GGUFTokenizerError(ValueError):
    """A tokenizer that cannot be carried between tokenizer.json and GGUF; the message is one line."""


# --------------------------------------------------------------------------------------
# byte-level pre-tokenizers llama.cpp knows by name (regexes from llama.cpp's
# src/llama-vocab.cpp, in the form of the models' own tokenizer.json)
# --------------------------------------------------------------------------------------

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    # the cased letters of many scripts (written as escapes: several are canonical singletons)
    ("\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373"
    "\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d"
    "\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
    "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d"
    "\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a"
    "\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2"
    "\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"),
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    r"\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
)
_DEEPSEEK_V3_SPLITS = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
     r"""| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
)
_KIMI_K2_SPLIT = "|".join((  # tokenization_kimi.py of moonshotai/Kimi-K2
    r"[\p{Han}]+",
    (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
     r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"),
    (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
     r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"),
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
))
#: what llama.cpp runs for a byte-level vocabulary named "default" or not named at all
_LLAMA_CPP_DEFAULT_SPLITS = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]")


@dataclass(frozen=True)
class _ByteLevelPre:
    """One llama.cpp byte-level pre-tokenizer in its Hugging Face form."""

    splits: tuple[str, ...] = ()  # regexes, each an isolated Split, in order
    individual_digits: bool = False  # then a Digits step
    gpt2_regex: bool = False  # ByteLevel splits with GPT-2's regex itself
    nfc: bool = False  # the NFC normalizer of the model's tokenizer.json
    ignore_merges: bool = False  # a word that is a token stays whole (llama.cpp's ignore_merges)
    add_bos: bool = False  # llama.cpp's add_bos_token when the GGUF does not say

    def pre_tokenizer(self) -> pre_tokenizers.PreTokenizer:
        steps = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in self.splits]
        if self.individual_digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=self.gpt2_regex))
        return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


#: tokenizer.ggml.pre names; export writes the first whose splitting matches
_BYTE_LEVEL_PRE = {
    "gpt-2": _ByteLevelPre(gpt2_regex=True),
    "llama-bpe": _ByteLevelPre((_LLAMA3_SPLIT,), ignore_merges=True, add_bos=True),
    "glm4": _ByteLevelPre((_LLAMA3_SPLIT,)),
    "qwen2": _ByteLevelPre((_QWEN2_SPLIT,), nfc=True),
    # DeepSeek splits digits one by one; llama.cpp keeps runs whole, the same ids for a vocabulary
    # without multi-digit tokens (as DeepSeek's)
    "deepseek-llm": _ByteLevelPre(_DEEPSEEK_LLM_SPLITS, individual_digits=True),
    "deepseek-v3": _ByteLevelPre(_DEEPSEEK_V3_SPLITS),
    "kimi-k2": _ByteLevelPre((_KIMI_K2_SPLIT,)),
    "default": _ByteLevelPre(_LLAMA_CPP_DEFAULT_SPLITS),
}
#: other names llama.cpp gives one of the pre-tokenizers above
_PRE_ALIASES = {
    "llama3": "llama-bpe", "llama-v3": "llama-bpe", "chatglm-bpe": "glm4", "olmo": "gpt-2",
    "deepseek-r1-qwen": "qwen2",
}
#: a text the pre-tokenizers above all split differently (llama-bpe and glm4 differ in ignore_merges only)
_CHECK_TEXT = (
    "Hello world! I'VE been told you're 'RE there, we'll see.\n\n  Tabs\tand   spaces   \r\n"
    "3 33 333 3333 33333 3.14 $1,000 ------====== ''''```\"\"\"......!!!!???? x+y<=z^2|~ "
    "café naïve Ωμέγα Привет мир 🚀 \U0001f636\u200d\U0001f32b\ufe0f ✅ 我想在apple工作1314151天～ "
    "カタカナ ひらがな 한국어 កាន់តែពិសេស <|im_end|> \n \n\n"
)
#: token texts llama.cpp stops on whatever the metadata says (special_eog_ids in llama-vocab.cpp)
_LLAMA_CPP_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
})
#: tokenizer_config.json names of the special tokens a GGUF records
_SPECIAL_ID_KEYS = {
    "bos_token": _KEY.BOS_ID, "eos_token": _KEY.EOS_ID, "unk_token": _KEY.UNK_ID, "pad_token": _KEY.PAD_ID,
    "sep_token": _KEY.SEP_ID, "mask_token": _KEY.MASK_ID,
}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_SPIECE_SPACE = "\u2581"


# --------------------------------------------------------------------------------------
# export: tokenizer files -> GGUF metadata
# --------------------------------------------------------------------------------------


def add_tokenizer_metadata(writer: gguf.GGUFWriter, model_dir: pathlib.Path) -> None:
    """Add tokenizer.ggml.* keys (model, pre, tokens, token_type, merges or scores, special token ids,
    add_bos/add_eos) and tokenizer.chat_template for the HF tokenizer files in model_dir, the way
    llama.cpp's convert_hf_to_gguf.py writes them.

    The token list is padded with ``[PAD{id}]`` (type UNUSED) to the model's ``vocab_size``
    (colibri.json's config, else config.json), as llama.cpp does.
    """
    model_dir = pathlib.Path(model_dir)
    path = model_dir / "tokenizer.json"
    spec = _read_json(path)
    if not spec:
        raise GGUFTokenizerError(f"{path}: missing (GGUF export needs the model's tokenizer.json)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exception on bad files
        raise GGUFTokenizerError(f"{path}: not a valid tokenizer.json ({one_line(e)})") from None
    model = spec.get("model") or {}
    sentencepiece = model.get("type") == "BPE" and bool(model.get("byte_fallback"))
    byte_level = model.get("type") == "BPE" and any(
        c.get("type") == "ByteLevel" for c in _components(spec.get("pre_tokenizer"))
    )
    if not (sentencepiece or byte_level):
        raise GGUFTokenizerError(
            f"{path}: a {model.get('type')} tokenizer cannot be written to GGUF "
            "(byte-level BPE and SentencePiece-style BPE with byte fallback can)"
        )
    tokens, types = _tokens_in_id_order(spec, _vocab_size(model_dir), sentencepiece, path)
    try:
        special = gguf.SpecialVocab(model_dir, load_merges=byte_level, n_vocab=len(tokens))
    except (OSError, ValueError) as e:
        raise GGUFTokenizerError(f"{model_dir}: cannot read the tokenizer files ({one_line(e)})") from None
    add_bos, add_eos = _added_by_post_processor(tokenizer, special.special_token_ids, path)
    special.add_special_token = {"bos": add_bos, "eos": add_eos}
    jinja = model_dir / "chat_template.jinja"
    if jinja.is_file():  # it wins over tokenizer_config.json's, as in transformers 5 and runtime.text
        try:
            special.chat_template = jinja.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise GGUFTokenizerError(f"{jinja}: cannot read ({one_line(e)})") from None
    _add_stop_tokens(special, model_dir, tokens)

    if sentencepiece:
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(_scores_from_merges(tokens, _merge_pairs(model.get("merges") or [])))
        writer.add_token_types(types)
        writer.add_add_space_prefix(_adds_space_prefix(spec))
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(_pre_tokenizer_name(tokenizer.pre_tokenizer, bool(model.get("ignore_merges"))))
        writer.add_token_list(tokens)
        writer.add_token_types(types)
    special.add_to_gguf(writer, quiet=True)


def _read_json(path: pathlib.Path) -> dict:
    return read_json_object(path, GGUFTokenizerError)


def _id_list(value) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _vocab_size(model_dir: pathlib.Path) -> int | None:
    """The embedding rows: colibri.json's config.vocab_size, else config.json's vocab_size."""
    for config in (_read_json(model_dir / "colibri.json").get("config") or {}, _read_json(model_dir / "config.json")):
        if sizes := _id_list(config.get("vocab_size")):
            return sizes[0]
    return None


def _components(node) -> list[dict]:
    """A normalizer / pre-tokenizer config and, for a Sequence, its steps."""
    if not isinstance(node, dict):
        return []
    steps = node.get("pretokenizers") or node.get("normalizers") or []
    return [node, *(c for step in steps for c in _components(step))]


def _tokens_in_id_order(spec: dict, vocab_size: int | None, sentencepiece: bool,
                        path: pathlib.Path) -> tuple[list[str], list[int]]:
    model = spec["model"]
    text = {i: t for t, i in (model.get("vocab") or {}).items()}
    added = {a["id"]: a for a in spec.get("added_tokens") or []}
    text.update((i, a["content"]) for i, a in added.items())
    count = max(text, default=-1) + 1
    if vocab_size is not None:
        if count > vocab_size:
            raise GGUFTokenizerError(f"{path}: {count} tokens, more than the model's vocab_size {vocab_size}")
        count = vocab_size
    unk = model.get("unk_token")
    tokens, types = [], []
    for i in range(count):
        token = text.get(i, f"[PAD{i}]")
        tokens.append(token)
        if i not in text:
            types.append(_TYPE.UNUSED)
        elif sentencepiece and token == unk:
            types.append(_TYPE.UNKNOWN)
        elif i in added:
            types.append(_TYPE.CONTROL if added[i].get("special") else _TYPE.USER_DEFINED)
        elif sentencepiece and _BYTE_TOKEN.fullmatch(token):
            types.append(_TYPE.BYTE)
        else:
            types.append(_TYPE.NORMAL)
    return tokens, types


def _added_by_post_processor(tokenizer: Tokenizer, special_ids: dict[str, int],
                             path: pathlib.Path) -> tuple[bool, bool]:
    """(add_bos, add_eos): what the tokenizer.json post-processor puts around a text.

    transformers 5 and runtime.text follow the post-processor (not tokenizer_config.json's
    add_bos_token), so this asks it.
    """
    encoding = tokenizer.encode("a", add_special_tokens=True)
    mask = encoding.special_tokens_mask
    lead = next((k for k, m in enumerate(mask) if not m), len(mask))
    trail = next((k for k, m in enumerate(reversed(mask)) if not m), len(mask))
    prefix, suffix = encoding.ids[:lead], encoding.ids[len(mask) - trail:]
    bos, eos = special_ids.get("bos"), special_ids.get("eos")
    if prefix not in ([], [bos]) or suffix not in ([], [eos]):
        raise GGUFTokenizerError(
            f"{path}: the post-processor adds {prefix} before and {suffix} after a text; "
            f"GGUF can only say whether BOS ({bos}) and EOS ({eos}) are added"
        )
    return bool(prefix), bool(suffix)


def _add_stop_tokens(special: gguf.SpecialVocab, model_dir: pathlib.Path, tokens: list[str]) -> None:
    """Put the stop tokens of generation_config.json / config.json that llama.cpp would not
    stop on by itself into the free eos / eot / eom slots."""
    ids = special.special_token_ids
    found = [*_id_list(_read_json(model_dir / "generation_config.json").get("eos_token_id")),
             *_id_list(_read_json(model_dir / "config.json").get("eos_token_id"))]
    extra = []
    for i in found:
        if i != ids.get("eos") and i not in extra and 0 <= i < len(tokens) and tokens[i] not in _LLAMA_CPP_EOG_TEXTS:
            extra.append(i)
    slots = [slot for slot in ("eos", "eot", "eom") if slot not in ids]
    if len(extra) > len(slots):
        raise GGUFTokenizerError(
            f"{model_dir}: stop tokens {extra} do not fit in GGUF's eos/eot/eom slots (free: {slots})"
        )
    ids.update(zip(slots, extra))


def _merge_pairs(merges: list) -> list[tuple[str, str]]:
    """Merges as pairs, from tokenizer.json's ``"a b"`` or ``["a", "b"]`` form or GGUF's ``"a b"``."""
    pairs = []
    for merge in merges:
        if isinstance(merge, str):
            cut = merge.find(" ", 1)  # like llama.cpp: the first part may start with a space
            if cut < 0:
                raise GGUFTokenizerError(f"malformed BPE merge {merge!r} (expected two tokens)")
            merge = (merge[:cut], merge[cut + 1:])
        pairs.append(tuple(merge))
    return pairs


def _scores_from_merges(tokens: list[str], merges: list[tuple[str, str]]) -> list[float]:
    """SentencePiece scores that rank tokens as the merges do: -(the first merge making the
    token); tokens no merge makes score below all of them."""
    first = {}
    for rank, (left, right) in enumerate(merges):
        first.setdefault(left + right, rank)
    return [-float(first.get(token, len(merges))) for token in tokens]


def _adds_space_prefix(spec: dict) -> bool:
    """Whether the SentencePiece-style tokenizer.json puts "▁" in front of a text."""
    prepends = any(c.get("type") == "Prepend" for c in _components(spec.get("normalizer")))
    return prepends or any(
        c.get("type") == "Metaspace" and c.get("prepend_scheme", "always") != "never"
        and c.get("add_prefix_space", True)
        for c in _components(spec.get("pre_tokenizer"))
    )


def _pieces(pre_tokenizer: pre_tokenizers.PreTokenizer | None) -> list[str]:
    return [] if pre_tokenizer is None else [p for p, _ in pre_tokenizer.pre_tokenize_str(_CHECK_TEXT)]


def _pre_tokenizer_name(pre_tokenizer: pre_tokenizers.PreTokenizer | None, ignore_merges: bool) -> str:
    """The llama.cpp name of the pre-tokenizer that splits ``_CHECK_TEXT`` the same way, else "default"."""
    pieces = _pieces(pre_tokenizer)
    names = [name for name, pre in _BYTE_LEVEL_PRE.items() if _pieces(pre.pre_tokenizer()) == pieces]
    same_merges = [n for n in names if _BYTE_LEVEL_PRE[n].ignore_merges == ignore_merges]
    return (same_merges or names or ["default"])[0]


# --------------------------------------------------------------------------------------
# import: GGUF metadata -> tokenizer files
# --------------------------------------------------------------------------------------


def tokenizer_files_from_gguf(reader: gguf.GGUFReader) -> dict[str, bytes]:
    """Rebuild HF tokenizer files from a GGUF's tokenizer metadata (for a split GGUF, its first part).

    Returns file name -> contents: 'tokenizer.json', 'tokenizer_config.json' (chat_template,
    bos/eos/unk/pad tokens, add_bos_token, added_tokens_decoder) and 'generation_config.json'
    (bos_token_id; eos_token_id: eos, eot, eom and the tokens llama.cpp stops on by their text).
    Raises GGUFTokenizerError for a tokenizer it cannot rebuild.
    """
    kind = _value(reader, _KEY.MODEL)
    if kind not in ("gpt2", "llama"):
        raise GGUFTokenizerError(
            f"GGUF tokenizer model {kind!r} cannot be rebuilt as a tokenizer.json "
            "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)"
        )
    tokens = _value(reader, _KEY.LIST)
    if not tokens:
        raise GGUFTokenizerError(f"GGUF has no {_KEY.LIST}")
    types = _value(reader, _KEY.TOKEN_TYPE) or [_TYPE.NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFTokenizerError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    if duplicates := [t for t, n in Counter(tokens).items() if n > 1]:
        raise GGUFTokenizerError(f"GGUF vocabulary lists token {duplicates[0]!r} more than once")
    ids = {name: i for name, key in _SPECIAL_ID_KEYS.items() if (i := _token_id(reader, key, tokens)) is not None}

    if kind == "gpt2":
        pre = _byte_level_pre(reader)
        tokenizer, add_bos_default = _byte_level_tokenizer(reader, tokens, types, pre), pre.add_bos
    else:  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
        tokenizer, add_bos_default = _sentencepiece_tokenizer(reader, tokens, types, ids.get("unk_token")), True
    added = [i for i, t in enumerate(types) if t in (_TYPE.CONTROL, _TYPE.UNKNOWN, _TYPE.USER_DEFINED)]
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i in added if types[i] != _TYPE.USER_DEFINED])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i in added if types[i] == _TYPE.USER_DEFINED])
    add_bos = bool(_value(reader, _KEY.ADD_BOS, add_bos_default))
    add_eos = bool(_value(reader, _KEY.ADD_EOS, False))
    tokenizer.post_processor = _post_processor(tokens, ids, add_bos, add_eos, byte_level=kind == "gpt2")

    config = {
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "added_tokens_decoder": {
            str(i): {"content": tokens[i], "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": types[i] != _TYPE.USER_DEFINED}
            for i in added
        },
        **{name: tokens[i] for name, i in ids.items()},
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if (template := _chat_template(reader)) is not None:
        config["chat_template"] = template
    generation = {}
    if "bos_token" in ids:
        generation["bos_token_id"] = ids["bos_token"]
    stops = _stop_ids(reader, tokens, ids.get("eos_token"))
    if stops:
        generation["eos_token_id"] = stops[0] if len(stops) == 1 else stops
    return {
        "tokenizer.json": tokenizer.to_str().encode("utf-8"),
        "tokenizer_config.json": _json_bytes(config),
        "generation_config.json": _json_bytes(generation),
    }


def _json_bytes(data: dict) -> bytes:
    return (json.dumps(data, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


def _value(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.get_field(key)
    if field is None:
        return default
    try:
        return field.contents()
    except (UnicodeDecodeError, ValueError, IndexError) as e:
        raise GGUFTokenizerError(f"GGUF {key}: unreadable ({one_line(e)})") from None


def _token_id(reader: gguf.GGUFReader, key: str, tokens: list[str]) -> int | None:
    """A special token id, or None when absent or out of range (llama.cpp ignores those too)."""
    value = _value(reader, key)
    return value if isinstance(value, int) and 0 <= value < len(tokens) else None


def _vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """The vocabulary without llama.cpp's ``[PAD{id}]`` fillers (ids the original tokenizer lacked)."""
    return {t: i for i, (t, k) in enumerate(zip(tokens, types)) if not (k == _TYPE.UNUSED and t == f"[PAD{i}]")}


def _bpe(vocab: dict[str, int], merges: list[tuple[str, str]], **options) -> models.BPE:
    try:
        return models.BPE(vocab, merges, **options)
    except Exception as e:  # the tokenizers library raises plain Exception on bad merges
        raise GGUFTokenizerError(f"GGUF tokenizer: cannot build its BPE model ({one_line(e)})") from None


def _byte_level_pre(reader: gguf.GGUFReader) -> _ByteLevelPre:
    """The pre-tokenizer tokenizer.ggml.pre names (none: llama.cpp's "default")."""
    name = _value(reader, _KEY.PRE) or "default"
    pre = _BYTE_LEVEL_PRE.get(_PRE_ALIASES.get(name, name))
    if pre is None:
        known = ", ".join(sorted([*_BYTE_LEVEL_PRE, *_PRE_ALIASES]))
        raise GGUFTokenizerError(f"GGUF pre-tokenizer {name!r} is not supported (supported: {known})")
    return pre


def _byte_level_tokenizer(reader: gguf.GGUFReader, tokens: list[str], types: list[int],
                          pre: _ByteLevelPre) -> Tokenizer:
    merges = _value(reader, _KEY.MERGES)
    if not merges:
        raise GGUFTokenizerError(f"GGUF byte-level tokenizer has no {_KEY.MERGES}")
    tokenizer = Tokenizer(_bpe(_vocab(tokens, types), _merge_pairs(merges), ignore_merges=pre.ignore_merges))
    if pre.nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre.pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_tokenizer(reader: gguf.GGUFReader, tokens: list[str], types: list[int],
                             unk: int | None) -> Tokenizer:
    """The tokenizer.json of a Llama-2 / Mixtral style SentencePiece vocabulary."""
    vocab = _vocab(tokens, types)
    merges = _value(reader, _KEY.MERGES)
    if merges:
        pairs = _merge_pairs(merges)
    else:
        scores = _value(reader, _KEY.SCORES)
        if not scores or len(scores) != len(tokens):
            raise GGUFTokenizerError(f"GGUF SentencePiece tokenizer needs {_KEY.SCORES} (one per token)")
        pairs = _merges_by_score(vocab, {t: scores[i] for t, i in vocab.items()})
    tokenizer = Tokenizer(_bpe(vocab, pairs, unk_token=None if unk is None else tokens[unk], fuse_unk=True,
                               byte_fallback=True))
    space_prefix = bool(_value(reader, _KEY.ADD_PREFIX, True))
    prepend, replace = normalizers.Prepend(_SPIECE_SPACE), normalizers.Replace(" ", _SPIECE_SPACE)
    tokenizer.normalizer = normalizers.Sequence([prepend, replace]) if space_prefix else replace
    steps = [decoders.Replace(_SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if space_prefix else steps)
    return tokenizer


def _merges_by_score(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges equivalent to SentencePiece scores, as transformers' ``generate_merges`` makes them:
    every split of a token into two tokens, best token score first."""
    merges = []
    for token, score in scores.items():
        splits = [(token[:k], token[k:]) for k in range(1, len(token)) if token[:k] in vocab and token[k:] in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, score) for left, right in splits)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _post_processor(tokens: list[str], ids: dict[str, int], add_bos: bool, add_eos: bool, byte_level: bool):
    """BOS / EOS around every text as the GGUF says (what transformers 5 and runtime.text apply)."""
    added = [name for wanted, name in ((add_bos, "bos_token"), (add_eos, "eos_token")) if wanted]
    if missing := [name for name in added if name not in ids]:
        raise GGUFTokenizerError(f"GGUF says to add the {missing[0]} but has no valid id for it")
    if not added:
        return processors.ByteLevel(trim_offsets=False) if byte_level else None
    first = [tokens[ids["bos_token"]]] if add_bos else []
    last = [tokens[ids["eos_token"]]] if add_eos else []
    return processors.TemplateProcessing(
        single=[*first, "$A", *last],
        pair=[*first, "$A", *last, *first, "$B:1", *last],
        special_tokens=[(tokens[ids[name]], ids[name]) for name in added],
    )


def _stop_ids(reader: gguf.GGUFReader, tokens: list[str], eos: int | None) -> list[int]:
    """What llama.cpp stops on: eos, eot, eom, and the tokens it knows as end-of-generation by their text."""
    found = [eos, _token_id(reader, _KEY.EOT_ID, tokens), _token_id(reader, _KEY.EOM_ID, tokens),
             *(i for i, t in enumerate(tokens) if t in _LLAMA_CPP_EOG_TEXTS)]
    stops = list(dict.fromkeys(i for i in found if i is not None))
    texts = {tokens[i] for i in stops if 0 <= i < len(tokens)}
    # llama.cpp's o200k_harmony workaround: with <|return|> and <|call|> (or <|call|>/<|calls|>
    # and <|flush|>), <|end|> ends a message, not the generation
    if "<|end|>" in texts and texts & {"<|call|>", "<|calls|>"} and texts & {"<|return|>", "<|flush|>"}:
        stops = [i for i in stops if tokens[i] != "<|end|>"]
    return stops


def _chat_template(reader: gguf.GGUFReader):
    """The default template, or tokenizer_config's list of named templates when the GGUF has several."""
    default = _value(reader, _KEY.CHAT_TEMPLATE)
    names = _value(reader, _KEY.CHAT_TEMPLATES) or []
    if not names:
        return default
    named = [{"name": "default", "template": default}] if default is not None else []
    return named + [{"name": n, "template": _value(reader, _KEY.CHAT_TEMPLATE_N.format(name=n))} for n in names]
