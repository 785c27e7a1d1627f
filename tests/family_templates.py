"""Chat templates written here in the shape of each model family's own (their markers,
their special tokens, how they render tools, earlier calls and results), for tests with
tiny random models: what `--tool-call-parser auto` and `--reasoning-parser auto` read."""

# Every family's markers, as special tokens of the tiny test vocabulary (tiny_models.py).
FAMILY_SPECIAL_TOKENS = [
    "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[INST]", "[/INST]", "[THINK]", "[/THINK]",
    "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>",
    "<｜tool▁calls▁end｜>", "<｜User｜>", "<｜Assistant｜>",
    "<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>", "<|user|>", "<|assistant|>",
    "<|end|>", "<|python_start|>", "<|python_end|>", "<|python_tag|>",
]

_TOOLS_JSON = "{% for t in tools %}{{ t | tojson }}{% endfor %}"

MISTRAL_V11 = (
    "{% if tools %}[AVAILABLE_TOOLS][" + "{% for t in tools %}{{ t | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}][/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}[TOOL_CALLS]{{ c.function.name }}[ARGS]"
    "{{ c.function.arguments | tojson }}{% endfor %}<|endoftext|>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% endif %}{% endfor %}")

MISTRAL_V3 = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}{% if tools and loop.last %}[AVAILABLE_TOOLS]["
    "{% for t in tools %}{{ t | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' %}{% if m.tool_calls %}[TOOL_CALLS]["
    "{% for c in m.tool_calls %}{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}{% if not loop.last %}, {% endif %}{% endfor %}]"
    "{% else %}{{ m.content }}{% endif %}<|endoftext|>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]"
    "{% endif %}{% endfor %}")

# Magistral's: thinking in [THINK]...[/THINK], opened by the generation prompt here.
MAGISTRAL = MISTRAL_V11 + "{% if add_generation_prompt %}[THINK]{% endif %}"

DEEPSEEK_V3 = (
    "{% if tools %}## Tools\n" + _TOOLS_JSON + "\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<｜Assistant｜>{{ m.content or '' }}"
    "{% if m.tool_calls %}<｜tool▁calls▁begin｜>{% for c in m.tool_calls %}"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ c.function.name }}\n```json\n"
    "{{ c.function.arguments | tojson }}\n```<｜tool▁call▁end｜>{% endfor %}"
    "<｜tool▁calls▁end｜>{% endif %}<|endoftext|>"
    "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}")

PHI4_MINI = (
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<|system|>{{ m.content }}{% if tools %}<|tool|>"
    "[" + "{% for t in tools %}{{ t.function | tojson }}{% if not loop.last %}, {% endif %}"
    "{% endfor %}]<|/tool|>{% endif %}<|end|>"
    "{% elif m.role == 'user' %}<|user|>{{ m.content }}<|end|>"
    "{% elif m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}"
    "{% if m.tool_calls %}<|tool_call|>[{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "{% if not loop.last %}, {% endif %}{% endfor %}]<|/tool_call|>{% endif %}<|end|>"
    "{% elif m.role == 'tool' %}<|tool|>{{ m.content }}<|end|>"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")

QWEN3_CODER = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>\n" + _TOOLS_JSON + "\n</tools>\n"
    "Call a function as <tool_call>\n<function=name>\n<parameter=key>\nvalue\n</parameter>\n"
    "</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n<function={{ c.function.name }}>\n"
    "{% for k, v in c.function.arguments.items() %}<parameter={{ k }}>\n{{ v }}\n</parameter>\n"
    "{% endfor %}</function>\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

LLAMA32_PYTHONIC = (
    "{% if tools %}<|im_start|>system\nYou can call functions. If you call one, answer "
    "only in the format [func_name1(params_name1=params_value1), func_name2(...)]\n"
    + _TOOLS_JSON + "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ 'ipython' if m.role == 'tool' else m.role }}\n"
    "{% if m.tool_calls %}[{% for c in m.tool_calls %}{{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}"
    "{% endfor %}]{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

LLAMA4_PYTHONIC = LLAMA32_PYTHONIC.replace("[func_name1(params_name1=params_value1), "
                                           "func_name2(...)]",
                                           "<|python_start|>[f(x=1)]<|python_end|>")

GEMMA = (
    "{% if tools %}<|im_start|>user\nYou may call functions: write the call in a "
    "```tool_code``` block.\n" + _TOOLS_JSON + "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% if m.tool_calls %}```tool_code\n{% for c in m.tool_calls %}{{ c.function.name }}("
    "{% for k, v in c.function.arguments.items() %}{{ k }}={{ v | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %})\n{% endfor %}```{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

LLAMA3_JSON = (
    "{% if tools %}<|im_start|>ipython\nRespond with {\"name\": ..., \"parameters\": ...} "
    "or <|python_tag|>\n" + _TOOLS_JSON + "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{\"name\": \"{{ c.function.name }}\", \"parameters\": "
    "{{ c.function.arguments | tojson }}}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# family (the syntax name auto must choose) -> its template
TOOL_TEMPLATES = {
    "mistral_v11": MISTRAL_V11, "mistral": MISTRAL_V3, "deepseek_v3": DEEPSEEK_V3,
    "phi4_mini_json": PHI4_MINI, "qwen3_coder": QWEN3_CODER, "pythonic": LLAMA32_PYTHONIC,
    "gemma": GEMMA, "llama3_json": LLAMA3_JSON,
}
