"""Screenshot of the streamrl page on the Dask dashboard, taken by headless Chromium while a real
run goes on.

    python scripts/dashboard_screenshot.py                      # recipes/addition.toml, 60 steps
    python scripts/dashboard_screenshot.py --after 25 --out /tmp/page.png --set run.steps=40

The run is ``streamrl recipe run`` done in this process (``run.runner.run``) on the embedded
cluster, with a held-out evaluation every 10 steps so the page shows one; once ``--after`` steps
are published, Chromium (Debian: ``apt-get install chromium``) opens the page the runner printed
and saves a PNG, and the run goes on to its end. The PNG is palette-quantized to stay small
enough to keep in the repository (docs/img/dashboard.png). It also prints what ``publish`` cost
the run per step.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def screenshot(url: str, out: Path, width: int = 1400, height: int = 720, settle_s: float = 2.0,
               timeout: float = 120) -> None:
    """Headless Chromium opens ``url`` and writes the window to ``out`` as PNG once Bokeh has drawn
    the page.

    Chromium is driven over its DevTools protocol (bound to 127.0.0.1) rather than with
    ``--screenshot``: Bokeh pulls the document over a websocket after the page has loaded, and
    ``--screenshot`` shoots at load or after a fixed budget of virtual time -- it showed Dask's
    navigation bar over an empty page. Here the shot waits until Bokeh reports its document idle,
    then ``settle_s`` more for the canvases to paint.
    """
    import asyncio

    asyncio.run(_screenshot(url, out, width, height, settle_s, timeout))


async def _screenshot(url: str, out: Path, width: int, height: int, settle_s: float, timeout: float) -> None:
    import asyncio
    import base64
    import itertools
    import json
    import re
    import urllib.request

    from tornado.websocket import websocket_connect

    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        raise SystemExit("chromium not found (Debian: apt-get install -y chromium)")
    with tempfile.TemporaryDirectory() as profile:  # a fresh profile: no state from earlier runs
        proc = await asyncio.create_subprocess_exec(
            chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0",
            f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank",
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            async with asyncio.timeout(timeout):
                port = None
                while port is None:  # "DevTools listening on ws://127.0.0.1:PORT/devtools/browser/..."
                    line = (await proc.stderr.readline()).decode()
                    if not line:
                        raise RuntimeError("chromium exited before it opened its DevTools port")
                    m = re.search(r"DevTools listening on ws://127\.0\.0\.1:(\d+)/", line)
                    port = m and m.group(1)
                asyncio.ensure_future(_drain(proc.stderr))  # chromium's log must not fill the pipe
                targets = json.loads(await asyncio.to_thread(
                    lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list").read()))
                page = next(t for t in targets if t.get("type") == "page")
                ws = await websocket_connect(page["webSocketDebuggerUrl"], max_message_size=64 << 20)
                ids = itertools.count(1)

                async def call(method: str, **params):
                    i = next(ids)
                    ws.write_message(json.dumps({"id": i, "method": method, "params": params}))
                    while True:  # events and answers share the socket; wait for ours
                        msg = json.loads(await ws.read_message())
                        if msg.get("id") == i:
                            if "error" in msg:
                                raise RuntimeError(f"{method}: {msg['error']}")
                            return msg["result"]

                await call("Emulation.setDeviceMetricsOverride", width=width, height=height,
                           deviceScaleFactor=1, mobile=False)
                await call("Page.navigate", url=url)
                drawn = ("!!(window.Bokeh && Bokeh.documents.length && Bokeh.documents[0].is_idle"
                         " && Bokeh.documents[0].roots().length)")
                while not (await call("Runtime.evaluate", expression=drawn))["result"].get("value"):
                    await asyncio.sleep(0.25)
                await asyncio.sleep(settle_s)
                shot = await call("Page.captureScreenshot", format="png")
                out.write_bytes(base64.b64decode(shot["data"]))
                ws.close()
        finally:
            proc.terminate()
            await proc.wait()


async def _drain(stream) -> None:
    while await stream.readline():
        pass


def shrink(path: Path, colors: int = 128) -> None:
    """Quantize the PNG to a palette: charts have few colours, and the file drops below 200 KB."""
    from PIL import Image

    Image.open(path).convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT).save(
        path, optimize=True)


def main(argv: list[str] | None = None) -> int:
    """Run the recipe, take the screenshot mid-run, print where it is."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default=str(ROOT / "recipes" / "addition.toml"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "img" / "dashboard.png"))
    ap.add_argument("--after", type=int, default=45, help="steps published before the screenshot")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="recipe overrides, as for streamrl recipe run")
    args = ap.parse_args(argv)

    from rich.console import Console

    from streamrl.run import runner
    from streamrl.recipe.recipe import load_recipe
    from streamrl.telemetry import dashboard

    # defaults for a screenshot: a short run, its folder in a temporary place, a free port
    tmp = Path(tempfile.mkdtemp(prefix="streamrl-screenshot-"))
    overrides = ["run.steps=60", f"run.out_dir={tmp}", "run.report=false", "cluster.dashboard_port=0",
                 "eval.every=10", "eval.max_prompts=128", *args.overrides]
    loaded = load_recipe(args.recipe, overrides)
    r = loaded.recipe
    if args.after > r.run.steps:
        raise SystemExit(f"--after {args.after}: the run has only {r.run.steps} steps")
    out = Path(args.out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)

    # The page's header shows the run's name, mode and step count when install() is given them;
    # a runner that does not pass them yet gets them here (what it passes itself wins).
    real_install, real_publish = dashboard.install, dashboard.publish
    state: dict = {"url": None, "steps": 0, "thread": None, "error": None, "cost": []}

    def install(client, **kw):
        state["url"] = real_install(client, **{"name": r.run.name, "mode": r.run.mode, "steps": r.run.steps, **kw})
        return state["url"]

    def shoot():
        try:
            screenshot(state["url"], out)
        except Exception as exc:  # reported after the run; the run itself goes on
            state["error"] = exc

    def publish(client, record):
        t = time.perf_counter()
        real_publish(client, record)
        state["cost"].append(time.perf_counter() - t)
        state["steps"] += 1
        if state["steps"] == args.after and state["url"]:
            state["thread"] = threading.Thread(target=shoot, daemon=True)
            state["thread"].start()

    dashboard.install, dashboard.publish = install, publish
    try:
        folder = runner.run(loaded, console=Console(stderr=True), plain=True)
    finally:
        dashboard.install, dashboard.publish = real_install, real_publish
    if state["thread"] is None:
        print(f"no screenshot: the page was not installed (url {state['url']})", file=sys.stderr)
        return 1
    state["thread"].join()
    if state["error"] is not None or not out.exists():
        print(f"no screenshot: {state['error']!r}", file=sys.stderr)
        return 1
    shrink(out)
    print(f"{out} ({out.stat().st_size // 1024} KB) of {state['url']} after step {args.after}; run folder {folder}")
    cost = sorted(state["cost"])
    print(f"publish() per step: median {cost[len(cost) // 2] * 1e6:.0f} us, max {cost[-1] * 1e6:.0f} us "
          f"over {len(cost)} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
