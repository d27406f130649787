"""Chat formats: start + the model's tokens + extend equals the template's whole conversation."""

from __future__ import annotations

import pytest

from flowrl.agents.chat import CharChat, TemplateChat, chat_format, hermes_tool_calls
from flowrl.data.tokenizer import CharTokenizer
from flowrl.tasks import BOS, EOS
from tests.agents.fakes import chatml_tokenizer

TINY = {"type": "tiny", "vocab_size": 102}


def test_the_char_format_is_bos_then_each_message_and_a_newline():
    fmt = chat_format(TINY)
    tok = CharTokenizer()
    assert isinstance(fmt, CharChat) and fmt.stop_ids == (EOS,)
    start = fmt.start([{"role": "system", "content": "hi"}, {"role": "user", "content": "12*3"}])
    assert start == [BOS] + tok.encode("hi\n12*3\n")[1:]
    assert fmt.extend([{"role": "tool", "content": "36"}]) == tok.encode("36\n")[1:]
    assert BOS not in fmt.extend([{"role": "user", "content": "x"}])
    assert fmt.text(tok.encode("=12*3")[1:] + [EOS]) == "=12*3"


def test_the_compact_call_is_calc_of_what_follows_the_equals_sign():
    fmt = chat_format(TINY)
    (call,) = fmt.tool_calls("=417*382")
    assert (call.name, call.arguments) == ("calc", {"expr": "417*382"})
    assert fmt.tool_calls("159294") == []
    assert fmt.tool_calls('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>')[0].name == "python"


def test_hermes_blocks_parse_in_order_and_bad_json_is_a_nameless_call_with_the_error():
    text = ('I will look. <tool_call>{"name": "calc", "arguments": {"expr": "2+2"}}</tool_call>\n'
            '<tool_call>{"name": "calc", "arguments": {"expr": </tool_call>'
            '<tool_call>{"name": "search", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
            '<tool_call>["no name"]</tool_call><tool_call>{"name": "calc", "arguments": {"expr": "1"}}')
    calls = hermes_tool_calls(text)
    assert [c.name for c in calls] == ["calc", "", "search", "", "calc"]
    assert calls[0].arguments == {"expr": "2+2"}
    assert "bad tool call" in calls[1].arguments["error"] and calls[1].arguments["raw"].startswith('{"name"')
    assert calls[2].arguments == {"q": "x"}  # arguments given as a JSON string
    assert calls[4].arguments == {"expr": "1"}  # an unclosed last block (the turn was cut) still parses


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {"name": "calc"}}]])
def test_template_start_model_tokens_and_extend_are_the_template_of_the_whole_conversation(tools):
    hf = chatml_tokenizer()
    fmt = chat_format(hf)
    assert isinstance(fmt, TemplateChat)
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in fmt.stop_ids and hf.eos_token_id in fmt.stop_ids
    first = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}]
    ids = fmt.start(first, tools)
    convo = list(first)
    for reply, env in [('<tool_call>{"name": "calc"}</tool_call>', {"role": "tool", "content": "4"}),
                       ("It is 4.", {"role": "user", "content": "thanks"})]:
        ids += hf.encode(reply, add_special_tokens=False) + [im_end]  # what the engine generated
        ids += fmt.extend([env])
        convo += [{"role": "assistant", "content": reply}, env]
        whole = hf.apply_chat_template(convo, tools=tools, add_generation_prompt=True, tokenize=True)
        whole = whole["input_ids"] if isinstance(whole, dict) or hasattr(whole, "input_ids") else whole
        assert ids == list(whole)
    assert fmt.text(hf.encode("It is 4.", add_special_tokens=False) + [im_end]) == "It is 4."


def test_extend_never_renders_the_earlier_turns_again():
    hf = chatml_tokenizer()
    fmt = chat_format(hf)
    fmt.start([{"role": "user", "content": "a"}])
    delta = fmt.extend([{"role": "user", "content": "zz"}])
    text = hf.decode(delta)
    assert text == "\n<|im_start|>user\nzz<|im_end|>\n<|im_start|>assistant\n"  # ChatML's newline after <|im_end|> first


def test_a_tokenizer_without_a_template_is_refused_with_the_fix():
    hf = chatml_tokenizer()
    hf.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        chat_format(hf)
