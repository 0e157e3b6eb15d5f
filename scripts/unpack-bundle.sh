# Sourced by gpu-check.sh and gpu-profile.sh: where $BUNDLE (default gpu-bundle) holds the
# bundle.tar.xz that build-gpu-bundle.sh packs (the binaries embed their kernels, too large to
# carry unpacked), unpacks it into a temporary directory and points BUNDLE there (exported, so a
# script started from the caller finds the binaries too).
BUNDLE=${BUNDLE:-gpu-bundle}
if [ -f "$BUNDLE/bundle.tar.xz" ]; then
    unpacked=$(mktemp -d)
    # tar needs xz installed; Python's tarfile reads xz by itself.
    if ! tar -xJf "$BUNDLE/bundle.tar.xz" -C "$unpacked" 2>/dev/null \
        && ! python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
            "$BUNDLE/bundle.tar.xz" "$unpacked"; then
        echo "cannot unpack $BUNDLE/bundle.tar.xz" >&2
        exit 1
    fi
    BUNDLE=$unpacked
fi
export BUNDLE
