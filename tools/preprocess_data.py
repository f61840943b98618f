"""Turn a directory of text files into a Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``).

Each file is one document. Tokens are the document's UTF-8 bytes (ids 0-255) followed by an
end-of-document id, for ``--tokenizer-type NullTokenizer --vocab-size 257`` (NullTokenizer's
end-of-document id is ``vocab_size - 1`` = 256; with 256 it would collide with byte 0xFF).
With ``--hf-tokenizer DIR`` a HuggingFace tokenizer installed locally is used instead (nothing is
downloaded); its ``eos_token_id`` ends each document.

    python tools/preprocess_data.py --input DIR --output-prefix data/corpus [--pattern '*.py']

Written with ``megatron.core.datasets.indexed_dataset.IndexedDatasetBuilder``; train with
``pretrain_gpt.py --data-path data/corpus_text_document``... see README.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

BYTE_VOCAB_SIZE = 257
BYTE_EOD_ID = BYTE_VOCAB_SIZE - 1


class PreprocessError(RuntimeError):
    """Bad input directory or tokenizer; the message says what to do."""


def find_documents(input_dir: str, pattern: str = "*") -> list[Path]:
    """Regular files under ``input_dir`` matching ``pattern`` (recursive), sorted for reproducibility.

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
        raise PreprocessError(f"--input {input_dir!r} holds no file matching {pattern!r}; "
                              "point it at a directory of text files")
    return files


def byte_tokenize(text: bytes) -> np.ndarray:
    """Byte-level token ids of a document, with the end-of-document id appended.

    Returns:
        uint16 array of shape [len(text) + 1]; values 0-255, last value ``BYTE_EOD_ID`` (256).
    """
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
    return np.append(ids, np.uint16(BYTE_EOD_ID))


def build(input_dir: str, output_prefix: str, pattern: str = "*", hf_tokenizer: str | None = None,
          progress: bool = True) -> dict[str, int]:
    """Write ``output_prefix.bin`` and ``output_prefix.idx``.

    Returns:
        {"documents": n, "tokens": n, "skipped": n} (empty or unreadable files are skipped).

    Raises:
        PreprocessError: see :func:`find_documents`; a tokenizer directory that does not load; no
            document could be read.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    files = find_documents(input_dir, pattern)
    if hf_tokenizer:
        try:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(hf_tokenizer, local_files_only=True)
        except Exception as e:  # noqa: BLE001 - report any load failure the same way
            raise PreprocessError(f"--hf-tokenizer {hf_tokenizer!r} did not load locally: {e}") from e
        if tok.eos_token_id is None:
            raise PreprocessError(f"--hf-tokenizer {hf_tokenizer!r} has no eos_token_id to end documents")
        dtype = np.int32

        def tokenize(data: bytes) -> np.ndarray:
            ids = tok(data.decode("utf-8", errors="replace"), add_special_tokens=False)["input_ids"]
            return np.asarray(ids + [tok.eos_token_id], dtype=dtype)
    else:
        dtype = np.uint16
        tokenize = byte_tokenize

    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(get_bin_path(output_prefix), dtype=dtype)
    stats = {"documents": 0, "tokens": 0, "skipped": 0}
    for path in tqdm(files, desc="documents", unit="file", disable=not progress):
        try:
            data = path.read_bytes()
        except OSError:
            stats["skipped"] += 1
            continue
        if not data:
            stats["skipped"] += 1
            continue
        ids = tokenize(data)
        builder.add_document(ids, [len(ids)])
        stats["documents"] += 1
        stats["tokens"] += len(ids)
    if stats["documents"] == 0:
        builder.data_file.close()
        os.remove(get_bin_path(output_prefix))
        raise PreprocessError(f"no readable, non-empty file under {input_dir!r}")
    builder.finalize(get_idx_path(output_prefix))
    return stats


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", required=True, help="directory of text files (searched recursively)")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    parser.add_argument("--pattern", default="*", help="file glob, e.g. '*.py' (default: all files)")
    parser.add_argument("--hf-tokenizer", default=None,
                        help="directory of a locally installed HuggingFace tokenizer (default: bytes)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    try:
        stats = build(args.input, args.output_prefix, args.pattern, args.hf_tokenizer,
                      progress=not args.no_progress)
    except PreprocessError as e:
        print(f"preprocess_data: error: {e}", file=sys.stderr)
        return 2
    print(f"preprocess_data: wrote {args.output_prefix}.bin/.idx: {stats['documents']} documents, "
          f"{stats['tokens']} tokens ({stats['skipped']} skipped)")
    if not args.hf_tokenizer:
        print(f"preprocess_data: train with --tokenizer-type NullTokenizer --vocab-size {BYTE_VOCAB_SIZE} "
              f"--data-path {args.output_prefix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
