"""runtime.text: tokenizer, streaming detokenizer and sandboxed chat template, checked
against transformers (when installed) on every synthetic architecture's tokenizer files."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colibri.convert.synthetic import ARCHITECTURES, tiny_config, write_tokenizer_files
from colibri.runtime.text import ChatTemplateError, Tokenizer, TokenizerError

try:
    from transformers import AutoTokenizer
except ImportError:  # pragma: no cover - the oracle extra is optional
    AutoTokenizer = None
needs_transformers = pytest.mark.skipif(
    AutoTokenizer is None, reason="transformers is not installed: it is the reference these outputs are compared to"
)

ARCHS = list(ARCHITECTURES)
UNICODE = "héllo wörld — 日本語 🙂"
TEXTS = [
    "The river town woke slowly on the first cold morning of autumn.",
    UNICODE,
    "  leading spaces, trailing space \n\ttabs\n\nand blank lines  ",
    "",
    "numbers 3.14159 and symbols #$%&*()[]{} ✓ Ωμέγα Привет مرحبا",
]
CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": UNICODE},
        {"role": "assistant", "content": "Hi there."},
        {"role": "user", "content": "And the river?"},
    ],
]


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    """arch -> folder with the tokenizer files only (what AutoTokenizer.from_pretrained reads)."""
    root = tmp_path_factory.mktemp("tok")
    dirs = {}
    for arch in ARCHS:
        dirs[arch] = root / arch
        write_tokenizer_files(dirs[arch], arch, tiny_config(arch))
    return dirs


def copy_dir(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: pathlib.Path, **changes) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    data.update(changes)
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")


# --------------------------------------------------------------------------------------
# same output as transformers
# --------------------------------------------------------------------------------------


@needs_transformers
@pytest.mark.parametrize("arch", ARCHS)
def test_chat_template_matches_transformers(tok_dirs, arch):
    ours, ref = Tokenizer.from_dir(tok_dirs[arch]), AutoTokenizer.from_pretrained(str(tok_dirs[arch]))
    for chat in CHATS:
        for gen in (True, False):
            expected = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(chat, add_generation_prompt=gen) == expected
        # tokenized chat: the template writes BOS itself, transformers encodes without special tokens
        expected_ids = ref.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        assert ours.encode(ours.apply_chat_template(chat), add_bos=False) == expected_ids


@needs_transformers
@pytest.mark.parametrize("arch", ARCHS)
def test_encode_matches_transformers(tok_dirs, arch):
    ours, ref = Tokenizer.from_dir(tok_dirs[arch]), AutoTokenizer.from_pretrained(str(tok_dirs[arch]))
    specials = "".join(ours.special_tokens.values())
    for text in TEXTS + [f"{specials} between {specials}"]:
        assert ours.encode(text) == ref.encode(text), text
    assert ours.bos_id == ref.bos_token_id
    assert ref.eos_token_id in ours.eos_ids


# A template using what real hub templates use: namespace, loop controls, tojson, tools,
# extra kwargs, reasoning_content, None-valued keys (dropped), whitespace control.
_RICH_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}
{%- endfor %}
{%- if tools %}
<tools>{% for t in tools %}{{ t | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}</tools>
{% endif %}
{%- for m in messages %}
    {%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
    {%- if loop.index0 > 5 %}{% break %}{% endif %}
    {%- if m.content is not defined %}{% continue %}{% endif %}
<|{{ m.role }}|>
    {%- if m.reasoning_content and loop.index0 > ns.last_user %}
<think>{{ m.reasoning_content | trim }}</think>
    {%- endif %}
 {{ m.content }}{{ eos_token if m.role == 'assistant' }}
{% endfor %}
{%- if add_generation_prompt %}<|assistant|>{{ '<think>' if enable_thinking | default(true) else '' }}{% endif %}
"""


@needs_transformers
@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_rich_template_matches_transformers(tok_dirs, tmp_path, arch):
    d = copy_dir(tok_dirs[arch], tmp_path / arch)
    (d / "chat_template.jinja").write_text(_RICH_TEMPLATE, encoding="utf-8")
    ours, ref = Tokenizer.from_dir(d), AutoTokenizer.from_pretrained(str(d))
    chat = [
        {"role": "system", "content": "Use tools.", "tool_calls": None},
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "reasoning_content": "  call the tool  ", "content": "Sunny."},
        {"role": "assistant", "content": None},
    ]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"city": "<str>"}}}]
    for kwargs in ({}, {"tools": tools}, {"tools": tools, "enable_thinking": False}):
        expected = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True, **kwargs)
        assert ours.apply_chat_template(chat, **kwargs) == expected, kwargs


@needs_transformers
def test_add_bos_token_in_config_does_not_override_post_processor(tok_dirs, tmp_path):
    # transformers 5 drops tokenizer_config's add_bos_token when tokenizer.json exists
    for arch, flipped in (("mixtral", False), ("qwen3_moe", True)):
        d = copy_dir(tok_dirs[arch], tmp_path / arch)
        edit_json(d / "tokenizer_config.json", add_bos_token=flipped)
        ref = AutoTokenizer.from_pretrained(str(d))
        assert Tokenizer.from_dir(d).encode(TEXTS[0]) == ref.encode(TEXTS[0])


# --------------------------------------------------------------------------------------
# tokens
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip(tok_dirs, arch):
    tok = Tokenizer.from_dir(tok_dirs[arch])
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_bos=False)) == text
    chat = tok.apply_chat_template(CHATS[1])
    assert tok.decode(tok.encode(chat, add_bos=False)) == chat  # special tokens survive as text
    ids = tok.encode(UNICODE, add_bos=False)
    assert tok.decode(ids + sorted(tok.eos_ids), skip_special_tokens=True) == UNICODE


@pytest.mark.parametrize("arch", ARCHS)
def test_add_bos(tok_dirs, arch):
    tok = Tokenizer.from_dir(tok_dirs[arch])
    plain = tok.encode(TEXTS[0], add_bos=False)
    assert tok.encode(TEXTS[0], add_bos=True) == [tok.bos_id, *plain]
    default = tok.encode(TEXTS[0])
    wants_bos = json.loads((tok_dirs[arch] / "tokenizer_config.json").read_text("utf-8"))["add_bos_token"]
    assert default == ([tok.bos_id, *plain] if wants_bos else plain)


@pytest.mark.parametrize("arch", ARCHS)
def test_special_token_ids(tok_dirs, tmp_path, arch):
    d = copy_dir(tok_dirs[arch], tmp_path / arch)
    cfg = tiny_config(arch)
    (d / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    tok = Tokenizer.from_dir(d)
    tok_cfg = json.loads((d / "tokenizer_config.json").read_text("utf-8"))
    gen = json.loads((d / "generation_config.json").read_text("utf-8"))
    as_set = lambda v: set(v) if isinstance(v, list) else ({v} if v is not None else set())  # noqa: E731
    assert tok.bos_id == tok.encode(tok_cfg["bos_token"], add_bos=False)[0]
    expected_eos = as_set(gen["eos_token_id"]) | as_set(cfg["eos_token_id"])
    assert tok.eos_ids == expected_eos | set(tok.encode(tok_cfg["eos_token"], add_bos=False))
    assert as_set(gen["eos_token_id"]) <= tok.eos_ids  # the stop tokens of generation_config, lists included


@pytest.mark.parametrize("arch", ARCHS)
def test_stream_equals_full_decode(tok_dirs, arch):
    tok = Tokenizer.from_dir(tok_dirs[arch])
    for text in (UNICODE, TEXTS[4], tok.apply_chat_template(CHATS[1])):
        ids = tok.encode(text, add_bos=False)
        stream = tok.stream()
        pieces = [stream.push(i) for i in ids]
        assert "".join(pieces) == tok.decode(ids) == text
        assert all("\ufffd" not in p for p in pieces)
    # the synthetic vocab has no merges for these characters: they arrive byte by byte
    stream = tok.stream()
    assert [stream.push(i) for i in tok.encode("日", add_bos=False)] == ["", "", "日"]


def test_stream_skips_special_tokens(tok_dirs):
    tok = Tokenizer.from_dir(tok_dirs["qwen3_moe"])
    ids = tok.encode(tok.apply_chat_template(CHATS[0]), add_bos=False)
    stream = tok.stream(skip_special_tokens=True)
    assert "".join(stream.push(i) for i in ids) == tok.decode(ids, skip_special_tokens=True)


# --------------------------------------------------------------------------------------
# chat template: source and sandbox
# --------------------------------------------------------------------------------------


def test_chat_template_jinja_takes_precedence(tok_dirs, tmp_path):
    d = copy_dir(tok_dirs["mixtral"], tmp_path / "m")
    (d / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}", "utf-8")
    assert Tokenizer.from_dir(d).apply_chat_template(CHATS[0]) == "[user]Hello!"


def test_chat_template_list_takes_default(tok_dirs, tmp_path):
    d = copy_dir(tok_dirs["mixtral"], tmp_path / "m")
    edit_json(d / "tokenizer_config.json", chat_template=[
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "default {{ bos_token }}"},
    ])
    assert Tokenizer.from_dir(d).apply_chat_template(CHATS[0]) == "default <s>"


def test_no_chat_template(tok_dirs, tmp_path):
    d = copy_dir(tok_dirs["mixtral"], tmp_path / "m")
    edit_json(d / "tokenizer_config.json", chat_template=None)
    tok = Tokenizer.from_dir(d)  # loading works; only chat needs the template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template(CHATS[0])
    edit_json(d / "tokenizer_config.json", chat_template=[{"name": "tool_use", "template": "x"}])
    with pytest.raises(ChatTemplateError, match="none named 'default'"):
        Tokenizer.from_dir(d).apply_chat_template(CHATS[0])


ATTACKS = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ lipsum.__globals__ }}",  # plain jinja2 would render this as an empty string
    "{{ joiner.__init__.__globals__['__builtins__']['open']('MARKER', 'w') }}",
    "{{ ''|attr('__class__') }}",
    "{{ '{0.__class__.__base__}'.format(1) }}",
    "{{ self.__init__.__globals__ }}",
    "{{ messages.append({'role': 'x'}) }}",
    "{% set ns = namespace(__class__=1) %}",
    "{% set ns = namespace() %}{% set ns.__dict__ = 1 %}",
]


@pytest.mark.parametrize("attack", ATTACKS)
def test_hostile_template_refused(tok_dirs, tmp_path, attack):
    d = copy_dir(tok_dirs["qwen3_moe"], tmp_path / "m")
    marker = tmp_path / "pwned"
    (d / "chat_template.jinja").write_text(attack.replace("MARKER", str(marker)), "utf-8")
    tok = Tokenizer.from_dir(d)
    with pytest.raises(ChatTemplateError, match="refused") as err:
        tok.apply_chat_template(CHATS[0])
    message = str(err.value)
    assert str(d / "chat_template.jinja") in message and "\n" not in message
    assert not marker.exists()


def test_template_cannot_modify_callers_messages(tok_dirs, tmp_path):
    d = copy_dir(tok_dirs["qwen3_moe"], tmp_path / "m")
    (d / "chat_template.jinja").write_text("{{ dict.update(messages[0], {'content': 'changed'}) }}", "utf-8")
    chat = [{"role": "user", "content": "original"}]
    with pytest.raises(ChatTemplateError):
        Tokenizer.from_dir(d).apply_chat_template(chat)
    assert chat == [{"role": "user", "content": "original"}]


def test_template_errors_are_one_line(tok_dirs, tmp_path):
    d = copy_dir(tok_dirs["qwen3_moe"], tmp_path / "m")
    src = str(d / "chat_template.jinja")
    for template, what in (
        ("{{ raise_exception('only user and assistant roles') }}", "raised: only user and assistant roles"),
        ("{% for %}", "is invalid"),
        ("{{ messages[0].content + 1 }}", "failed: TypeError"),
        ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nested too deeply"),  # jinja's parser recursed past Python's limit
        ("{{ " + "[" * 300 + "]" * 300 + " }}", "nested too deeply"),  # parsed, then too deep for Python's compiler
    ):
        (d / "chat_template.jinja").write_text(template, "utf-8")
        with pytest.raises(ChatTemplateError) as err:
            Tokenizer.from_dir(d).apply_chat_template(CHATS[0])
        assert src in str(err.value) and what in str(err.value) and "\n" not in str(err.value)


def test_strftime_now_and_tojson(tok_dirs, tmp_path):
    d = copy_dir(tok_dirs["qwen3_moe"], tmp_path / "m")
    (d / "chat_template.jinja").write_text("{{ strftime_now('%Y') | length }} {{ {'a': '<é>'} | tojson }}", "utf-8")
    assert Tokenizer.from_dir(d).apply_chat_template(CHATS[0]) == '4 {"a": "<é>"}'


# --------------------------------------------------------------------------------------
# bad folders
# --------------------------------------------------------------------------------------


def test_missing_tokenizer_json(tok_dirs, tmp_path):
    d = copy_dir(tok_dirs["mixtral"], tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="missing") as err:
        Tokenizer.from_dir(d)
    assert str(d / "tokenizer.json") in str(err.value)


@pytest.mark.parametrize("name", ["tokenizer.json", "tokenizer_config.json", "generation_config.json"])
def test_corrupt_files(tok_dirs, tmp_path, name):
    d = copy_dir(tok_dirs["mixtral"], tmp_path / "m")
    (d / name).write_text('{"truncated": ', "utf-8")
    with pytest.raises(TokenizerError) as err:
        Tokenizer.from_dir(d)
    assert str(d / name) in str(err.value) and "\n" not in str(err.value)


RUNAWAY_TEMPLATES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}",
    "{{ lipsum(n=10**6) }}",
    "{% set x = 7 %}{{ x ** (10**9) }}",
    "{{ 'a' * 10**8 }}",
    "{{ ['a'] * 10**8 }}",
    "{{ '{:999999999}'.format(1) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ '%999999999d'|format(1) }}",
    "{{ 'x'|center(10**9) }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ ('a' * 4000000).replace('a', 'bbbbbbbbbbbbbbbbbbbb') }}",
    "{{ ('a' * 1000000)|replace('a', 'bbbbbbbbbbbbbbbbbbbb') }}",
    "{{ (['a' * 4000000] * 1000)|join('') }}",
    "{{ ('a' * 4000000).join(['xy'] * 100) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
    "{% macro f(s, n) %}{% if n > 0 %}{{ f(s ~ s, n - 1) }}{% endif %}{% endmacro %}{{ f('ab', 64) }}",
    "{% set s = 'a' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
]


@pytest.mark.parametrize("template", RUNAWAY_TEMPLATES)
def test_runaway_template_refused_within_limits(tok_dirs, tmp_path, monkeypatch, template):
    """Each runaway template stops with one line, within the deadline, without a large allocation."""
    import resource

    from colibri.runtime import template_sandbox

    monkeypatch.setattr(template_sandbox, "MAX_SECONDS", 1.0)
    d = copy_dir(tok_dirs["qwen3_moe"], tmp_path / "m")
    (d / "chat_template.jinja").write_text(template, "utf-8")
    tok = Tokenizer.from_dir(d)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ChatTemplateError) as err:
        tok.apply_chat_template(CHATS[0])
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 < 400 << 20
    message = str(err.value)
    assert str(d / "chat_template.jinja") in message and "\n" not in message


def test_ordinary_templates_pass_the_limits(tok_dirs, tmp_path):
    d = copy_dir(tok_dirs["qwen3_moe"], tmp_path / "m")
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{{ '%-6s'|format(m.role) }}{{ m.content|center(12) }}{{ '{:>3}'.format(ns.n) }}{% endfor %}"
                "{{ ['a', 'b']|join(', ') }}{{ 2 ** 10 }}{{ 'ab' * 3 }}{{ range(3)|list|length }}")
    (d / "chat_template.jinja").write_text(template, "utf-8")
    chat = [{"role": "user", "content": "hi"}]
    assert Tokenizer.from_dir(d).apply_chat_template(chat) == "user  " + "hi".center(12) + "  1a, b1024ababab3"


def test_joins_of_iterators_are_checked_without_being_used_up(tok_dirs, tmp_path):
    """The size check reads a `map` iterator once and joins what it read (it joined nothing)."""
    d = copy_dir(tok_dirs["qwen3_moe"], tmp_path / "m")
    (d / "chat_template.jinja").write_text(
        "{{ messages|map(attribute='role')|join(', ') }}|{{ '-'.join(messages|map(attribute='content')) }}", "utf-8")
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert Tokenizer.from_dir(d).apply_chat_template(chat) == "user, assistant|a-b"


TEMPLATE_PIECES = [
    "{{ messages[0].content }}", "{% for m in messages %}{{ m.role }}{% endfor %}", "{{ 'ab' * N }}",
    "{{ N ** N }}", "{{ range(N)|list|length }}", "{% for i in range(N) %}{% for j in range(N) %}{% endfor %}{% endfor %}",
    "{{ '{:N}'.format(1) }}", "{{ '%Nd' % 1 }}", "{{ 'x'|center(N) }}", "{{ 'x'|indent(N) }}", "{{ ('a' * N)|wordwrap(N) }}",
    "{{ (['ab'] * N)|join('-' * N) }}", "{{ ('ab' * N).replace('a', 'bb' * N) }}", "{{ lipsum(n=N) }}",
    "{% set ns = namespace(s='ab') %}{% for i in range(N) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(N) }}",
    "{{ raise_exception('no') }}", "{{ ''.__class__ }}", "{{ messages|tojson(indent=N) }}", "{{ 'a'.zfill(N) }}",
    "{{ (N|string)|int }}", "{{ 'x' ~ N }}", "{% if N > 3 %}big{% else %}small{% endif %}",
]


@settings(max_examples=500, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(pieces=st.lists(st.tuples(st.sampled_from(TEMPLATE_PIECES),
                                 st.sampled_from([0, 1, 3, 64, 1000, 10**5, 10**7, 10**9, 10**18])), min_size=1, max_size=4))
def test_fuzzed_templates_render_or_are_refused_within_limits(tok_dirs, tmp_path_factory, monkeypatch, pieces):
    import resource

    from colibri.runtime import template_sandbox

    monkeypatch.setattr(template_sandbox, "MAX_SECONDS", 0.2)
    d = copy_dir(tok_dirs["qwen3_moe"], tmp_path_factory.mktemp("t") / "m")
    (d / "chat_template.jinja").write_text("".join(p.replace("N", str(n)) for p, n in pieces), "utf-8")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tokenizer = Tokenizer.from_dir(d)
    try:
        text = tokenizer.apply_chat_template(CHATS[0])
    except ChatTemplateError as e:
        assert "\n" not in str(e)
    else:
        assert len(text) <= template_sandbox.MAX_OUTPUT_CHARS
    assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024 < 400 << 20
