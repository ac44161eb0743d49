"""The offline tiny checkpoint: transformers loads it, and its chat template renders the Qwen3 tool layout."""
import torch
from transformers import AutoModelForCausalLM

from model import Transformer
from data.prompts import CODE_INTERPRETER as TOOL_SCHEMA

CONVERSATION = [
    {"role": "user", "content": "What is 123*456?"},
    {"role": "assistant", "content": "Let me compute.",
     "tool_calls": [{"type": "function", "function": {"name": "code_interpreter",
                                                      "arguments": {"code": "print(123*456)"}}}]},
    {"role": "tool", "content": "56088"},
    {"role": "assistant", "content": "",
     "tool_calls": [{"name": "code_interpreter", "arguments": '{"code": "1+1"}'},
                    {"name": "code_interpreter", "arguments": {"code": "2"}}]},
    {"role": "tool", "content": "2"},
    {"role": "tool", "content": "2"},
    {"role": "assistant", "content": "The answer is \\boxed{56088}."},
]

EXPECTED_TAIL = (
    "<|im_start|>user\nWhat is 123*456?<|im_end|>\n"
    "<|im_start|>assistant\nLet me compute.\n<tool_call>\n"
    '{"name": "code_interpreter", "arguments": {"code": "print(123*456)"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n56088\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>\n"
    '{"name": "code_interpreter", "arguments": {"code": "1+1"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "code_interpreter", "arguments": {"code": "2"}}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\nThe answer is \\boxed{56088}.<|im_end|>\n"
)


def test_chat_template_renders_tool_conversation(tiny_tokenizer):
    text = tiny_tokenizer.apply_chat_template(CONVERSATION, tools=[TOOL_SCHEMA], tokenize=False)
    head, tail = text.split("<|im_end|>\n", 1)
    assert head.startswith("<|im_start|>system\n# Tools\n\n")
    assert "<tools>\n" + __import__("json").dumps(TOOL_SCHEMA) + "\n</tools>" in head
    assert head.endswith('<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')
    assert tail == EXPECTED_TAIL
    prompt = tiny_tokenizer.apply_chat_template(CONVERSATION[:1], tools=[TOOL_SCHEMA], tokenize=False,
                                                add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nWhat is 123*456?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_without_tools_and_with_system(tiny_tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert tiny_tokenizer.apply_chat_template(msgs, tokenize=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")
    with_tools = tiny_tokenizer.apply_chat_template(msgs, tools=[TOOL_SCHEMA], tokenize=False)
    assert with_tools.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")


def test_special_and_marker_tokens_are_single_ids(tiny_tokenizer):
    for t in ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<tool_call>", "</tool_call>",
              "<tool_response>", "</tool_response>"]:
        assert len(tiny_tokenizer.encode(t, add_special_tokens=False)) == 1, t
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    # digits one by one, as Qwen's tokenizer splits them
    assert tiny_tokenizer.convert_ids_to_tokens(tiny_tokenizer.encode("1234567", add_special_tokens=False)) == [
        "1", "2", "3", "4", "5", "6", "7"]
    # as plain text, a special-token string does not become the special token
    plain = tiny_tokenizer.encode("<|im_end|>", add_special_tokens=False, split_special_tokens=True)
    assert tiny_tokenizer.eos_token_id not in plain and tiny_tokenizer.decode(plain) == "<|im_end|>"


def test_tiny_checkpoint_loads_in_both(tiny_ckpt, tiny_tokenizer):
    ours = Transformer.from_pretrained(tiny_ckpt)
    theirs = AutoModelForCausalLM.from_pretrained(tiny_ckpt).eval()
    assert ours.config.vocab_size == len(tiny_tokenizer)
    ids = torch.tensor([tiny_tokenizer.encode("The answer is 42.")])
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max() < 1e-4

