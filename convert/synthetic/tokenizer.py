"""The synthetic tokenizers: deterministic byte-level BPE trained on one paragraph, with
the special tokens, chat template and config ids of each tokenizer family. An
architecture names its family in its adapter's tiny model (`convert.arch`)."""

from __future__ import annotations

import json
import pathlib
from functools import lru_cache

from colibri.convert.arch import tiny_model

_PARAGRAPH = (
    "The river town woke slowly on the first cold morning of autumn. Fishermen pulled their boats "
    "onto the gravel bank, and the baker opened the green shutters of her small shop before the sun "
    "had cleared the hills. Children ran along the stone wall by the water, counting the ducks and the "
    "gulls, while their parents argued gently about the price of apples, the weather, and the new bridge "
    "that the council had promised for many years. An old teacher sat on a wooden bench near the market "
    "and read a thick book about the history of mountains, rivers, forests and the people who had lived "
    "beside them. She liked to say that every valley remembers the names of those who worked in it, and "
    "that a patient listener can still hear those names in the wind. In the afternoon the clouds gathered "
    "over the northern ridge, and a steady rain began to fall on the roofs, the gardens and the empty road. "
    "The shopkeepers brought their tables inside, the cats found dry corners under the stairs, and the "
    "whole town settled into a quiet rhythm of tea, conversation and small chores. A young engineer who had "
    "arrived that week walked across the square with a notebook full of measurements. He was thinking about "
    "numbers, about the weight of steel and the strength of stone, about water moving under a bridge in "
    "spring when the snow melts in the high meadows. He stopped to ask the teacher for directions to the "
    "library, and she told him that the library was closed on Mondays, but that the station master kept a "
    "fine collection of maps and would gladly show them to anyone who asked politely. They talked for an "
    "hour about floods, harvests, trains, music and the strange habits of migrating birds. When the rain "
    "finally stopped, the evening light turned the river into a ribbon of copper and gold, and the engineer "
    "wrote a single sentence at the top of a clean page: build something that will still be useful when "
    "nobody remembers who built it. Later, in the warm kitchen of the inn, travellers shared bread, cheese, "
    "soup and stories. A merchant described the busy harbour cities of the south, where ships arrive every "
    "hour with spices, cloth, timber and machines. A musician tuned an old violin and played three slow "
    "songs and one fast dance, and everyone clapped and laughed. Outside, the stars appeared one by one "
    "above the dark water, and the town fell asleep, waiting for another ordinary, remarkable day."
)
#: at most this many BPE merges (the paragraph supports ~690)
MAX_MERGES = 400

_LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\n\n' }}{% endif %}"
    "{% endfor %}"
)
_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_TULU_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + eos_token }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
_KIMI_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_' + message['role'] + '|>' + message['role'] + '<|im_middle|>' + message['content'] + '<|im_end|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_assistant|>assistant<|im_middle|>' }}{% endif %}"
)
_GLM_TEMPLATE = (
    "[gMASK]<sop>{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)
_HARMONY_TEMPLATE = (  # gpt-oss's harmony format, its final channel only
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ '<|start|>assistant<|channel|>final<|message|>' + message['content'] + '<|end|>' }}"
    "{% else %}{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}"
)

# specials: listed in id order; front=True puts them at ids 0.., else after the BPE vocab.
# cfg_*: which token the config's bos/eos/pad ids name (eos may be a list).
# "deepseek_back" (V2) is "deepseek" with the special tokens after the BPE vocab.
FAMILIES = {
    "llama": dict(
        specials=["<unk>", "<s>", "</s>"], front=True, bos="<s>", eos="</s>", pad=None, unk="<unk>",
        add_bos=True, template=_LLAMA_TEMPLATE,
        cfg_bos="<s>", cfg_eos="</s>", cfg_pad=None, gen_eos="</s>",
    ),
    "chatml": dict(
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], front=False,
        bos="<|endoftext|>", eos="<|im_end|>", pad="<|endoftext|>", unk=None, add_bos=False,
        template=_CHATML_TEMPLATE,
        cfg_bos="<|endoftext|>", cfg_eos="<|im_end|>", cfg_pad=None, gen_eos=["<|im_end|>", "<|endoftext|>"],
    ),
    "olmoe": dict(
        specials=["<|endoftext|>", "<|padding|>", "<|user|>", "<|assistant|>", "<|system|>"], front=False,
        bos="<|endoftext|>", eos="<|endoftext|>", pad="<|padding|>", unk=None, add_bos=False,
        template=_TULU_TEMPLATE,
        cfg_bos=None, cfg_eos="<|endoftext|>", cfg_pad="<|padding|>", gen_eos="<|endoftext|>",
    ),
    "deepseek": dict(
        specials=["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"], front=True,
        bos="<｜begin▁of▁sentence｜>", eos="<｜end▁of▁sentence｜>", pad="<｜end▁of▁sentence｜>", unk=None,
        add_bos=True, template=_DEEPSEEK_TEMPLATE,
        cfg_bos="<｜begin▁of▁sentence｜>", cfg_eos="<｜end▁of▁sentence｜>", cfg_pad=None,
        gen_eos="<｜end▁of▁sentence｜>",
    ),
    "kimi": dict(
        specials=["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                  "<|im_middle|>"],
        front=False, bos="[BOS]", eos="<|im_end|>", pad="[EOS]", unk=None, add_bos=False,
        template=_KIMI_TEMPLATE,
        cfg_bos="[BOS]", cfg_eos="[EOS]", cfg_pad=None, gen_eos="<|im_end|>",
    ),
    "glm": dict(
        specials=["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                  "<|assistant|>", "<|observation|>"],
        front=False, bos="[gMASK]", eos="<|endoftext|>", pad="<|endoftext|>", unk=None, add_bos=False,
        template=_GLM_TEMPLATE,
        cfg_bos=None, cfg_eos=["<|endoftext|>", "<|user|>", "<|observation|>"], cfg_pad="<|endoftext|>",
        gen_eos=["<|endoftext|>", "<|user|>", "<|observation|>"],
    ),
    "harmony": dict(
        specials=["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
                  "<|end|>", "<|message|>", "<|call|>"],
        front=False, bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>", unk=None, add_bos=False,
        template=_HARMONY_TEMPLATE,
        cfg_bos="<|startoftext|>", cfg_eos="<|return|>", cfg_pad="<|endoftext|>",
        gen_eos=["<|return|>", "<|endoftext|>", "<|call|>"],
    ),
}
FAMILIES["deepseek_back"] = {**FAMILIES["deepseek"], "front": False}

def _layout(family: str, vocab_size: int) -> tuple[dict, int, dict[str, int]]:
    fam = FAMILIES[family]
    specials = fam["specials"]
    n_merges = min(MAX_MERGES, vocab_size - 256 - len(specials))
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} too small for 256 byte tokens + {len(specials)} specials")
    first = 0 if fam["front"] else 256 + n_merges
    return fam, n_merges, {tok: first + i for i, tok in enumerate(specials)}


def special_token_config_ids(arch: str, vocab_size: int) -> dict:
    """The bos/eos (and pad) token ids a config.json of ``arch`` names."""
    fam, _, ids = _layout(tiny_model(arch).tokenizer, vocab_size)

    def resolve(v):
        if v is None:
            return None
        if isinstance(v, list):
            return [ids[t] for t in v]
        return ids[v]

    out = {"bos_token_id": resolve(fam["cfg_bos"]), "eos_token_id": resolve(fam["cfg_eos"])}
    if fam["cfg_pad"] is not None:
        out["pad_token_id"] = resolve(fam["cfg_pad"])
    return out


@lru_cache(maxsize=32)
def _tokenizer_json(family: str, vocab_size: int) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    fam, n_merges, ids = _layout(family, vocab_size)
    specials = fam["specials"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + n_merges + (len(specials) if fam["front"] else 0),
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in specials] if fam["front"] else [],
    )
    tok.train_from_iterator([_PARAGRAPH], trainer=trainer)
    if not fam["front"]:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    for t, i in ids.items():
        if tok.token_to_id(t) != i:  # pragma: no cover - layout invariant
            raise AssertionError(f"special token {t!r} got id {tok.token_to_id(t)}, expected {i}")
    if fam["add_bos"]:
        bos = fam["bos"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids[bos])]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if tok.get_vocab_size() > vocab_size:  # pragma: no cover - layout invariant
        raise AssertionError("tokenizer larger than vocab_size")
    return tok.to_str(pretty=True)


def build_tokenizer(arch: str, vocab_size: int | None = None):
    """The synthetic ``tokenizers.Tokenizer`` for ``arch`` (byte-level BPE, deterministic)."""
    from tokenizers import Tokenizer

    model = tiny_model(arch)
    if vocab_size is None:
        vocab_size = int(model.config["vocab_size"])
    return Tokenizer.from_str(_tokenizer_json(model.tokenizer, int(vocab_size)))


def write_tokenizer_files(out_dir, arch: str, config: dict) -> None:
    """Write tokenizer.json, tokenizer_config.json and generation_config.json."""
    family = tiny_model(arch).tokenizer
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = int(config["vocab_size"])
    fam, _, ids = _layout(family, vocab_size)
    (out / "tokenizer.json").write_text(_tokenizer_json(family, vocab_size), encoding="utf-8")
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t, i in ids.items()
    }
    tok_cfg = {
        "add_bos_token": fam["add_bos"],
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": fam["bos"],
        "chat_template": fam["template"],
        "clean_up_tokenization_spaces": False,
        "eos_token": fam["eos"],
        "model_max_length": int(config.get("max_position_embeddings") or 4096),
        "pad_token": fam["pad"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": fam["unk"],
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", "utf-8")
    gen_eos = fam["gen_eos"]
    gen = {
        "_from_model_config": True,
        "bos_token_id": config.get("bos_token_id"),
        "eos_token_id": [ids[t] for t in gen_eos] if isinstance(gen_eos, list) else ids[gen_eos],
        "transformers_version": config.get("transformers_version", "4.57.1"),
    }
    if config.get("pad_token_id") is not None:
        gen["pad_token_id"] = config["pad_token_id"]
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n", "utf-8")
