#!/bin/bash
cd /tmp/docrun/rollout
export ROLLOUT_WARM_START_CACHE=/tmp/docrun/cache
export PYTHONPATH=/tmp/docrun/rollout
V=/work/venv/bin
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/docrun/times.txt
  s=$(date +%s); bash -c "$*" > /tmp/docrun/logs/$name.out 2> /tmp/docrun/logs/$name.err; rc=$?
  echo "== $name rc $rc $(( $(date +%s)-s )) s end $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /tmp/docrun/times.txt; }
until grep -q ALLDONE_C /tmp/docrun/times.txt; do sleep 15; done
mv runs/grpo_tp2 runs/grpo_tp2.before-torchrun
run tp2_accelerate "$V/accelerate launch --config_file recipes/accelerate/2cpu.yaml recipes/grpo.py --tp_size 2 --output_dir runs/grpo_tp2"
echo ALLDONE_D >> /tmp/docrun/times.txt
