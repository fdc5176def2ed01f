#!/usr/bin/env bash
# Builds the torch-free core and the GoogleTest C++ tests with CMake, then runs them with ctest.
# Installs Debian's libgtest-dev first when GTest is missing. Exits non-zero on any failure.
#   tests/cpp/run.sh [extra ctest args, e.g. -R allreduce]
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD_DIR=${TDX_CMAKE_BUILD_DIR:-build/cmake}

if [ ! -f /usr/lib/x86_64-linux-gnu/cmake/GTest/GTestConfig.cmake ] && [ ! -f /usr/lib/cmake/GTest/GTestConfig.cmake ] &&
   ! ls /usr/lib/*/cmake/GTest/GTestConfig.cmake >/dev/null 2>&1; then
  echo "GTest not found; installing libgtest-dev" >&2
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update
  $SUDO apt-get install -y libgtest-dev
fi

GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
if [ -f "$BUILD_DIR/CMakeCache.txt" ]; then GEN=(); fi  # keep the generator of an existing build
cmake -S . -B "$BUILD_DIR" "${GEN[@]}"
cmake --build "$BUILD_DIR" -j "$(nproc)"
ctest --test-dir "$BUILD_DIR" --output-on-failure -j "$(nproc)" "$@"
