#!/usr/bin/env bash
# Renders the HTML reports of `audit`, `check` and `mutants` in headless Chromium and checks
# that each loads without a console error and that every plot holds as many points as were
# plotted (the page's own check writes the result into <body data-plots=...>).
# Usage: tests/browser/report.sh BINARY [SCREENSHOT.png]
set -euo pipefail
bin="$1"
shot="${2:-}"
browser="$(command -v chromium || command -v chromium-browser || true)"
if [ -z "$browser" ]; then
    echo "browser test: chromium not found (apt-get install chromium)" >&2
    exit 1
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
flags=(--headless --no-sandbox --disable-gpu --disable-quic --no-first-run
       --disable-background-networking --disable-component-update --disable-sync
       --user-data-dir="$work/profile" --enable-logging=stderr --v=0)

"$bin" audit --html "$work/audit.html" > /dev/null
"$bin" check oracles/golden/traces/opacus_ghost_untied.safetensors --html "$work/check.html" > /dev/null
"$bin" mutants --html "$work/mutants.html" > /dev/null

status=0
for page in audit check mutants; do
    "$browser" "${flags[@]}" --dump-dom "file://$work/$page.html" > "$work/$page.dom" 2> "$work/$page.log" || true
    plots="$(grep -o 'data-plots="[^"]*"' "$work/$page.dom" | head -1 | sed 's/data-plots="\(.*\)"/\1/')"
    figures="$(grep -o 'data-figures="[0-9]*"' "$work/$page.dom" | head -1 | tr -dc 0-9)"
    expected="$(grep -o '<figure data-plot=' "$work/$page.html" | wc -l)"
    errors="$(grep -E 'CONSOLE|Uncaught|SyntaxError|ReferenceError' "$work/$page.log" || true)"
    if [ "$plots" != "ok" ] || [ "$figures" != "$expected" ] || [ "$expected" -eq 0 ] || [ -n "$errors" ]; then
        echo "browser test: $page.html FAILED: plots='$plots', figures $figures of $expected" >&2
        [ -n "$errors" ] && echo "$errors" >&2
        status=1
    else
        points="$(grep -o 'data-rendered="[0-9]*"' "$work/$page.dom" | tr -dc '0-9\n' | awk '{s+=$1} END {print s}')"
        echo "browser test: $page.html ok ($figures plots, $points points rendered, no console error)"
    fi
done
if [ -n "$shot" ] && [ "$status" -eq 0 ]; then
    "$browser" "${flags[@]}" --hide-scrollbars --window-size=1340,1500 \
        --screenshot="$shot" "file://$work/audit.html" 2> /dev/null
    echo "browser test: screenshot $shot"
fi
exit "$status"
