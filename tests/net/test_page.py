"""The operator's page in a real headless Chromium against the real daemon with real clients.

Chromium is driven over the Chrome DevTools protocol with aiohttp's websocket client (no browser
download: Debian's `chromium` package; .ci/run installs it). Set DDILOCO_PAGE_SCREENSHOT to a path to
keep the screenshot the test takes (docs/operator-page.png is made that way).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import re
import shutil

import aiohttp

from .test_daemon import TOKEN, Learner, Syncer, train, train_until, two_learners, until

HOSTILE = "<img src=x onerror=alert(1)>"
CHROMIUM_START_S_MAX = 60.0
PAGE_WAIT_S_MAX = 30.0


class Browser:
    """One headless Chromium and one page of it, spoken to over the DevTools websocket."""

    def __init__(self, user_dir):
        self.user_dir = user_dir
        self.proc = None
        self.http = None
        self.ws = None
        self.ids = itertools.count(1)
        self.events: list[dict] = []

    async def start(self) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        assert binary, "chromium not found: install it (apt-get install -y chromium; .ci/run does)"
        self.proc = await asyncio.create_subprocess_exec(
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--remote-debugging-port=0",
            f"--user-data-dir={self.user_dir}",
            "--window-size=1280,1000",
            "about:blank",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        port_file = self.user_dir / "DevToolsActivePort"
        await until(
            lambda: port_file.exists() and port_file.read_text().count("\n") >= 1,
            CHROMIUM_START_S_MAX,
            "chromium's DevTools port",
        )
        port = int(port_file.read_text().split()[0])
        self.http = aiohttp.ClientSession()
        targets = await (await self.http.get(f"http://127.0.0.1:{port}/json/list")).json()
        page = next(t for t in targets if t["type"] == "page")
        self.ws = await self.http.ws_connect(page["webSocketDebuggerUrl"], max_msg_size=64 << 20)
        await self.call("Page.enable")
        await self.call("Runtime.enable")

    async def call(self, method: str, **params) -> dict:
        ident = next(self.ids)
        await self.ws.send_json({"id": ident, "method": method, "params": params})
        while True:
            message = json.loads((await self.ws.receive(timeout=PAGE_WAIT_S_MAX)).data)
            if message.get("id") == ident:
                assert "error" not in message, message
                return message["result"]
            self.events.append(message)  # (dialogs, console messages: looked at by the test)
            if message.get("method") == "Page.javascriptDialogOpening":  # an injected alert() would block the page
                await self.ws.send_json(
                    {"id": next(self.ids), "method": "Page.handleJavaScriptDialog", "params": {"accept": True}}
                )

    async def eval(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    async def wait_for(self, expression: str, what: str):
        """Poll a JS expression until it is truthy (the page polls its syncer once a second)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + PAGE_WAIT_S_MAX
        while not (value := await self.eval(expression)):
            assert loop.time() < deadline, f"timed out waiting for the page to show {what}"
            await asyncio.sleep(0.1)
        return value

    async def stop(self) -> None:
        if self.ws is not None:
            await self.ws.close()
        if self.http is not None:
            await self.http.close()
        if self.proc is not None and self.proc.returncode is None:
            self.proc.terminate()
            await self.proc.wait()


def rows(table: str) -> str:
    """JS: the rows of a table as lists of cell texts."""
    return f"[...document.querySelectorAll('#{table} tbody tr')].map(r => [...r.cells].map(c => c.textContent))"


async def test_page_shows_the_run_escapes_what_learners_send_and_marks_a_dead_syncer(tmp_path):
    s = Syncer(tmp_path)
    await s.start()
    a, b = await two_learners(s)
    hostile = Learner(s.ws_url, HOSTILE, seed=3)
    await hostile.welcome()
    await until(lambda: len(hostile.client.inbox.updates) == 2, what="the third learner's recovery updates")
    # Steps until four merges, not a fixed count: under load a round can close before the pushes
    # answering it arrive (late), and a fixed number of steps then merged too few.
    await train_until(s.server, [a, b, hostile], 4)
    async with aiohttp.ClientSession() as http:
        answer = await http.post(f"{s.http}/checkpoint", headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status == 200, await answer.text()
    await b.stop()  # a learner gone: a warning
    await until(lambda: any(r.status.value == "gone" for r in s.server.view.learners), what="b gone")

    browser = Browser(tmp_path / "chromium")
    try:
        await browser.start()
        await browser.call("Page.navigate", url=f"{s.http}/")
        await browser.wait_for("document.querySelectorAll('#learners tbody tr').length === 2", "the two learners left")
        # Rates need two polls with merges between them: the run goes on until the page shows one.
        running = asyncio.create_task(train(s.server, [a, hostile], 10_000))
        try:
            cards = await browser.wait_for(
                "(() => { const c = Object.fromEntries([...document.querySelectorAll('.card')].map("
                "e => [e.firstChild.textContent, e.lastChild.textContent]));"
                " return parseFloat(c['merges/s']) > 0 && c; })()",
                "a merge rate",
            )
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)
        learners = await browser.eval(rows("learners"))
        fragments = await browser.eval(rows("fragments"))
        decisions = await browser.eval(rows("decisions"))
        ledger = await browser.eval(rows("ledger"))
        warnings = await browser.eval("[...document.querySelectorAll('#warnings li')].map(e => e.textContent)")
        answer = await browser.eval("document.getElementById('answer').textContent")
        images = await browser.eval("document.querySelectorAll('img').length")
        screenshot = base64.b64decode((await browser.call("Page.captureScreenshot", format="png"))["data"])

        # The hostile name is text in its cell, nothing else; no element was injected, no dialog opened.
        names = [r[1] for r in learners]
        assert sorted(names) == sorted(["a", HOSTILE])
        assert images == 0
        assert not any(e.get("method") == "Page.javascriptDialogOpening" for e in browser.events)
        # What the run is doing.
        assert answer.startswith("syncer answering")
        assert float(cards["tokens/s reported"]) > 0 and int(cards["global step"]) > 0
        assert int(cards["merges"]) >= 4 and cards["checkpoint"].endswith(" ago")
        assert all(r[2] == "live" for r in learners)
        assert all(re.fullmatch(r"\d+\.\d%", r[6]) for r in learners)  # merged share
        assert len(fragments) == 2 and all(int(f[1]) >= 1 for f in fragments)
        assert decisions and any(d[4].startswith("merged") for d in decisions)
        assert [r[0] for r in ledger] == ["merged", "merged_late", "late", "stale", "rejected", "lost", "open"]
        assert any(w.startswith("learner 2 (b) gone, last seen") for w in warnings), warnings
        assert screenshot.startswith(b"\x89PNG")
        if os.environ.get("DDILOCO_PAGE_SCREENSHOT"):
            with open(os.environ["DDILOCO_PAGE_SCREENSHOT"], "wb") as fh:
                fh.write(screenshot)

        # The syncer dies: the page says so, in red, with the time it stopped answering.
        await a.stop()
        await hostile.stop()
        await s.server.stop()
        mark = await browser.wait_for(
            "(() => { const a = document.getElementById('answer');"
            " return a.className === 'down' && [a.textContent, getComputedStyle(a).color]; })()",
            "that the syncer is not answering",
        )
        assert re.match(r"syncer not answering since \d\d:\d\d:\d\d \(", mark[0]), mark
        assert mark[1] == "rgb(204, 0, 0)"
        assert await browser.eval("document.getElementById('view').className") == "stale"
    finally:
        await browser.stop()
