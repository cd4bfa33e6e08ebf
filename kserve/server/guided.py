"""The seam between request fields and grammar-masked decoding (filled in by the grammar work, issue 6)."""

from __future__ import annotations

from typing import Any

from kserve.server.protocol import ResponseFormat


def guided_decoding_request(
    response_format: ResponseFormat | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict,
    parallel_tool_calls: bool | None,
    *,
    guided_decoding: bool,
    tool_grammar: bool,
) -> Any:
    """What to put in `SamplingParams.guided` for this request; None means unconstrained decoding.

    Inputs are already validated: tools carry valid schemas, tool_choice names a declared tool, a
    json_schema response_format has a valid schema. `guided_decoding` / `tool_grammar` are the
    `--guided-decoding` / `--tool-grammar` switches.
    """
    return None
