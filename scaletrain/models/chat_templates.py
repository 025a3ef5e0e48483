"""The chat templates released models are trained in, by the name ``--chat-template`` takes.

Each is a Jinja template as a model folder ships it in tokenizer_config.json, rendered by
data/chat.py as transformers renders it: ``chatml`` (the ``<|im_start|>role ... <|im_end|>``
turns of Qwen2 and many fine-tunes), ``llama3`` (Llama 3's ``<|start_header_id|>`` headers and
``<|eot_id|>`` ends, its BOS first) and ``alpaca`` (Taori et al. 2023's ``### Instruction:`` /
``### Response:`` prompt, the answer ended by the tokenizer's EOS as axolotl and torchtune end
it). Their markers are special tokens only where the tokenizer has them; elsewhere they are
text, which a fine-tune learns like any other.
"""

from __future__ import annotations

CHAT_TEMPLATES = {
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    "llama3": (
        "{{ bos_token if bos_token is defined else '' }}"
        "{% for message in messages %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
    ),
    "alpaca": (
        "{% for message in messages %}"
        "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
        "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
        "{% else %}{{ '### Response:\\n' + message['content'] }}"
        "{{ eos_token if eos_token is defined else '\\n\\n' }}{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}"
    ),
}
