"""`rollout.api.content`: which form a chat template wants its content in (vLLM's `auto` detection from the
Jinja tree), and list content turned into it."""

from __future__ import annotations

import pytest

from rollout.api.content import ContentPartError, content_format, normalize_messages

STRING_TEMPLATES = [
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
    # Qwen3-style: tests `is string`, loops over other things of the message, never over its content
    "{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}{{ content }}"
    "{%- for call in message.tool_calls %}{{ call }}{% endfor %}{% endfor %}",
    # a loop over the characters of something that is not a message's content
    "{% for m in messages %}{% for c in m['role'] %}{{ c }}{% endfor %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ m.content",  # NOTE: unparsable: "string" (rendering fails anyway)
]
PARTS_TEMPLATES = [
    "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% if m.content is string %}{{ m.content }}{% else %}"
    "{% for p in m.content | selectattr('type', 'equalto', 'text') %}{{ p.text }}{% endfor %}{% endif %}{% endfor %}",
    # Llama-style: the loop runs over a slice of messages, the content through a variable
    "{% set loop_messages = messages[1:] %}{% for message in loop_messages %}{% set c = message['content'] %}"
    "{% for part in c %}{{ part['text'] }}{% endfor %}{% endfor %}",
    # a chain of variables set in any order (the search does not depend on where a {% set %} sits)
    "{% for m in b %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}{% set b = a %}{% set a = messages %}",
]


@pytest.mark.parametrize("template", STRING_TEMPLATES)
def test_string_templates(template):
    assert content_format(template) == "string"


@pytest.mark.parametrize("template", PARTS_TEMPLATES)
def test_parts_templates(template):
    assert content_format(template) == "openai"


def test_list_content_is_joined_or_kept_as_text_parts():
    parts = [{"type": "text", "text": "a", "cache_control": {}}, {"text": "b"}]
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": parts}, {"role": "tool"}]
    joined = normalize_messages(messages, STRING_TEMPLATES[0])
    assert joined == [messages[0], {"role": "user", "content": "a\nb"}, messages[2]]
    assert joined[0] is messages[0]  # NOTE: string content is untouched
    kept = normalize_messages(messages, PARTS_TEMPLATES[0])
    assert kept[1] == {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}


@pytest.mark.parametrize("content,where", [
    ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}],
     r"content\[1\] is a 'image_url'"),
    ([{"type": "text", "text": 3}], r"content\[0\] is a text part without a string 'text'"),
    (["a"], r"content\[0\] must be a content part"),
    ({"type": "text", "text": "a"}, r"messages\[0\]\.content must be a string or a list"),
])
def test_bad_content_names_the_part(content, where):
    with pytest.raises(ContentPartError, match=where):
        normalize_messages([{"role": "user", "content": content}], STRING_TEMPLATES[0])
