# shellcheck shell=bash
# Sourced by the device benchmark drivers (device_bench_moonep.sh, device_bench_layer48.sh). The caller sets OUT,
# SUMMARY, STEPS (the step names to run), DEADLINE_S, START (= $SECONDS at its start) and FAILED=0 first.
#
#   say TEXT...                   echo, and append to $SUMMARY
#   step NAME TIMEOUT_S CMD...    when NAME is in $STEPS: CMD with a timeout (capped by what is left of DEADLINE_S),
#                                 its output in $OUT/NAME.log (first line: the command), one PASS / FAIL / SKIP (exit
#                                 0 but a line starting with SKIP: no CUDA device) / NOT RUN (deadline) line in
#                                 $SUMMARY; anything but PASS sets FAILED=1 and prints the log's last 20 lines
#   env_log FILE DRIVER           the run's date, steps, commit, uncommitted files and GPUs into FILE
# shellcheck disable=SC2034  # FAILED is the caller's

say() { echo "$*" | tee -a "$SUMMARY"; }

step() {
    local name=$1 limit=$2
    shift 2
    [[ " $STEPS " == *" $name "* ]] || return 0
    local left=$((DEADLINE_S - (SECONDS - START)))
    if ((left < 10)); then
        say "NOT RUN $name: the deadline (BENCH_DEADLINE_S=$DEADLINE_S) is reached"
        FAILED=1
        return
    fi
    ((limit > left)) && limit=$left
    local log=$OUT/$name.log t0=$SECONDS rc
    echo "==> $name (timeout $limit s): $*"
    echo "# $*" >"$log"
    timeout --kill-after=10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    if ((rc == 0)) && grep -q '^SKIP' "$log"; then
        say "SKIP $name ($((SECONDS - t0)) s): no CUDA device; log $log"
        FAILED=1
    elif ((rc == 0)); then
        say "PASS $name ($((SECONDS - t0)) s) log $log"
    else
        say "FAIL $name (exit $rc after $((SECONDS - t0)) s) log $log"
        tail -n 20 "$log" | sed 's/^/    /'
        FAILED=1
    fi
}

env_log() {
    {
        echo "# $2 $(date -u +%FT%TZ); steps: $STEPS"
        git log -1 --format='# commit %H %s' 2>/dev/null
        git status --short 2>/dev/null | head -n 20
        nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv 2>&1
    } >"$1"
}
