"""The prompts file the command-line tools take (`--prompts FILE`: the queue, the demo, the workload benchmark).

One rule, for all three: UTF-8 text, one prompt per line, in order; each line is stripped of surrounding
whitespace, and blank lines and lines starting with `#` (after leading whitespace) are skipped. A file that
cannot be read, is not UTF-8 or holds no prompt is a `PromptFileError` that says which.
"""

from __future__ import annotations

import os
from pathlib import Path

RULE = "one prompt per line; blank lines and lines starting with # are skipped"


class PromptFileError(ValueError):
    """A prompts file that cannot be used, with a message meant for the user."""


def read_prompt_file(path: str | os.PathLike[str]) -> list[str]:
    """The prompts of the file at `path`, in order, by the module's rule; PromptFileError when there are none."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise PromptFileError(f"cannot read prompts file {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise PromptFileError(f"prompts file {path} is not UTF-8 text: {error}") from None
    prompts = prompt_lines("\n".join(lines))
    if not prompts:
        raise PromptFileError(f"prompts file {path} holds no prompts ({RULE})")
    return prompts


def prompt_lines(text: str) -> list[str]:
    """The prompts of `text` by the module's rule (a text box's value, a file's content)."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
