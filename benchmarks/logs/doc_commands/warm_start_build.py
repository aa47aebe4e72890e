"""Build the recipes' warm start alone, from a given checkout, and print its held-out greedy exact match (issue 62:
why 0.281 at 1af7dca and 0.309 now). Run as the logs beside it were made, e.g.

    git archive 1af7dca | tar -x -C /tmp/ws1af
    OMP_NUM_THREADS=1 PYTHONPATH=/tmp/ws1af python warm_start_build.py /tmp/ws1af /tmp/out_1af_t1
    OMP_NUM_THREADS=1 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        PYTHONPATH=. python warm_start_build.py . /tmp/out_avx2
"""

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # NOTE: as the recipes set it
root, out = sys.argv[1], sys.argv[2]
sys.path[:0] = [root + "/recipes", root]
import _common  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from trainers.tasks import AdditionTask, greedy_accuracy  # noqa: E402

print("threads", torch.get_num_threads(), "rollout from", __import__("rollout").__file__, flush=True)
_common.build_warm_start(out, seed=0, target_exact=0.3, max_sft_steps=1000)
model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(out)
print("HELDOUT512", greedy_accuracy(model, tokenizer, AdditionTask(num_digits=3), n=512), flush=True)
