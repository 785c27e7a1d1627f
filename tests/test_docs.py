"""The documentation: the site builds strictly (a broken link or a page left out of the nav
fails it), offline; the generated reference pages (options, metrics) agree with the code;
README and BENCHMARKS stay short; every `pagedllm` command shown in the docs parses; the
page's screenshots are made by their script."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DOCS = os.path.join(ROOT, "docs")
QUIET = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def _build(config: str, site: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", config,
                           "-d", site], capture_output=True, text=True, timeout=300, env=QUIET)


def test_the_site_builds_strictly_and_offline(tmp_path):
    done = _build(os.path.join(ROOT, "mkdocs.yml"), str(tmp_path / "site"))
    assert done.returncode == 0, done.stderr
    index = (tmp_path / "site" / "index.html").read_text()
    assert "fonts.googleapis.com" not in index  # no font from a CDN
    for page in ("apis", "reference/options", "reference/metrics", "benchmarks/log",
                 "troubleshooting", "architecture"):
        assert (tmp_path / "site" / f"{page}.html").exists(), page  # offline: file URLs


@pytest.mark.parametrize("damage", ["link", "nav"])
def test_a_broken_link_or_a_page_outside_the_nav_fails_the_build(tmp_path, damage):
    docs = tmp_path / "docs"
    shutil.copytree(DOCS, docs)
    config = open(os.path.join(ROOT, "mkdocs.yml")).read().replace("docs_dir: docs",
                                                                    f"docs_dir: {docs}")
    if damage == "link":
        with open(docs / "serving.md", "a") as f:
            f.write("\nSee [the missing page](no-such-page.md).\n")
    else:
        (docs / "orphan.md").write_text("# Not in the nav\n")
    (tmp_path / "mkdocs.yml").write_text(config)
    done = _build(str(tmp_path / "mkdocs.yml"), str(tmp_path / "site"))
    assert done.returncode != 0
    assert ("no-such-page.md" if damage == "link" else "orphan.md") in done.stderr


def test_the_reference_pages_are_generated_from_the_code():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "docs_reference.py"),
                           "--check"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    options = open(os.path.join(DOCS, "reference", "options.md")).read()
    for option in ("`--tool-call-parser`", "`--reasoning-budget`", "`--models-dir`",
                   "## pagedllm plan", "## pagedllm bench", "### pagedllm keys add"):
        assert option in options
    assert "| `--max-num-seqs` | `auto` |" in options and "`max-num-seqs` |" in options


def test_readme_and_benchmarks_stay_short():
    assert len(open(os.path.join(ROOT, "README.md")).read().splitlines()) <= 200
    assert len(open(os.path.join(ROOT, "BENCHMARKS.md")).read().splitlines()) <= 300


def _commands_in_code_blocks(text: str):
    """`pagedllm ...` lines of the fenced blocks (continuations joined, comments cut), and
    inline code spans that are a `pagedllm` command."""
    in_block, pending = False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            in_block, pending = not in_block, ""
            continue
        if not in_block:
            for span in re.findall(r"`((?:\.venv/bin/)?pagedllm [^`]+)`", line):
                yield span
            continue
        line = pending + line
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        for part in re.split(r"&&|\|\||;|\s&\s|\s\|\s", line.split("  #")[0]):
            words = part.strip().split()
            while words and re.match(r"^[A-Z_]+=", words[0]):  # VAR=value before a command
                words.pop(0)
            if words and os.path.basename(words[0]) == "pagedllm":
                yield " ".join(words)


def _parse_error(words: list[str]) -> str | None:
    """argparse's complaint about these words, or None where they parse (--help exits 0)."""
    import contextlib
    import io

    from pagedllm.cli.main import build_parser

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(words)
    except SystemExit as exc:
        return None if exc.code == 0 else said.getvalue().strip().splitlines()[-1]
    return None


def test_every_pagedllm_command_in_the_docs_parses():
    sources = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "BENCHMARKS.md")]
    sources += [os.path.join(folder, name) for folder, _, names in os.walk(DOCS)
                for name in names if name.endswith(".md") and "benchmarks" not in folder]
    checked = []
    for path in sources:
        for command in _commands_in_code_blocks(open(path, encoding="utf-8").read()):
            if re.search(r"\[--|\|[a-z]|<[A-Za-z]|\.\.\.|\| grep", command):
                continue  # a synopsis ([--option], a|b, <VALUE>, ...), not a command
            words = ["2" if word == "N" else word for word in shlex.split(command)[1:]]
            if len(words) < 2:
                continue  # a command named in the text (`pagedllm plan`)
            error = _parse_error(words)
            if error and "expected one argument" in error and words[-1].startswith("--"):
                continue  # an option named in the text (`pagedllm bench --out`)
            assert error is None, f"{os.path.relpath(path, ROOT)}: `{command}`: {error}"
            checked.append(command)
    assert len(checked) >= 12, checked


def test_the_screenshots_script_makes_both_pictures(tmp_path):
    if shutil.which("chromium") is None:
        pytest.skip("Debian's chromium is not installed (make test installs it with apt-get)")
    done = subprocess.run([sys.executable, os.path.join(DOCS, "screenshots.py"), "--out",
                           str(tmp_path), "--quick"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("page-chat.png", "page-server.png"):
        picture = tmp_path / name
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and picture.stat().st_size > 20_000
    page = open(os.path.join(DOCS, "page.md")).read()
    assert "](page-chat.png)" in page and "](page-server.png)" in page


def test_every_route_the_server_declares_is_in_the_routes_table():
    server = os.path.join(ROOT, "src", "pagedllm", "server")
    declared = set()
    for name in os.listdir(server):
        if name.endswith(".py"):
            text = open(os.path.join(server, name), encoding="utf-8").read()
            declared |= set(re.findall(r'@app\.(?:get|post|delete|put)\("([^"]+)"', text))
    table = open(os.path.join(DOCS, "apis.md"), encoding="utf-8").read()
    table = re.sub(r"\{[a-z_:]+\}", "{}", table.replace("{id}", "{}"))
    unprefixed = {"/models", "/chat/completions", "/completions", "/responses", "/embeddings"}
    missing = [route for route in sorted(declared)
               if re.sub(r"\{[a-z_:]+\}", "{}", route) not in table and route not in unprefixed
               and not route.startswith("/ui/") and not route.startswith("/models/")]
    assert declared and not missing, missing


def _blocks(path: str, language: str) -> list[str]:
    text = open(path, encoding="utf-8").read()
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def _pointed_at(code: str, server) -> str:
    """A quick-start snippet aimed at the suite's server (its address, its served name)."""
    return code.replace("http://127.0.0.1:8000", server.url).replace(
        "SmolLM2-135M-Instruct.Q4_1", "smollm2")


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_first_requests_shown_work(page, server, capsys):
    """The curl command and the client snippets of the quick start, run as written against
    a running server (only its address and served name changed)."""
    path = os.path.join(ROOT, page)
    snippets = [code for code in _blocks(path, "python") if "127.0.0.1:8000" in code]
    curls = [code for code in _blocks(path, "") if code.startswith("curl ")]
    assert snippets and curls
    for code in snippets:
        exec(compile(_pointed_at(code, server), page, "exec"), {})
        assert capsys.readouterr().out.strip()  # each prints an answer
    if shutil.which("curl") is None:
        pytest.skip("no curl here")
    for code in curls:
        done = subprocess.run(["bash", "-c", _pointed_at(code, server)], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0 and '"choices"' in done.stdout, done.stdout + done.stderr
