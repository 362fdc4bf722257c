"""Chat templates: rendered in a sandbox, equal to transformers' rendering for SmolLM2, and a
template that reaches outside its sandbox refused in one line."""

from __future__ import annotations

import warnings

import jinja2.sandbox
import pytest

from handformer.pretrained.chat_template import check_messages, render_chat_template
from handformer.pretrained.lm_tokenizer import LMTokenizer
from tokenizer_util import as_metadata, gguf_metadata, smollm2_path, spm_fields

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Capital of Japan?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 你好"},
     {"role": "user", "content": "Say it in code:\n```py\nprint('hi')\n```"}],
]


@pytest.fixture(scope="module")
def smol() -> tuple[LMTokenizer, object]:
    import transformers

    path = smollm2_path()
    ours = LMTokenizer.from_gguf_metadata(gguf_metadata(path), source=path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return ours, theirs


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_template_equals_transformers(smol, add_generation_prompt: bool) -> None:
    ours, theirs = smol
    for messages in CONVERSATIONS:
        text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert text == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    text = ours.apply_chat_template(CONVERSATIONS[0])
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>assistant\n")
    ids = ours.encode(text)
    assert ids == theirs.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)
    assert ids.count(ours.token_to_id("<|im_start|>")) == 3  # kept whole, never split


def test_a_model_without_template_is_refused() -> None:
    tok = LMTokenizer.from_gguf_metadata(as_metadata("gemma3", "llama", spm_fields()),
                                         source="gemma-3-270m-q4_k_m.gguf")
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="^gemma-3-270m-q4_k_m.gguf has no chat template "
                                         r"\(a base model"):
        tok.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_the_template_sees_special_tokens() -> None:
    fields = spm_fields() | {"chat_template": "{{ bos_token }}{% for m in messages %}"
                                              "[{{ m.role }}] {{ m.content }}{{ eos_token }}"
                                              "{% endfor %}"}
    tok = LMTokenizer.from_gguf_metadata(as_metadata("llama", "llama", fields), source="x")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s>[user] hi</s>"


ESCAPES = [
    "{{ ''.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{% if ''.__class__ %}found{% endif %}",  # silently False in a plain sandbox
    "{{ raise_exception.__globals__ }}",
    "{{ messages.__class__ }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{% set ns = namespace(__class__=1) %}{{ ns }}",
    "{% set ns = namespace() %}{% set ns._x = 1 %}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_sandbox_refuses_escapes(template: str) -> None:
    with pytest.raises(ValueError, match="^chat template refused by the sandbox: ") as info:
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert "\n" not in str(info.value)


def test_a_plain_sandbox_would_let_a_probe_pass() -> None:
    """Why unsafe attributes raise at once: jinja2's own sandbox renders an unsafe attribute
    as undefined, which a template can test without any error."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment()
    assert env.from_string("{% if ''.__class__ %}x{% else %}quiet{% endif %}").render() == "quiet"


@pytest.mark.parametrize("template", ["{{ 'a' * 100000000 }}", "{{ [1, 2] * 10000000 }}",
                                      "{{ 10 ** 100000 }}"])
def test_sandbox_bounds_memory(template: str) -> None:
    with pytest.raises(ValueError, match="above the sandbox's limit"):
        render_chat_template(template, [{"role": "user", "content": "hi"}])
    assert render_chat_template("{{ 'ab' * 3 }}{{ 2 ** 10 }}",
                                [{"role": "user", "content": "x"}]) == "ababab1024"


def test_sandbox_refuses_mutation() -> None:
    with pytest.raises(ValueError, match="refused by the sandbox"):
        render_chat_template("{{ messages.append(1) }}", [{"role": "user", "content": "hi"}])


def test_template_helpers() -> None:
    msgs = [{"role": "user", "content": "<b>&</b>"}]
    assert render_chat_template("{{ messages[0].content | tojson }}", msgs) == '"<b>&</b>"'
    assert render_chat_template("{{ {'b': 1, 'a': [1]} | tojson(sort_keys=True) }}",
                                msgs) == '{"a": [1], "b": 1}'
    assert len(render_chat_template("{{ strftime_now('%Y') }}", msgs)) == 4
    loop = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
            "{{ m.content }}{% endfor %}")
    assert render_chat_template(loop, msgs * 3) == "<b>&</b>"
    with pytest.raises(ValueError, match="^chat template failed: roles must alternate$"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", msgs)
    with pytest.raises(ValueError, match="^chat template does not compile: line 1: "):
        render_chat_template("{% for m in messages %}", msgs)
    assert render_chat_template("{% if add_generation_prompt %}G{% endif %}", msgs,
                                add_generation_prompt=False) == ""


@pytest.mark.parametrize(("messages", "error", "message"), [
    ("hi", TypeError, "messages must be a list of"),
    ({"role": "user", "content": "hi"}, TypeError, "messages must be a list of"),
    ([], ValueError, "messages is empty"),
    (["hi"], TypeError, r"messages\[0\] must be a dict with 'role' and 'content', got str"),
    ([{"content": "hi"}], ValueError, r"messages\[0\] has no 'role'"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": 3}], ValueError,
     r"messages\[1\]\['content'\] must be a string, got int"),
])
def test_messages_are_checked(messages: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        check_messages(messages)


def test_messages_are_not_changed() -> None:
    msgs = [{"role": "user", "content": "hi", "name": "x"}]
    out = check_messages(msgs)
    assert out == msgs and out[0] is not msgs[0]
    assert render_chat_template("{{ messages[0].name }}", msgs) == "x"
