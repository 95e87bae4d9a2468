"""normlab/files/formats.py: JSON Lines reading tolerates only the torn last line a killed writer leaves; YAML that a
user wrote fails with its file and line."""

import pytest

from normlab.files.formats import load_yaml_mapping, read_jsonl, write_jsonl


def test_read_jsonl_skips_a_torn_last_line_only(tmp_path):
    path = tmp_path / "m.jsonl"
    write_jsonl(path, [{"step": 1}, {"step": 2}])
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text(path.read_text() + '{"step": 3, "lo')  # killed mid-line
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_jsonl(path)
    assert read_jsonl(tmp_path / "absent.jsonl") == []


def test_load_yaml_mapping_names_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("a: 1\nb: [1, 2\n")
    with pytest.raises(ValueError, match=r"bad.yaml line \d+ is not valid YAML"):
        load_yaml_mapping(bad)
    bad.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="must hold a mapping of keys.*got list"):
        load_yaml_mapping(bad)
    bad.write_text("")
    assert load_yaml_mapping(bad) == {}
