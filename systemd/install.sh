#!/usr/bin/env bash
# Installs the tfelastic@.service and tfelastic-coordinator@.service templates, the tfelastic system user and an
# example job file.
#
#   systemd/install.sh [--prefix DIR] [--destdir DIR] [--uid N] [--no-user]
#
#   --prefix DIR   the virtual environment tfelastic is installed in (default /opt/tfelastic): the unit runs
#                  DIR/bin/tfelastic. Create it first: python3 -m venv DIR && DIR/bin/pip install '.[trainer]'
#   --destdir DIR  install under DIR instead of / (packaging, tests; also $DESTDIR). Creates no user and does
#                  not reload systemd.
#   --uid N        the user's uid and gid. Give the same on every node: files on shared storage (NFS) carry
#                  numbers, and every node's agent must be able to write every other node's checkpoints.
#   --no-user      do not create the user.
#
# Idempotent: never overwrites an existing file in /etc/tfelastic, and keeps an existing user.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
prefix=/opt/tfelastic
destdir=${DESTDIR:-}
uid=
make_user=1
while (($#)); do
  case $1 in
    --prefix) prefix=$2; shift 2 ;;
    --destdir) destdir=$2; shift 2 ;;
    --uid) uid=$2; shift 2 ;;
    --no-user) make_user=0; shift ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ $prefix == /* ]] || { echo "install.sh: --prefix must be an absolute path" >&2; exit 2; }
[[ -z $destdir ]] || make_user=0

if ((make_user)) && ! getent passwd tfelastic >/dev/null; then
  getent group tfelastic >/dev/null || groupadd --system ${uid:+--gid "$uid"} tfelastic
  # A system user without a login shell or home directory: the unit gives it /var/lib/tfelastic/JOB.
  useradd --system --gid tfelastic ${uid:+--uid "$uid"} --no-create-home --home-dir /var/lib/tfelastic \
    --shell /usr/sbin/nologin --comment "tfelastic training agent" tfelastic
  echo "created system user tfelastic ($(id tfelastic))"
fi

units=$destdir/etc/systemd/system
conf=$destdir/etc/tfelastic
refuse() { echo "install.sh: $*" >&2; exit 1; }
# Where others may write, a name we write to could be a planted symlink: refuse one, and a directory anyone but
# its owner may write.
not_a_symlink() { [[ ! -L $1 ]] || refuse "$1 is a symbolic link; remove it (check where it points) and run again"; }
not_writable_by_others() {
  local mode
  mode=$(stat -c %a "$1")
  (( (8#$mode & 8#022) == 0 )) || refuse "$1 is writable by users other than its owner (mode $mode); run: chmod go-w" \
    "$1, check what is in it, and run again"
}
install -d -m 0755 "$units"
not_a_symlink "$units"
not_writable_by_others "$units"
for unit in tfelastic@.service tfelastic-coordinator@.service; do
  not_a_symlink "$units/$unit"
  partial=$(mktemp "$units/.$unit.XXXXXX")  # a fresh name, created exclusively: no planted file is followed
  sed "s|^ExecStart=/opt/tfelastic/bin/tfelastic |ExecStart=$prefix/bin/tfelastic |" "$here/$unit" > "$partial"
  chmod 0644 "$partial"
  mv -T "$partial" "$units/$unit"  # the units are ours: always replaced
  echo "installed $units/$unit (ExecStart=$prefix/bin/tfelastic)"
done

# Configs may hold paths to secrets: readable by root and the agent's group only.
not_a_symlink "$conf"
if [[ ! -d $conf ]]; then
  install -d -m 0750 "$conf"
  if getent group tfelastic >/dev/null && [[ -z $destdir ]]; then chgrp tfelastic "$conf"; fi
fi
not_writable_by_others "$conf"
not_a_symlink "$conf/example.toml"
if [[ -e $conf/example.toml ]]; then
  echo "kept $conf/example.toml (exists)"
else
  install -m 0640 "$here/example.toml" "$conf/example.toml"
  if getent group tfelastic >/dev/null && [[ -z $destdir ]]; then chgrp tfelastic "$conf/example.toml"; fi
  echo "installed $conf/example.toml"
fi

docs=$destdir/usr/share/doc/tfelastic
if [[ -e $here/../docs/operations.md ]]; then
  install -d -m 0755 "$docs" && install -m 0644 "$here/../docs/operations.md" "$docs/operations.md"
fi

if [[ -z $destdir ]] && [[ -d /run/systemd/system ]]; then
  systemctl daemon-reload
fi
cat <<EOF
next: write /etc/tfelastic/JOB.toml (see $conf/example.toml), a token readable by tfelastic only
(chown tfelastic: /etc/tfelastic/token && chmod 600 /etc/tfelastic/token), a drop-in with
ReadWritePaths= for the backup_dir, then: systemctl enable --now tfelastic@JOB   (docs/operations.md);
on a head node without training: systemctl enable --now tfelastic-coordinator@JOB
EOF
