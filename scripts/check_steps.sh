# Sourced by the scripts/check-*.sh step runners: each step's status and note, and the summary table printed last.
#   record NAME EXIT_CODE NOTE     (a non-zero exit code marks the step FAIL and the run's status 1)
#   elapsed START_SECONDS          ("42s")
#   print_summary WIDTH            (the table; WIDTH: the step column's)
#   log_environment OUT            (the GPU, its driver and power limit, and the commit, into OUT/environment.log)
#   gpu_tests OUT SECONDS EXPR FILE...  (the files' gpu tests selected by -k EXPR, 12 workers, into OUT/tests.log;
#                                  recorded as the step "tests")
#   want N                         (step N is in the caller's $steps, e.g. steps=" ${STEPS:-1 2 3} ")
# and this checkout's omnigen first on PYTHONPATH, Python's output unbuffered (logs as they come). Source it from the
# repository's root.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
want() { [[ "$steps" == *" $1 "* ]]; }
declare -a names statuses notes
status=0
record() {  # name, exit code, note
  names+=("$1"); notes+=("$3")
  if [ "$2" -eq 0 ]; then statuses+=("ok"); else statuses+=("FAIL($2)"); status=1; fi
}
elapsed() { echo "$(( $(date +%s) - $1 ))s"; }
print_summary() {  # the step column's width
  printf "%-${1}s %-9s %s\n" step status note
  for i in "${!names[@]}"; do printf "%-${1}s %-9s %s\n" "${names[$i]}" "${statuses[$i]}" "${notes[$i]}"; done
}
log_environment() {  # the output folder
  { nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader
    git log -1 --format='commit %h %s' 2>/dev/null; } 2>&1 | tee "$1/environment.log"
}
gpu_tests() {  # output folder, timeout in seconds, -k expression, test files
  local out=$1 seconds=$2 expression=$3 start
  shift 3
  start=$(date +%s)
  timeout "$seconds" python3 -m pytest -q -n 12 -m gpu -p no:cacheprovider -W ignore "$@" -k "$expression" \
    > "$out/tests.log" 2>&1
  local rc=$?
  tail -6 "$out/tests.log"
  record tests $rc "$(tail -1 "$out/tests.log" | tr -d '=' | xargs) $(elapsed "$start")"
}
