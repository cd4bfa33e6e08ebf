"""The K2 chat layer: tokenizer, prompt rendering/encoding, tool-call and reasoning parsers.

Imports nothing from kserve.server / kserve.engine / kserve.model and no torch.
"""

from kserve.chat.dialect import (
    DIALECTS,
    ChatDialect,
    HistoryReasoning,
    ToolDeclarationFormat,
    detect_dialect,
    dialect_named,
)
from kserve.chat.reasoning import ReasoningDelta, StreamingReasoningParser, split_reasoning
from kserve.chat.template import ChatTemplate, render_prompt
from kserve.chat.tokenizer import IncrementalDetokenizer, KimiTokenizer, load_tokenizer
from kserve.chat.tool_declaration_ts import ToolDeclarationError, deep_sorted, encode_tools_typescript
from kserve.chat.tool_ids import normalize_tool_call_ids
from kserve.chat.tool_parser import (
    StreamDelta,
    StreamingToolParser,
    ToolCall,
    ToolCallDelta,
    ToolParseResult,
    parse_tool_calls,
    parse_tool_output,
)

__all__ = [
    "DIALECTS",
    "ChatDialect",
    "ChatTemplate",
    "HistoryReasoning",
    "IncrementalDetokenizer",
    "KimiTokenizer",
    "ReasoningDelta",
    "StreamDelta",
    "StreamingReasoningParser",
    "StreamingToolParser",
    "ToolCall",
    "ToolCallDelta",
    "ToolDeclarationError",
    "ToolDeclarationFormat",
    "ToolParseResult",
    "deep_sorted",
    "detect_dialect",
    "dialect_named",
    "encode_tools_typescript",
    "load_tokenizer",
    "normalize_tool_call_ids",
    "parse_tool_calls",
    "parse_tool_output",
    "render_prompt",
    "split_reasoning",
]
