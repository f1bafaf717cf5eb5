"""convert.gguf_tokenizer: model folder tokenizer -> GGUF metadata -> tokenizer files, read back
with runtime.text, for every synthetic architecture, each llama.cpp pre-tokenizer name and a
SentencePiece vocabulary; checked against transformers' own GGUF tokenizer conversion and,
when llama-cpp-python is installed, against llama.cpp reading the exported GGUF."""

from __future__ import annotations

import json
import pathlib
import re

import gguf
import numpy as np
import pytest
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

from colibri.convert.gguf_tokenizer import (
    _BYTE_LEVEL_PRE,
    GGUFTokenizerError,
    add_tokenizer_metadata,
    tokenizer_files_from_gguf,
)
from colibri.convert.synthetic import ARCHITECTURES, tiny_config, write_tokenizer_files
from colibri.runtime.text import Tokenizer

KEY = gguf.Keys.Tokenizer
TEXTS = [
    "The river town woke slowly on the first cold morning of autumn.",
    "héllo wörld — 日本語 🙂 😶‍🌫️ Привет мир, 我想在apple工作1314151天",
    "  leading spaces, trailing space \n\ttabs\n\nand blank lines  ",
    "numbers 3 33 333 3333 3.14159 and symbols #$%&*()[]{} I'VE you're ------======",
    "",
]
CHAT = [{"role": "user", "content": "Hello, how are you?"}, {"role": "assistant", "content": "Fine, thanks."}]
CORPUS = (
    "The river town woke slowly on the first cold morning of autumn. Fishermen pulled their boats onto "
    "the gravel bank, and the baker opened the green shutters of her small shop before the sun had cleared "
    "the hills. Children ran along the stone wall by the water, counting the ducks and the gulls."
)
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
    "{% else %}{{ m['content'] + eos_token }}{% endif %}{% endfor %}"
)


def write_gguf(path: pathlib.Path, add_metadata) -> gguf.GGUFReader:
    """A real one-tensor GGUF file with the metadata ``add_metadata(writer)`` adds, opened for reading
    (with the few hyperparameters llama.cpp needs to load its vocabulary)."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(64)
    writer.add_embedding_length(4)
    writer.add_block_count(1)
    writer.add_feed_forward_length(4)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    add_metadata(writer)
    writer.add_tensor("token_embd.weight", np.zeros((2, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(path)


def rebuild(reader: gguf.GGUFReader, out: pathlib.Path) -> pathlib.Path:
    out.mkdir()
    for name, data in tokenizer_files_from_gguf(reader).items():
        (out / name).write_bytes(data)
    return out


def round_trip(src: pathlib.Path, tmp_path: pathlib.Path) -> tuple[gguf.GGUFReader, pathlib.Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    reader = write_gguf(tmp_path / "model.gguf", lambda w: add_tokenizer_metadata(w, src))
    return reader, rebuild(reader, tmp_path / "rebuilt")


def value(reader: gguf.GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()


def synthetic_folder(path: pathlib.Path, arch: str, **config_overrides) -> pathlib.Path:
    config = tiny_config(arch, **config_overrides)
    write_tokenizer_files(path, arch, config)
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def pre_tokenizer_folder(path: pathlib.Path, name: str) -> pathlib.Path:
    """A byte-level tokenizer folder splitting text like llama.cpp's pre-tokenizer ``name``. Its
    merges were learned on unsplit text, so they cross every boundary a pre-tokenizer draws:
    splitting like another one gives other tokens."""
    pre = _BYTE_LEVEL_PRE[name]
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=700, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = [CORPUS, *TEXTS]
    if pre.individual_digits:  # no multi-digit tokens, like DeepSeek's vocabulary: llama.cpp keeps digit runs whole
        corpus = [re.sub(r"[0-9]", "", text) for text in corpus]
    tok.train_from_iterator(corpus, trainer)
    tok.pre_tokenizer = pre.pre_tokenizer()
    tok.decoder = decoders.ByteLevel()
    if pre.nfc:
        tok.normalizer = normalizers.NFC()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|endoftext|>", "<|im_end|>")])
    spec = json.loads(tok.to_str())
    spec["model"]["ignore_merges"] = pre.ignore_merges
    path.mkdir()
    (path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}",
    }), encoding="utf-8")
    (path / "config.json").write_text(json.dumps({"vocab_size": tok.get_vocab_size()}), encoding="utf-8")
    stops = [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]  # as Qwen's; llama.cpp stops on both
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}), encoding="utf-8")
    return path


def special_texts(folder: pathlib.Path) -> list[str]:
    """Texts around each added token of the folder's tokenizer.json, e.g. "a<|im_end|>b <|im_end|>\\n"."""
    added = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))["added_tokens"]
    return [f"a{t['content']}b {t['content']}\n" for t in added]


def assert_same_tokenizer(original: pathlib.Path, rebuilt: pathlib.Path, texts: list[str]) -> None:
    """runtime.text reads both folders alike: ids, BOS, decoding of every id, stop tokens, chat template."""
    a, b = Tokenizer.from_dir(original), Tokenizer.from_dir(rebuilt)
    assert (b.bos_id, b.eos_ids, b.special_tokens) == (a.bos_id, a.eos_ids, a.special_tokens)
    for text in texts:
        assert b.encode(text) == a.encode(text), text  # the post-processor: add_bos behaviour
        ids = a.encode(text, add_bos=False)
        assert b.encode(text, add_bos=False) == ids, text
        assert b.decode(ids) == a.decode(ids)
        assert b.decode(ids, skip_special_tokens=True) == a.decode(ids, skip_special_tokens=True)
    for i in range(json.loads((original / "config.json").read_text())["vocab_size"]):
        assert b.decode([i]) == a.decode([i]), i
    assert b.apply_chat_template(CHAT) == a.apply_chat_template(CHAT)


# --------------------------------------------------------------------------------------
# byte-level BPE
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_synthetic_tokenizer_round_trips(arch, tmp_path):
    src = synthetic_folder(tmp_path / "src", arch)
    reader, out = round_trip(src, tmp_path)
    vocab_size = tiny_config(arch)["vocab_size"]
    assert value(reader, KEY.MODEL) == "gpt2"
    assert value(reader, KEY.PRE) == "gpt-2"  # the synthetic tokenizers split with GPT-2's regex
    assert len(value(reader, KEY.LIST)) == vocab_size
    assert_same_tokenizer(src, out, TEXTS + special_texts(src))


def test_stop_tokens_llama_cpp_cannot_find_by_text_go_to_eot_and_eom(tmp_path):
    """As llama.cpp's own GLM-4.5 conversion: eos <|endoftext|>, eot <|user|>, eom <|observation|>;
    ChatML's second stop token <|endoftext|> needs no slot (llama.cpp stops on it by its text)."""
    reader, _ = round_trip(synthetic_folder(tmp_path / "glm", "glm4_moe"), tmp_path / "glm")
    tokens = value(reader, KEY.LIST)
    ids = [value(reader, key) for key in (KEY.EOS_ID, KEY.EOT_ID, KEY.EOM_ID)]
    assert [tokens[i] for i in ids] == ["<|endoftext|>", "<|user|>", "<|observation|>"]
    reader, _ = round_trip(synthetic_folder(tmp_path / "qwen", "qwen3_moe"), tmp_path / "qwen")
    assert value(reader, KEY.LIST)[value(reader, KEY.EOS_ID)] == "<|im_end|>"
    assert value(reader, KEY.EOT_ID) is None and value(reader, KEY.EOM_ID) is None


def test_imported_stop_tokens_include_those_llama_cpp_knows_by_text(tmp_path):
    """A Kimi-K2 GGUF as llama.cpp writes it says eos [EOS]; llama.cpp also stops on <|im_end|>."""
    def add(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("kimi-k2")
        writer.add_token_list(["a", "b", "ab", "[BOS]", "[EOS]", "<|im_end|>"])
        writer.add_token_types([gguf.TokenType.NORMAL] * 3 + [gguf.TokenType.CONTROL] * 3)
        writer.add_token_merges(["a b"])
        writer.add_bos_token_id(3)
        writer.add_eos_token_id(4)

    out = rebuild(write_gguf(tmp_path / "kimi.gguf", add), tmp_path / "rebuilt")
    assert json.loads((out / "generation_config.json").read_text()) == {"bos_token_id": 3, "eos_token_id": [4, 5]}
    tok = Tokenizer.from_dir(out)
    assert (tok.eos_ids, tok.special_tokens) == ({4, 5}, {"bos_token": "[BOS]", "eos_token": "[EOS]"})
    assert tok.encode("ab<|im_end|>ba") == [2, 5, 1, 0]


def test_token_list_is_padded_to_vocab_size(tmp_path):
    src = synthetic_folder(tmp_path / "src", "qwen3_moe")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 8}))
    reader, out = round_trip(src, tmp_path)
    tokens, types = value(reader, KEY.LIST), value(reader, KEY.TOKEN_TYPE)
    assert len(tokens) == config["vocab_size"] + 8
    assert tokens[-1] == f"[PAD{len(tokens) - 1}]" and types[-8:] == [gguf.TokenType.UNUSED] * 8
    assert types[config["eos_token_id"]] == gguf.TokenType.CONTROL
    assert_same_tokenizer(src, out, TEXTS)


@pytest.mark.parametrize("name", list(_BYTE_LEVEL_PRE))
def test_pre_tokenizer_is_named_and_rebuilt(name, tmp_path):
    """A tokenizer.json splitting like llama.cpp's ``name`` exports as ``name`` and comes back the same."""
    src = pre_tokenizer_folder(tmp_path / "src", name)
    reader, out = round_trip(src, tmp_path)
    assert value(reader, KEY.PRE) == name
    assert_same_tokenizer(src, out, TEXTS + special_texts(src))


def test_unknown_pre_tokenizer_exports_as_default(tmp_path):
    src = synthetic_folder(tmp_path / "src", "qwen3_moe")
    spec = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    spec["pre_tokenizer"]["add_prefix_space"] = True  # no llama.cpp pre-tokenizer does this
    (src / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    reader = write_gguf(tmp_path / "model.gguf", lambda w: add_tokenizer_metadata(w, src))
    assert value(reader, KEY.PRE) == "default"


def test_split_regexes_are_transformers_ones():
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    for name in ("llama-bpe", "qwen2"):
        assert _BYTE_LEVEL_PRE[name].splits == (mapping.GGUF_PRE_TOKENIZER_SPLITS[name],)


def test_chat_templates_named_list_and_jinja_file(tmp_path):
    src = synthetic_folder(tmp_path / "src", "qwen3_moe")
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    named = [{"name": "default", "template": config["chat_template"]}, {"name": "tool_use", "template": "{{ 1 }}"}]
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}), encoding="utf-8")
    _, out = round_trip(src, tmp_path / "list")
    assert json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"] == named

    (src / "chat_template.jinja").write_text("{% for m in messages %}<{{ m['role'] }}>{% endfor %}", encoding="utf-8")
    _, out = round_trip(src, tmp_path / "jinja")
    assert Tokenizer.from_dir(out).apply_chat_template(CHAT) == "<user><assistant>"


# --------------------------------------------------------------------------------------
# SentencePiece (GGUF model "llama")
# --------------------------------------------------------------------------------------


def sentencepiece_vocab() -> tuple[list[str], list[float], list[int]]:
    """A Llama-like vocabulary: <unk> <s> </s>, the 256 byte tokens, merged pieces best first, then characters."""
    trained = HFTokenizer(models.BPE())
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trained.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=260, show_progress=False))
    pieces = sorted(trained.get_vocab().items(), key=lambda item: item[1])
    chars = [p for p, _ in pieces if len(p) == 1]
    merged = [p for p, _ in pieces if len(p) > 1]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *merged, *chars]
    scores = [0.0] * 259 + [-float(k) for k in range(len(merged) + len(chars))]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, *[gguf.TokenType.BYTE] * 256,
             *[gguf.TokenType.NORMAL] * (len(merged) + len(chars))]
    return tokens, scores, types


SPM_TEXTS = [
    "The river town woke slowly",
    "héllo wörld 日本語 🙂 and\nnew lines\t\ttabs",
    "  leading spaces and a trailing one ",
    "x</s>y <s> [INST] cold [/INST]</s>",
    "",
]


def test_sentencepiece_gguf_matches_transformers(tmp_path):
    mapping = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    tokens, scores, types = sentencepiece_vocab()

    def add(writer):
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_chat_template(LLAMA_TEMPLATE)

    out = rebuild(write_gguf(tmp_path / "spm.gguf", add), tmp_path / "rebuilt")
    ours = Tokenizer.from_dir(out)
    reference, _ = mapping.convert_gguf_tokenizer("llama", {
        "tokenizer_type": "llama", "tokens": tokens, "scores": scores, "token_type": types,
        "bos_token_id": 1, "eos_token_id": 2, "unk_token_id": 0,
    })
    # transformers prefixes "▁" only at the very start; both agree on text without a leading
    # space or special tokens inside
    for text in ("The river town woke slowly", "héllo wörld 日本語 🙂 and\nnew\t\ttabs", "cold dusk, counting gulls"):
        ids = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_bos=False) == ids, text
        assert ours.decode(ids) == reference.decode(ids)
    assert ours.encode("hi") == [1, *ours.encode("hi", add_bos=False)]  # llama.cpp's add_bos default for SPM
    assert (ours.bos_id, ours.eos_ids) == (1, {2})
    # like llama.cpp (and Llama-2's tokenizer.json): every text between special tokens gets its "▁"
    x, y = ours.encode("x", add_bos=False), ours.encode("y", add_bos=False)
    assert ours.encode("x</s>y", add_bos=False) == [*x, 2, *y]
    assert ours.apply_chat_template(CHAT) == "<s>[INST] Hello, how are you? [/INST]Fine, thanks.</s>"


def sentencepiece_folder(path: pathlib.Path) -> pathlib.Path:
    """A model folder with a Llama-2 / Mixtral style tokenizer.json: the vocabulary above with the
    merges transformers derives from SentencePiece scores."""
    base = pytest.importorskip("transformers.tokenization_utils_base")
    tokens, scores, _ = sentencepiece_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = HFTokenizer(models.BPE(vocab, base.generate_merges(vocab, dict(zip(tokens, scores))), unk_token="<unk>",
                                 fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in tokens[:3]])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B:1",
                                                       special_tokens=[("<s>", 1)])
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "chat_template": LLAMA_TEMPLATE,
    }), encoding="utf-8")
    (path / "config.json").write_text(json.dumps({"vocab_size": len(tokens) + 4, "eos_token_id": 2}), encoding="utf-8")
    return path


def test_sentencepiece_tokenizer_json_round_trips(tmp_path):
    src = sentencepiece_folder(tmp_path / "src")
    tokens, _, _ = sentencepiece_vocab()
    reader, out = round_trip(src, tmp_path)
    assert value(reader, KEY.MODEL) == "llama"
    assert value(reader, KEY.ADD_PREFIX) is True and value(reader, KEY.ADD_BOS) is True
    types = value(reader, KEY.TOKEN_TYPE)
    assert types[:4] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL, gguf.TokenType.BYTE]
    assert len(value(reader, KEY.SCORES)) == len(tokens) + 4
    assert_same_tokenizer(src, out, SPM_TEXTS)


# --------------------------------------------------------------------------------------
# llama.cpp reading the exported GGUF
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [*ARCHITECTURES, *(f"pre:{name}" for name in _BYTE_LEVEL_PRE), "sentencepiece"])
def test_llama_cpp_reads_the_export_like_the_model_folder(case, tmp_path):
    """llama.cpp (llama-cpp-python, vocabulary only) tokenizes as the folder does, adds BOS when it
    does, and stops on exactly the folder's stop tokens."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="the optional llama extra is not installed (pip install 'colibri-moe[llama]')")
    if case == "sentencepiece":
        src, texts = sentencepiece_folder(tmp_path / "src"), SPM_TEXTS
    else:
        src = pre_tokenizer_folder(tmp_path / "src", case[4:]) if case.startswith("pre:") else \
            synthetic_folder(tmp_path / "src", case)
        texts = TEXTS + special_texts(src)
    write_gguf(tmp_path / "model.gguf", lambda w: add_tokenizer_metadata(w, src))
    llm = llama_cpp.Llama(str(tmp_path / "model.gguf"), vocab_only=True, verbose=False)
    ours = Tokenizer.from_dir(src)
    for text in texts:
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == ours.encode(text), text
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    assert {i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)} == ours.eos_ids
    llm.close()


# --------------------------------------------------------------------------------------
# refusals
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["bert", "rwkv"])
def test_unsupported_tokenizer_model_is_refused(model, tmp_path):
    def add(writer):
        writer.add_tokenizer_model(model)
        writer.add_token_list(["[UNK]", "a", "b"])

    reader = write_gguf(tmp_path / "m.gguf", add)
    with pytest.raises(GGUFTokenizerError, match=f"'{model}'"):
        tokenizer_files_from_gguf(reader)


def test_unknown_pre_tokenizer_name_is_refused(tmp_path):
    def add(writer):
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("no-such-pre")
        writer.add_token_list(["a", "b", "ab"])
        writer.add_token_merges(["a b"])

    with pytest.raises(GGUFTokenizerError, match="'no-such-pre'"):
        tokenizer_files_from_gguf(write_gguf(tmp_path / "m.gguf", add))


def test_unigram_tokenizer_is_not_exported(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    HFTokenizer(models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0)).save(str(src / "tokenizer.json"))
    with pytest.raises(GGUFTokenizerError, match="Unigram"):
        add_tokenizer_metadata(gguf.GGUFWriter(tmp_path / "m.gguf", "llama"), src)
