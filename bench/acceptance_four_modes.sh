#!/bin/bash
# bench/acceptance_four_modes.sh: `dflash bench acceptance` of a shipped DFlash drafter and a DFlash2
# candidate in their four drafting modes (DFlash greedy / probabilistic drafts, DFlash2 greedy /
# sampled walk) on the four sets, T = 0 and 1, as six concurrent processes on one GPU (each with a
# small KV cache), then one merged JSON + plot (bench/merge_acceptance_modes.py). tau and acceptance
# by position only: tokens/s of concurrent processes are not speed figures (bench/ship_decision.py
# takes step times from runs that had the GPU alone).
#
# Usage: bash bench/acceptance_four_modes.sh MODEL SHIPPED_DIR CANDIDATE_DIR GSM8K_TEST OUT [SECONDS]
#   SECONDS  time limit of each process (default 540); a cut process keeps the cells it finished
set -u
MODEL=$1; SHIP=$2; CAND=$3; GSM8K=$4; OUT=$5; LIMIT=${6:-540}
mkdir -p "$OUT"
acc() {  # label draft temperature draft-sampling
  timeout "$LIMIT" python3 -m dflash bench acceptance --model "$MODEL" --draft "$2" \
    --datasets gsm8k,humaneval,mtbench,math --gsm8k-path "$GSM8K" --temperatures "$3" --draft-sampling "$4" \
    --max-tokens 512 --max-model-len 2048 --kv-cache-tokens 4096 \
    --device cuda --out "$OUT/acc_$1.json" -q > "$OUT/acc_$1.log" 2>&1
  echo "rc $? $1" >> "$OUT/acc_$1.log"
}
acc ship_t0 "$SHIP" 0 auto &
acc cand_t0 "$CAND" 0 auto &
acc ship_greedy_t1 "$SHIP" 1 greedy &
acc ship_prob_t1 "$SHIP" 1 probabilistic &
acc cand_greedy_t1 "$CAND" 1 greedy &
acc cand_walk_t1 "$CAND" 1 auto &
wait
tail -n 7 "$OUT"/acc_*.log
python3 "$(dirname "$0")/merge_acceptance_modes.py" \
  --mode "dflash_greedy=$OUT/acc_ship_t0.json,$OUT/acc_ship_greedy_t1.json" \
  --mode "dflash_probabilistic=$OUT/acc_ship_t0.json,$OUT/acc_ship_prob_t1.json" \
  --mode "dflash2_greedy_walk=$OUT/acc_cand_t0.json,$OUT/acc_cand_greedy_t1.json" \
  --mode "dflash2_sampled_walk=$OUT/acc_cand_t0.json,$OUT/acc_cand_walk_t1.json" \
  --reference dflash_probabilistic \
  --what "dflash bench acceptance, batch 1 per process, 512 tokens, four sets, T 0/1: $SHIP vs $CAND ($(date -u +%F))" \
  --out "$OUT/acceptance_four_modes.json" --plot "$OUT/acceptance_four_modes.png"
