"""TypeScript tool declarations: every shared golden byte-exact, the two refused lists refused, and random schemas
encoded exactly as Moonshot's own encoder does (loaded from ../shared as an oracle) or refused where it fails."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_chat_k25_support import TS_GOLDENS, official_typescript_encoder, read_jsonl, sort_keys

from kserve.chat import ChatTemplate, ToolDeclarationError, deep_sorted, encode_tools_typescript
from kserve.chat.dialect import K2_6, prepare_tools


def test_every_ts_golden():
    rows = read_jsonl(TS_GOLDENS)
    assert len(rows) == 30
    passed = 0
    for row in rows:
        tools = deep_sorted(row["tools"])
        if "error" in row:
            with pytest.raises(ToolDeclarationError):
                encode_tools_typescript(tools)
        else:
            assert encode_tools_typescript(tools) == row["output"], row["id"]
        passed += 1
    assert passed == 30


def test_refused_schemas_fall_back_to_compact_sorted_json():
    bad = next(r for r in read_jsonl(TS_GOLDENS) if r["id"] == "bad_enum")
    prepared = prepare_tools(K2_6, bad["tools"])
    assert prepared.typescript is None and prepared.tools == sort_keys(bad["tools"])
    text = ChatTemplate(dialect="k2.6").render([{"role": "user", "content": "hi"}], bad["tools"])
    assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"function":{"description":"Enum values')


def test_deep_sorted_sorts_every_dict_and_keeps_list_order():
    value = {"b": [{"z": 1, "a": {"d": 0, "c": 0}}, 3], "a": (2, {"y": 0, "x": 0})}
    out = deep_sorted(value)
    assert list(out) == ["a", "b"] and list(out["b"][0]) == ["a", "z"] and list(out["b"][0]["a"]) == ["c", "d"]
    assert out["a"] == (2, {"y": 0, "x": 0}) and list(out["a"][1]) == ["y", "x"]  # tuples are not entered
    assert deep_sorted(None) is None


def test_empty_and_plugin_only_lists():
    assert encode_tools_typescript([]) == encode_tools_typescript(None) == ""
    assert encode_tools_typescript([{"type": "_plugin", "_plugin": {"name": "web_search"}}]) == ""


def test_plugin_only_tools_still_get_a_json_declaration():
    """The encoder gives "" for them, which the templates treat as missing: compact JSON, as Moonshot's class does."""
    tools = [{"type": "_plugin", "_plugin": {"name": "web_search"}}]
    for dialect in ("k2.5", "k2.6", "k2.7-code"):
        text = ChatTemplate(dialect=dialect).render([{"role": "user", "content": "hi"}], tools)
        assert text.startswith('<|im_system|>tool_declare<|im_middle|>[{"_plugin":{"name":"web_search"},'
                               '"type":"_plugin"}]<|im_end|>')
    assert not ChatTemplate(dialect="k2.6").render([{"role": "user", "content": "hi"}], []).startswith("<|im_system|>")


# -- random schemas against the official encoder -----------------------------------------------------------------

_names = st.sampled_from(["a", "b", "city", "x_1", "Zed", "名字"])
_descriptions = st.one_of(st.just(""), st.sampled_from(["one line", "two\nlines", "gap\n\nhere", " spaced "]))
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([0.5, 2.0]),
                     st.sampled_from(["s", "é", 'q"uote']))


def _with_description(schema: dict, description: str) -> dict:
    return {**schema, "description": description} if description else schema


@st.composite
def _leaf(draw):
    kind = draw(st.sampled_from(["string", "integer", "number", "boolean", "null", "enum", "union", "empty", "bool",
                                 "bad_type"]))
    if kind == "bool":
        return draw(st.booleans())
    if kind == "empty":
        return {}
    if kind == "bad_type":
        return {"type": draw(st.sampled_from([None, 3, "weird"]))}
    if kind == "enum":
        schema = {"enum": draw(st.lists(_scalars, min_size=1, max_size=3))}
        if draw(st.booleans()):
            schema["type"] = draw(st.sampled_from(["string", "integer", "number", "boolean", ["string", "null"],
                                                   ["integer"], ["a", "b", "c"]]))
    elif kind == "union":
        schema = {"type": draw(st.lists(st.sampled_from(["string", "integer", "null", "object", "array", "any"]),
                                        min_size=1, max_size=3))}
    else:
        schema = {"type": kind}
        for key in {"string": ["maxLength", "minLength", "pattern"], "integer": ["maximum", "minimum"],
                    "number": ["maximum", "minimum"]}.get(kind, []):
            if draw(st.integers(0, 2)) == 0:
                schema[key] = draw(st.one_of(st.integers(0, 9), st.just("^[a-z]+$")))
    if draw(st.booleans()):
        schema["default"] = draw(st.one_of(_scalars, st.lists(_scalars, max_size=2),
                                           st.dictionaries(_names, _scalars, max_size=2)))
    return _with_description(schema, draw(_descriptions))


def _composite(children):
    return st.one_of(
        st.builds(lambda props, req, extra, desc: _with_description(
            {"type": "object", "properties": props, "required": req, **extra}, desc),
            st.dictionaries(_names, children, max_size=3), st.lists(_names, max_size=2),
            st.sampled_from([{}, {"additionalProperties": True}, {"additionalProperties": False},
                             {"additionalProperties": {"type": "string"}}, {"additionalProperties": "yes"}]),
            _descriptions),
        st.builds(lambda items, extra, desc: _with_description({"type": "array", **items, **extra}, desc),
                  st.one_of(st.just({}), children.map(lambda c: {"items": c})),
                  st.sampled_from([{}, {"minItems": 1}, {"maxItems": 4, "minItems": 0}]), _descriptions),
        st.builds(lambda options, desc: _with_description({"anyOf": options}, desc),
                  st.lists(children, min_size=1, max_size=3), _descriptions),
        st.sampled_from([{"$ref": "#"}, {"$ref": "#/$defs/Item"}, {"$ref": "#/$defs/Missing"},
                         {"$ref": "#/definitions/X"}, {"$ref": "#/$defs/Item", "description": "an item"}]),
    )


_schemas = st.recursive(_leaf(), _composite, max_leaves=8)


@st.composite
def _tool_lists(draw):
    tools = []
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["function", "function", "function", "_plugin"]))
        if kind == "_plugin":
            tools.append({"type": "_plugin", "_plugin": {"name": "web_search"}})
            continue
        function = {"name": draw(_names)}
        if draw(st.booleans()):
            function["description"] = draw(_descriptions)
        shape = draw(st.sampled_from(["object", "none", "null", "root"]))
        if shape == "object":
            params = {"type": "object", "properties": draw(st.dictionaries(_names, _schemas, max_size=4)),
                      "required": draw(st.lists(_names, max_size=3))}
            if draw(st.booleans()):
                params["$defs"] = {"Item": draw(_schemas), "Other": {"type": "object", "description": "other",
                                                                     "properties": {"n": {"type": "integer"}}}}
            if draw(st.booleans()):
                params["additionalProperties"] = draw(st.sampled_from([True, False, {"type": "number"}]))
            function["parameters"] = params
        elif shape == "null":
            function["parameters"] = None
        elif shape == "root":
            function["parameters"] = draw(_schemas)
        tools.append({"type": "function", "function": function})
    return tools


def _outcome(encode, tools):
    try:
        return ("ok", encode(tools))
    except Exception:  # both refuse the same lists (the exception types may differ)
        return ("error", None)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tools=_tool_lists())
def test_random_schemas_match_the_official_encoder(tools):
    official = official_typescript_encoder()
    tools = sort_keys(tools)
    assert _outcome(encode_tools_typescript, tools) == _outcome(official, tools)
