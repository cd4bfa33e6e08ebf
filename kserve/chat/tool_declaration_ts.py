"""TypeScript-style tool declarations: the ``tools_ts_str`` that Kimi K2.5 / K2.6 / K2.7-Code templates print.

Written to give, byte for byte, what Moonshot's tokenizer wrapper passes its templates: one ``type NAME = (_: {...})
=> any;`` per function tool inside ``namespace functions``, required parameters first, ``$defs`` as interfaces.
Schemas that wrapper cannot encode (an enum value of the wrong type, an unsupported ``$ref``...) raise here too, so
the caller falls back to compact JSON exactly as it does. The input is expected already deep-sorted (``deep_sorted``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

INDENT = "  "
FIELD_SEPARATOR = ",\n"
ROOT_INTERFACE = "parameters"  # the name a self-referencing ("$ref": "#") parameter object gets
DEFS_REF_PREFIX = "#/$defs/"

# Which keywords a scalar or an array shows as a "// key: value" comment line.
_STRING_CONSTRAINTS = ("maxLength", "minLength", "pattern")
_NUMBER_CONSTRAINTS = ("maximum", "minimum")
_ARRAY_CONSTRAINTS = ("minItems", "maxItems")
# A `"type": [...]` list is written as a union of these spellings; any other member is refused.
_UNION_MEMBER_TEXT = MappingProxyType({
    "string": "string", "number": "number", "integer": "number", "boolean": "boolean", "null": "null",
    "object": "{}", "array": "Array<any>",
})


class ToolDeclarationError(ValueError):
    """A tool schema the TypeScript encoding does not support (the caller falls back to JSON)."""


def deep_sorted(value: Any) -> Any:
    """``value`` with every dict's keys sorted, recursively through dicts and lists (tuples are left as they are)."""
    if isinstance(value, dict):
        return {key: deep_sorted(value[key]) for key in sorted(value)}
    if isinstance(value, list):
        return [deep_sorted(item) for item in value]
    return value


def _comment_lines(text: Any, indent: str) -> str:
    """``// `` before every line of ``text``; blank lines stay blank (no indent, no slashes)."""
    if not isinstance(text, str):
        raise ToolDeclarationError(f"a description must be a string, got {type(text).__name__}")
    return "\n".join(f"{indent}// {line}" if line else "" for line in text.split("\n"))


def _as_text(value: Any) -> str:
    """A type's spelling where it is joined or concatenated: a non-string ``type`` keyword fails there."""
    if not isinstance(value, str):
        raise ToolDeclarationError(f"type name {value!r} is not a string")
    return value


# -- parsed schema nodes -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Node:
    """A parsed schema: what its comment shows (description, constraints) and how its type is spelled."""

    description: Any = ""
    constraints: tuple[tuple[str, Any], ...] = ()

    def comments(self, indent: str) -> str:
        """The comment lines written above a field (or array item) of this type, each ending in a newline."""
        lines = []
        if self.description:
            lines.append(_comment_lines(self.description, indent))
        if self.constraints:
            lines.append(indent + "// " + ", ".join(f"{key}: {value}" for key, value in self.constraints))
        return "".join(line + "\n" for line in lines)

    def spell(self, indent: str) -> Any:
        raise NotImplementedError


@dataclass(frozen=True)
class _Scalar(_Node):
    type_name: Any = "any"  # whatever the schema said; only "integer" is renamed

    def spell(self, indent: str) -> Any:
        return "number" if self.type_name == "integer" else self.type_name


@dataclass(frozen=True)
class _Reference(_Node):
    target: str = ""

    def spell(self, indent: str) -> str:
        return self.target


@dataclass(frozen=True)
class _Enum(_Node):
    values: Any = ()

    def spell(self, indent: str) -> str:
        # Strings are quoted as they are (no escaping); everything else is Python's str(): None, True, 1.5.
        return " | ".join(f'"{value}"' if isinstance(value, str) else str(value) for value in self.values)


@dataclass(frozen=True)
class _AnyOf(_Node):
    options: tuple[_Node, ...] = ()

    def spell(self, indent: str) -> str:
        return " | ".join(_as_text(option.spell(indent)) for option in self.options)


@dataclass(frozen=True)
class _TypeUnion(_Node):
    members: tuple[str, ...] = ()

    def spell(self, indent: str) -> str:
        return " | ".join(self.members)


@dataclass(frozen=True)
class _Array(_Node):
    item: _Node = _Scalar()

    def spell(self, indent: str) -> str:
        inner = indent + INDENT
        item_comments = self.item.comments(inner)
        if item_comments:  # a commented item type goes on its own lines
            return f"Array<\n{item_comments}{inner}{_as_text(self.item.spell(inner))}\n{indent}>"
        return f"Array<{self.item.spell(indent)}>"


@dataclass(frozen=True)
class _Field:
    name: str
    node: _Node
    optional: bool
    default: Any = None

    def declaration(self, indent: str) -> str:
        text = self.node.comments(indent)
        if self.default is not None:
            # Numbers and booleans as Python writes them (True, 2.5), anything else as JSON.
            shown = repr(self.default) if isinstance(self.default, (int, float)) else json.dumps(
                self.default, ensure_ascii=False)
            text += f"{indent}// Default: {shown}\n"
        return text + f"{indent}{self.name}{'?' if self.optional else ''}: {self.node.spell(indent)}"


@dataclass(frozen=True)
class _Object(_Node):
    fields: tuple[_Field, ...] = ()
    extra: Any = None  # additionalProperties: None (absent), True, False, a parsed _Node, or an unsupported value

    def spell(self, indent: str) -> str:
        inner = indent + INDENT
        ordered = sorted((f for f in self.fields if not f.optional), key=lambda f: f.name)
        ordered += sorted((f for f in self.fields if f.optional), key=lambda f: f.name)
        lines = [f.declaration(inner) for f in ordered]
        if self.extra is not None:
            lines.append(f"{inner}[k: string]: {self._extra_type(inner)}")
        if not lines:
            return "{}"
        return "{\n" + FIELD_SEPARATOR.join(lines) + f"\n{indent}}}"

    def _extra_type(self, indent: str) -> Any:
        if self.extra is True:
            return "any"
        if self.extra is False:
            return "never"
        if isinstance(self.extra, _Node):
            return self.extra.spell(indent)
        raise ToolDeclarationError(f"unsupported additionalProperties: {self.extra!r}")


# -- parsing -----------------------------------------------------------------------------------------------------

class _SchemaReader:
    """Parses one function's parameter schemas; collects ``$defs`` as it meets them (one reader per function)."""

    def __init__(self) -> None:
        self.definitions: dict[str, Any] = {}
        self.refers_to_root = False

    def parse(self, schema: Any) -> _Node:
        if isinstance(schema, bool):  # true accepts anything; false is written as null
            return _Scalar(type_name="any" if schema else "null")
        if not isinstance(schema, dict):
            raise ToolDeclarationError(f"a schema must be an object or a boolean, got {type(schema).__name__}")
        description = schema.get("description", "")
        if "$ref" in schema:
            return _Reference(description, target=self._resolve(schema["$ref"]))
        if "anyOf" in schema:
            return _AnyOf(description, options=tuple(self.parse(option) for option in schema["anyOf"]))
        if "enum" in schema:
            return _enum(schema)
        if "type" in schema:
            type_name = schema["type"]
            if isinstance(type_name, list):
                return _type_union(schema)
            if type_name == "object":
                return self.parse_object(schema)
            if type_name == "array":
                items = schema.get("items")
                return _Array(description, _constraints(schema, _ARRAY_CONSTRAINTS),
                              item=self.parse(items) if items else _Scalar())
            allowed = (_STRING_CONSTRAINTS if type_name == "string"
                       else _NUMBER_CONSTRAINTS if type_name in ("number", "integer") else ())
            return _Scalar(description, _constraints(schema, allowed), type_name=type_name)
        if not schema:
            return _Scalar()
        raise ToolDeclarationError(f"invalid JSON Schema object: {schema}")

    def parse_object(self, schema: Any) -> _Object:
        """An object schema; also how a function's ``parameters`` is read, whatever its ``type`` says."""
        if not isinstance(schema, dict):
            raise ToolDeclarationError(f"an object schema must be an object, got {type(schema).__name__}")
        description = schema.get("description", "")
        if not schema:
            return _Object(description)
        definitions = schema.get("$defs")
        if definitions:
            if not isinstance(definitions, dict):
                raise ToolDeclarationError("$defs must be an object")
            self.definitions.update(definitions)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            extra = self.parse(extra)
        if "properties" not in schema:
            return _Object(description, extra=extra)
        properties = schema["properties"]
        if not isinstance(properties, dict):
            raise ToolDeclarationError("properties must be an object")
        required = set(schema.get("required", []))
        fields = tuple(
            _Field(name, self.parse(prop), optional=name not in required,
                   default=prop.get("default") if isinstance(prop, dict) else None)
            for name, prop in properties.items()
        )
        return _Object(description, fields=fields, extra=extra)

    def _resolve(self, ref: Any) -> str:
        """The type name a ``$ref`` is written as; only ``#`` and ``#/$defs/NAME`` (already seen) are supported."""
        if ref == "#":
            self.refers_to_root = True
            return ROOT_INTERFACE
        if not isinstance(ref, str) or not ref.startswith(DEFS_REF_PREFIX):
            raise ToolDeclarationError(f"Unsupported reference format: {ref}")
        name = ref.split("/")[-1]
        if name not in self.definitions:
            raise ToolDeclarationError(f"Reference not found: {ref}")
        target = self.definitions[name]
        if not isinstance(target, dict):
            raise ToolDeclarationError(f"definition {name!r} is not an object")
        return ROOT_INTERFACE if target.get("$self_ref") else name


def _constraints(schema: dict, allowed: tuple[str, ...]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((key, value) for key, value in schema.items() if key in allowed))


def _enum(schema: dict) -> _Enum:
    values = schema["enum"]
    if "type" in schema:
        declared = schema["type"]
        if isinstance(declared, list):  # one type, or one type and "null"
            if len(declared) == 2 and "null" in declared:
                declared = declared[0] if declared[0] != "null" else declared[1]
            elif len(declared) == 1:
                declared = declared[0]
            else:
                raise ToolDeclarationError(f"Enum type {declared} is not supported")
        accepts = {"string": (str,), "number": (int, float), "integer": (int,), "boolean": (bool,)}
        expected = accepts.get(declared) if isinstance(declared, str) else None
        for value in values:
            if value is not None and expected is not None and not isinstance(value, expected):
                raise ToolDeclarationError(f"Enum value {value} is not a {declared}")
    return _Enum(schema.get("description", ""), values=values)


def _type_union(schema: dict) -> _TypeUnion:
    members = []
    for member in schema["type"]:
        if not isinstance(member, str) or member not in _UNION_MEMBER_TEXT:
            raise ToolDeclarationError(f"unsupported type in a type list: {member!r}")
        members.append(_UNION_MEMBER_TEXT[member])
    return _TypeUnion(schema.get("description", ""), members=tuple(members))


# -- functions and the tool list ---------------------------------------------------------------------------------

def _function_declaration(function: dict) -> str:
    reader = _SchemaReader()
    root = reader.parse_object(function.get("parameters") or {})
    blocks: list[str] = []
    # Only a reference met while reading the parameters themselves makes the root an interface ($defs come later).
    root_is_interface = reader.refers_to_root
    if root_is_interface:
        # The root interface lists its fields in declaration order and without an index signature.
        body = FIELD_SEPARATOR.join(f.declaration(INDENT) for f in root.fields)
        blocks.append(f"interface {ROOT_INTERFACE} {{" + (f"\n{body}\n" if body else "") + "}")
    for name, schema in list(reader.definitions.items()):
        spelled = reader.parse(schema).spell("")
        if not isinstance(schema, dict):
            raise ToolDeclarationError(f"definition {name!r} is not an object")
        description = schema.get("description", "")
        heading = _comment_lines(description, "") + "\n" if description else ""
        blocks.append(f"{heading}interface {name} {spelled}")
    name = function.get("name", "function")
    signature = ROOT_INTERFACE if root_is_interface else root.spell("")
    description = function.get("description")
    parts = ["\n".join(blocks), _comment_lines(description, "") if description else "",
             f"type {name} = (_: {signature}) => any;"]
    return "\n".join(part for part in parts if part)


def encode_tools_typescript(tools: list[dict] | None) -> str:
    """The ``# Tools`` block for the function tools in ``tools`` ("" when there are none).

    Tools of another type (``_plugin``...) and functions without a definition are skipped. Raises
    ``ToolDeclarationError`` (or, for malformed input, another exception) where the official encoder fails.
    """
    if not tools:
        return ""
    declarations = []
    for tool in tools:
        if not isinstance(tool, dict):
            raise ToolDeclarationError(f"a tool must be an object, got {type(tool).__name__}")
        if tool.get("type") != "function":
            continue
        function = tool.get("function", {})
        if function:
            if not isinstance(function, dict):
                raise ToolDeclarationError("a tool's function must be an object")
            declarations.append(_function_declaration(function))
    if not declarations:
        return ""
    return "# Tools\n\n## functions\nnamespace functions {\n" + "\n".join(declarations) + "\n}\n"
