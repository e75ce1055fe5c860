"""A real headless Chromium (Debian's package), driven over the DevTools protocol on a pipe.

    with Browser() as browser:
        page = browser.open(Path("report.html"))     # Page: requests, console errors, load time
        page.evaluate("document.title")
        page.screenshot(Path("shot.png"))

No download and no port: Chromium is started with --remote-debugging-pipe, so the protocol's JSON
messages go over file descriptors 3 and 4, NUL-separated. Every request the page makes is seen
through the Network domain (`page.requests`); the browser is also given a proxy that does not
exist, so a request that slipped past would fail rather than leave the machine. Console errors
and uncaught exceptions are collected in `page.errors`.

    python tests/helpers/browser.py shot REPORT.html OUT.png [WIDTH [HEIGHT [CSS-SELECTOR]]]  # the README's pictures
    python tests/helpers/browser.py time REPORT.html                            # seconds until every chart is drawn
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FLAGS = ["--headless", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-extensions", "--disable-default-apps",
         "--no-default-browser-check", "--mute-audio", "--hide-scrollbars",
         "--proxy-server=127.0.0.1:9", "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE localhost"]


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class BrowserError(RuntimeError):
    pass


class Browser:
    def __init__(self, width: int = 1400, height: int = 900, timeout: float = 60.0):
        self.width, self.height, self.timeout = width, height, timeout
        self.proc = None
        self._id = 0
        self._buffer = b""
        self.events: list[dict] = []

    def __enter__(self) -> "Browser":
        binary = chromium()
        if binary is None:
            raise BrowserError("chromium is not installed (apt-get install chromium)")
        self._profile = tempfile.mkdtemp(prefix="anvil-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def fds():   # the protocol's pipe ends at the child's fds 3 (commands) and 4 (answers)
            os.dup2(to_child_r, 3)
            os.dup2(from_child_w, 4)

        argv = [binary, *FLAGS, f"--user-data-dir={self._profile}", f"--window-size={self.width},{self.height}",
                "--remote-debugging-pipe"]
        if os.geteuid() == 0:
            argv.append("--no-sandbox")       # Chromium refuses to run as root with its sandbox
        self.proc = subprocess.Popen(argv + ["about:blank"], preexec_fn=fds, pass_fds=(3, 4),   # kept open after fds() ran
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_child_r)
        os.close(from_child_w)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.send("Browser.close")
        except Exception:    # noqa: BLE001 - closing anyway
            pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for fd in (self._to_child, self._from_child):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)

    # -- the protocol
    def _read_message(self, deadline: float) -> dict:
        import select
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError("no answer from chromium in time")
            ready, _, _ = select.select([self._from_child], [], [], left)
            if ready:
                chunk = os.read(self._from_child, 1 << 20)
                if not chunk:
                    raise BrowserError("chromium closed its pipe")
                self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float | None = None) -> dict:
        self._id += 1
        message = {"id": self._id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_child, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, session: str, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            for event in self.events:
                if event.get("method") == method and event.get("sessionId") == session:
                    self.events.remove(event)
                    return event
            self.events.append(self._read_message(deadline))

    def open(self, path: Path, wait_for: str = "document.body && document.body.dataset.chartsDrawn !== undefined"):
        """Load a local file in a fresh tab; returns once `wait_for` is true (or the timeout)."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Network", "Runtime", "Log"):
            self.send(f"{domain}.enable", session=session)
        self.send("Emulation.setDeviceMetricsOverride", {"width": self.width, "height": self.height,
                                                         "deviceScaleFactor": 1, "mobile": False}, session=session)
        url = Path(path).resolve().as_uri()
        started = time.monotonic()
        self.send("Page.navigate", {"url": url}, session=session)
        self.wait_event("Page.loadEventFired", session)
        page = Page(self, session, url)
        deadline = time.monotonic() + self.timeout
        while not page.evaluate(f"Boolean({wait_for})"):
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        page.load_seconds = time.monotonic() - started
        return page


class Page:
    def __init__(self, browser: Browser, session: str, url: str):
        self.browser, self.session, self.url = browser, session, url
        self.load_seconds = 0.0

    def evaluate(self, expression: str):
        result = self.browser.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                                        "awaitPromise": True}, session=self.session)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:60]}: {result['exceptionDetails'].get('text')}")
        return result.get("result", {}).get("value")

    def _events(self, *methods) -> list[dict]:
        # drain what has arrived, without waiting
        self.evaluate("1")
        return [e for e in self.browser.events if e.get("sessionId") == self.session and e.get("method") in methods]

    @property
    def requests(self) -> list[str]:
        """Every URL the page asked for, its own file included."""
        return [e["params"]["request"]["url"] for e in self._events("Network.requestWillBeSent")]

    @property
    def errors(self) -> list[str]:
        """Console errors, uncaught exceptions and error log entries (CSP violations among them)."""
        out = []
        for e in self._events("Runtime.consoleAPICalled", "Runtime.exceptionThrown", "Log.entryAdded"):
            p = e["params"]
            if e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console: " + " ".join(str(a.get("value", a.get("description", ""))) for a in p["args"]))
            elif e["method"] == "Runtime.exceptionThrown":
                details = p["exceptionDetails"]
                out.append("exception: " + str(details.get("exception", {}).get("description") or details.get("text")))
            elif e["method"] == "Log.entryAdded" and p["entry"].get("level") == "error":
                out.append(f"log: {p['entry'].get('text')} {p['entry'].get('url', '')}")
        return out

    def screenshot(self, out: Path, full_page: bool = False, selector: str = "") -> Path:
        """The viewport, the whole page, or the box of the first element `selector` matches."""
        params = {"format": "png"}
        if selector:
            box = self.evaluate(f"(function(){{var r = document.querySelector({json.dumps(selector)})"
                                ".getBoundingClientRect(); return [r.x, r.y + window.scrollY, r.width, r.height];})()")
            params.update(captureBeyondViewport=True,
                          clip={"x": box[0], "y": box[1], "width": box[2], "height": box[3], "scale": 1})
        elif full_page:
            height = self.evaluate("document.documentElement.scrollHeight")
            params.update(captureBeyondViewport=True,
                          clip={"x": 0, "y": 0, "width": self.browser.width, "height": height, "scale": 1})
        data = self.browser.send("Page.captureScreenshot", params, session=self.session)["data"]
        Path(out).write_bytes(base64.b64decode(data))
        return Path(out)


def _main(argv: list[str]) -> int:
    if len(argv) >= 3 and argv[0] == "shot":
        width = int(argv[3]) if len(argv) > 3 else 1400
        height = int(argv[4]) if len(argv) > 4 else 900
        selector = argv[5] if len(argv) > 5 else ""
        with Browser(width, height) as browser:
            page = browser.open(Path(argv[1]))
            page.screenshot(Path(argv[2]), selector=selector)
            print(f"{argv[2]} ({page.load_seconds:.2f} s to draw; errors: {page.errors or 'none'})")
        return 0
    if len(argv) == 2 and argv[0] == "time":
        with Browser() as browser:
            page = browser.open(Path(argv[1]))
            print(f"{page.load_seconds:.3f} s until every chart is drawn")
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
