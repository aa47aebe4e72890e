"""vLLM's CPU build scoring given tokens with `prompt_logprobs`, run in its own venv (benchmarks/scoring.py).

    /work/vllm-venv/bin/python benchmarks/vllm_scoring.py IN.json OUT.json

IN.json: {"model": save_pretrained dir, "dtype", "threads", "sequences": [[ids]] (prompt + completion),
"warmup": [[ids]]}. OUT.json: {"seconds": wall time of the timed call, "init_seconds", "logprobs":
[[logprob of token t given tokens < t, for t >= 1]]}. Each sequence is one request with
`prompt_logprobs=0` (the given token's own logprob) and `max_tokens=1`; engine start-up and one small
warm-up batch run before the clock starts.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # NOTE: run as a script in vLLM's own venv

from vllm_cpu import start_llm  # noqa: E402


def main() -> None:
    job, llm, init, dst = start_llm(__doc__)
    from vllm import SamplingParams  # noqa: PLC0415
    from vllm.inputs import TokensPrompt  # noqa: PLC0415

    def run(seqs):
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs], params, use_tqdm=False)
        return [[next(iter(d.values())).logprob if len(d) == 1 else d[t].logprob
                 for d, t in zip(o.prompt_logprobs[1:], s[1:], strict=True)] for o, s in zip(outs, seqs, strict=True)]

    run(job["warmup"])
    t0 = time.perf_counter()
    logprobs = run(job["sequences"])
    seconds = time.perf_counter() - t0
    with open(dst, "w") as f:
        json.dump({"seconds": seconds, "init_seconds": init, "logprobs": logprobs}, f)


if __name__ == "__main__":
    main()
