#!/usr/bin/env bash
# Fresh-clone figure runs for issue 46: the README's / docs' commands exactly, seeds 0-2.
cd /work/fresh
A=".venv/bin/accelerate launch --config_file recipes/accelerate/local.yaml"
run() { name=$1; shift; echo "== $name start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /work/fresh_logs/times.txt
  s=$(date +%s); "$@" > /work/fresh_logs/$name.log 2>&1; rc=$?
  echo "== $name rc $rc $(( $(date +%s) - s )) s end $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /work/fresh_logs/times.txt; }
run grpo0 $A recipes/grpo.py --output_dir runs/grpo
run agent0 $A recipes/agent_grpo.py --output_dir runs/agent_grpo
run distill0 $A recipes/distill.py
run grpo1 $A recipes/grpo.py --model runs/grpo/init --seed 1 --output_dir runs/grpo_seed1
run async0 $A recipes/grpo.py --async_rollout --max_staleness 1 --output_dir runs/grpo_async
run agent1 $A recipes/agent_grpo.py --seed 1 --output_dir runs/agent_grpo_seed1
run grpo2 $A recipes/grpo.py --model runs/grpo/init --seed 2 --output_dir runs/grpo_seed2
run distill1 $A recipes/distill.py --seed 1 --output_dir runs/distill_seed1
run async1 $A recipes/grpo.py --async_rollout --max_staleness 1 --seed 1 --output_dir runs/grpo_async_seed1
run agent2 $A recipes/agent_grpo.py --seed 2 --output_dir runs/agent_grpo_seed2
run distill2 $A recipes/distill.py --seed 2 --output_dir runs/distill_seed2
run async2 $A recipes/grpo.py --async_rollout --max_staleness 1 --seed 2 --output_dir runs/grpo_async_seed2
echo ALLDONE >> /work/fresh_logs/times.txt
