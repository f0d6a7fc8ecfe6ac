#!/usr/bin/env bash
# GPU tests within one device call, from a pack made by scripts/gpu-pack.sh
# (copied there as tests.sh): every test of the chosen binaries in a process
# of its own (the binaries' tests JIT-compile serially; the machine's cores
# compile many at once), JOBS at a time, each under LIMIT seconds and with a
# kernel cache of its own, then one line per test and a count.
#
#   TESTLIST="gpu_backward gpu_varlen_backward" FILTER=hopper LIMIT=240 tests.sh
#
# TESTLIST: binaries by name (bin/test-<name>; default every one); FILTER:
# a substring of the test names to run (default all); JOBS (default 8);
# LIMIT: seconds per test (default 300; a test cut off reads "timeout", not
# "FAILED"). Logs go to $OUT (or ./gpu-logs) as tests.tgz. Exits non-zero
# when a test failed.
set -uo pipefail
source "$(dirname "$0")/env.sh"  # here, out, LD_LIBRARY_PATH, ncu
cd "$here"
logs="$(mktemp -d)"
cases="$logs/cases"
for t in bin/test-*; do
    name=${t#bin/test-}
    [ -n "${TESTLIST:-}" ] && [[ " $TESTLIST " != *" $name "* ]] && continue
    "$t" --list --include-ignored 2>/dev/null | sed -n 's/: test$//p' | grep -F -- "${FILTER:-}" |
        sed "s|^|$name |" >>"$cases"
done
[ -s "$cases" ] || { echo "tests.sh: no test matches" >&2; exit 2; }
run_case() {  # binary name, test name
    local log="$logs/$1.$2.log" cache rc status
    cache="$(mktemp -d)"
    FLASHGEN_CACHE_DIR="$cache" timeout "${LIMIT:-300}" "bin/test-$1" --include-ignored --exact "$2" >"$log" 2>&1
    rc=$?
    rm -rf "$cache"
    case $rc in
    0) status=ok ;;
    124) status=timeout ;;
    *) status=FAILED ;;
    esac
    printf '%-24s %-48s %s\n' "$1" "$2" "$status"
}
export -f run_case
export logs
xargs -P "${JOBS:-8}" -L 1 bash -c 'run_case "$0" "$1"' <"$cases" | sort >"$logs/summary"
cat "$logs/summary"
printf '%s ok, %s cut off, %s failed\n' "$(grep -c ' ok$' "$logs/summary")" \
    "$(grep -c ' timeout$' "$logs/summary")" "$(grep -c ' FAILED$' "$logs/summary")"
tar -czf "$out/tests.tgz" -C "$logs" .
! grep -q ' FAILED$' "$logs/summary"
