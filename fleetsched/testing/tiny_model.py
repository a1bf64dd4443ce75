"""Generate a tiny random-weight Llama with a byte-level BPE tokenizer and a tool-aware chat template.

No weights can be downloaded on the project's machines, and the vLLM tests only need an engine that
schedules, batches, streams and counts tokens: the model's text is noise. Run it as a script with
the vLLM virtualenv's python (it imports only the standard library, torch, transformers and
tokenizers, so it needs neither fleetsched nor its dependencies)::

    .venv-vllm/bin/python fleetsched/testing/tiny_model.py .cache/tiny-model

The output is deterministic (fixed seed, fixed corpus). Sizes: hidden 128, 2 layers, 2 heads of
head_dim 64 (the CPU attention kernel rejects head_dim 16), vocabulary 1024.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SEED = 0
VOCAB_SIZE = 1024
MAX_POSITIONS = 4096

BOS, EOS, PAD = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"
START_HEADER, END_HEADER, EOT = "<|start_header|>", "<|end_header|>", "<|eot|>"
TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
SPECIAL_TOKENS = [BOS, EOS, PAD, START_HEADER, END_HEADER, EOT, TOOL_CALL, END_TOOL_CALL]

# Llama-3-like framing with Hermes-style tool calls. OpenAI `tools` are listed in the system turn;
# an assistant turn's `tool_calls` become <tool_call>{"name": ..., "arguments": ...}</tool_call>;
# `tool` messages are rendered as a "tool" turn naming the call they answer. Arguments may arrive as
# a JSON string (the OpenAI wire format) or already parsed into a mapping (vLLM parses them).
CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- set ns = namespace(system='') %}"
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{%- set ns.system = messages[0]['content'] if messages[0]['content'] is string else '' %}"
    "{%- set messages = messages[1:] %}"
    "{%- endif %}"
    "{%- if tools or ns.system %}"
    "{{- '<|start_header|>system<|end_header|>\\n' }}"
    "{{- ns.system }}"
    "{%- if tools %}"
    "{{- '\\n\\nYou may call these tools. To call one, answer with '"
    " '<tool_call>{\"name\": NAME, \"arguments\": {...}}</tool_call>.\\n' }}"
    "{%- for tool in tools %}"
    "{{- (tool['function'] if tool['function'] is defined else tool) | tojson }}{{- '\\n' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|eot|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    # A namespace, because a plain `set` inside the inner loop would not outlive it (Jinja
    # scoping), and vLLM passes content as a list of parts by default.
    "{%- set c = namespace(text=(message['content'] if message['content'] is string else '')) %}"
    "{%- if message['content'] is not string and message['content'] %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{%- set c.text = c.text + part['text'] %}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{%- set content = c.text %}"
    "{%- if message['role'] == 'tool' %}"
    "{{- '<|start_header|>tool<|end_header|>\\n' }}"
    "{%- if message['tool_call_id'] is defined and message['tool_call_id'] %}"
    "{{- '[' + message['tool_call_id'] + '] ' }}"
    "{%- endif %}"
    "{{- content + '<|eot|>' }}"
    "{%- else %}"
    "{{- '<|start_header|>' + message['role'] + '<|end_header|>\\n' + content }}"
    "{%- if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set fn = call['function'] if call['function'] is defined else call %}"
    "{{- '<tool_call>{\"name\": \"' + fn['name'] + '\", \"arguments\": ' }}"
    "{%- if fn['arguments'] is string %}{{- fn['arguments'] }}{%- else %}{{- fn['arguments'] | tojson }}{%- endif %}"
    "{{- '}</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|eot|>' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header|>assistant<|end_header|>\\n' }}{%- endif %}"
)

_CORPUS = """
You are a helpful assistant. The user asks a question and the assistant answers it.
An agent plans, calls tools, reads their results and answers. A tool call names a function and
passes JSON arguments: {"name": "search", "arguments": {"query": "weather in Paris", "limit": 3}}.
The tool returns a result: {"temperature": 21.5, "unit": "celsius", "sky": "clear"}.
Schedulers share one inference server among many tenants. Each tenant has a tier: critical,
standard or batch. Requests wait in a queue; the engine batches running sequences continuously,
and the key-value cache holds the attention state of every token of every running sequence.
def add(a, b):
    return a + b
for i in range(10):
    print(i, i * i)
SELECT name, count(*) FROM sessions WHERE tenant = 'acme' GROUP BY name ORDER BY 2 DESC;
The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828
Monday Tuesday Wednesday Thursday Friday Saturday Sunday; January February March April May June.
Please read the file, summarise it in three sentences, then write the summary to notes.txt.
Error: connection refused. Retrying in 2 seconds. Success after 3 attempts. Latency 41 ms.
"""


def build_tokenizer(out_dir: Path):
    """Train the byte-level BPE on the built-in corpus and save it as a fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Repeat the corpus so that merges beyond single occurrences are learned in a stable order.
    tokenizer.train_from_iterator([_CORPUS] * 8, trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[START_HEADER, END_HEADER, EOT, TOOL_CALL, END_TOOL_CALL],
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def build_model(out_dir: Path, tokenizer) -> None:
    """Create the random-weight Llama (seeded) and save it as float32 safetensors."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    eos_ids = [tokenizer.convert_tokens_to_ids(EOS), tokenizer.convert_tokens_to_ids(EOT)]
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(str(out_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path, help="directory to write the model and tokenizer into")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(args.out_dir)
    build_model(args.out_dir, tokenizer)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    summary = {"out_dir": str(args.out_dir), "vocab": len(tokenizer), "template_sample": rendered}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
