"""Grammar-masked decoding for K2 with xgrammar: JSON schemas, tool_choice and strict tools.

A `GrammarSpec` is compiled once (cached by spec) by a `GrammarCompiler` and turned into one `TokenMatcher`, the
engine's TokenConstraint, per generated sequence. Tool-call markers can only appear where the grammar puts them.
xgrammar imports torch and transformers, so it is imported lazily. Details: docs/chat.md, 'Grammar'.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from kserve.chat.markers import (
    ARGUMENT_BEGIN,
    CALL_BEGIN,
    CALL_END,
    SECTION_BEGIN,
    SECTION_END,
    TOOL_MARKER_TOKENS,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Bounds that keep a random or confused model from looping forever inside a call header or JSON.
# One whitespace character per gap admits both compact JSON and K2's own `{"city": "Beijing"}`.
MAX_CALL_INDEX_DIGITS = 3
MAX_JSON_WHITESPACE = 1
# A JSON number's runs of digits (integer part, fraction, exponent): uint64 has 20, float64 17 significant.
MAX_NUMBER_DIGITS = 20

# The character classes xgrammar writes for JSON strings: unbounded, and length-bounded (minLength /
# maxLength). The bounded one admits raw control characters, and both admit UTF-16 surrogates, which
# are invalid in UTF-8: strict JSON parsers reject either. We narrow both to legal characters.
_XGRAMMAR_STRING_CHARS = (r'[^\0-\x1f\"\\\r\n]', r'[^\"\\\r\n]')
_STRICT_STRING_CHARS = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


class GrammarError(ValueError):
    """A schema or tool set that cannot be compiled into a grammar (a client error)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains. `payload` is compact JSON so specs hash and compare by value. Key order is
    kept: xgrammar binds an object's properties in the order its schema lists them, so sorted keys would force
    a model's arguments into alphabetical order.

    kind:
      - "json_schema": output is one JSON value matching payload (a schema).
      - "json_object": output is any JSON object.
      - "tools": output follows K2's tool-call format for the tools in payload, with `mode`
        "required" (one section of one or more calls, nothing else), "forced" (one call to the one
        tool in payload) or "auto" (free text; once a section opens, names and arguments are bound,
        and the turn ends with the section). An "auto" spec with an `answer` schema (a response format
        beside tools) allows a section or, instead of free text, one JSON value matching it.
    """

    kind: Literal["json_schema", "json_object", "tools"]
    payload: str = "null"
    mode: Literal["auto", "required", "forced"] = "auto"
    parallel_tool_calls: bool = True
    answer: str | None = None

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool) -> "GrammarSpec":
        return cls("json_schema", _compact_json(schema))

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls("json_object")

    @classmethod
    def tools(
        cls,
        tools: list[dict[str, Any]],
        mode: Literal["auto", "required", "forced"],
        parallel_tool_calls: bool = True,
        answer: dict[str, Any] | bool | None = None,
    ) -> "GrammarSpec":
        """`tools` are OpenAI tool objects. Every tool, strict or not, binds its name, and its arguments to its
        schema with objects closed (`json_value_ebnf`); `strict` only decides whether `auto` binds at all
        (`--tool-grammar off`, kserve/server/guided.py)."""
        functions = [_tool_function(t) for t in tools]
        if answer is not None and mode != "auto":
            raise GrammarError("an answer schema applies only when the model may answer instead of calling")
        return cls("tools", _compact_json(functions), mode, parallel_tool_calls,
                   None if answer is None else _compact_json(answer))


def _compact_json(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _tool_function(tool: dict[str, Any]) -> dict[str, Any]:
    fn = tool.get("function", tool)
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise GrammarError("every tool needs a function name")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object"}
    return {"name": name, "parameters": params}


class TokenMatcher:
    """One sequence's grammar state: the engine's TokenConstraint."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept_token(self, token_id: int) -> bool:
        return bool(self._matcher.accept_token(int(token_id)))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens > 0:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class CompiledGrammar:
    """A compiled spec; `SamplingParams.guided` holds one. Makes a fresh matcher per sequence."""

    def __init__(self, spec: GrammarSpec, compiled: Any) -> None:
        self.spec = spec
        self._compiled = compiled

    def make_constraint(self) -> TokenMatcher:
        import xgrammar as xgr

        return TokenMatcher(xgr.GrammarMatcher(self._compiled))


class GrammarCompiler:
    """Compiles GrammarSpecs against one tokenizer and caches the results by spec.

    Thread-safe: the server compiles in a worker thread, off the engine loop.
    """

    def __init__(self, tokenizer: Any, model_vocab_size: int, cache_size: int = 256) -> None:
        import xgrammar as xgr

        self._special = {name: tokenizer.special_ids[name] for name in TOOL_MARKER_TOKENS}
        self.tokenizer_info = build_tokenizer_info(tokenizer, model_vocab_size)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2)
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def marker_ids(self) -> dict[str, int]:
        return dict(self._special)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        try:
            compiled = CompiledGrammar(spec, self._compile(spec))
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError/ValueError/pydantic errors
            raise GrammarError(f"cannot compile a grammar for this request: {exc}") from exc
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec) -> Any:
        if spec.kind == "json_object":
            return self._compiler.compile_grammar(json_value_ebnf({"type": "object"}))
        if spec.kind == "json_schema":
            return self._compiler.compile_grammar(json_value_ebnf(json.loads(spec.payload)))
        return self._compiler.compile_structural_tag(self._tool_call_tag(spec))

    def _tool_call_tag(self, spec: GrammarSpec) -> Any:
        from xgrammar import structural_tag as st

        functions = json.loads(spec.payload)
        if not functions:
            raise GrammarError("tool_choice needs at least one tool")
        ids = self._special

        def call(fn: dict[str, Any]) -> Any:
            return st.SequenceFormat(
                elements=[
                    st.TokenFormat(token=ids[CALL_BEGIN]),
                    st.ConstStringFormat(value=f"functions.{fn['name']}:"),
                    st.RegexFormat(pattern=rf"[0-9]{{1,{MAX_CALL_INDEX_DIGITS}}}"),
                    st.TokenFormat(token=ids[ARGUMENT_BEGIN]),
                    st.GrammarFormat(grammar=json_value_ebnf(fn["parameters"])),
                    st.TokenFormat(token=ids[CALL_END]),
                ]
            )

        calls = [call(fn) for fn in functions]
        one_call = calls[0] if len(calls) == 1 else st.OrFormat(elements=calls)
        body = one_call
        if spec.parallel_tool_calls and spec.mode != "forced":
            body = st.PlusFormat(content=one_call)
        if spec.mode in ("required", "forced") or spec.answer is not None:
            fmt = st.SequenceFormat(
                elements=[st.TokenFormat(token=ids[SECTION_BEGIN]), body, st.TokenFormat(token=ids[SECTION_END])]
            )
            if spec.answer is not None:  # a section, or the answer in the response format
                answer = st.GrammarFormat(grammar=json_value_ebnf(json.loads(spec.answer)))
                fmt = st.OrFormat(elements=[fmt, answer])
        else:
            section = st.TagFormat(
                begin=st.TokenFormat(token=ids[SECTION_BEGIN]),
                content=body,
                end=st.TokenFormat(token=ids[SECTION_END]),
            )
            # K2 ends its turn after the tool-call section: one section, then only a stop token.
            fmt = st.TokenTriggeredTagsFormat(
                trigger_tokens=[ids[SECTION_BEGIN]],
                tags=[section],
                exclude_tokens=[ids[m] for m in TOOL_MARKER_TOKENS if m != SECTION_BEGIN],
                stop_after_first=True,
            )
        return st.StructuralTag(format=fmt)


def json_value_ebnf(schema: dict[str, Any] | bool) -> str:
    """EBNF for one JSON value matching `schema`, with bounded whitespace and strict strings. An object that
    lists `properties` and leaves `additionalProperties` unset admits no other key (xgrammar's `strict_mode`,
    as vLLM and SGLang compile schemas): an open key's free string lets a model that misreads a forced call
    write until the context ends (docs/server.md). Objects without `properties` stay free-form, and a schema
    with `patternProperties` keeps JSON Schema's default: xgrammar's strict mode would refuse the keys they match."""
    import xgrammar as xgr

    grammar = xgr.Grammar.from_json_schema(
        schema, any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE,
        strict_mode=not _uses_keyword(schema, "patternProperties"),
    )
    ebnf = _bound_number_digits(str(grammar))
    for loose in _XGRAMMAR_STRING_CHARS:
        ebnf = ebnf.replace(loose, _STRICT_STRING_CHARS)
    return ebnf


def _bound_number_digits(ebnf: str) -> str:
    """xgrammar's numbers take any count of digits, so a confused model can write one forever; cap each run.
    It writes a run as `[1-9] [0-9]*` in its two number rules, or as a one-digit rule repeated `{k, -1}` (after a
    `[1-9]` where it leads)."""
    cap = MAX_NUMBER_DIGITS
    lines = ebnf.split("\n")
    for i, line in enumerate(lines):
        if line.startswith(("basic_integer ::= ", "basic_number_2 ::= ")):
            lines[i] = line.replace("[1-9] [0-9]*", f"[1-9] [0-9]{{0, {cap - 1}}}")
    ebnf = "\n".join(lines)
    for digit in re.findall(r"^(\w+) ::= \(\(\[0-9\]\)\)$", ebnf, flags=re.M):
        ebnf = re.sub(rf"(\[1-9\] )?\b{digit}\{{(\d+), -1\}}",
                      lambda m: f"{m[1] or ''}{digit}{{{m[2]}, {cap - 1 if m[1] else cap}}}", ebnf)
    return ebnf


def _uses_keyword(schema: Any, keyword: str) -> bool:
    if isinstance(schema, dict):
        return keyword in schema or any(_uses_keyword(v, keyword) for v in schema.values())
    return isinstance(schema, list) and any(_uses_keyword(v, keyword) for v in schema)


def build_tokenizer_info(tokenizer: Any, model_vocab_size: int) -> Any:
    """xgrammar's view of the K2 vocabulary, padded to the model's vocab size (see module doc)."""
    import xgrammar as xgr

    stop_ids = list(tokenizer.stop_token_ids)
    markers = {tokenizer.special_ids[name]: name for name in TOOL_MARKER_TOKENS}
    vocab: list[bytes] = []
    for token_id in range(tokenizer.vocab_size):
        if token_id in markers:
            vocab.append(b"\x00" + markers[token_id].encode())
        elif token_id in stop_ids:
            vocab.append(b"\x00" + tokenizer.decode([token_id]).encode())
        elif tokenizer.is_special(token_id):
            vocab.append(b"")
        else:
            vocab.append(tokenizer.token_bytes(token_id))
    return xgr.TokenizerInfo(
        vocab,
        xgr.VocabType.RAW,
        vocab_size=max(model_vocab_size, len(vocab)),
        stop_token_ids=stop_ids,
    )
