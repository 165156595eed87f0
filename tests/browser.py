"""Headless Chromium for tests: open a local page and evaluate JavaScript in it over the DevTools
protocol, so a test can check what a person would see (element sizes, decoded images)."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def find_browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@contextlib.contextmanager
def open_page(browser: str, page: Path, profile: Path) -> Iterator:
    """A DevTools websocket attached to page (a file), loaded in a fresh headless browser."""
    from websockets.sync.client import connect

    process = subprocess.Popen(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--window-size=1280,2000",
            page.as_uri(),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        for _ in range(300):
            if port_file.is_file() and port_file.read_text(encoding="utf-8").strip():
                break
            time.sleep(0.1)
        port = port_file.read_text(encoding="utf-8").split()[0]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            target = next(t for t in json.load(response) if t["type"] == "page")
        with connect(target["webSocketDebuggerUrl"], max_size=None) as socket:
            call(socket, "Page.enable")
            call(socket, "Page.navigate", url=page.as_uri())
            wait_for(socket, "Page.loadEventFired")
            yield socket
    finally:
        process.terminate()
        process.wait(timeout=20)


def call(socket, method: str, **params) -> dict:
    """Send one DevTools command and return its result, skipping the events that arrive meanwhile."""
    call.counter = getattr(call, "counter", 0) + 1
    socket.send(json.dumps({"id": call.counter, "method": method, "params": params}))
    while True:
        reply = json.loads(socket.recv(timeout=30))
        if reply.get("id") == call.counter:
            if "error" in reply:
                raise RuntimeError(f"{method} failed: {reply['error']}")
            return reply["result"]


def wait_for(socket, event: str) -> dict:
    while True:
        message = json.loads(socket.recv(timeout=30))
        if message.get("method") == event:
            return message


def evaluate(socket, expression: str):
    """The JSON-able value of a JavaScript expression in the loaded page."""
    result = call(socket, "Runtime.evaluate", expression=f"JSON.stringify({expression})")
    if "exceptionDetails" in result:
        raise RuntimeError(f"the page raised: {result['exceptionDetails']['text']}")
    return json.loads(result["result"]["value"])
