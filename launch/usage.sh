# Sourced first by the launch scripts: `usage_or_help MIN_ARGS "ARGUMENTS" "$@"`. --help (or -h) prints the calling
# script's opening comment, which is its usage, and exits 0; fewer than MIN_ARGS arguments print a usage line naming
# ARGUMENTS and exit 2.
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
