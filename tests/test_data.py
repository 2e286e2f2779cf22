"""Data loading: truncated ShareGPT recovery, formats, clear errors."""

from __future__ import annotations

import json
import warnings

import pytest

from elsi.data import load_dataset, load_questions, recover_json_list


def _records(n):
    return [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
            for i in range(n)]


def test_truncated_sharegpt_recovers_complete_records_and_warns_once(tmp_path):
    text = json.dumps(_records(5), indent=2)
    cut = text[: text.index('"c4"') + 10]  # cut inside the last record
    path = tmp_path / "cut.json"
    path.write_text(cut)
    load_dataset.cache_clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ds = load_dataset(str(path))
        again = load_dataset(str(path))
    assert again is ds
    assert [s.id for s in ds.samples] == ["c0", "c1", "c2", "c3"]
    assert ds.truncated
    msgs = [str(x.message) for x in w]
    assert len(msgs) == 1 and "recovered 4 complete records" in msgs[0]


def test_complete_list_and_formats(tmp_path):
    p = tmp_path / "ok.json"
    p.write_text(json.dumps(_records(3)))
    ds = load_dataset(str(p))
    assert len(ds.samples) == 3 and not ds.truncated
    assert ds.samples[0].messages == (("user", "q0"), ("assistant", "a0"))
    j = tmp_path / "mixed.jsonl"
    rows = [{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                          {"role": "assistant", "content": "a"}]},
            {"text": "plain"}, {"conversations": [{"from": "gpt", "value": "only assistant"}]},
            {"other": 1}]
    j.write_text("\n".join(json.dumps(r) for r in rows) + "\n{\"text\": \"cut")
    with pytest.warns(UserWarning, match=r"mixed\.jsonl is truncated: recovered 4 complete records \(2 usable"):
        ds = load_dataset(str(j))
    assert [s.text for s in ds.samples] == [None, "plain"]
    assert ds.samples[0].messages[0] == ("system", "s")
    assert ds.skipped == {"empty": 1, "unknown_format": 1, "bad_json_line": 1}


def test_unusable_files_name_the_file(tmp_path):
    for name, body, msg in [("a.json", '{"x": 1}', "not a JSON list"), ("b.json", "[{\"id\": ", "no complete JSON record"),
                            ("c.json", "[]", "no usable sample"), ("d.txt", "hi", "unsupported data format")]:
        p = tmp_path / name
        p.write_text(body)
        with pytest.raises(ValueError, match=msg) as err:
            load_dataset(str(p))
        assert name in str(err.value)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        load_dataset(str(tmp_path / "missing.json"))


def test_recover_stops_at_garbage():
    recs, truncated = recover_json_list('[{"a": 1}, {"b": 2} garbage', "x")
    assert recs == [{"a": 1}, {"b": 2}] and truncated


def test_spec_bench_is_shipped_with_six_subtasks():
    qs = load_questions()
    assert len(qs) == 480
    by = {}
    for q in qs:
        by.setdefault(q.subtask, []).append(q)
    assert {k: len(v) for k, v in by.items()} == {s: 80 for s in
                                                  ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")}
    assert all(len(q.turns) == 2 for q in by["mt_bench"])
    assert len(load_questions(["qa"], per_subtask=3)) == 3
    with pytest.raises(ValueError, match="unknown Spec-Bench subtask"):
        load_questions(["nope"])


def test_assistant_mask_marks_reply_tokens_only():
    from conftest import make_tokenizer

    from elsi.data.conversations import Sample, assistant_mask, tokenize

    tok = make_tokenizer()
    s = Sample("x", (("user", "the cat sat"), ("assistant", "on the mat"), ("user", "and then"),
                     ("assistant", "it slept")))
    ids = tokenize(s, tok, 1000)
    mask = assistant_mask(s, tok, ids)
    assert len(mask) == len(ids)
    reply = tok.decode([t for t, m in zip(ids, mask) if m])
    other = tok.decode([t for t, m in zip(ids, mask) if not m])
    for word in ("on", "the", "mat", "it", "slept"):
        assert word in reply
    assert "cat" in other and "then" in other and "cat" not in reply and "then" not in reply
    # Raw text and a cut sequence: every token counts / the mask follows the cut ids.
    assert all(assistant_mask(Sample("t", text="the cat"), tok, [1, 2])) is True
    assert assistant_mask(s, tok, ids[:5]) == mask[:5]
