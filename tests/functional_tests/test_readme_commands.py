"""The README's runnable shell blocks run as written (CPU, short), so they cannot rot.

A block is runnable when the line right before its opening fence is ``<!-- runnable: NAME -->``
(an HTML comment: invisible on the rendered page). Each runnable block of ``README.md`` and
``examples/README.md`` is run with ``bash -euo pipefail`` in a fresh directory that stands in for a
clone (every top-level entry of this checkout symlinked into it, ``.venv`` included), with the
environment of ``scripts/setup.sh`` active (its ``bin/`` first on ``PATH``), as a user who copied
it would. Beyond the exit code, every top-level entry a block creates must be ignored by
``.gitignore`` (commands must not leave untracked files in a clone), and blocks with a NAME known
here get their outputs checked.

``cpu-train`` (one 2-rank launch) is the entrypoint smoke run of the quick lane
(``scripts/test.sh --quick``, marker ``quick``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import REPO, count_real_launch, printed_losses

MARKER = re.compile(r"^<!-- runnable: ([\w-]+) -->$")
QUICK = {"cpu-train"}


def runnable_blocks(path: Path) -> list[tuple[str, str]]:
    """(name, shell text) of every block in ``path`` whose fence follows a runnable marker."""
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        m = MARKER.match(line.strip())
        if not m:
            continue
        assert i + 1 < len(lines) and lines[i + 1].strip() in ("```bash", "```sh"), (
            f"{path.name}:{i + 1}: a runnable marker must be followed by a ```bash fence"
        )
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        out.append((m.group(1), "\n".join(lines[i + 2 : end])))
    return out


BLOCKS = [
    (f"{p.relative_to(REPO)}:{name}", text)
    for p in (REPO / "README.md", REPO / "examples" / "README.md")
    for name, text in runnable_blocks(p)
]


def test_the_readme_has_runnable_blocks():
    names = {b[0].split(":")[1] for b in BLOCKS}
    assert {"quickstart", "cpu-train", "preprocess"} <= names, names


def _clone(tmp_path: Path) -> Path:
    """A directory that behaves like a clone with its environment set up: symlinks to this
    checkout's tracked top-level entries and to ``.venv``."""
    tracked = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    )
    top = {Path(p).parts[0] for p in tracked.stdout.split()} | {".venv", ".gitignore"}
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in sorted(top):
        if (REPO / name).exists():
            (clone / name).symlink_to(REPO / name)
    return clone


def _ignored(clone: Path, names: list[str]) -> list[str]:
    """The names that ``.gitignore`` ignores (as ``git check-ignore`` decides, no index)."""
    if not names:
        return []
    asked = {n + ("/" if (clone / n).is_dir() else ""): n for n in names}  # `/runs/` matches dirs
    proc = subprocess.run(
        ["git", "-C", str(REPO), "check-ignore", "--no-index", "--stdin"],
        input="\n".join(asked),
        capture_output=True,
        text=True,
    )
    return sorted(asked[p] for p in proc.stdout.split())


def _check_cpu_train(clone: Path, out: str) -> None:
    assert (clone / "runs" / "cpu-demo" / "ckpt" / "iter_0000020").is_dir(), out[-3000:]
    printed = printed_losses(out)
    assert sorted(printed) == [1, 5, 10, 15, 20], sorted(
        printed
    )  # --log-interval 5 (and the first)
    assert all(0 < float(v) < 10 for v in printed.values()), printed
    assert "validation loss at iteration 10" in out and "validation loss at iteration 20" in out


def _check_preprocess(clone: Path, out: str) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ds = IndexedDataset(str(clone / "data" / "corpus_text_document"))
    docs = [ds[i].tolist() for i in range(len(ds))]
    assert docs == [list(b"Hello, Megatron.") + [256], list(b"A second document.") + [256]], docs


def _check_quickstart(clone: Path, out: str) -> None:
    lines = [ln.split()[0] for ln in out.splitlines() if ln.startswith("  ") and ln.split()]
    for what in ("setup", "corpus", "trained", "lost", "recovered", "verified", "finished"):
        assert what in lines, out
    assert "rank 1: local checkpoint at iteration 12: repaired from rank 0's replica" in out, out
    assert len(out.splitlines()) <= 16, out  # a few lines; the rest is in the logs
    work = clone / "runs" / "quickstart"
    rows = [json.loads(x) for x in (work / "losses.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == list(range(1, 21))
    assert sorted(p.name for p in (work / "local" / "1").glob("iter_0000016_*_local.pt")) == [
        "iter_0000016_0_local.pt",
        "iter_0000016_1_local.pt",
    ]  # its own shard and rank 0's replica
    for log in ("setup", "preprocess", "part1", "part2", "verify"):
        assert (work / f"{log}.log").stat().st_size > 0
    assert f"TensorBoard: {work / 'tb'} (view: " in out, out
    assert len(list((work / "tb").glob("events.out.tfevents.*"))) == 2  # one per launch
    assert "(iterations 1-20; resumed at 12 after 12 (0 iterations lost); " in out, out
    assert (work / "losses.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


CHECKS = {
    "cpu-train": _check_cpu_train,
    "preprocess": _check_preprocess,
    "quickstart": _check_quickstart,
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, text",
    [
        pytest.param(n, t, id=n, marks=[pytest.mark.quick] if n.split(":")[1] in QUICK else [])
        for n, t in BLOCKS
    ],
)
def test_runnable_block(tmp_path, name, text):
    clone = _clone(tmp_path)
    before = set(os.listdir(clone))
    env = {
        **os.environ,
        "PATH": f"{clone / '.venv' / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "VIRTUAL_ENV": str(clone / ".venv"),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("PYTHONPATH", None)  # as a user's shell: the project is installed in the venv
    count_real_launch(["bash", "-euo", "pipefail", "-c", text])
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", text],
        cwd=clone,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, (
        f"{name} failed ({proc.returncode}):\n{text}\n---\n{proc.stdout[-6000:]}"
    )
    created = sorted(set(os.listdir(clone)) - before)
    assert sorted(_ignored(clone, created)) == created, (
        f"{name} left files that .gitignore does not cover: "
        f"{sorted(set(created) - set(_ignored(clone, created)))}"
    )
    check = CHECKS.get(name.split(":")[1])
    if check:
        check(clone, proc.stdout)


if __name__ == "__main__":  # print the blocks, e.g. to copy them
    for n, t in BLOCKS:
        print(f"# {n}\n{t}\n", file=sys.stdout)
