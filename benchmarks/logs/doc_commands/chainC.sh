#!/bin/bash
cd /tmp/docrun/rollout
export ROLLOUT_WARM_START_CACHE=/tmp/docrun/cache
export PYTHONPATH=/tmp/docrun/rollout
V=/work/venv/bin
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/docrun/times.txt
  s=$(date +%s); bash -c "$*" > /tmp/docrun/logs/$name.out 2> /tmp/docrun/logs/$name.err; rc=$?
  echo "== $name rc $rc $(( $(date +%s)-s )) s end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/docrun/times.txt; }
until grep -q ALLDONE_B /tmp/docrun/times.txt; do sleep 15; done
run seed2 "$V/accelerate launch --config_file recipes/accelerate/local.yaml recipes/grpo.py --model runs/grpo/init --seed 2 --output_dir runs/grpo_seed2"
run ppo_seed1 "$V/accelerate launch --config_file recipes/accelerate/local.yaml recipes/ppo.py --seed 1 --output_dir runs/ppo_seed1"
echo ALLDONE_C >> /tmp/docrun/times.txt
