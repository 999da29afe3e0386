"""Real-browser check of the notebook panel: JupyterLab on 127.0.0.1, the quickstart notebook run
in headless Chromium (Debian's ``chromium``, driven by Playwright), screenshots mid-run and at the end.

    python .ci/browser_check.py [--notebook notebooks/quickstart.ipynb] [--out docs/_static]

Exits non-zero when the panel does not render (an empty widget placeholder, no shard grid, no
plot) or the run does not finish.  Needs the ``browser`` extra (jupyterlab, playwright) and
``/usr/bin/chromium``; Playwright never downloads a browser here.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
]
PANEL = ".jp-OutputArea-output:has(.widget-html-content :text('shards'))"


def start_lab(root: Path, port: int, token: str, log: Path) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.open_browser=False",
        "--allow-root",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=root)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=2)
            return proc
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited: {log.read_text()[-2000:]}") from None
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"jupyter lab did not start in 90 s: {log.read_text()[-2000:]}")


def check(notebook: Path, out: Path, chromium: str, timeout: float) -> dict:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="vcdask-browser-"))
    shutil.copy(notebook, root / notebook.name)
    from vcdask.testing.s3 import free_port

    port, token = free_port(), secrets.token_hex(16)
    lab = start_lab(root, port, token, root / "lab.log")
    report: dict = {}
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
            page = browser.new_page(viewport={"width": 1500, "height": 1100})
            try:
                _drive(page, port, token, notebook, out, timeout, report)
            except Exception:
                page.screenshot(path=str(out / "failure.png"))
                (out / "failure.html").write_text(page.content())
                raise
            browser.close()
    finally:
        lab.terminate()
        try:
            lab.wait(15)
        except subprocess.TimeoutExpired:
            lab.kill()
    problems = []
    if "finished" not in report.get("end_text", ""):
        problems.append("the panel never said 'finished'")
    if "workers" not in report.get("end_text", "") or "epoch" not in report.get("end_text", ""):
        problems.append("the panel lacks its shard grid or worker table")
    if not report.get("canvases"):
        problems.append("the bokeh plot did not render (no canvas): an empty widget placeholder?")
    report["problems"] = problems
    return report


def _drive(page, port: int, token: str, notebook: Path, out: Path, timeout: float, report: dict) -> None:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.goto(f"http://127.0.0.1:{port}/lab/tree/{notebook.name}?token={token}")
    page.wait_for_selector(".jp-Notebook", timeout=90_000)
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    select = page.locator(".jp-Dialog button:has-text('Select')")  # JupyterLab may ask which kernel
    try:
        select.wait_for(timeout=10_000)
        select.click()
    except PlaywrightTimeout:
        pass
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=90_000)
    page.click("li.lm-MenuBar-item:has-text('Run')", timeout=30_000)  # the main menu
    page.click("li.lm-Menu-item[data-command='runmenu:run-all']", timeout=30_000)
    # mid-run: the panel is up and some (not all) epochs are done
    panel = page.locator(PANEL).first
    panel.wait_for(timeout=timeout * 1000)
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        text = panel.inner_text()
        if "running" in text and "merged" in text and "epoch 2" in text:
            break
        time.sleep(0.2)
    panel.scroll_into_view_if_needed()
    panel.screenshot(path=str(out / "panel-midrun.png"))
    report["midrun_text"] = panel.inner_text()[:400]
    # the end: the header says finished and the plot has drawn
    page.wait_for_function(
        "() => [...document.querySelectorAll('.widget-html-content')].some(e => e.innerText.includes('finished'))",
        timeout=timeout * 1000,
    )
    page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=timeout * 1000)
    time.sleep(1.0)  # let bokeh finish drawing
    panel = page.locator(PANEL).first
    panel.scroll_into_view_if_needed()
    panel.screenshot(path=str(out / "panel-end.png"))
    report["end_text"] = panel.inner_text()
    report["canvases"] = panel.locator("canvas").count()
    report["errors"] = page.locator(
        ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']:has-text('Error')"
    ).count()
    page.screenshot(path=str(out / "notebook-end.png"), full_page=False)


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent.parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--notebook", type=Path, default=here / "notebooks" / "quickstart.ipynb")
    ap.add_argument("--out", type=Path, default=here / "docs" / "_static")
    ap.add_argument("--chromium", default=os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the run")
    args = ap.parse_args(argv)
    if not Path(args.chromium).exists():
        print(f"no Chromium at {args.chromium} (apt-get install chromium)", file=sys.stderr)
        return 2
    report = check(args.notebook, args.out, args.chromium, args.timeout)
    print(f"mid-run panel:\n{report.get('midrun_text', '')}\n\nfinal panel:\n{report.get('end_text', '')}")
    print(f"screenshots in {args.out}: panel-midrun.png, panel-end.png, notebook-end.png")
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
