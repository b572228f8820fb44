#!/bin/bash
# The README's picture of a report page: a finished run's results/report.html in headless Chromium
# (Debian's `chromium` package), 1,200 px wide, its top 1,500 px.
#   bash bench/screenshot.sh WORKDIR [OUT.png]     (default OUT: docs/report-screenshot.png)
set -euo pipefail
page=$(realpath "$1/results/report.html")
out=$(realpath -m "${2:-docs/report-screenshot.png}")
browser=$(command -v chromium || command -v chromium-browser) || { echo "no chromium: apt-get install chromium" >&2; exit 1; }
"$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1200,1500 \
  --screenshot="$out" "file://$page" 2>/dev/null
echo "$out"
