"""The README stays what a newcomer reads in five minutes, its example config is real, and the site's
config page (generated at each build by `jaxrl config --markdown`, scripts/docs_hooks.py) holds every
key `jaxrl config` prints. The site itself is built with warnings as errors by scripts/docs.sh, which
scripts/test.sh runs beside the suite."""

import re
from pathlib import Path

from jaxrl.run.config import TrainConfig, load_config
from jaxrl.run.typed_config import describe, describe_markdown, key_rows

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
COMMANDS = ["bash scripts/setup.sh && .venv/bin/jaxrl train configs/tiny_cpu.yaml", "bash scripts/test.sh"]


def fenced_blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, line of the opening fence) of each fenced code block."""
    return [(m[1], m[2], text.count("\n", 0, m.start()) + 1)
            for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.M | re.S)]


def prose_paragraphs(text: str) -> list[list[str]]:
    """Paragraphs outside code blocks, tables and lists."""
    text = re.sub(r"^```.*?^```$", "", text, flags=re.M | re.S)
    paragraphs = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.splitlines() if line.strip()]
        if lines and not lines[0].startswith(("|", "#", "- ", "* ")):
            paragraphs.append(lines)
    return paragraphs


def test_readme_is_short():
    lines = README.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; at most 200 (the rest belongs in docs/)"
    long = [(i, len(line)) for i, line in enumerate(lines, 1) if len(line) > 120]
    assert not long, f"README.md lines over 120 characters (line, length): {long}"
    tall = [p[0][:60] for p in prose_paragraphs(README) if len(p) > 8]
    assert not tall, f"README.md paragraphs over 8 lines: {tall}"


def test_readme_starts_with_the_two_commands():
    blocks = fenced_blocks(README)
    assert [body.strip() for _, body, _ in blocks[:2]] == COMMANDS, (
        "the README's first two code blocks must be the two commands: set up + run the default job, "
        "set up + run the tests")
    assert blocks[1][2] <= 25, "the two commands come first, before line 25"


def test_readme_keeps_history_out():
    dates = re.findall(r"\b20\d\d-\d\d-\d\d\b", README)
    assert not dates, f"dated history belongs in docs/benchmarks.md, not the README: {dates}"
    hashes = [h for h in re.findall(r"\b[0-9a-f]{7,40}\b", README) if re.search(r"[a-f]", h) and re.search(r"\d", h)]
    assert not hashes, f"commit hashes belong in docs/benchmarks.md, not the README: {hashes}"


def test_readme_example_config_is_the_file_and_loads():
    example = ROOT / "configs" / "qwen3_openenv_url.yaml"
    yaml_blocks = [body for lang, body, _ in fenced_blocks(README) if lang == "yaml"]
    assert example.read_text() in yaml_blocks, "the README's example config must be configs/qwen3_openenv_url.yaml"
    cfg = load_config(example)
    assert cfg.envs[0].url == "http://127.0.0.1:8000" and cfg.model.tiny is None
    assert len(example.read_text().splitlines()) <= 25


def test_coming_from_trl_config_loads():
    page = (ROOT / "docs" / "coming-from-trl.md").read_text()
    yaml_block = next(body for lang, body, _ in fenced_blocks(page) if lang == "yaml")
    cfg = load_config(__import__("yaml").safe_load(yaml_block))
    assert cfg.learner.group_size == 8 and cfg.rollout.max_turns == 5 and cfg.envs[0].env_class


def describe_keys(text: str) -> set[str]:
    """The dotted keys of `jaxrl config`'s commented YAML: keys, and under a list or an unset section
    the commented keys of its items (`#   name: ...`)."""
    keys, stack = set(), []
    for line in text.splitlines():
        m = re.match(r"^( *)(#   )?( *)([A-Za-z_][A-Za-z0-9_]*):(?: |$)", line)
        if m is None:
            continue
        level = len(m[1]) // 2 + (1 + len(m[3]) // 2 if m[2] else 0)
        stack[level:] = [m[4]]
        keys.add(".".join(stack))
    return keys


def test_config_page_has_every_key():
    rows = [key for key, *_ in key_rows(TrainConfig)]
    plain = {key.replace("[]", "") for key in rows}
    printed = describe_keys(describe(TrainConfig))
    assert len(printed) > 100
    missing = [k for k in printed if k not in plain and not any(r.startswith(k + ".") for r in plain)]
    assert not missing, f"keys `jaxrl config` prints that the config page lacks: {missing}"
    extra = sorted(plain - printed)
    assert not extra, f"config page keys that `jaxrl config` does not print: {extra}"
    page = describe_markdown(TrainConfig)
    assert all(f"| `{key}` |" in page for key in rows)
    assert "## rollout" in page and "## learner" in page and describe(TrainConfig).strip() in page


def test_config_page_escapes_help_text():
    page = describe_markdown(TrainConfig)
    row = next(line for line in page.splitlines() if line.startswith("| `envs[].harness` |"))
    assert "&lt;harness\\_port&gt;" in row, "an HTML-like <word> in help text must not become a tag"
    assert row.endswith(" |") and row.count("`") % 2 == 0
