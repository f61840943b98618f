"""Tokenize a corpus into Megatron indexed datasets: ``<prefix>_<key>_document.bin`` / ``.idx``.

Upstream Megatron-LM's ``tools/preprocess_data.py`` interface for the common case, writing the same
files that upstream's reader (``megatron.core.datasets.indexed_dataset.IndexedDataset``) and
``pretrain_gpt.py --data-path <prefix>_text_document`` expect::

    python tools/preprocess_data.py --input corpus.jsonl --json-keys text \\
        --output-prefix data/corpus --tokenizer-type GPT2BPETokenizer \\
        --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt --append-eod --workers 8

* ``--input``: one or more JSONL files (one JSON object per line; blank lines are skipped). Each
  ``--json-keys`` field (default ``text``; a string, or a list of strings that are concatenated)
  becomes one document of the dataset ``<prefix>_<key>_document``.
* ``--tokenizer-type`` and its options are upstream's tokenizer flags, the same as for
  ``pretrain_gpt.py`` (``megatron.training.arguments``), built by megatron-core's
  ``build_tokenizer``. Local tokenizers: ``NullTokenizer`` (text of space-separated integer ids,
  ``--vocab-size``), ``GPT2BPETokenizer`` (``--vocab-file``, ``--merge-file``; needs the
  ``transformers`` package), ``HuggingFaceTokenizer`` / ``SentencePieceTokenizer`` /
  ``TikTokenizer`` with ``--tokenizer-model`` pointing at local files. Nothing is downloaded.
* ``--tokenizer-type ByteLevelTokenizer`` (this fork's addition): megatron-core's byte-level
  tokenizer, UTF-8 bytes as ids 0-255 and an end-of-document id ``--vocab-size - 1`` (default
  ``--vocab-size 257``: id 256). Train on it with
  ``--tokenizer-type NullTokenizer --vocab-size 257`` (NullTokenizer's end-of-document id is
  ``vocab_size - 1`` too; with 256, byte 0xFF would collide).
* ``--append-eod`` appends the tokenizer's end-of-document id to every document (upstream: off).
* ``--workers N`` tokenizes in N processes; the output order is the input order.

Not supported here (upstream's rarer options): ``--split-sentences``, ``--keep-newlines``,
``--partitions``.

Extra of this fork: ``--input DIR`` (a directory) reads plain-text files under it (recursive,
``--pattern``, default ``*``), each file one document of ``<prefix>_text_document``; files that
are not UTF-8 text (a NUL byte or invalid UTF-8 in them, e.g. ``.pyc``) are skipped and counted.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
from tqdm import tqdm

BYTE_LEVEL = "ByteLevelTokenizer"
BYTE_VOCAB_SIZE = 257
BYTE_EOD_ID = BYTE_VOCAB_SIZE - 1


class PreprocessError(RuntimeError):
    """Bad input, bad arguments or a tokenizer that does not build; the message says what to do."""


@dataclass
class Stats:
    """What one run read and wrote (per ``--json-keys`` key for documents and tokens)."""

    documents: dict[str, int] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)
    empty: int = 0  # records / files whose every key tokenized to nothing: not written
    skipped_binary: int = 0  # directory mode: files that are not UTF-8 text
    skipped_unreadable: int = 0  # directory mode: files that could not be read


# --------------------------------------------------------------------------------------------------
# Arguments and tokenizer
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """Upstream's arguments (input data, tokenizer, output, runtime) plus this fork's extras."""
    from megatron.training.arguments import _add_tokenizer_args

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    group = parser.add_argument_group(title="input data")
    group.add_argument(
        "--input",
        nargs="+",
        required=True,
        help="JSONL file(s); or one directory of plain-text files (this fork)",
    )
    group.add_argument(
        "--json-keys",
        nargs="+",
        default=["text"],
        help="space separated keys to extract from each JSON line (default: text)",
    )
    group.add_argument(
        "--pattern",
        default="*",
        help="with --input DIR: file glob, e.g. '*.py' (default: all files)",
    )
    _add_tokenizer_args(parser)
    for action in parser._actions:
        if action.dest == "tokenizer_type":
            action.choices = tuple(action.choices or ()) + (BYTE_LEVEL,)
            action.help = (action.help or "") + f" {BYTE_LEVEL}: UTF-8 bytes (this fork)."
    group = parser.add_argument_group(title="tokenization process")
    group.add_argument(
        "--append-eod",
        action="store_true",
        help="append the end-of-document token to every document",
    )
    group = parser.add_argument_group(title="output data")
    group.add_argument(
        "--output-prefix",
        required=True,
        help="writes <prefix>_<key>_document.bin/.idx for each --json-keys key",
    )
    group = parser.add_argument_group(title="runtime")
    group.add_argument("--workers", type=int, default=1, help="tokenizer processes (default 1)")
    group.add_argument(
        "--log-interval",
        type=int,
        default=1000,
        help="accepted for upstream compatibility (a progress bar is shown instead)",
    )
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def build_tokenizer(args: argparse.Namespace):
    """megatron-core's tokenizer for ``args`` (upstream's tokenizer flags).

    Returns:
        an object with ``tokenize(str) -> list[int]``, ``eod`` (int) and ``vocab_size`` (int).

    Raises:
        PreprocessError: no ``--tokenizer-type``, or the tokenizer does not build (names the cause).
    """
    from megatron.core.tokenizers import MegatronTokenizer
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer as mcore_build

    if args.tokenizer_type is None:
        raise PreprocessError(
            f"--tokenizer-type is required (e.g. {BYTE_LEVEL}, NullTokenizer, "
            "GPT2BPETokenizer with --vocab-file/--merge-file)"
        )
    if args.tokenizer_type == BYTE_LEVEL:
        vocab = args.vocab_size or BYTE_VOCAB_SIZE
        if vocab < 257:
            raise PreprocessError(
                f"{BYTE_LEVEL} needs --vocab-size >= 257 (ids 0-255 are bytes, the "
                f"end-of-document id is vocab_size - 1), got {vocab}"
            )
        return MegatronTokenizer.from_pretrained(
            metadata_path={"library": "byte-level"}, vocab_size=vocab, _eos_id=vocab - 1
        )
    if args.tokenizer_type == "GPT2BPETokenizer" and not (args.vocab_file and args.merge_file):
        raise PreprocessError("GPT2BPETokenizer needs --vocab-file and --merge-file (local files)")
    # what upstream's preprocess_data.py sets for build_tokenizer (no model-parallel padding here)
    args.rank, args.make_vocab_size_divisible_by, args.tensor_model_parallel_size = 1, 128, 1
    try:
        return mcore_build(args)
    except ModuleNotFoundError as e:
        raise PreprocessError(
            f"--tokenizer-type {args.tokenizer_type} needs the Python package "
            f"{e.name!r}: pip install {e.name}"
        ) from e
    except Exception as e:
        raise PreprocessError(f"--tokenizer-type {args.tokenizer_type} did not build: {e}") from e


# --------------------------------------------------------------------------------------------------
# Encoding (in worker processes)
# --------------------------------------------------------------------------------------------------

_worker: dict = {}


def _init_worker(args: argparse.Namespace) -> None:
    _worker["tokenizer"] = build_tokenizer(args)
    _worker["args"] = args


def _tokenize_value(value, where: str) -> list[int]:
    tok = _worker["tokenizer"]
    parts = value if isinstance(value, list) else [value]
    ids: list[int] = []
    for part in parts:
        if not isinstance(part, str):
            raise PreprocessError(
                f"{where}: expected a string or a list of strings, got {type(part).__name__}"
            )
        if part:
            ids.extend(int(i) for i in tok.tokenize(part))
    return ids


def _encode(item: tuple[str, str | None, bytes]) -> tuple[int, dict[str, list[int]] | None, str]:
    """(where, kind, payload) -> (payload bytes, key -> token ids or None if skipped, why
    skipped)."""
    where, kind, payload = item
    args = _worker["args"]
    if kind == "json":
        try:
            record = json.loads(payload)
        except json.JSONDecodeError as e:
            raise PreprocessError(f"{where}: not a JSON object: {e}") from e
        if not isinstance(record, dict):
            raise PreprocessError(f"{where}: expected a JSON object, got {type(record).__name__}")
        missing = [k for k in args.json_keys if k not in record]
        if missing:
            raise PreprocessError(
                f"{where}: no key {missing[0]!r} (--json-keys "
                f"{' '.join(args.json_keys)}); keys here: {sorted(record)}"
            )
        values = {k: record[k] for k in args.json_keys}
    else:  # a plain-text file
        if b"\0" in payload[:8192]:
            return len(payload), None, "binary"
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            return len(payload), None, "binary"
        values = {"text": text}
    out = {}
    for key, value in values.items():
        ids = _tokenize_value(value, f"{where} key {key!r}")
        if ids and args.append_eod:
            ids.append(int(_worker["tokenizer"].eod))
        out[key] = ids
    return len(payload), out, ""


def _jsonl_items(paths: list[Path]) -> Iterator[tuple[str, str, bytes]]:
    for path in paths:
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    yield f"{path}:{n}", "json", line


def _dir_items(files: list[Path], stats: Stats) -> Iterator[tuple[str, str, bytes]]:
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            stats.skipped_unreadable += 1
            continue
        yield str(path), "text", data


def find_documents(input_dir: str, pattern: str = "*") -> list[Path]:
    """Regular files under ``input_dir`` matching ``pattern`` (recursive), sorted for
    reproducibility.

    Raises:
        PreprocessError: the directory does not exist, cannot be read, or holds no matching file.
    """
    root = Path(input_dir)
    if not root.is_dir():
        raise PreprocessError(f"--input {input_dir!r} is not a directory")
    if not os.access(root, os.R_OK | os.X_OK):
        raise PreprocessError(f"--input {input_dir!r} is not readable (check its permissions)")
    files = sorted(p for p in root.rglob(pattern) if p.is_file())
    if not files:
        raise PreprocessError(
            f"--input {input_dir!r} holds no file matching {pattern!r}; "
            "point it at a directory of text files"
        )
    return files


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def output_prefix(prefix: str, key: str) -> str:
    """Dataset path prefix upstream writes for ``key``: ``<prefix>_<key>_document``."""
    return f"{prefix}_{key}_document"


def build(args: argparse.Namespace) -> Stats:
    """Tokenize ``args.input`` and write one indexed dataset per ``--json-keys`` key.

    Token ids are stored with megatron-core's smallest dtype for the tokenizer's vocabulary
    (``DType.optimal_dtype``: uint16 below 65500 ids, else int32), one sequence per document.

    Returns:
        :class:`Stats` of the run.

    Raises:
        PreprocessError: a missing input, a JSONL line that is not an object or lacks a key, a
            tokenizer that does not build, or nothing to write (no file is left behind then).
    """
    from megatron.core.datasets.indexed_dataset import (
        DType,
        IndexedDatasetBuilder,
        get_bin_path,
        get_idx_path,
    )

    stats = Stats()
    tokenizer = build_tokenizer(args)  # fail here, before any worker starts
    dirs = [p for p in args.input if Path(p).is_dir()]
    if dirs:
        if len(args.input) != 1:
            raise PreprocessError("--input takes JSONL files or exactly one directory, not both")
        files = find_documents(dirs[0], args.pattern)
        keys = ["text"]
        items = _dir_items(files, stats)
        total, unit = len(files), "file"
    else:
        paths = [Path(p) for p in args.input]
        for p in paths:
            if not p.is_file():
                raise PreprocessError(f"--input {str(p)!r} is not a file or directory")
        keys = list(args.json_keys)
        items = _jsonl_items(paths)
        total, unit = sum(p.stat().st_size for p in paths), "B"
    if args.workers < 1:
        raise PreprocessError(f"--workers must be >= 1, got {args.workers}")

    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    Path(args.output_prefix).parent.mkdir(parents=True, exist_ok=True)
    builders = {
        k: IndexedDatasetBuilder(get_bin_path(output_prefix(args.output_prefix, k)), dtype=dtype)
        for k in keys
    }
    stats.documents = dict.fromkeys(keys, 0)
    stats.tokens = dict.fromkeys(keys, 0)
    ok = False
    pool = None
    try:
        if args.workers > 1:
            pool = multiprocessing.get_context("fork").Pool(args.workers, _init_worker, (args,))
            results = pool.imap(_encode, items, chunksize=16)
        else:
            _init_worker(args)
            results = map(_encode, items)
        with tqdm(
            total=total,
            unit=unit,
            unit_scale=unit == "B",
            desc="preprocess",
            disable=args.no_progress,
        ) as bar:
            for size, doc, why in results:
                bar.update(size if unit == "B" else 1)
                if doc is None:
                    stats.skipped_binary += why == "binary"
                    continue
                if not any(doc.values()):
                    stats.empty += 1
                    continue
                for key, ids in doc.items():
                    if ids:
                        builders[key].add_document(np.asarray(ids, dtype=dtype), [len(ids)])
                        stats.documents[key] += 1
                        stats.tokens[key] += len(ids)
        if not any(stats.documents.values()):
            raise PreprocessError(
                f"nothing to write: no non-empty document in {' '.join(args.input)}"
                f" ({stats.skipped_binary} binary file(s) skipped)"
            )
        for key, builder in builders.items():
            builder.finalize(get_idx_path(output_prefix(args.output_prefix, key)))
        ok = True
    finally:
        if pool is not None:
            if ok:
                pool.close()
            else:
                pool.terminate()
            pool.join()
        if not ok:
            for key, builder in builders.items():
                builder.data_file.close()
                for path in (
                    get_bin_path(output_prefix(args.output_prefix, key)),
                    get_idx_path(output_prefix(args.output_prefix, key)),
                ):
                    if os.path.exists(path):
                        os.remove(path)
    return stats


def preprocess(argv: list[str]) -> Stats:
    """:func:`build` for a command line (``argv`` as for ``tools/preprocess_data.py``)."""
    return build(build_parser().parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        stats = build(args)
    except PreprocessError as e:
        print(f"preprocess_data: error: {e}", file=sys.stderr)
        return 2
    for key in stats.documents:
        print(
            f"preprocess_data: wrote {output_prefix(args.output_prefix, key)}.bin/.idx: "
            f"{stats.documents[key]} documents, {stats.tokens[key]} tokens"
        )
    print(
        f"preprocess_data: skipped {stats.empty} empty document(s), {stats.skipped_binary} binary "
        f"file(s), {stats.skipped_unreadable} unreadable file(s)"
    )
    if args.tokenizer_type == BYTE_LEVEL:
        print(
            f"preprocess_data: train with --tokenizer-type NullTokenizer --vocab-size "
            f"{args.vocab_size or BYTE_VOCAB_SIZE} --data-path "
            f"{output_prefix(args.output_prefix, next(iter(stats.documents)))}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
