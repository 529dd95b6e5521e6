"""Screenshots of ``corral view``'s main views, into docs/images/viewer-*.png.

    python scripts/viewer_screenshots.py [RUN_DIR ...] [--out docs/images]

Serves the viewer on 127.0.0.1 over the given folders (e.g. a run folder of a short ``corral
train``) plus a play folder with a forked session written by the gateway's own session code
(tests/viewer_folders.py), and drives headless Chromium (Debian's ``chromium`` and
``chromium-driver``, through Selenium: no browser download) through the runs page, the
episode list, an episode, a forked sample and a comparison. Run from the repository root.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from corral.serving import serve_in_thread  # noqa: E402
from corral.viewer.app import create_app, open_state  # noqa: E402
from corral.viewer.pieces import load_pieces  # noqa: E402
from tests.viewer_folders import pieces, write_eval_folder, write_play_folder, write_run_folder  # noqa: E402


def browser(width: int = 1400, height: int = 1000):  # type: ignore[no-untyped-def]
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 f"--window-size={width},{height}"):  # fmt: skip
        options.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)


def wait_for(driver, css: str, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(
        ec.presence_of_element_located((By.CSS_SELECTOR, css))
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", type=Path, help="run, eval or play folders")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--tokenizer", type=Path, help="the folders' model, for token text")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folders = list(args.folders)
        if not folders:
            folders = [write_run_folder(Path(tmp) / "run"), write_eval_folder(Path(tmp) / "eval")]
        play = write_play_folder(Path(tmp) / "play")
        state = open_state([*folders, play])
        tokenizer = load_pieces(args.tokenizer) if args.tokenizer else None
        # The play folder's tokens are characters: the stand-in tokenizer reads them.
        state.pieces = tokenizer or pieces
        play_set = state.sets[-1].id
        with serve_in_thread(create_app(state)) as url:
            driver = browser()
            try:
                shots = [
                    ("runs", "#/", ".chart svg"),
                    ("episodes", "#/episodes", ".ep-row"),
                    ("episode", f"#/episode/{state.sets[0].id}/1", "#conversation"),
                    ("sample", f"#/sample/{play_set}/0/1", "#forks"),
                    ("compare", f"#/compare?a={state.sets[0].id}&b={state.sets[-2].id}",
                     "#compare-summary"),
                ]  # fmt: skip
                for name, hash_, ready in shots:
                    driver.get(url + "/" + hash_)
                    wait_for(driver, ready)
                    time.sleep(0.3)  # let the list or token view paint its rows
                    path = args.out / f"viewer-{name}.png"
                    driver.save_screenshot(str(path))
                    print(path)
            finally:
                driver.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
