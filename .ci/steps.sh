# Step timing for .ci/run and .ci/checks (sourced, not run).
#
#   step <name>   ends the current step (prints its time) and starts <name>;
#   step end      ends the last one;
#   step_summary  prints one line per step: wall time, CPU time, name.
#
# The CPU time is that of the step's finished commands (user + sys, from the
# shell's `times`), so that a step that waits for a busy machine shows apart
# from one that works: CPU near twice the wall time is both cores busy.

STEPS_LABEL=${STEPS_LABEL:-ci}
STEPS_TIMES=$(mktemp)
STEPS_STARTED=$SECONDS
STEP_NAME=
STEP_STARTED=$SECONDS
STEP_CPU=0
STEP_SUMMARY=()
trap 'rm -f "$STEPS_TIMES" "$STEPS_TIMES.cpu"' EXIT

# CPU seconds of this shell's finished children so far. Called in this
# shell with a redirection (`steps_cpu >file`), never in `$(..)`: a subshell's
# `times` counts only its own children.
steps_cpu() {
  times >"$STEPS_TIMES"
  tail -n 1 "$STEPS_TIMES" \
    | awk '{ t = 0; for (i = 1; i <= 2; i++) { split($i, a, /[ms]/); t += a[1] * 60 + a[2] } printf "%d", t }'
}

step() {
  local now_cpu
  steps_cpu >"$STEPS_TIMES.cpu"
  now_cpu=$(cat "$STEPS_TIMES.cpu")
  if [ -n "$STEP_NAME" ]; then
    local wall=$((SECONDS - STEP_STARTED)) cpu=$((now_cpu - STEP_CPU))
    echo "$STEPS_LABEL: $STEP_NAME done in $wall s (CPU $cpu s; total $((SECONDS - STEPS_STARTED)) s; load $(cut -d' ' -f1-3 /proc/loadavg))"
    STEP_SUMMARY+=("$(printf '%5d s %6d s CPU  %s: %s' "$wall" "$cpu" "$STEPS_LABEL" "$STEP_NAME")")
  fi
  STEP_NAME=$*
  STEP_STARTED=$SECONDS
  STEP_CPU=$now_cpu
  if [ "$STEP_NAME" = end ]; then
    rm -f "$STEPS_TIMES" "$STEPS_TIMES.cpu"
  else
    echo "$STEPS_LABEL: next: $STEP_NAME"
  fi
}

step_summary() {
  printf '  %s\n' "${STEP_SUMMARY[@]}"
}
