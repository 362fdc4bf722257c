"""Chat templates: rendered in a sandbox, equal to transformers' rendering for SmolLM2, a
template that reaches outside its sandbox refused in one line, and one that would run for ever
or fill the memory refused by its budget in one line naming the file (``handformer chat``
exits 2)."""

from __future__ import annotations

from pathlib import Path

import jinja2.sandbox
import pytest

from conftest import hf_gguf_tokenizer
from handformer.chat.sandbox import RenderBudget
from handformer.chat.template import (
    ChatTemplateError,
    check_messages,
    render_chat_template,
)
from handformer.tokenizers.lm import LMTokenizer
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
    path = smollm2_path()
    ours = LMTokenizer.from_gguf_metadata(gguf_metadata(path), source=path)
    return ours, hf_gguf_tokenizer(path)


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


# ---- the budget: templates that would run for ever or fill the memory ------------------------

HI = [{"role": "user", "content": "hi"}]
NESTED_LOOPS = ("{% for a in range(100000) %}{% for b in range(100000) %}"
                "{% for c in range(100000) %}{% endfor %}{% endfor %}{% endfor %}")
DOUBLING = ("{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
            "{% endfor %}{{ ns.s }}")

# The four templates, and the other ways found to the same ends: (template, the words
# of the refusal).
HOSTILE = {
    "nested range loops": (NESTED_LOOPS, "more than 100000 steps"),
    "loops over a list": ("{% set r = range(100000) | list %}{% for a in r %}{% for b in r %}"
                          "{% endfor %}{% endfor %}", "more than 100000 steps"),
    "tower of powers": ("{{ ((9**999)**999)**999 }}",
                        "bits (3167-bit base, exponent 999) is above"),
    "doubling with ~": (DOUBLING, "a ~ concatenation of 1048576 items"),
    "doubling with +": (DOUBLING.replace("ns.s ~ ns.s", "ns.s + ns.s"), "a str of 1048576 items"),
    "900k-item join": ("{{ ((range(100000) | list) * 9) | join('x' * 999999) }}",
                       "a joined text of"),
    "join method": ("{{ ('x' * 999999).join((range(100000) | list) * 9) }}", "a joined text of"),
    "nested literals": ("{% set a = 'x' * 999999 %}{% set b = [a, a] %}{{ [b, b] }}",
                        "a literal holds more than 1000000 items"),
    "shared nesting": ("{% set ns = namespace(x=[1]) %}{% for i in range(60) %}"
                       "{% set ns.x = [ns.x, ns.x] %}{% endfor %}{{ ns.x == ns.x }}",
                       "a literal holds more than"),
    "set block": ("{% set s %}{% for i in range(1000) %}{{ 'x' * 999999 }}{% endfor %}"
                  "{% endset %}{{ s | length }}", "writes more than 4000000 characters"),
    "macro fan-out": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                      "{% endmacro %}{{ f(60) }}", "more than 100000 steps"),
    "constant filter": ("{% for i in range(100) %}{{ 'a' | center(999999) }}{% endfor %}",
                        "writes more than 4000000 characters"),
    "ljust": ("{{ 'a'.ljust(10**9) }}", "ljust() gets the number 1000000000"),
    "format width": ("{{ '{:>999999999}'.format(1) }}", "a format string asks for a width"),
    "% width": ("{{ '%999999999d' % 1 }}", "a % format asks for a width of 999999999"),
    "replace ''": ("{{ ('a' * 100000).replace('', 'x' * 1000) }}", "a replaced text of"),
    "replace filter": ("{{ ('a' * 100000) | replace('', 'x' * 1000) }}", "a replaced text of"),
    "indent": ("{{ ('\n' * 100000) | indent(width=1000) }}", "an indented text of"),
    "batch": ("{{ [1] | batch(10**9, 'x') | list | length }}",
              "filter batch gets the number 1000000000"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_budget_refuses_in_one_line_naming_the_file(name: str) -> None:
    template, words = HOSTILE[name]
    with pytest.raises(ChatTemplateError) as info:
        render_chat_template(template, HI, source="evil.gguf")
    message = str(info.value)
    assert message.startswith("evil.gguf: chat template refused by the sandbox: ")
    assert words in message and "\n" not in message
    assert isinstance(info.value, ValueError)  # what callers of the tokenizer catch


def test_budget_bounds_the_time() -> None:
    slow = "{% for i in range(99999) %}{{ (range(1000) | list) | string | length }}{% endfor %}"
    with pytest.raises(ChatTemplateError, match=r"^x.gguf: chat template refused by the "
                                                r"sandbox: it runs for more than 0.2 s"):
        render_chat_template(slow, HI, source="x.gguf", budget=RenderBudget(seconds=0.2))


def test_budget_bounds_are_the_given_ones() -> None:
    """Each bound holds at the value given, and a template just within it renders."""
    loop = "{% for i in range(10) %}{{ i }}{% endfor %}"
    assert render_chat_template(loop, HI, budget=RenderBudget(steps=12)) == "0123456789"
    with pytest.raises(ChatTemplateError, match="more than 10 steps"):
        render_chat_template(loop, HI, budget=RenderBudget(steps=10))
    assert render_chat_template("{{ 'ab' * 5 }}", HI, budget=RenderBudget(items=10)) == "ab" * 5
    with pytest.raises(ChatTemplateError, match="repeated 6 times is above the sandbox's limit "
                                                "of 10 items"):
        render_chat_template("{{ 'ab' * 6 }}", HI, budget=RenderBudget(items=10))
    with pytest.raises(ChatTemplateError, match="writes more than 5 characters"):
        render_chat_template("{{ 'abc' }}{{ 'def' }}", HI, budget=RenderBudget(output=5))
    assert render_chat_template("{{ 2 ** 60 }}", HI, budget=RenderBudget(int_bits=64)) == str(
        2**60)
    with pytest.raises(ChatTemplateError, match="above the sandbox's limit of 64 bits"):
        render_chat_template("{{ 2 ** 70 }}", HI, budget=RenderBudget(int_bits=64))
    with pytest.raises(ValueError, match=r"RenderBudget.seconds must be a positive number"):
        RenderBudget(seconds=0)
    with pytest.raises(TypeError, match="budget must be a RenderBudget, got dict"):
        render_chat_template("x", HI, budget={"seconds": 1})


def test_other_template_failures_are_one_line() -> None:
    for template, words in (("{{ 1 + 'a' }}", "TypeError: unsupported operand"),
                            ("{{ 9.0 ** 999 }}", "OverflowError"),
                            ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
                            ("{{ lipsum(10**6) }}", "'lipsum' is undefined"),
                            ("{{ [1] | tojson(indent=100000) }}", "indent must be at most 16"),
                            ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "RecursionError")):
        with pytest.raises(ChatTemplateError, match="^f.gguf: chat template (failed|does not "
                                                    "compile): ") as info:
            render_chat_template(template, HI, source="f.gguf")
        assert words in str(info.value) and "\n" not in str(info.value)


def test_budget_leaves_real_templates_alone(smol) -> None:
    """SmolLM2's template on a long conversation: a few steps per message, far within."""
    ours, _ = smol
    long = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i} " * 20}
            for i in range(2000)]
    text = ours.apply_chat_template(long)
    assert text.count("<|im_start|>") == 2002 and text.endswith("<|im_start|>assistant\n")
    assert render_chat_template("{% for m in messages %}{{ m.content | upper }}{% endfor %}",
                                long[:3], budget=RenderBudget(steps=12)) == "TURN 0 " * 20 + (
        "TURN 1 " * 20) + "TURN 2 " * 20


def _evil_gguf(path: Path, template: str) -> Path:
    """A complete tiny llama GGUF (SentencePiece vocabulary) whose chat template is
    ``template``."""
    import numpy as np

    from gguf_util import ARR, STR, U32, llama_metadata, write_gguf

    fields = spm_fields()
    V, E, F, H, K, D = len(fields["tokens"]), 16, 32, 2, 1, 8
    rng = np.random.default_rng(0)
    meta = llama_metadata("llama", vocab=V, hidden=E, layers=1, heads=H, kv=K, ff=F)
    meta.update({"tokenizer.ggml.model": (STR, "llama"),
                 "tokenizer.ggml.tokens": (ARR, fields["tokens"]),
                 "tokenizer.ggml.scores": (ARR, fields["scores"]),
                 "tokenizer.ggml.token_type": (ARR, fields["token_types"]),
                 "tokenizer.ggml.unknown_token_id": (U32, 0),
                 "tokenizer.chat_template": (STR, template)})

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    tensors = {"token_embd.weight": w(V, E), "output_norm.weight": w(E),
               "blk.0.attn_norm.weight": w(E), "blk.0.ffn_norm.weight": w(E),
               "blk.0.attn_q.weight": w(H * D, E), "blk.0.attn_k.weight": w(K * D, E),
               "blk.0.attn_v.weight": w(K * D, E), "blk.0.attn_output.weight": w(E, H * D),
               "blk.0.ffn_gate.weight": w(F, E), "blk.0.ffn_up.weight": w(F, E),
               "blk.0.ffn_down.weight": w(E, F)}
    return write_gguf(path, "llama", meta, tensors)


def test_chat_command_exits_2_with_one_line_on_a_refused_template(tmp_path, monkeypatch,
                                                                  capsys) -> None:
    import io

    from handformer.cli import main

    path = _evil_gguf(tmp_path / "evil.gguf", NESTED_LOOPS)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\nhello again\n"))
    assert main(["chat", "--model", str(path), "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith(f"handformer chat: error: {path}: chat template refused by the "
                          "sandbox: it takes more than 100000 steps")
    # A template within its budget chats (the same file, a plain template).
    good = _evil_gguf(tmp_path / "good.gguf", "{% for m in messages %}{{ m.content }}"
                                              "{% endfor %}")
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    assert main(["chat", "--model", str(good), "--max-new-tokens", "2"]) == 0
