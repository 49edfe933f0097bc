#!/usr/bin/env bash
# Work longer than one device call (600 s) on a held GPU machine. `start` runs a command detached (a session of
# its own outlives the call) from a copy of the tree (the next call's tree replaces this one); `wait` waits for it
# up to a limit and brings what it has written so far (its OUT, /tmp/detached/out) back as one archive in this call's
# $OUT (detached_out.tar.gz), and prints every summary.txt in it. Make the
# next call within the 30 s a machine stays warm after one, naming the same kind, needs_h200 and carry as the first:
# twice (2026-11-27 and -28) a follow-up found the machine gone, the second time one that named no kind and carried
# less; follow-ups that repeated the first call's arguments found it each time. Usage:
#   call 1:  bash tools/gpu_detach.sh start 'source .gpup/setup.sh; OUT=$OUT/a ... bash tools/gpu_run.sh peers'
#            bash tools/gpu_detach.sh wait 560
#   call 2+: bash tools/gpu_detach.sh wait 580       # until it prints "done rc=..."
set -u
D=${DETACHED_DIR:-/tmp/detached}  # the job: its copy of the tree (src), its OUT (out), log and exit status (rc)
case ${1:-} in
  start)
    rm -rf "$D" && mkdir -p "$D/out"
    cp -a . "$D/src" && : > "$D/log"  # the log before the job: a `wait` right after this finds it
    # Every stream away from the caller's: a job holding its stdout would keep a piped caller waiting to its end.
    (cd "$D/src" && OUT=$D/out exec setsid nohup bash -c "$2; echo \$? > $D/rc") >> "$D/log" 2>&1 < /dev/null &
    echo "started: $2"
    ;;
  wait)  # copies every 20 s too: a call stopped at its limit still brings back what was copied
    # No job here: the machine was given back since `start` (idle > 30 s) and this one is fresh; don't wait on it.
    [ -f "$D/log" ] || { echo "no detached job on this machine (a fresh one: the held machine was released)"; exit 3; }
    end=$((SECONDS + ${2:-560})) next=$((SECONDS + 20))
    # One archive: a call brings back at most 8 files of $OUT, 2 folders down (device README); a job writes more.
    # The JIT cache at its top comes back as it is (the next session carries it), the ones below are left out.
    bring() {
      local o=${OUT:-/tmp/gpu_out}
      tar czf "$o/detached_out.tar.gz" --exclude='jitcache*' -C "$D/out" . && cp "$D/log" "$o/detached.log"
      for j in "$D"/out/jitcache*.tar.gz; do [ -f "$j" ] && cp "$j" "$o/"; done
    }
    while [ ! -f "$D/rc" ] && [ $SECONDS -lt $end ]; do
      sleep 5
      if [ $SECONDS -ge $next ]; then bring; next=$((SECONDS + 20)); fi
    done
    bring
    if [ -f "$D/rc" ]; then echo "done rc=$(cat "$D/rc")"; else echo "still running after ${2:-560} s"; fi
    tail -n 30 "$D/log"
    find "$D/out" -name summary.txt | sort | while read -r f; do echo "== ${f#"$D"/out/}"; cat "$f"; done
    ;;
  *) echo "usage: gpu_detach.sh start COMMAND | wait SECONDS" >&2; exit 2 ;;
esac
