# Sourced first by the launch scripts: `usage_or_help MIN_ARGS "ARGUMENTS" "$@"`. --help (or -h) prints the calling
# script's opening comment, which is its usage, and exits 0; fewer than MIN_ARGS arguments print a usage line naming
# ARGUMENTS and exit 2. `show_command COMMAND...` prints the command they are about to run.
usage_or_help() {
  local min=$1 arguments=$2 script
  shift 2
  script="launch/$(basename "$0")"
  if [ "${1:-}" = -h ] || [ "${1:-}" = --help ]; then
    sed -n '2,/^set -euo pipefail/{/^#/s/^# \{0,1\}//p}' "$0"
    exit 0
  fi
  if [ $# -lt "$min" ]; then
    echo "usage: $script $arguments (--help: more)" >&2
    exit 2
  fi
}

# "+ COMMAND..." quoted as a shell reads it back, so the line can be copied and rerun: plain words as they are, any
# other (a space, a quote, Hydra's [list] that the shell would take for a pattern) in single quotes.
show_command() {
  local word line="+" plain='^[A-Za-z0-9_.,:=/+@%-]+$'
  for word in "$@"; do
    if [[ $word =~ $plain ]]; then line+=" $word"; else line+=" ${word@Q}"; fi
  done
  echo "$line"
}
