#!/bin/bash
# PPO --seed 1 with the fixed recipe (warm start seed 0: the cached 0.309), from the firsthour2 worktree
mkdir -p /tmp/docrun/ppo_fixed && cd /tmp/docrun/ppo_fixed && ln -sfn /work/wt-firsthour2/recipes recipes
export ROLLOUT_WARM_START_CACHE=/tmp/docrun/cache
export PYTHONPATH=/work/wt-firsthour2
V=/work/venv/bin
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/docrun/times.txt
  s=$(date +%s); bash -c "$*" > /tmp/docrun/logs/$name.out 2> /tmp/docrun/logs/$name.err; rc=$?
  echo "== $name rc $rc $(( $(date +%s)-s )) s end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/docrun/times.txt; }
run ppo_seed1_fixed "$V/accelerate launch --config_file recipes/accelerate/local.yaml recipes/ppo.py --seed 1 --output_dir runs/ppo_seed1"
run ppo_seed2_fixed "$V/accelerate launch --config_file recipes/accelerate/local.yaml recipes/ppo.py --seed 2 --output_dir runs/ppo_seed2"
echo ALLDONE_E >> /tmp/docrun/times.txt
