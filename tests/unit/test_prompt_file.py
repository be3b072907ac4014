"""The one prompts-file rule of the queue, the demo and the workload benchmark (carnator_core.prompt_file)."""

from __future__ import annotations

import pytest

from carnator_core.prompt_file import PromptFileError, read_prompt_file


def test_one_prompt_per_line_blank_lines_and_comments_skipped(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_bytes("# a comment\n  a red ball rolls left  \n\n   \n  # an indented comment\r\n"
                     "a café at night # not a comment here\r\nlast line without newline".encode())
    assert read_prompt_file(path) == ["a red ball rolls left", "a café at night # not a comment here",
                                      "last line without newline"]
    assert read_prompt_file(str(path)) == read_prompt_file(path)  # a str or a Path


@pytest.mark.parametrize(("content", "message"), [
    (None, "cannot read prompts file"),
    (b"", "holds no prompts"),
    (b"# only a comment\n\n  \n", "holds no prompts"),
    (b"a caf\xe9\n", "is not UTF-8 text"),
])
def test_unusable_file_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "prompts.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(PromptFileError, match=message) as raised:
        read_prompt_file(path)
    assert str(path) in str(raised.value) and isinstance(raised.value, ValueError)
