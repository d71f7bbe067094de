"""Prompt skeletons: the expected tree on real-looking prompts, and robustness on junk."""
from __future__ import annotations

import json
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ac_observe.engine.skeleton import MAX_DEPTH, skeleton_of_request, skeleton_of_text
from support.servers import run_cli

PROMPT = """# Task
<instructions>
Answer using the context.
## Rules
- be short
- cite sources
  1. by title
</instructions>
<context>
<document index="1">
```json
{"title": "GPU report", "rows": [{"sm": 0.9}, {"sm": 0.7}]}
```
</document>
</context>

| metric | value |
|--------|-------|
| ttft   | 12 ms |
"""

EXPECTED_TREE = """request
  message system
  message user
    heading h1
      tag instructions
        heading h2
          list unordered
            item
            item
              list ordered
                item
      tag context
        tag document
          code json
            json object
              json array
                json object
                json object
      table 2 columns"""


def _cli(*args, stdin=None):
    return run_cli("skeleton", *args, input=stdin)


def test_cli_prints_tree_and_depth_of_a_request_file(tmp_path):
    body = {"model": "m", "max_tokens": 5, "system": "Be terse.",
            "messages": [{"role": "user", "content": PROMPT}]}
    path = tmp_path / "request.json"
    path.write_text(json.dumps(body))
    out = _cli(str(path))
    assert out.returncode == 0, out.stderr
    tree, summary = out.stdout.rstrip("\n").rsplit("\n", 1)
    assert tree == EXPECTED_TREE
    assert summary.startswith("depth: 8  nodes: 19  id: ")


def test_cli_reads_plain_text_from_stdin_and_reports_json():
    out = _cli("-", "--json", stdin="<a><b>x</b></a>\n- one\n- two\n")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["depth"] == 3  # message > a > b
    assert result["tree"].splitlines()[2:] == ["    tag a", "      tag b", "    list unordered",
                                               "      item", "      item"]


def test_cli_missing_file_is_a_clear_error(tmp_path):
    out = _cli(str(tmp_path / "nope.txt"))
    assert out.returncode == 2 and "cannot read" in out.stderr


def test_skeleton_id_ignores_content_but_not_structure():
    a = skeleton_of_text("<doc>\n- alpha\n- beta\n</doc>")
    b = skeleton_of_text("<doc>\n- one\n- two\n- three\n</doc>")  # same template, more items
    c = skeleton_of_text("<doc>\n1. alpha\n</doc>")
    assert a.skeleton_id == b.skeleton_id != c.skeleton_id
    assert a.node_count < b.node_count


def test_content_blocks_and_tool_use_are_structure():
    sk = skeleton_of_request(messages=[
        {"role": "user", "content": [{"type": "text", "text": "<q>hi</q>"},
                                     {"type": "image", "source": {}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "name": "f",
                                           "input": {"a": [1, {"b": 2}]}}]},
        {"role": "user", "content": [{"type": "tool_result", "content": "# done"}]},
    ])
    assert sk.render().splitlines() == [
        "request", "  message user", "    tag q", "    image", "  message assistant",
        "    tool_use", "      json object", "        json array", "          json object",
        "  message user", "    tool_result", "      heading h1"]


def test_unclosed_and_mismatched_tags_do_not_raise_and_depth_is_capped():
    assert skeleton_of_text("<a><b></a></b></c>").depth == 3
    deep = skeleton_of_text("<x>" * 10_000)
    assert deep.depth == MAX_DEPTH and deep.truncated


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(
    st.text(),
    st.text(alphabet="<>/ab{}[]\"\\`~#-*|1. \n\t"),
    st.binary().map(lambda b: b.decode("latin-1")),
), st.text(max_size=40))
def test_fuzz_never_raises(text, system):
    sk = skeleton_of_request(system, [{"role": "user", "content": text},
                                      {"role": "assistant", "content": [{"type": "text",
                                                                          "text": text}]}])
    assert 1 <= sk.depth <= MAX_DEPTH
    assert sk.node_count >= 3
    assert sk.render().startswith("request")


def _best_seconds(*texts: str, rounds: int = 5) -> list[float]:
    """Each text's least parse time over `rounds`, the texts taken in turn each round: a
    busy moment of the machine slows one round of each, not every run of one."""
    best = [float("inf")] * len(texts)
    for _ in range(rounds):
        for i, text in enumerate(texts):
            start = time.perf_counter()
            skeleton_of_text(text)
            best[i] = min(best[i], time.perf_counter() - start)
    return best


@settings(max_examples=12, deadline=None)
@given(st.sampled_from(["<a ", "<a>", "{", "[\"", "- ", "  - x\n", "# h\n", "```json\n[",
                        "| a |\n", "<a\n", "{\"a\":[", "</a>"]))
def test_time_stays_linear_in_input_size(unit):
    small = unit * (20_000 // len(unit))
    large = unit * (160_000 // len(unit))  # 8x the input
    small_seconds, large_seconds = _best_seconds(small, large)
    ratio = large_seconds / max(small_seconds, 1e-4)
    assert ratio < 24, f"{unit!r}: 8x input took {ratio:.1f}x the time"


def test_one_megabyte_of_junk_is_handled():
    junk = ("<tag attr='x'>{[\"\\" * 60_000)[:1_000_000]
    sk = skeleton_of_text(junk)
    assert sk.depth <= MAX_DEPTH
