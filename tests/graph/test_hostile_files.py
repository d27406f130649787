"""Graph and inventory files as careless users and attackers write them: every one is a GraphError
with file, line or key path; never a traceback or a hang. The reader's work on a hostile file is
counted (values composed from the text, values built into data) and bounded by what the file
writes, never by what its aliases or nesting would expand to; how long files take is measured by
benchmarks/check_speed.py and benchmarks/fuzz_graphs.py."""

import pytest

from flowrl.graph import GraphError, load_graph, load_graph_text
from flowrl.graph.reading import MAX_DEPTH, MAX_VALUES, _Builder, _Loader, parse_yaml
from flowrl.placement.declared import DeclaredInventory

PIPE = """\
name: t
nodes:
  prompts: {kind: prompts}
  rollout: {kind: rollout}
  actor: {kind: actor}
edges: [prompts -> rollout, rollout -> actor]
weights: [actor -> rollout]
"""
# the classic "billion laughs": 9^9 strings from a few hundred bytes
BOMB = "".join([
    'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n',
    *(f"{b}: &{b} [{','.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi")),
])


@pytest.fixture
def work(monkeypatch):
    """{"compose": YAML values read from the text (aliases count once each), "build": values turned
    into data (an alias is one call: its anchor's data is shared)} for what the test reads next."""
    counts = {"compose": 0, "build": 0}

    def counting(name, original):
        def wrapper(self, *args):
            counts[name] += 1
            return original(self, *args)
        return wrapper

    monkeypatch.setattr(_Loader, "compose_node", counting("compose", _Loader.compose_node))
    monkeypatch.setattr(_Builder, "build", counting("build", _Builder.build))
    return counts


def problems(text: str, file="g.yaml"):
    with pytest.raises(GraphError) as e:
        load_graph_text(text, file)
    return e.value.problems


def file_problems(tmp_path, data: bytes):
    path = tmp_path / "g.yaml"
    path.write_bytes(data)
    with pytest.raises(GraphError) as e:
        load_graph(path)
    return e.value.problems


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32"])
def test_a_file_with_a_byte_order_mark_loads_in_any_utf_encoding(tmp_path, encoding):
    data = PIPE.encode(encoding)
    if encoding in ("utf-16-le", "utf-16-be"):
        data = "\ufeff".encode(encoding) + data  # PowerShell writes the mark
    path = tmp_path / "g.yaml"
    path.write_bytes(data)
    assert list(load_graph(path).nodes) == ["prompts", "rollout", "actor"]


def test_a_latin_1_file_names_the_byte_its_line_and_the_fix(tmp_path):
    (p,) = file_problems(tmp_path, PIPE.replace("name: t", "name: café").encode("latin-1"))
    assert p.line == 1 and "0xe9" in p.message and "é" in p.message and "save the file as UTF-8" in p.fix


def test_utf_16_without_a_byte_order_mark_is_named(tmp_path):
    (p,) = file_problems(tmp_path, PIPE.encode("utf-16-le"))
    assert "UTF-16" in p.message and "save the file as UTF-8" in p.fix


def test_a_510_byte_alias_bomb_fails_fast_with_a_line(work):
    assert len(BOMB) < 520
    (p,) = problems(BOMB + PIPE)
    assert "alias" in p.message and p.line is not None and p.file == "g.yaml"
    # the ~120 values the file writes, each built at most once: not the 9^9 strings they expand to
    assert work["build"] <= work["compose"] < 200, work


def test_the_line_table_never_expands_aliases():
    located = parse_yaml(BOMB.split("e:")[0])  # four levels: 9^4 strings once expanded
    assert len(located.data["d"]) == 9 and len(located.lines) < 50  # what the file writes, not 9^4


def test_an_alias_inside_its_own_anchor_is_an_error():
    (p,) = problems("a: &a [1, *a]\n" + PIPE)
    assert "recursive alias" in p.message and p.line == 1


@pytest.mark.parametrize("text", ["[" * 5000 + "]" * 5000, "a: " + "{b: " * 3000 + "1" + "}" * 3000,
                                  "a:\n" + "".join("  " * i + "- \n" for i in range(1, 200))],
                         ids=["flow-lists", "flow-mappings", "block-lists"])
def test_deep_nesting_fails_fast_with_a_line(text, work):
    (p,) = problems(text)
    assert f"deeper than {MAX_DEPTH}" in p.message and p.line
    # refused while reading, at the first level too deep (a mapping level is a key and a value)
    assert work["compose"] <= 2 * (MAX_DEPTH + 1) and work["build"] == 0, work


def test_nesting_that_is_only_deep_through_aliases_is_bounded_too():
    levels = ["x0: &x0 " + "[" * 40 + "1" + "]" * 40]
    levels += [f"x{i}: &x{i} " + "[" * 40 + f"*x{i - 1}" + "]" * 40 for i in range(1, 5)]
    (p,) = problems("\n".join(levels) + "\n")
    assert "aliases are expanded" in p.message


def test_merge_keys_merge_with_written_keys_winning_and_lines_at_the_merge():
    text = PIPE.replace("  rollout: {kind: rollout}", "  rollout:\n    <<: *base\n    replicas: 3")
    spec = load_graph_text("vars:\n  base: &base {kind: rollout, replicas: 2, devices: 1}\n" + text)
    node = spec.nodes["rollout"]
    assert (node.kind, node.replicas, node.devices) == ("rollout", 3, 1)
    bad = "vars:\n  base: &base {kind: rollout, replicaz: 2}\n" + text.replace("replicas: 3", "devices: 1")
    (p,) = problems(bad)
    assert p.path == "nodes.rollout.replicaz" and p.line == 7  # the `<<:` line


def test_merge_of_a_list_of_mappings_takes_the_first_that_has_a_key():
    located = parse_yaml("a: &a {x: 1}\nb: &b {x: 2, y: 2}\nc:\n  <<: [*a, *b]\n")
    assert located.data["c"] == {"x": 1, "y": 2}


@pytest.mark.parametrize("key", ["0x10", "1:20", "? [a, b]\n  : 1\n  x", "~", "1.5", "true"])
def test_odd_keys_are_graph_errors_not_tracebacks(key):
    found = problems(PIPE.replace("  actor: {kind: actor}", f"  actor: {{kind: actor}}\n  {key}: 1"))
    assert found and all(p.file == "g.yaml" and (p.line or p.path) for p in found)


def test_a_complex_key_is_named_as_such():
    (p,) = problems("? [a, b]\n: 1\n" + PIPE)
    assert "complex" in p.message and p.line == 1


@pytest.mark.parametrize("text", ["", "---\n", "---", "# nothing\n", "\ufeff", "~\n"])
def test_a_file_without_a_document_says_so(text):
    (p,) = problems(text)
    assert "no YAML document" in p.message and p.line == 1


def test_a_value_its_tag_cannot_read_is_an_error_with_its_line():
    (p,) = problems(PIPE.replace("name: t", "name: !!int abc"))
    assert p.line == 1 and "!!int" in p.message


def test_an_unsafe_tag_is_refused():
    (p,) = problems(PIPE.replace("name: t", "name: !!python/object/apply:os.system [ls]"))
    assert p.line == 1


@pytest.mark.parametrize("kind", ["..:X", ":", "a:", ":b", "a..b:C", "1abc:X"])
def test_a_kind_that_is_not_an_import_path_is_an_error_at_its_key(kind):
    (p,) = problems(PIPE.replace("kind: actor", f'kind: "{kind}"'))
    assert p.path == "nodes.actor.kind" and p.line == 5 and "import path" in p.message


def test_a_node_module_that_fails_at_import_is_an_error_not_a_traceback():
    (p,) = problems(PIPE.replace("kind: actor", 'kind: "tests.graph.broken_module:Node"'))
    assert p.path == "nodes.actor.kind" and "RuntimeError" in p.message


def test_a_control_character_is_an_error_with_its_line():
    (p,) = problems(PIPE.replace("name: t", "name: \x07"))
    assert p.line == 1 and "U+0007" in p.message


def test_a_megabyte_value_is_cut_in_the_message():
    found = problems(PIPE.replace("  actor: {kind: actor}", "  actor: {kind: actor, replicas: " + "9x" * 500_000 + "}"))
    assert all(len(str(p)) < 2000 for p in found) and "characters in all" in str(found[0])


def test_a_megabyte_key_is_cut_in_the_message():
    found = problems(PIPE + "k" * (1 << 20) + ": 1\n")
    assert all(len(str(p)) < 2000 for p in found)


def test_a_message_with_many_problems_prints_ten_and_counts_the_rest():
    text = PIPE + "".join(f"extra{i}: 1\n" for i in range(30))
    with pytest.raises(GraphError) as e:
        load_graph_text(text, "g.yaml")
    assert len(e.value.problems) == 30 and "and 20 more" in str(e.value)


def test_a_huge_file_is_refused_before_parsing(tmp_path):
    (p,) = file_problems(tmp_path, b"# " + b"x" * (3 << 20) + b"\n")
    assert "bytes" in p.message


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "1.0e400"])
def test_an_infinite_memory_size_in_an_inventory_is_an_error(value):
    with pytest.raises(GraphError) as e:
        DeclaredInventory.from_text(f"hosts: [{{name: h, gpus: [{{id: 0, memory_gb: {value}}}]}}]", "inv.yaml")
    (p,) = e.value.problems
    assert p.path == "hosts.0.gpus.0.memory_gb" and p.line == 1


def test_an_inventory_with_a_billion_cpus_is_an_error():
    with pytest.raises(GraphError) as e:
        DeclaredInventory.from_text("hosts: [{name: h, cpus: 1000000000}]", "inv.yaml")
    assert e.value.problems[0].path == "hosts.0.cpus"


def test_an_override_with_an_odd_digit_is_a_key_not_a_crash():
    spec = load_graph_text(PIPE, "g.yaml", ["vars.²=1"])
    assert spec.vars == {"²": 1}


@pytest.mark.parametrize("text", ["a: [" + "1," * 400_000 + "1]\n", "a:\n" + "- 1\n" * 200_000],
                         ids=["flow-list", "block-list"])
def test_a_file_of_very_many_values_fails_fast(text, work):
    (p,) = problems(text)
    assert "values" in p.message and p.line
    # refused at the first value over the limit, not after reading the other 190,000
    assert work == {"compose": MAX_VALUES + 1, "build": 0} and p.line <= MAX_VALUES
