"""data/tiny.py: a genuine Hugging Face checkpoint built offline, for the tests and the CPU demo.

`build_tiny_checkpoint(dir)` writes random tiny Qwen3 weights and a tokenizer AutoTokenizer loads:
byte-level BPE trained on a built-in corpus, Qwen's special tokens, the tool-call markers as single
added tokens and digits one by one (as in Qwen), a Qwen3 tool-use chat template. Nothing downstream
special-cases it: real Qwen checkpoints take the same code paths.

    python -m data.tiny runs/tiny      # write the checkpoint, print what was built
"""

import json
import os
import sys

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # their ids follow this order
# Added, not special (Qwen has them as single ids too): decoding keeps them.
MARKER_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]

TINY_CONFIG = dict(model_type="qwen3", hidden_size=128, intermediate_size=384,
                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=4096,
                   tie_word_embeddings=True, attention_bias=False, dtype="float32")
VOCAB_SIZE = 2048   # the BPE's ceiling; the small corpus below yields 761 tokens

# Qwen3's tool-use chat template (a line ending in """ goes on in the next r"""). Tool calls with or
# without the "function" wrapper, arguments a dict or JSON text; adjacent tool turns: one user turn.
CHAT_TEMPLATE = (r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"""
r"""You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
{%- for tool in tools %}{{- '\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\n</tools>\n\nFor each function call, return a json object with function name and """
r"""arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"""
r"""{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
{%- set content = message.content if message.content is string else '' %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' + content }}
{%- if message.tool_calls %}
{%- for tool_call in message.tool_calls %}
{%- if (loop.first and content) or (not loop.first) %}{{- '\n' }}{%- endif %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '<tool_call>\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"""
r"""{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}
""").strip()

# Qwen2's pre-tokenizer split (contractions, words, punctuation runs, newlines, spaces), digits one
# by one as in Qwen: ten digit tokens, each seen often, which the toy model learns to copy quickly.
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tiny_checkpoint(path, seed=0, **overrides):
    """Write a random tiny Qwen3 checkpoint with the offline tokenizer into `path`; returns path."""
    from model import ModelConfig, Transformer
    from data.prompts import CODE_INTERPRETER
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    # the text the merges are learned from: the chat and tool layout, Python, arithmetic prose
    layout = (CHAT_TEMPLATE.replace("{{-", " ").replace("}}", " ")
              .replace("{%-", " ").replace("%}", " "))
    python = ("print(result)\nimport math\nresult = sum(int(d) for d in str(n))\nfor i in range(10):\n"
              "    total += i * i\nx = 12345 * 6789\nprint(x % 97)\ndef f(n):\n    return n ** 2\n"
              "Traceback (most recent call last):\nNameError: name is not defined\nSyntaxError: invalid syntax\n")
    prose = ("Compute the value. Let me use the code tool to calculate it. The answer is \\boxed{42}. "
             "What is the product of the numbers? Find the remainder when divided by. "
             "Solve the problem step by step and put the final answer in \\boxed{}. "
             "The result of the computation is. I will write Python code to compute this. "
             "<tool_call>\n{\"name\": \"code_interpreter\", \"arguments\": {\"code\": \"print(1)\"}}\n</tool_call> "
             "<tool_response>\n1\n</tool_response> the sum of the digits of modulo times plus minus "
             "What is 12 * 34? What is (56 * 78) % 9? What is the sum of the digits of 12**5? "
             "Use the code tool, then give the final answer in \\boxed{}. The answer is \\boxed{7}. "
             "NameError: name 'pritn' is not defined SyntaxError: invalid syntax. Perhaps you forgot a comma? ")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(MARKER_TOKENS),
                                  special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([layout, json.dumps(CODE_INTERPRETER), python, prose] * 20, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                        pad_token="<|endoftext|>", unk_token=None,
                                        bos_token=None, clean_up_tokenization_spaces=False)
    tokenizer.add_tokens(MARKER_TOKENS)  # after training, so the merges never swallow them
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = TINY_CONFIG["max_position_embeddings"]
    tokenizer.save_pretrained(path)
    cfg = {**TINY_CONFIG, "vocab_size": len(tokenizer), **overrides}
    cfg.setdefault("eos_token_id", tokenizer.convert_tokens_to_ids("<|im_end|>"))
    cfg.setdefault("pad_token_id", tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    Transformer.from_config(ModelConfig.from_dict(cfg), seed=seed).save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": cfg["eos_token_id"], "pad_token_id": cfg["pad_token_id"]}, f)
    return path


if __name__ == "__main__":
    out = build_tiny_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(out)
    print(f"wrote {out}: vocab {len(tok)}, files {sorted(os.listdir(out))}")
