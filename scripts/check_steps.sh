# Sourced by the scripts/check-*.sh step runners: each step's status and note, and the summary table printed last.
#   record NAME EXIT_CODE NOTE     (a non-zero exit code marks the step FAIL and the run's status 1)
#   elapsed START_SECONDS          ("42s")
#   print_summary WIDTH            (the table; WIDTH: the step column's)
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
