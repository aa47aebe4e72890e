"""An inspect-ai eval through `rollout serve` (issue 45), with user messages made of several text parts.

Runs under the python of a venv with inspect-ai (`pip install inspect-ai==0.3.285`), against a server that is
already up; imports nothing of rollout:

    /work/venv-clients/bin/python benchmarks/serve_inspect.py --base-url http://127.0.0.1:8000/v1 \
        --api-key secret --model tiny --provider openai-api      # or --provider vllm (VLLM_BASE_URL's path)

`openai-api` is inspect's provider for any OpenAI-compatible service (`openai-api/rollout/MODEL`); `vllm` is its
vLLM provider pointed at an existing server (`base_url`; it does not start one and reads `max_model_len` from
`/v1/models`). Each sample's user turn is `[ContentText(a), ContentText(b)]`; generation is greedy. Prints one
JSON object: the eval's status, its sample count, each sample's completion and error, the usage inspect saw.
`tests/serve/test_serve_inspect.py` runs it for both providers and checks each completion against a direct
request with the parts joined by "\\n", as vLLM joins them for a string template.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

PAIRS = [("12+", "34="), ("Once upon", "a time"), ("abc", "def"), ("7*8", "=")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", required=True, help="the server's OpenAI base URL (http://HOST:PORT/v1)")
    p.add_argument("--api-key", default="none")
    p.add_argument("--model", default="tiny", help="the server's served model name")
    p.add_argument("--provider", default="openai-api", choices=("openai-api", "vllm"))
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--log-dir", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.model import ChatMessageUser, ContentText
    from inspect_ai.scorer import includes
    from inspect_ai.solver import generate

    samples = [Sample(input=[ChatMessageUser(content=[ContentText(text=a), ContentText(text=b)])], target="0",
                      id=i) for i, (a, b) in enumerate(PAIRS)]
    task = Task(dataset=samples, solver=generate(), scorer=includes())
    model = f"openai-api/rollout/{args.model}" if args.provider == "openai-api" else f"vllm/{args.model}"
    log = eval(task, model=model, model_base_url=args.base_url, model_args={"api_key": args.api_key},
               temperature=0.0, max_tokens=args.max_tokens, display="none",
               log_dir=args.log_dir or tempfile.mkdtemp(prefix="inspect-logs-"), max_retries=0)[0]
    out = {"provider": args.provider, "model": model, "status": log.status,
           "error": None if log.error is None else log.error.message,
           "samples": [{"id": s.id, "parts": list(PAIRS[int(s.id)]), "completion": s.output.completion,
                        "error": None if s.error is None else s.error.message} for s in (log.samples or [])],
           "usage": {k: v.model_dump() for k, v in (log.stats.model_usage or {}).items()}}
    print(json.dumps(out))
    return 0 if log.status == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
