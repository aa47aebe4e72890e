#!/bin/bash
# runs doc commands as written in a fresh clone, fresh warm-start cache
cd /tmp/docrun/rollout
export ROLLOUT_WARM_START_CACHE=/tmp/docrun/cache
export PYTHONPATH=/tmp/docrun/rollout
V=/work/venv/bin
mkdir -p /tmp/docrun/logs
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/docrun/times.txt
  s=$(date +%s); bash -c "$*" > /tmp/docrun/logs/$name.out 2> /tmp/docrun/logs/$name.err; rc=$?
  echo "== $name rc $rc $(( $(date +%s)-s )) s end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/docrun/times.txt; }
run readme1 "$V/accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --output_dir runs/grpo"
run readme2 "$V/accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --model runs/grpo/init --seed 1 --output_dir runs/grpo_seed1"
run eval_sweep "$V/accelerate launch --config_file recipes/accelerate/local.yaml recipes/eval_sweep.py"
run ppo "$V/accelerate launch --config_file recipes/accelerate/local.yaml recipes/ppo.py --output_dir runs/ppo"
run lora_r8 "$V/accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --lora_rank 8 --output_dir runs/grpo_r8"
echo ALLDONE >> /tmp/docrun/times.txt
