"""Prompt skeletons: the structure of a request with its content dropped.

A request (system + messages) becomes a tree of roles, XML-like tags, fenced code blocks
(with their language), JSON objects/arrays, Markdown headings (as nested sections), lists
and tables. Its depth is the `skeleton_complexity`; its id is a stable hash of the
structure (runs of identical siblings folded, so a template keeps one id whatever number
of items it is filled with).

NOTE: linear time and never raising on user text. Work is bounded: at most MAX_DEPTH
levels, MAX_NODES nodes, MAX_INPUT_CHARS characters per request, and JSON scanning
limited to a budget proportional to the input. Torch-free.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

MAX_DEPTH = 64
MAX_NODES = 10_000
MAX_INPUT_CHARS = 4 << 20
VOID_TAGS = frozenset({"br", "hr", "img", "input", "meta", "link", "area", "base", "col",
                       "embed", "source", "track", "wbr"})

_FENCE = re.compile(r"[ \t]{0,3}(`{3,}|~{3,})[ \t]*([\w+#.-]{0,32})")
_HEADING = re.compile(r"[ \t]{0,3}(#{1,6})(?:[ \t]|$)")
_LIST_ITEM = re.compile(r"([ \t]*)([-*+]|\d{1,9}[.)])[ \t]+")
_TABLE_ROW = re.compile(r"[ \t]*\|.*\|[ \t]*$")
_TABLE_SEPARATOR = re.compile(r"[ \t]*\|?[ \t]*:?-{3,}")
# [^<>] stops at the next '<', so all attempts together scan each character a bounded
# number of times: linear in the line's length.
_TAG = re.compile(r"<(/?)([A-Za-z][\w.:-]{0,63})((?:\s[^<>]{0,512}?)?)\s*(/?)>")


class Node:
    __slots__ = ("kind", "attr", "children", "depth")

    def __init__(self, kind: str, attr: str = "", depth: int = 0):
        self.kind = kind
        self.attr = attr
        self.children: list[Node] = []
        self.depth = depth

    def label(self) -> str:
        return f"{self.kind} {self.attr}".rstrip()

    def signature(self) -> str:
        """Canonical form: runs of identical sibling signatures folded into one."""
        parts: list[str] = []
        for child in self.children:
            sig = child.signature()
            if not parts or parts[-1] != sig:
                parts.append(sig)
        inner = ",".join(parts)
        return f"{self.kind}:{self.attr}({inner})" if inner else f"{self.kind}:{self.attr}"


@dataclass(slots=True)
class Skeleton:
    root: Node
    depth: int
    node_count: int
    skeleton_id: str
    truncated: bool

    def render(self) -> str:
        lines: list[str] = []
        stack = [(self.root, 0)]
        while stack:
            node, indent = stack.pop()
            lines.append("  " * indent + node.label())
            stack.extend((child, indent + 1) for child in reversed(node.children))
        return "\n".join(lines)


class _Builder:
    def __init__(self):
        self.root = Node("request")
        self.node_count = 1
        self.max_depth = 0
        self.truncated = False
        self.budget = 0          # characters left for JSON scanning

    def add(self, parent: Node, kind: str, attr: str = "") -> Node | None:
        """A new child, or None when a cap is reached (the structure is then truncated)."""
        if parent.depth >= MAX_DEPTH or self.node_count >= MAX_NODES:
            self.truncated = True
            return None
        node = Node(kind, attr, parent.depth + 1)
        parent.children.append(node)
        self.node_count += 1
        self.max_depth = max(self.max_depth, node.depth)
        return node


def skeleton_of_request(system=None, messages=()) -> Skeleton:
    """Skeleton of a Messages/Chat request: `system` (str or blocks) and messages."""
    builder = _Builder()
    remaining = MAX_INPUT_CHARS
    entries = []
    if system:
        entries.append(("system", system))
    for message in messages or ():
        if isinstance(message, dict):
            entries.append((str(message.get("role", "user"))[:32], message.get("content", "")))
    for role, content in entries:
        node = builder.add(builder.root, "message", role)
        if node is None:
            break
        remaining = _content(builder, node, content, remaining)
    depth = builder.max_depth
    digest = hashlib.blake2b(builder.root.signature().encode(), digest_size=6).hexdigest()
    return Skeleton(builder.root, depth, builder.node_count, digest, builder.truncated)


def skeleton_of_text(text: str) -> Skeleton:
    return skeleton_of_request(messages=[{"role": "user", "content": text}])


def _content(builder: _Builder, parent: Node, content, remaining: int) -> int:
    if isinstance(content, str):
        text = content[:max(remaining, 0)]
        _parse_text(builder, parent, text)
        return remaining - len(text)
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list):
        return remaining
    for block in content:
        if not isinstance(block, dict):
            continue
        kind = str(block.get("type", "text"))[:32]
        if kind == "text":
            remaining = _content(builder, parent, block.get("text", ""), remaining)
            continue
        node = builder.add(parent, kind)
        if node is None:
            continue
        if kind == "tool_result":
            remaining = _content(builder, node, block.get("content", ""), remaining)
        elif kind == "tool_use" and isinstance(block.get("input"), (dict, list)):
            _python_json(builder, node, block["input"])
    return remaining


def _python_json(builder: _Builder, parent: Node, value) -> None:
    stack = [(parent, value)]
    while stack:
        node, item = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        child = builder.add(node, "json", "object" if isinstance(item, dict) else "array")
        if child is None:
            continue
        for sub in children:
            if isinstance(sub, (dict, list)):
                stack.append((child, sub))


class _Frame:
    __slots__ = ("node", "kind", "key")

    def __init__(self, node: Node, kind: str, key):
        self.node, self.kind, self.key = node, kind, key  # key: tag name / heading level / indent


def _parse_text(  # noqa: C901 - one branch per kind of Markdown block
        builder: _Builder, parent: Node, text: str) -> None:
    builder.budget += 2 * len(text) + 4096
    stack = [_Frame(parent, "root", None)]
    fence: tuple[str, Node | None, int] | None = None  # (marker, code node, start offset)
    last_table_line = -2
    pos, line_no, size = 0, 0, len(text)
    while pos < size:
        end = text.find("\n", pos)
        end = size if end < 0 else end
        line = text[pos:end]
        line_start, pos, line_no = pos, end + 1, line_no + 1
        if fence is not None:
            marker, code, body_start = fence
            stripped = line.strip()
            if stripped.startswith(marker) and not stripped.strip(marker[0]):
                if code is not None and code.attr == "json":
                    _scan_json(builder, code, text, body_start, line_start)
                fence = None
            continue
        match = _FENCE.match(line)
        if match:
            _close_lists(stack, line)
            fence = (match.group(1), builder.add(stack[-1].node, "code", match.group(2).lower()),
                     pos)
            continue
        match = _HEADING.match(line)
        if match:
            _open_section(builder, stack, len(match.group(1)))
            _scan_tags(builder, stack, line, match.end())
            continue
        if _TABLE_ROW.match(line):
            if last_table_line != line_no - 1:
                _close_lists(stack, line)
                builder.add(stack[-1].node, "table", f"{max(line.count('|') - 1, 1)} columns")
            last_table_line = line_no
            continue
        match = _LIST_ITEM.match(line)
        if match and not _TABLE_SEPARATOR.match(line):
            _open_item(builder, stack, len(match.group(1).expandtabs(4)),
                       "ordered" if match.group(2)[0].isdigit() else "unordered")
            _scan_tags(builder, stack, line, match.end())
            continue
        stripped = line.lstrip()
        if not stripped:
            continue
        _close_lists(stack, line)
        if stripped[0] in "{[":
            consumed = _scan_json(builder, stack[-1].node, text,
                                  line_start + len(line) - len(stripped), size)
            if consumed is not None:
                next_newline = text.find("\n", consumed)
                pos = size if next_newline < 0 else next_newline + 1
                continue
        _scan_tags(builder, stack, line, 0)
    if fence is not None and fence[1] is not None and fence[1].attr == "json":
        _scan_json(builder, fence[1], text, fence[2], size)


def _close_lists(stack: list[_Frame], line: str) -> None:
    """A line that is not indented ends every open list."""
    if line[:1] in (" ", "\t"):
        return
    while stack[-1].kind in ("list", "item"):
        stack.pop()


def _open_section(builder: _Builder, stack: list[_Frame], level: int) -> None:
    while stack[-1].kind in ("list", "item") or (
            stack[-1].kind == "section" and stack[-1].key >= level):
        stack.pop()
    node = builder.add(stack[-1].node, "heading", f"h{level}")
    if node is not None:
        stack.append(_Frame(node, "section", level))


def _open_item(builder: _Builder, stack: list[_Frame], indent: int, ordered: str) -> None:
    while True:
        top = stack[-1]
        if top.kind == "item" and stack[-2].key >= indent:
            stack.pop()
        elif top.kind == "list" and top.key > indent:
            stack.pop()
        else:
            break
    if stack[-1].kind != "list":
        node = builder.add(stack[-1].node, "list", ordered)
        if node is None:
            return
        stack.append(_Frame(node, "list", indent))
    item = builder.add(stack[-1].node, "item")
    if item is not None:
        stack.append(_Frame(item, "item", indent))


def _scan_tags(builder: _Builder, stack: list[_Frame], line: str, start: int) -> None:
    if "<" not in line:
        return
    for match in _TAG.finditer(line, start):
        closing, name, _, self_closing = match.groups()
        name = name.lower()
        if closing:
            for i in range(len(stack) - 1, 0, -1):
                if stack[i].kind == "tag" and stack[i].key == name:
                    del stack[i:]
                    break
            continue
        node = builder.add(stack[-1].node, "tag", name)
        if node is not None and not self_closing and name not in VOID_TAGS:
            stack.append(_Frame(node, "tag", name))


def _scan_json(builder: _Builder, parent: Node, text: str, start: int, stop: int) -> int | None:
    """Structure of the JSON value at text[start] ('{' or '['), or None if it does not close.

    Only brackets and strings are tracked: scalars and keys are content. Returns the
    offset after the value. Scanning spends the builder's budget, so the total stays linear.
    """
    if start >= stop or text[start] not in "{[" or builder.budget <= 0:
        return None
    limit = min(stop, start + builder.budget)
    opened: list[str] = []
    brackets: list[str] = []  # the value's bracket sequence, replayed into nodes if it closes
    i, in_string = start, False
    while i < limit:
        char = text[i]
        if in_string:
            if char == "\\":
                i += 1
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            opened.append("}" if char == "{" else "]")
            brackets.append(char)
        elif char in "}]":
            if not opened or opened.pop() != char:
                break
            brackets.append(char)
            if not opened:
                builder.budget -= i + 1 - start
                _build_json(builder, parent, brackets)
                return i + 1
        i += 1
    builder.budget -= i - start
    return None


def _build_json(builder: _Builder, parent: Node, brackets: list[str]) -> None:
    """Object/array nodes of a balanced bracket sequence."""
    stack = [parent]
    for char in brackets:
        if char in "{[":
            node = builder.add(stack[-1], "json", "object" if char == "{" else "array")
            stack.append(node if node is not None else stack[-1])
        else:
            stack.pop()
