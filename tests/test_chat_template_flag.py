"""`coserve serve --chat-template FILE` (vLLM's flag): the file's template replaces the model's in the gateway,
so a template that renders tools makes `tool_choice: auto` servable; a missing, huge or broken file is refused
before anything loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from coserve.cli import build_parser
from coserve.server.options import MAX_CHAT_TEMPLATE_BYTES, ServeOptions

TEMPLATE = Path(__file__).resolve().parents[1] / "deploy" / "chat-templates" / "smollm2-tools.jinja"


def test_the_flag_reaches_the_options() -> None:
    args = build_parser().parse_args(["serve", "--model", "m", "--tenants", "t", "--chat-template", str(TEMPLATE)])
    assert args.chat_template == str(TEMPLATE)


def test_bad_files_are_refused(tmp_path: Path) -> None:
    missing = ServeOptions(model="m", tenants="t", chat_template=str(tmp_path / "none.jinja"))
    with pytest.raises(ValueError, match="cannot be read"):
        missing.validate()
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for x in %}")
    with pytest.raises(ValueError, match="not a Jinja template"):
        ServeOptions(model="m", tenants="t", chat_template=str(broken)).validate()
    huge = tmp_path / "huge.jinja"
    huge.write_text("x" * (MAX_CHAT_TEMPLATE_BYTES + 1))
    with pytest.raises(ValueError, match="larger than"):
        ServeOptions(model="m", tenants="t", chat_template=str(huge)).validate()


def test_the_template_renders_tools_and_smollm2s_own_text(smollm2_dir: Path) -> None:
    """Without tools it renders SmolLM2's own template's text; with them, tools and calls in hermes' format,
    which the gateway detects (so `auto` is served)."""
    from coserve.frontend.tokenizer import Tokenizer
    from coserve.frontend.tool_admission import ToolSupport

    tokenizer = Tokenizer.from_pretrained(smollm2_dir)
    assert ToolSupport(tokenizer).family is None  # SmolLM2's own template renders no tools
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    tokenizer.chat_template = ServeOptions(model="m", tenants="t", chat_template=str(TEMPLATE)).chat_template_text()
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == own
    support = ToolSupport(tokenizer)
    assert support.renders_tools and support.family is not None and support.family.name == "hermes"
