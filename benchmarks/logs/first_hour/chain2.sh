#!/usr/bin/env bash
while ! grep -q ALLDONE /work/fresh_logs/times.txt; do sleep 20; done
cd /work/fresh
A=".venv/bin/accelerate launch --config_file recipes/accelerate/2cpu_fsdp.yaml"
run() { name=$1; shift; echo "== $name start $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /work/fresh_logs/times.txt
  s=$(date +%s); "$@" > /work/fresh_logs/$name.log 2>&1; rc=$?
  echo "== $name rc $rc $(( $(date +%s) - s )) s end $(date +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" >> /work/fresh_logs/times.txt; }
run ppo_fsdp $A recipes/ppo.py --steps 20 --output_dir runs/ppo_fsdp
run agent_fsdp $A recipes/agent_grpo.py --steps 20 --output_dir runs/agent_fsdp
echo ALLDONE2 >> /work/fresh_logs/times.txt
