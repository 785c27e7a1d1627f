"""Screenshots of the page for the docs (docs/page.md): docs/page-chat.png and
docs/page-server.png.

    .venv/bin/python docs/screenshots.py [--out DIR] [--quick]

--quick: shorter background answers (the suite runs it so, into a temporary folder, so the
script cannot rot).

Starts a server on a free loopback port, sends it a chat through the page and a few
requests sharing a prompt (so the block map has used, shared and cached blocks), and
photographs both views with Debian's chromium through Playwright.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time

import httpx
from playwright.sync_api import sync_playwright

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from server_process import ServerProcess  # noqa: E402  (the tests' helper starts the server)


def main() -> None:
    parser = argparse.ArgumentParser(description="screenshots of the page")
    parser.add_argument("--out", default=HERE, help="the folder for the two PNGs (default: docs/)")
    parser.add_argument("--quick", action="store_true", help="shorter background answers")
    args = parser.parse_args()
    server = ServerProcess("--kv-cache-memory", str(48 << 20), "--max-num-seqs", "4",
                           log_path="/tmp/pagedllm-screenshots.log")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=shutil.which("chromium"),
                                                 args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.goto(server.url)
            page.wait_for_selector("body[data-ready=true]")
            page.evaluate("document.getElementById('chat-settings').open = true")
            page.fill("#max-tokens", "80")
            page.fill("#prompt", "Write a Python function that reverses a string, in a code block.")
            page.press("#prompt", "Enter")
            page.locator(".message.assistant .meta span", has_text="TTFT").wait_for(timeout=120_000)
            page.screenshot(path=os.path.join(args.out, "page-chat.png"))
            # Earlier prompts leave cached blocks; n=3 samples share theirs while they run.
            for i in range(3):
                httpx.post(server.url + "/v1/completions", timeout=120,
                           json={"prompt": f"Story {i}: " + "Once upon a time " * 40, "max_tokens": 4})
            body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 30, "n": 3,
                    "max_tokens": 150 if args.quick else 1500, "ignore_eos": True, "temperature": 1.0}
            thread = threading.Thread(target=lambda: httpx.post(server.url + "/v1/completions",
                                                                json=body, timeout=300))
            thread.start()
            page.click("button[data-view=server]")
            page.wait_for_function("Number(document.getElementById('block-map').dataset.shared) > 0",
                                   timeout=60_000)
            time.sleep(2.5)  # a few seconds of charts, the samples still running
            page.screenshot(path=os.path.join(args.out, "page-server.png"), full_page=True)
            thread.join()
            browser.close()
    finally:
        server.stop()
    print(f"wrote page-chat.png and page-server.png in {args.out}")


if __name__ == "__main__":
    main()
