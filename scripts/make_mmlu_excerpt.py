"""Build the MMLU excerpt shipped inside peerinfer (peerinfer/data/mmlu_excerpt.json).

A fresh clone has no ../shared data, yet the demo and the tests need MMLU prompts. The excerpt
keeps, for every subject, the whole dev split (the 5 few-shot examples that form a request's
shared prefix) and the first few test questions (the unique suffixes), about 200 kB of JSON.
It also writes MMLU_LICENSE.txt beside it: MMLU is MIT-licensed and the notice must travel.

Usage:
    python scripts/make_mmlu_excerpt.py [--source DIR] [--out DIR] [--test-per-subject N]

The source defaults to $PEERINFER_MMLU or ../shared/data/mmlu. The output is deterministic
(sorted subjects, rows in file order), so re-running it on the same data changes nothing.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from peerinfer.workload import EXCERPT_FORMAT, MMLU, default_data_dir  # noqa: E402

EXPECTED_SUBJECTS = 57
DEV_ROWS = 5
#: Above this the excerpt is written gzipped (the loader reads both).
GZIP_ABOVE_BYTES = 512 * 1024

LICENSE_TEXT = """\
The file mmlu_excerpt.json in this directory holds an excerpt of MMLU (Hendrycks et al.,
"Measuring Massive Multitask Language Understanding", ICLR 2021): for each of the 57 subjects,
the complete dev split (5 questions) and the first {test_per_subject} questions of the test split, unchanged.

Upstream: https://github.com/hendrycks/test (the data.tar release).
Provenance of the copy used: the upstream data.tar contents as redistributed unchanged in
hiyouga/LLaMA-Factory evaluation/mmlu/mmlu.zip (commit
465ee8119aa489a41bee0b01b3c105a2f3dd137f, zip sha256
9e2b2d78bf59d80baf271a13005568ef0aca17bd663f2e5ebfecdc07a68f0edc); dev and test were
cross-checked row for row against an independent copy. The excerpt is produced by
scripts/make_mmlu_excerpt.py in the peerinfer repository.

MIT License

Copyright (c) 2020 Dan Hendrycks

Permission is hereby granted, free of charge, to any person obtaining a copy
of this software and associated documentation files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.
"""


def build_excerpt(mmlu: MMLU, test_per_subject: int) -> dict[str, object]:
    subjects = mmlu.subjects
    if len(subjects) != EXPECTED_SUBJECTS:
        raise SystemExit(f"expected {EXPECTED_SUBJECTS} subjects in {mmlu.source}, got {len(subjects)}")
    out: dict[str, object] = {}
    for subject in subjects:
        dev = mmlu.dev(subject)
        if len(dev) != DEV_ROWS:
            raise SystemExit(f"{subject}: expected {DEV_ROWS} dev rows, got {len(dev)}")
        test = mmlu.test(subject)[:test_per_subject]
        out[subject] = {"dev": [q.to_row() for q in dev], "test": [q.to_row() for q in test]}
    return {
        "format": EXCERPT_FORMAT,
        "version": 1,
        "description": (
            f"MMLU excerpt: for each subject the full dev split and the first {test_per_subject} "
            "test questions; rows are [question, A, B, C, D, answer]."
        ),
        "license": "MIT, Copyright (c) 2020 Dan Hendrycks (hendrycks/test); see MMLU_LICENSE.txt",
        "subjects": out,
    }


def render(document: dict[str, object]) -> str:
    """Pretty JSON with one question row per line, so the committed file reads and diffs well."""

    def dump(value: object) -> str:
        return json.dumps(value, ensure_ascii=False)

    lines = ["{"]
    for key, value in document.items():
        if key != "subjects":
            lines.append(f" {dump(key)}: {dump(value)},")
    lines.append(' "subjects": {')
    subjects = document["subjects"]
    assert isinstance(subjects, dict)
    for i, (subject, splits) in enumerate(sorted(subjects.items())):
        lines.append(f"  {dump(subject)}: {{")
        for j, split in enumerate(("dev", "test")):
            rows = ",\n".join(f"    {dump(row)}" for row in splits[split])
            lines.append(f'   "{split}": [\n{rows}\n   ]' + ("," if j == 0 else ""))
        lines.append("  }" + ("," if i < len(subjects) - 1 else ""))
    lines += [" }", "}"]
    text = "\n".join(lines) + "\n"
    if json.loads(text) != document:
        raise AssertionError("render() changed the document")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=None, help="MMLU directory (dev/, test/)")
    parser.add_argument("--out", type=Path, default=REPO / "peerinfer" / "data")
    parser.add_argument("--test-per-subject", type=int, default=4)
    args = parser.parse_args(argv)
    source = args.source or default_data_dir()
    if source is None:
        parser.error("no MMLU directory: pass --source or set PEERINFER_MMLU")
    mmlu = MMLU.load(source)
    document = build_excerpt(mmlu, args.test_per_subject)
    data = render(document).encode()
    args.out.mkdir(parents=True, exist_ok=True)
    target = args.out / "mmlu_excerpt.json"
    stale = args.out / "mmlu_excerpt.json.gz"
    if len(data) > GZIP_ABOVE_BYTES:
        target, stale = stale, target
        data = gzip.compress(data, mtime=0)
    target.write_bytes(data)
    stale.unlink(missing_ok=True)
    license_text = LICENSE_TEXT.format(test_per_subject=args.test_per_subject)
    (args.out / "MMLU_LICENSE.txt").write_text(license_text, encoding="utf-8")
    print(f"wrote {target} ({len(data):,} bytes, {len(mmlu.subjects)} subjects) from {mmlu.source}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
