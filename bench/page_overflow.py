"""Does a run's report page fit a window of a given width? Headless Chromium (Debian's ``chromium``)
lays out a copy of ``results/report.html`` and lists every element that is wider than the page's
content or that makes the window scroll sideways.

    python bench/page_overflow.py WORKDIR [--width 1280]

Prints one line per overflowing element (its tag, the heading above it, its width) and exits 1 when
there is any, 0 when the page fits. The page itself is not changed.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs in the page once it has laid out: the document's own width against the window, and every table,
# figure and preformatted block whose box reaches past the body's content box.
PROBE = """<script>
window.addEventListener("load", () => {
  const body = document.body.getBoundingClientRect();
  const wide = [];
  for (const el of document.querySelectorAll("table, figure, img, pre, p, nav")) {
    const box = el.getBoundingClientRect();
    if (box.right > body.right + 1 || el.scrollWidth > el.clientWidth + 1 && el.tagName !== "PRE") {
      let heading = el.previousElementSibling;
      while (heading && !/^H[1-4]$/.test(heading.tagName)) heading = heading.previousElementSibling;
      wide.push({tag: el.tagName.toLowerCase(), under: heading ? heading.textContent.slice(0, 60) : "",
                 width: Math.round(Math.max(box.width, el.scrollWidth))});
    }
  }
  const out = {page: document.documentElement.scrollWidth, window: window.innerWidth, wide: wide};
  document.body.setAttribute("data-overflow", JSON.stringify(out));
});
</script>"""


def browser() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        raise SystemExit("no chromium on this machine: apt-get install chromium")
    return found


def measure(page: Path, width: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "page.html"
        copy.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
        dom = subprocess.run([browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                              f"--window-size={width},900", "--virtual-time-budget=5000", "--dump-dom",
                              copy.as_uri()], capture_output=True, text=True, timeout=300).stdout
    found = re.search(r'data-overflow="([^"]*)"', dom)
    if not found:
        raise SystemExit("chromium returned no layout for the page (is it a kvpool report?)")
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--width", type=int, default=1280)
    args = parser.parse_args()
    result = measure(args.workdir / "results" / "report.html", args.width)
    print(f"page {result['page']} px wide in a {result['window']} px window")
    for element in result["wide"]:
        print(f"  {element['tag']} under {element['under']!r}: {element['width']} px")
    fits = result["page"] <= result["window"] and not result["wide"]
    print("fits" if fits else "overflows")
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
