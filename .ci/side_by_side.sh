# Sourced by .ci/run: side_by_side LOGDIR FUNCTION... runs each shell function in the background (under set -e,
# output to LOGDIR/FUNCTION.log, ending with the seconds it took), then prints each output whole, in the order
# given, once it is done; returns 1 if any failed, naming it.
side_by_side() {
    local logs="$1" failed=0 i
    shift
    local jobs=("$@") pids=()
    for i in "${!jobs[@]}"; do
        (set -e; start=$SECONDS; "${jobs[$i]}"; echo "-- ${jobs[$i]}: done in $((SECONDS - start)) s") \
            > "$logs/${jobs[$i]}.log" 2>&1 &
        pids+=($!)
    done
    for i in "${!jobs[@]}"; do
        echo "-- ${jobs[$i]}"
        wait "${pids[$i]}" || { failed=1; echo "-- FAILED: ${jobs[$i]} (its output follows)"; }
        cat "$logs/${jobs[$i]}.log"
    done
    return "$failed"
}
