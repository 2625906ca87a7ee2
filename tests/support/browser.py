"""A minimal headless Chromium driver over the Chrome DevTools protocol (for page tests).

Starts the system's `chromium` with a private profile, opens one page and lets a test navigate,
run JavaScript, wait for a condition and take a screenshot. No browser download, no playwright.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import connect


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with one page, driven over CDP."""

    def __init__(self, binary: str, width: int = 1400, height: int = 900,
                 timeout_s: float = 30.0) -> None:
        self.profile = tempfile.mkdtemp(prefix="art-chromium-")
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-extensions", "--remote-debugging-address=127.0.0.1",
             "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._drain, args=(lines,), daemon=True).start()
        deadline = time.monotonic() + timeout_s
        url = None
        while url is None:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise RuntimeError("chromium did not print its DevTools address") from None
            if "DevTools listening on " in line:
                url = line.split("DevTools listening on ", 1)[1].strip()
        self._stack = contextlib.ExitStack()
        self.ws = self._stack.enter_context(connect(url, max_size=None, open_timeout=timeout_s))
        self._ids = itertools.count(1)
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.call("Target.attachToTarget",
                                 {"targetId": target, "flatten": True})["sessionId"]
        self.call("Page.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=True)

    def _drain(self, lines: queue.Queue[str]) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            lines.put(line)

    def call(self, method: str, params: dict[str, Any] | None = None, *,
             session: bool = False, timeout_s: float = 30.0) -> dict[str, Any]:
        """Send one CDP command and return its result (events in between are ignored)."""
        msg_id = next(self._ids)
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = self.session
        self.ws.send(json.dumps(msg))
        deadline = time.monotonic() + timeout_s
        while True:
            reply = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if reply.get("id") == msg_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url}, session=True)

    def eval(self, expression: str) -> Any:
        """Evaluate JavaScript in the page; returns its (JSON) value."""
        result = self.call("Runtime.evaluate", {
            "expression": expression, "returnByValue": True, "awaitPromise": True},
            session=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page JS failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 15.0) -> Any:
        """Poll `expression` until it is truthy; return its value."""
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            try:
                value = self.eval(expression)
            except RuntimeError:
                value = None  # the page is navigating
            if value:
                return value
            time.sleep(0.1)
        raise TimeoutError(f"timed out waiting for {expression!r} (last value {value!r})")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport":
                                                    False}, session=True)["data"]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            if getattr(self, "_stack", None) is not None:
                self._stack.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            shutil.rmtree(self.profile, ignore_errors=True)
