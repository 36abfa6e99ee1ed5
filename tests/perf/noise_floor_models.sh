#!/usr/bin/env bash
# The models of one live window against its noise floor, niced (virtual time; no engines):
#   tests/perf/noise_floor_models.sh W SPLIT_FROM [OUT]
# W: a live window folder (tests/perf/live_ab_window.py --out W: ab/, repeat/, profile.json, profile-after.json);
# SPLIT_FROM: a live folder with engine spans whose measured path split (`gpuhit profile path-split`)
# the split variants take (another window's for an out-of-sample split). Writes OUT/{lsq,stalls,split,
# after-stalls,after-split} sim-vs-real folders and OUT/floor.md.
set -euo pipefail
W=$1; FROM=$2; OUT=${3:-$W/models}
mkdir -p "$OUT"
run() { setsid bash -c 'echo 15 > /proc/self/autogroup; exec nice -n 15 "$@"' _ "$@"; }
AFTER=(); [ -f "$W/profile-after.json" ] && AFTER=("$W/profile-after.json")  # a window cut short has none
[ -f "$W/profile-stalls.json" ] || run python tests/perf/profile_variants.py "$W/profile.json" "${AFTER[@]}"
for v in stalls after-stalls; do
    if [ -f "$W/profile-$v.json" ]; then gpuhit profile path-split "$W/profile-$v.json" --live "$FROM" --out "$OUT/profile-${v%stalls}split.json"; fi
done
svr() { run gpuhit experiment sim-vs-real --live "$W/ab" --profile "$1" --live-path "$2" --no-plots --out "$OUT/$3" > "$OUT/$3.log" 2>&1; }
svr "$W/profile-lsq.json" response lsq
svr "$W/profile-stalls.json" response stalls
svr "$OUT/profile-split.json" split split
MODELS=(lsq="$OUT/lsq" stalls="$OUT/stalls" split="$OUT/split")
if [ ${#AFTER[@]} -gt 0 ]; then
    svr "$W/profile-after-stalls.json" response after-stalls
    svr "$OUT/profile-after-split.json" split after-split
    MODELS+=(after-stalls="$OUT/after-stalls" after-split="$OUT/after-split")
fi
python tests/perf/floor_report.py "${MODELS[@]}" | tee "$OUT/floor.md"
