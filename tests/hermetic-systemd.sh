#!/bin/bash
# hermetic-systemd.sh: boot a throwaway systemd (PID 1 of private pid/mount/uts/ipc namespaces) for tests
# of unit files, and drive it with systemctl. Needs root. Touches nothing of the host: every directory that
# systemd writes is a private tmpfs, and every unit that early boot would pull in is masked.
#
#   hermetic-systemd.sh start [UNIT_DIR]   boot, with the unit files of UNIT_DIR copied into the namespace's
#                                          private /run/systemd/system; prints the host PID of its PID 1
#   hermetic-systemd.sh exec PID CMD...    run CMD inside (systemctl, journalctl, ...)
#   hermetic-systemd.sh stop PID           kill the namespace's PID 1: everything inside dies with it
#
# HERMETIC_KEEP=PATH[:PATH...]: directories that stay visible inside although a private tmpfs covers where they
# live (a checkout or a virtual environment under /tmp, /var/tmp or /srv): each is bound back into place.
#
# Why: booting systemd without this isolation ran systemd-tmpfiles and emptied the host's /tmp.
# tfelastic's copy of the team recipe adds: a private /srv and overlays over /etc and /var/lib (tests write job
# files, create users and state directories without touching the host), and journald's sockets left unmasked
# (else PID 1 never logs to the journal: no "Watchdog timeout", no unit results).
# The network namespace is shared with the host on purpose (loopback servers stay reachable).
set -euo pipefail

# The HERMETIC_KEEP directories, bound to /run/hermetic-keep/N before the tmpfs hides them, then back in place.
keep_aside() {
  local path wanted
  kept=()
  IFS=: read -ra wanted <<<"${HERMETIC_KEEP:-}"
  for path in "${wanted[@]}"; do
    [[ -d $path ]] || continue
    mkdir -p "/run/hermetic-keep/${#kept[@]}" && mount --bind "$path" "/run/hermetic-keep/${#kept[@]}"
    kept+=("$path")
  done
}

keep_back() {
  local i
  for i in "${!kept[@]}"; do
    mkdir -p "${kept[$i]}" && mount --bind "/run/hermetic-keep/$i" "${kept[$i]}"
  done
}

boot() {
  local units=${1:-}
  mount -t tmpfs tmpfs /run
  mkdir -p /run/systemd/system
  if [[ -n $units ]]; then cp -r "$units"/. /run/systemd/system/; fi   # before /tmp is hidden
  # tfelastic: private, writable /etc and /var/lib (overlays over the host's), so that tests can put job files in
  # /etc/tfelastic, create users, and let units create StateDirectory= without touching the host; /srv (below)
  # is their private "shared storage".
  for d in etc var/lib; do
    mkdir -p "/run/hermetic-overlay/$d/upper" "/run/hermetic-overlay/$d/work"
    mount -t overlay overlay \
      -o "lowerdir=/$d,upperdir=/run/hermetic-overlay/$d/upper,workdir=/run/hermetic-overlay/$d/work" "/$d"
  done
  keep_aside
  for d in /tmp /var/tmp /var/log /var/lib/systemd /srv /dev/shm; do mount -t tmpfs tmpfs "$d"; done
  keep_back
  for w in /lib/systemd/system/*.target.wants /etc/systemd/system/*.target.wants; do
    for u in "$w"/*; do
      [[ -e $u || -L $u ]] || continue
      n=${u##*/}
      # tfelastic: journald's sockets too, or PID 1 never logs to the journal ("Watchdog timeout", results)
      [[ $n == systemd-journald.service || $n == systemd-journald.socket || $n == systemd-journald-dev-log.socket ]] \
        && continue
      ln -sf /dev/null "/run/systemd/system/$n"
    done
  done
  ln -sf /dev/null /run/systemd/system/systemd-remount-fs.service
  printf '[Unit]\nDescription=hermetic test target\nWants=systemd-journald.service\n' \
    > /run/systemd/system/hermetic.target
  exec /lib/systemd/systemd --system --unit=hermetic.target
}

case ${1:-} in
  _boot) shift; boot "$@" ;;
  start)
    units=${2:+$(readlink -f "$2")}
    setsid unshare --pid --fork --mount --uts --ipc --mount-proc --propagation private \
      "$(readlink -f "$0")" _boot "$units" </dev/null >"${HERMETIC_LOG:-/dev/null}" 2>&1 &
    launcher=$!   # unshare; its child becomes systemd, PID 1 inside
    for _ in $(seq 1 100); do
      pid=$(pgrep -P "$launcher" | head -n1 || true)
      if [[ -n $pid && $(cat /proc/"$pid"/comm 2>/dev/null) == systemd ]]; then
        state=$(timeout 5 nsenter -t "$pid" -m -p -u systemctl is-system-running 2>/dev/null || true)
        if [[ $state == running || $state == degraded ]]; then echo "$pid"; exit 0; fi
      fi
      sleep 0.1
    done
    echo "hermetic-systemd: systemd did not come up" >&2; exit 1 ;;
  exec) shift; pid=$1; shift; exec nsenter -t "$pid" -m -p -u "$@" ;;
  stop) kill -9 "$2" ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
