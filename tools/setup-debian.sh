#!/bin/sh
# SPDX-License-Identifier: MIT
#
# Installs what building and testing libgmlake needs, from Debian's
# packages (Debian 12 or later, Ubuntu 22.04 or later). Idempotent: when
# every package is already installed it changes nothing and needs no
# network. Run as root, or as a user with sudo.
#
# clang and libclang-rt-dev (on Debian 12: clang-14 and libclang-rt-14-dev,
# which holds libFuzzer) build the fuzz targets (make fuzz); gcc builds the
# rest, with its own ASan and UBSan for --enable-sanitizer.
#
# The CUDA driver API headers (cuda.h, cudaTypedefs.h) are needed to build
# even without a GPU (libgmlake never links -lcuda). They come with the
# CUDA toolkit, usually /usr/local/cuda; this script only checks for them.

set -eu

PACKAGES="
	build-essential
	autoconf
	automake
	libtool
	pkg-config
	check
	zlib1g-dev
	liburing-dev
	libnuma-dev
	libncurses-dev
	python3
	tmux
	clang
	libclang-rt-dev
"

missing=""
for p in $PACKAGES; do
	status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
	case "$status" in
	*" installed") ;;
	*) missing="$missing $p" ;;
	esac
done

if [ -n "$missing" ]; then
	if [ "$(id -u)" -eq 0 ]; then
		as_root=""
	elif command -v sudo >/dev/null 2>&1; then
		as_root="sudo"
	else
		echo "setup-debian.sh: not root and no sudo; install as root:$missing" >&2
		exit 1
	fi
	echo "setup-debian.sh: installing:$missing"
	export DEBIAN_FRONTEND=noninteractive
	$as_root apt-get update
	# shellcheck disable=SC2086
	$as_root apt-get install -y --no-install-recommends $missing
else
	echo "setup-debian.sh: all packages already installed"
fi

# The CUDA headers: configure looks in --with-cuda=DIR, /usr/local/cuda, /usr.
found=""
for d in /usr/local/cuda /usr; do
	if [ -r "$d/include/cuda.h" ] && [ -r "$d/include/cudaTypedefs.h" ]; then
		found="$d"
		break
	fi
done
if [ -n "$found" ]; then
	echo "setup-debian.sh: CUDA headers found in $found/include"
else
	echo "setup-debian.sh: warning: cuda.h and cudaTypedefs.h not found in" \
		"/usr/local/cuda/include or /usr/include; install the CUDA toolkit" \
		"headers and pass ./configure --with-cuda=DIR" >&2
fi
