"""Read a YAML file into plain data plus the line of every key, whatever the file holds.

    located = parse_yaml(decode(path.read_bytes(), "g.yaml"), "g.yaml")
    located.data["nodes"], located.line_of(("nodes", "actor", "devices"))

Graph and inventory files come from editors, PowerShell (UTF-16 by default), generators and
attackers, so every way a file can be wrong is a `GraphError` with file, line and key path:
- bytes: a byte-order mark selects UTF-8/16/32; other bytes must be UTF-8, and the message names
  the first bad byte and the fix (save the file as UTF-8);
- size: nesting deeper than `MAX_DEPTH` and documents whose aliases expand to more than
  `MAX_VALUES` values (the "billion laughs") are refused in time linear in the file; an alias that
  contains itself is refused;
- the line table records the lines of what the file *writes*, never of alias expansions: a key
  path inside an alias reports the line of the alias (the nearest key that has a line);
- merge keys (`<<: *base`, `<<: [*a, *b]`) work as in YAML 1.1: keys written in the mapping win,
  then the merged mappings in order; merged keys report the line of their `<<`;
- keys are scalars (`0x10:` and `1:20:` read as YAML 1.1 integers); a complex key (`? [a, b]`) and a
  scalar its tag cannot read (`!!int abc`) are problems.
"""

from __future__ import annotations

import codecs
from typing import Any

import yaml
from yaml.constructor import SafeConstructor

from flowrl.graph.errors import GraphError, Problem, clip, shown

Loc = tuple  # key path as a tuple of str / int

MAX_BYTES = 2 << 20
"""Largest file read (2 MiB); graph and inventory files are a few KiB. (PyYAML's scanner reads
about a megabyte a second, so this bounds the time a file can take.)"""
MAX_DEPTH = 64
"""Deepest nesting of mappings and lists, aliases expanded."""
MAX_VALUES = 10_000
"""Most values (keys, scalars, containers) a file may hold, as written and once its aliases are
expanded; graph files hold a few hundred."""

_BOMS = (  # UTF-32 first: its little-endian mark starts with UTF-16's
    (codecs.BOM_UTF32_LE, "utf-32", "UTF-32"), (codecs.BOM_UTF32_BE, "utf-32", "UTF-32"),
    (codecs.BOM_UTF8, "utf-8-sig", "UTF-8"),
    (codecs.BOM_UTF16_LE, "utf-16", "UTF-16"), (codecs.BOM_UTF16_BE, "utf-16", "UTF-16"),
)
SAVE_AS_UTF8 = ("save the file as UTF-8 (in an editor: save with encoding UTF-8; in PowerShell: "
                "`Set-Content -Encoding utf8` or `Out-File -Encoding utf8`)")


class Located:
    """Plain Python data from YAML plus the line of every key path written in the file."""

    def __init__(self, data: Any, lines: dict[Loc, int], file: str | None):
        self.data, self.lines, self.file = data, lines, file

    def line_of(self, loc: Loc) -> int | None:
        loc = tuple(loc)
        while loc:  # nearest enclosing key that has a line
            if loc in self.lines:
                return self.lines[loc]
            loc = loc[:-1]
        return self.lines.get(())


def _fail(message: str, fix: str, file: str | None, line: int | None, path: str = "") -> GraphError:
    return GraphError([Problem(path, message, fix, file, line)])


def decode(data: bytes, file: str | None = None) -> str:
    """File bytes -> text: a byte-order mark picks UTF-8/16/32, anything else must be UTF-8."""
    if len(data) > MAX_BYTES:
        raise _fail(f"file is {len(data):,} bytes; graph and inventory files are a few KiB "
                    f"(limit {MAX_BYTES:,})", "check that this is the file you meant", file, 1)
    for bom, codec, name in _BOMS:
        if data.startswith(bom):
            try:
                return data.decode(codec)
            except UnicodeDecodeError as e:
                line = data[: e.start].decode(codec, "replace").count("\n") + 1
                raise _fail(f"file starts with a {name} byte-order mark but byte {e.start} (line {line}) is not "
                            f"valid {name} ({e.reason})", SAVE_AS_UTF8, file, line) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        bad = data[e.start]
        if b"\x00" in data[:64]:
            guess = "it looks like UTF-16 or UTF-32 without a byte-order mark"
        else:
            guess = f"in Latin-1/Windows-1252 it would read {bytes([bad]).decode('cp1252', 'replace')!r}, so the file is probably in that encoding"
        raise _fail(f"file is not UTF-8: byte 0x{bad:02x} at line {line} cannot be decoded ({guess})",
                    SAVE_AS_UTF8, file, line) from None
    if "\x00" in text:
        line = text[: text.index("\x00")].count("\n") + 1
        raise _fail("file holds NUL bytes: it looks like UTF-16 or UTF-32 without a byte-order mark",
                    SAVE_AS_UTF8, file, line)
    return text


class _Loader(yaml.SafeLoader):
    """The safe loader, with nesting depth (the composer recurses) and the number of values
    bounded while composing, so that neither a deep nor a long file runs for long."""

    def __init__(self, text: str):
        super().__init__(text)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent, index):
        self._depth += 1
        self._nodes += 1
        try:
            if self._nodes > MAX_VALUES:
                mark = self.peek_event().start_mark
                raise _fail(f"file holds more than {MAX_VALUES:,} values; graph and inventory files hold a few "
                            "hundred", "check that this is the file you meant", None, mark.line + 1)
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _fail(f"nesting is deeper than {MAX_DEPTH} levels", "flatten the structure; graph "
                            "files need a few levels", None, mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _Builder:
    """YAML nodes -> Python data. An anchor and its aliases become one shared object (so an
    override of `vars.model.d_model` reaches every node that says `model: *model`); sizes and depth
    are counted with aliases expanded, in time linear in the node graph."""

    def __init__(self, file: str | None):
        self.file = file
        self.lines: dict[Loc, int] = {}
        self.problems: list[Problem] = []
        self.memo: dict[int, tuple[Any, int, int]] = {}  # id(node) -> (data, values, depth)
        self.active: set[int] = set()
        self.scalars = SafeConstructor()

    def problem(self, loc: Loc, message: str, fix: str, line: int | None) -> None:
        self.problems.append(Problem(_dotted(loc), message, fix, self.file, line))

    def scalar(self, node: yaml.ScalarNode, loc: Loc) -> Any:
        if node.tag == "tag:yaml.org,2002:str":
            return node.value
        try:
            return self.scalars.construct_object(node)
        except Exception as e:  # noqa: BLE001 - any tag constructor failure is the file's fault
            self.scalars.constructed_objects.clear()
            self.scalars.recursive_objects.clear()
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            why = clip(str(e).splitlines()[0] if str(e) else type(e).__name__, 120)
            self.problem(loc, f"value {shown(node.value)} cannot be read as {tag} ({why})",
                         "quote it to make it a string, or write a value of that type", node.start_mark.line + 1)
            return node.value

    def build(self, node: yaml.Node, loc: Loc) -> tuple[Any, int, int]:
        """(data, values it expands to, depth it expands to)."""
        key = id(node)
        self.lines.setdefault(loc, node.start_mark.line + 1)
        if key in self.memo:  # an alias: share the object, record no lines inside it
            return self.memo[key]
        if isinstance(node, yaml.ScalarNode):
            return self.scalar(node, loc), 1, 0
        if key in self.active:
            raise _fail("an alias refers to the mapping or list that contains it (a recursive alias)",
                        "use an alias only after its anchor's value is complete", self.file,
                        node.start_mark.line + 1, _dotted(loc))
        self.active.add(key)
        try:
            data, values, depth = self.mapping(node, loc) if isinstance(node, yaml.MappingNode) else self.sequence(node, loc)
        finally:
            self.active.discard(key)
        if depth > MAX_DEPTH:
            raise _fail(f"nesting is deeper than {MAX_DEPTH} levels once aliases are expanded",
                        "flatten the structure; graph files need a few levels", self.file,
                        node.start_mark.line + 1, _dotted(loc))
        if values > MAX_VALUES:
            raise _fail(f"aliases expand this value to more than {MAX_VALUES:,} values (an alias bomb?)",
                        "write the value out, or use fewer nested aliases", self.file,
                        node.start_mark.line + 1, _dotted(loc))
        self.memo[key] = (data, values, depth)
        return data, values, depth

    def sequence(self, node: yaml.SequenceNode, loc: Loc) -> tuple[list, int, int]:
        out, values, depth = [], 1, 0
        for i, item in enumerate(node.value):
            data, n, d = self.build(item, loc + (i,))
            out.append(data)
            values, depth = values + n, max(depth, d + 1)
        return out, values, depth

    def key(self, node: yaml.Node, loc: Loc) -> tuple[bool, Any]:
        if not isinstance(node, yaml.ScalarNode):
            kind = "list" if isinstance(node, yaml.SequenceNode) else "mapping"
            self.problem(loc, f"a key is a {kind} (a complex `? ...` key)", "use a plain name as the key",
                         node.start_mark.line + 1)
            return False, None
        return True, self.scalar(node, loc)

    def mapping(self, node: yaml.MappingNode, loc: Loc) -> tuple[dict, int, int]:
        out: dict = {}
        values, depth = 1, 0
        merges = []
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                merges.append((key_node, value_node))
                continue
            ok, key = self.key(key_node, loc)
            if not ok:
                continue
            line = key_node.start_mark.line + 1
            if key in out:
                self.problem(loc + (key,), f"key {shown(key)} appears twice (duplicate name)",
                             "give every key (and every node) a unique name", line)
            self.lines[loc + (key,)] = line
            data, n, d = self.build(value_node, loc + (key,))
            out[key] = data
            values, depth = values + n + 1, max(depth, d + 1)
        for key_node, value_node in merges:
            line = key_node.start_mark.line + 1
            sources = value_node.value if isinstance(value_node, yaml.SequenceNode) else [value_node]
            for source in sources:
                if not isinstance(source, yaml.MappingNode):
                    self.problem(loc + ("<<",), "`<<` merges a mapping or a list of mappings",
                                 "write `<<: *anchor` or `<<: [*a, *b]`", line)
                    continue
                data, n, d = self.build(source, loc + ("<<",))
                for k, v in data.items():
                    if k not in out:  # written keys win, then earlier merges
                        out[k] = v
                        self.lines.setdefault(loc + (k,), line)
                values, depth = values + n, max(depth, d)
        self.lines.pop(loc + ("<<",), None)
        return out, values, depth


def _dotted(loc: Loc) -> str:
    return ".".join(clip(str(p), 60) for p in loc)


def parse_yaml(text: str, file: str | None = None) -> Located:
    """Parse YAML text keeping the line of every key. Raises GraphError on every kind of bad input."""
    try:
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except GraphError as e:
        raise GraphError([Problem(p.path, p.message, p.fix, file, p.line) for p in e.problems]) from None
    except yaml.reader.ReaderError as e:
        line = text[: e.position].count("\n") + 1
        code = ord(e.character) if isinstance(e.character, str) else int(e.character)
        what = f"character U+{code:04X}"
        raise _fail(f"{what} is not allowed in a YAML file", "remove it; " + SAVE_AS_UTF8, file, line) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        why = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or str(e)
        raise _fail(f"not valid YAML: {clip(why, 300)}", "fix the YAML syntax at that line", file,
                    mark.line + 1 if mark else None) from None
    if root is None or (isinstance(root, yaml.ScalarNode) and root.tag == "tag:yaml.org,2002:null"):
        raise _fail("file holds no YAML document (it is empty, or only `---` or comments)",
                    "write the graph's mapping, e.g. start from graphs/ppo.yaml", file, 1)
    builder = _Builder(file)
    data, _, _ = builder.build(root, ())
    if builder.problems:
        raise GraphError(builder.problems)
    return Located(data, builder.lines, file)
