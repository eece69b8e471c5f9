#!/bin/bash
# bench/train_dflash2_side_by_side.sh: DFlash2 training runs for SmolLM2 side by side on one GPU
# (issue 14: K, rank and the selector weight chosen by measurement), each in its own work dir,
# all on the same packed data set with the same schedule, for one device call of at most
# MINUTES from CALL_START; a later call with the same arguments resumes them (warm machine).
#
# Usage: bash bench/train_dflash2_side_by_side.sh DATA CALL_START MINUTES TAU_PROMPTS STEPS [INIT]
#   DATA         packed set (.npz.xz, e.g. /tmp/wa/data.npz.xz from device_run run --no-train)
#   TAU_PROMPTS  held-out prompts decoded with the runtime at the end (0 in a call that will resume)
#   INIT         warm start (default: the shipped DFlash drafter); a run whose flags hold --scratch
#                starts from random weights instead (--scratch itself is not passed on)
#   WARMUP=N     warmup steps (env, default 100)
# Logs: /tmp/log_<run>.txt; reports /tmp/o_<run>/report.json; drafters /tmp/w_<run>/run/drafter.
# Run set: RUNS="name:flags;name:flags" overrides the default set below.
set -u
DATA=$1; START=$2; MINUTES=$3; TAU=$4; STEPS=$5
INIT=${6:-python/dflash/drafters/SmolLM2-135M-Instruct}
COMMON="--data-in $DATA --lr 3e-4 --warmup-steps ${WARMUP:-100} --steps $STEPS --save-every 0 --no-drafter --log-every 100"
RUNS=${RUNS:-"d1ctl:;d2k16r64:--arch dflash2 --selector-top-k 16 --selector-rank 64;d2k32r64:--arch dflash2 --selector-top-k 32 --selector-rank 64;d2k16r128:--arch dflash2 --selector-top-k 16 --selector-rank 128"}
IFS=';' read -ra LIST <<< "$RUNS"
for item in "${LIST[@]}"; do
  name=${item%%:*}; flags=${item#*:}
  if [[ " $flags " == *" --scratch "* ]]; then flags=${flags//--scratch/}; else flags="--init-from $INIT $flags"; fi
  python3 -m dflash.train.device_run run --call-start "$START" --minutes "$MINUTES" --tau-prompts "$TAU" \
    --tau-seconds 75 --work /tmp/w_$name --out /tmp/o_$name $COMMON $flags > /tmp/log_$name.txt 2>&1 &
done
wait
for item in "${LIST[@]}"; do
  name=${item%%:*}; echo "== $name"; grep -E "summary|Error|tau:" /tmp/log_$name.txt | tail -3
done
