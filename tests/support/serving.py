"""Helpers of the serve tests: a tiny saved model whose tokenizer has a chat template, and a server on
127.0.0.1 run by uvicorn on a thread of the test process (bounded start, stopped at the end)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .tiny_models import VOCAB, make_model

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<|im_start|>tools\n{% for t in tools %}{{ t['function']['name'] }}\n{% endfor %}<|im_end|>\n{% "
    "endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% if greeting is defined %}{{ greeting }}{% endif "
    "%}{% endif %}"
)


def make_tokenizer():
    """A character-level tokenizer over the tiny models' 128-token vocabulary, with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    names = SPECIALS + chars
    names += [f"<x{i}>" for i in range(VOCAB - len(names))]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


PARTS_TEMPLATE = (  # iterates content parts (string content printed as is), each part in <...>
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for part in m['content'] %}<{{ part['text'] }}>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_parts_tokenizer():
    """`make_tokenizer` with `PARTS_TEMPLATE` and a post-processor that puts <s> first (add_special_tokens)."""
    from tokenizers import processors

    tok = make_tokenizer()
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    tok.chat_template = PARTS_TEMPLATE
    return tok


def save_tiny(path: Path, seed: int = 0, tokenizer=None) -> Path:
    """Save a tiny Qwen3-architecture model and the tokenizer (`make_tokenizer` by default) to `path`."""
    make_model("qwen3", seed=seed).save_pretrained(path)
    (tokenizer or make_tokenizer()).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Served:
    url: str
    key: str
    app: object
    engine: object
    model_dir: Path


def call(server, method: str, path: str, body=None, timeout: float = 120, **params):
    """One request to a `serving` server (`Served`): `body` as JSON, `params` as the query, its API key as bearer."""
    import httpx

    return httpx.request(method, server.url + path, json=body, params=params or None, timeout=timeout,
                         headers={"Authorization": f"Bearer {server.key}"})


@contextlib.contextmanager
def serving(model_dir: Path, key: str = "test-key", start_timeout: float = 60.0, app_kwargs: dict | None = None,
            **engine_config):
    """Run `rollout serve` on `model_dir` in this process; yields a `Served`. `app_kwargs` go to `build_app`."""
    import uvicorn

    from rollout import ContinuousBatchingConfig, RolloutEngine
    from rollout.serve.app import build_app
    from rollout.serve.cli import load

    model, tokenizer, gc = load(str(model_dir), "float32")
    config = ContinuousBatchingConfig(**{"page_size": 16, "num_blocks": 256, **engine_config})
    engine = RolloutEngine(model, tokenizer=tokenizer, config=config, generation_config=gc)
    app = build_app(engine, tokenizer, "tiny", key, max_body_bytes=1 << 16, **(app_kwargs or {}))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            engine.close()
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Served(f"http://127.0.0.1:{port}", key, app, engine, model_dir)
    finally:
        server.should_exit = True
        thread.join(30)
        engine.close()
