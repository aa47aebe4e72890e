#!/bin/bash
cd /tmp/docrun/rollout
export ROLLOUT_WARM_START_CACHE=/tmp/docrun/cache
export PYTHONPATH=/tmp/docrun/rollout
V=/work/venv/bin
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/docrun/times.txt
  s=$(date +%s); bash -c "$*" > /tmp/docrun/logs/$name.out 2> /tmp/docrun/logs/$name.err; rc=$?
  echo "== $name rc $rc $(( $(date +%s)-s )) s end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/docrun/times.txt; }
run tiny_chat "$V/python tests/support/chat_model.py runs/tiny_chat"
run gsm8k_cpu "$V/accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --model runs/tiny_chat --dataset tests/data/gsm8k_tiny.jsonl --prompt_column question --answer_column answer --reward math --chat_template --steps 5 --prompts_per_step 4 --group_size 4 --max_new_tokens 16 --lr 1e-4 --output_dir runs/grpo_gsm8k_cpu"
while [ -z "$(ls /tmp/docrun/cache 2>/dev/null | grep -v tmp)" ]; do sleep 10; done
run fleet "$V/accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --rollout_engines 1 --async_rollout --max_staleness 1 --output_dir runs/grpo_fleet"
run tp2_torchrun "$V/torchrun --nproc-per-node 2 recipes/grpo.py --tp_size 2 --output_dir runs/grpo_tp2"
run launch_2cpu "$V/accelerate launch --config_file recipes/accelerate/2cpu.yaml recipes/grpo.py --output_dir runs/grpo_2cpu"
echo ALLDONE_B >> /tmp/docrun/times.txt
