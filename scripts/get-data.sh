#!/usr/bin/env bash
# Puts Fashion-MNIST (MNIST's IDX format, gzip) into DATA_DIR/fashion-mnist without
# root: from /usr/share/datasets if Debian's package is installed, else by
# `apt-get download dataset-fashion-mnist` and `dpkg-deb -x`. Idempotent.
set -euo pipefail
data_dir=${1:-data}
dest="$data_dir/fashion-mnist"
files="train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz"

have_all() { for f in $files; do [ -s "$1/$f" ] || return 1; done; }

if have_all "$dest"; then echo "fashion-mnist: present in $dest"; exit 0; fi
mkdir -p "$dest"
system=/usr/share/datasets/fashion-mnist
if have_all "$system"; then
  for f in $files; do cp "$system/$f" "$dest/"; done
  echo "fashion-mnist: copied from $system to $dest"; exit 0
fi
if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "fashion-mnist: no apt-get/dpkg-deb here; put $files into $dest (or run: dbs-mpi data fetch fashion-mnist)" >&2
  exit 1
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
( cd "$tmp" && apt-get download dataset-fashion-mnist >/dev/null 2>apt.log ) || {
  # The package lists may be missing on a fresh machine; refresh them if we may.
  if [ "$(id -u)" = 0 ]; then apt-get update -qq >/dev/null && ( cd "$tmp" && apt-get download dataset-fashion-mnist >/dev/null 2>apt.log ); else cat "$tmp/apt.log" >&2; exit 1; fi
}
dpkg-deb -x "$tmp"/dataset-fashion-mnist_*.deb "$tmp/root"
for f in $files; do cp "$tmp/root$system/$f" "$dest/"; done
echo "fashion-mnist: unpacked Debian's dataset-fashion-mnist into $dest"
