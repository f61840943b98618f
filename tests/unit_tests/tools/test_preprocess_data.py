"""``tools/preprocess_data.py``: upstream's interface (JSONL, --json-keys, --tokenizer-type,
--append-eod, --workers) writes ``<prefix>_<key>_document`` datasets that megatron-core's
``IndexedDataset`` reads back token for token; plain-text directories skip binary files."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tools import preprocess_data


def _read(prefix: str) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def _bytes(text: str, eod: int | None = 256) -> list[int]:
    return list(text.encode("utf-8")) + ([eod] if eod is not None else [])


def test_jsonl_byte_level_two_keys_workers_append_eod(tmp_path, capsys):
    docs = [
        {"text": "héllo", "title": "a"},
        {"text": ["x", "yz"], "title": ""},
        {"text": "", "title": ""},
        {"text": "last", "title": "t"},
    ]
    src = tmp_path / "c.jsonl"
    src.write_text(
        "\n".join(json.dumps(d) for d in docs[:2])
        + "\n\n"
        + "\n".join(json.dumps(d) for d in docs[2:])
        + "\n"
    )
    out = tmp_path / "out" / "corpus"
    rc = preprocess_data.main(
        [
            "--input",
            str(src),
            "--json-keys",
            "text",
            "title",
            "--output-prefix",
            str(out),
            "--tokenizer-type",
            "ByteLevelTokenizer",
            "--append-eod",
            "--workers",
            "2",
            "--no-progress",
        ]
    )
    assert rc == 0
    assert _read(f"{out}_text_document") == [_bytes("héllo"), _bytes("xyz"), _bytes("last")]
    assert _read(f"{out}_title_document") == [_bytes("a"), _bytes("t")]
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    assert IndexedDataset(f"{out}_text_document").index.dtype == np.uint16
    printed = capsys.readouterr().out
    assert "corpus_text_document.bin/.idx: 3 documents, 16 tokens" in printed
    assert "skipped 1 empty document(s)" in printed
    assert f"--data-path {out}_text_document" in printed


def test_null_tokenizer_ids_without_eod(tmp_path):
    src = tmp_path / "ids.jsonl"
    src.write_text('{"text": "5 6 7"}\n{"text": "100"}\n')
    out = tmp_path / "ids"
    assert (
        preprocess_data.main(
            [
                "--input",
                str(src),
                "--output-prefix",
                str(out),
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "257",
                "--no-progress",
            ]
        )
        == 0
    )
    assert _read(f"{out}_text_document") == [[5, 6, 7], [100]]


def test_several_inputs_keep_order(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"text": "1"}\n{"text": "2"}\n')
    b.write_text('{"text": "3"}\n')
    out = tmp_path / "ab"
    assert (
        preprocess_data.main(
            [
                "--input",
                str(a),
                str(b),
                "--output-prefix",
                str(out),
                "--tokenizer-type",
                "ByteLevelTokenizer",
                "--no-progress",
            ]
        )
        == 0
    )
    assert _read(f"{out}_text_document") == [
        _bytes("1", None),
        _bytes("2", None),
        _bytes("3", None),
    ]


def test_directory_of_text_files_skips_binary_files(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.py").write_text("print(1)\n")
    (src / "sub" / "b.txt").write_text("zz")
    (src / "sub" / "c.pyc").write_bytes(b"\x0b\r\r\n\0\0\0\0binary")
    (src / "d.bin").write_bytes(b"\xff\xfe not utf-8")
    out = tmp_path / "dir"
    assert (
        preprocess_data.main(
            [
                "--input",
                str(src),
                "--output-prefix",
                str(out),
                "--tokenizer-type",
                "ByteLevelTokenizer",
                "--append-eod",
                "--no-progress",
            ]
        )
        == 0
    )
    assert _read(f"{out}_text_document") == [_bytes("print(1)\n"), _bytes("zz")]
    assert "2 binary file(s)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", r"c\.jsonl:2: not a JSON object"),
        ('{"body": "x"}', r"c\.jsonl:2: no key 'text' .*keys here: \['body'\]"),
        ('{"text": 3}', r"c\.jsonl:2 key 'text': expected a string"),
    ],
)
def test_bad_lines_are_named_and_leave_no_files(tmp_path, line, message):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "ok"}\n' + line + "\n")
    args = preprocess_data.build_parser().parse_args(
        [
            "--input",
            str(src),
            "--output-prefix",
            str(tmp_path / "o"),
            "--tokenizer-type",
            "ByteLevelTokenizer",
            "--no-progress",
        ]
    )
    with pytest.raises(preprocess_data.PreprocessError, match=message):
        preprocess_data.build(args)
    assert not list(tmp_path.glob("o_*"))


def test_tokenizer_errors_are_actionable(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text('{"text": "ok"}\n')
    base = ["--input", str(src), "--output-prefix", str(tmp_path / "o"), "--no-progress"]
    parse = preprocess_data.build_parser().parse_args
    with pytest.raises(preprocess_data.PreprocessError, match="--tokenizer-type is required"):
        preprocess_data.build(parse(base))
    with pytest.raises(
        preprocess_data.PreprocessError, match="needs --vocab-file and --merge-file"
    ):
        preprocess_data.build(parse(base + ["--tokenizer-type", "GPT2BPETokenizer"]))
    with pytest.raises(preprocess_data.PreprocessError, match="--vocab-size >= 257"):
        preprocess_data.build(
            parse(base + ["--tokenizer-type", "ByteLevelTokenizer", "--vocab-size", "256"])
        )
