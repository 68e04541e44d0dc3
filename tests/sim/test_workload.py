"""MMLU loading, prompt format, seeded workloads (skews, arrivals, chats) and their files."""

from __future__ import annotations

import gzip
import importlib.util
import json
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peerinfer.errors import ConfigError
from peerinfer.workload import (
    CHAT_SYSTEM_PROMPT,
    HOT_SHARE,
    MMLU,
    MMLUQuestion,
    Skew,
    WorkloadItem,
    default_data_dir,
    five_shot_prefix,
    load_workload,
    mmlu_workload,
    multiturn_workload,
    parse_skew,
    question_suffix,
    save_workload,
)

REPO = Path(__file__).resolve().parents[2]
SHARED_MMLU = REPO.parent / "shared" / "data" / "mmlu"
EXCERPT = REPO / "peerinfer" / "data" / "mmlu_excerpt.json"
needs_shared = pytest.mark.skipif(
    not (SHARED_MMLU / "dev").is_dir(), reason="the full MMLU set (../shared/data/mmlu) is absent"
)


@pytest.fixture(scope="module")
def excerpt() -> MMLU:
    return MMLU.load()


def q(subject: str, text: str, answer: str = "A") -> MMLUQuestion:
    return MMLUQuestion(subject, text, ("w", "x", "y", "z"), answer)


def write_csv(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode())


def tiny_mmlu_dir(root: Path) -> Path:
    """Two subjects; one file with CRLF line ends and a quoted field holding a newline."""
    write_csv(root / "dev" / "algebra_dev.csv", 'What is 1+1?,1,2,3,4,B\r\n"Two\r\nlines",a,b,c,d,D\r\n')
    write_csv(root / "test" / "algebra_test.csv", "What is 2+2?,4,5,6,7,A\n")
    write_csv(root / "dev" / "world_history_dev.csv", "Who?,p,q,r,s,C\n")
    write_csv(root / "test" / "world_history_test.csv", "When?,p,q,r,s,D\nWhere?,\"p, q\",r,s,t,B\n")
    return root


# --------------------------------------------------------------------------------------------
# Loading.


def test_the_packaged_excerpt_has_every_subject_with_five_dev_rows(excerpt: MMLU) -> None:
    assert len(excerpt.subjects) == 57
    assert excerpt.subjects == sorted(excerpt.subjects)
    for subject in excerpt.subjects:
        dev, test = excerpt.dev(subject), excerpt.test(subject)
        assert len(dev) == 5 and len(test) == 4
        for question in dev + test:
            assert question.subject == subject
            assert question.answer in "ABCD" and len(question.answer) == 1
            assert len(question.choices) == 4 and question.question
    assert excerpt.dev("abstract_algebra")[0].question.startswith("Find all c in Z_3")


def test_the_excerpt_is_small_and_licensed() -> None:
    assert EXCERPT.stat().st_size < 1_000_000
    license_text = (EXCERPT.parent / "MMLU_LICENSE.txt").read_text()
    assert "Copyright (c) 2020 Dan Hendrycks" in license_text
    assert "hendrycks/test" in license_text and "MIT License" in license_text


def test_a_directory_is_read_with_csv_rules(tmp_path: Path) -> None:
    mmlu = MMLU.load(tiny_mmlu_dir(tmp_path))
    assert mmlu.subjects == ["algebra", "world_history"]
    assert mmlu.dev("algebra") == [
        MMLUQuestion("algebra", "What is 1+1?", ("1", "2", "3", "4"), "B"),
        MMLUQuestion("algebra", "Two\r\nlines", ("a", "b", "c", "d"), "D"),
    ]
    assert mmlu.test("world_history")[1].choices == ("p, q", "r", "s", "t")
    assert mmlu.source == str(tmp_path)


def test_the_returned_lists_are_copies(excerpt: MMLU) -> None:
    excerpt.dev("anatomy").clear()
    assert len(excerpt.dev("anatomy")) == 5


def test_an_excerpt_file_plain_or_gzipped_loads_like_the_package(tmp_path: Path, excerpt: MMLU) -> None:
    plain = tmp_path / "x.json"
    plain.write_bytes(EXCERPT.read_bytes())
    packed = tmp_path / "x.json.gz"
    packed.write_bytes(gzip.compress(EXCERPT.read_bytes()))
    for path in (plain, packed):
        loaded = MMLU.load(path)
        assert loaded.subjects == excerpt.subjects
        assert all(loaded.test(s) == excerpt.test(s) for s in excerpt.subjects)


@needs_shared
def test_the_full_shared_set_loads() -> None:
    full = MMLU.load(SHARED_MMLU)
    assert len(full.subjects) == 57
    assert sum(len(full.test(s)) for s in full.subjects) == 14_042
    assert all(len(full.dev(s)) == 5 for s in full.subjects)


@needs_shared
def test_the_committed_excerpt_is_what_the_script_builds_from_the_full_set() -> None:
    spec = importlib.util.spec_from_file_location("make_mmlu_excerpt", REPO / "scripts" / "make_mmlu_excerpt.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    full = MMLU.load(SHARED_MMLU)
    assert script.render(script.build_excerpt(full, 4)) == EXCERPT.read_text(encoding="utf-8")


def test_default_data_dir_prefers_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PEERINFER_MMLU", str(tmp_path))
    assert default_data_dir() == tmp_path
    monkeypatch.delenv("PEERINFER_MMLU")
    found = default_data_dir()
    if (SHARED_MMLU / "dev").is_dir():
        assert found is not None and found.resolve() == SHARED_MMLU.resolve()
    else:
        assert found is None


def _broken(root: Path, how: str) -> Path:
    tiny_mmlu_dir(root)
    if how == "no dev dir":
        for f in (root / "dev").iterdir():
            f.unlink()
        (root / "dev").rmdir()
    elif how == "no test dir":
        for f in (root / "test").iterdir():
            f.unlink()
        (root / "test").rmdir()
    elif how == "dev dir empty":
        for f in (root / "dev").iterdir():
            f.unlink()
    elif how == "test file missing":
        (root / "test" / "algebra_test.csv").unlink()
    elif how == "five columns":
        write_csv(root / "test" / "algebra_test.csv", "ok?,1,2,3,4,A\nbad?,1,2,3,4\n")
    elif how == "answer E":
        write_csv(root / "dev" / "algebra_dev.csv", "bad?,1,2,3,4,E\n")
    elif how == "empty split":
        write_csv(root / "test" / "algebra_test.csv", "")
    elif how == "not utf-8":
        (root / "test" / "algebra_test.csv").write_bytes(b"caf\xe9,1,2,3,4,A\n")
    return root


@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("no dev dir", "dev/ is missing"),
        ("no test dir", "test/ is missing"),
        ("dev dir empty", "_dev.csv"),
        ("test file missing", "algebra_test.csv"),
        ("five columns", "algebra_test.csv:2"),
        ("answer E", "'E'"),
        ("empty split", "algebra"),
        ("not utf-8", "algebra_test.csv"),
    ],
)
def test_a_broken_directory_raises_config_error_naming_the_problem(
    tmp_path: Path, how: str, named: str
) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        MMLU.load(_broken(tmp_path, how))
    assert named in str(info.value)


@pytest.mark.parametrize(
    "content",
    [b"not json", b"[]", b'{"format": "other"}', b'{"format": "peerinfer-mmlu-excerpt"}',
     b'{"format": "peerinfer-mmlu-excerpt", "subjects": {"a": {"dev": [["q","1","2","3","4","A"]]}}}',
     b'{"format": "peerinfer-mmlu-excerpt", "subjects": {"a": {"dev": [[1,2]], "test": []}}}',
     b"\x1f\x8b broken gzip"],
)
def test_a_bad_excerpt_file_raises_config_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / ("x.json.gz" if content.startswith(b"\x1f\x8b") else "x.json")
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=str(path.name)):
        MMLU.load(path)


def test_a_missing_path_raises_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such MMLU"):
        MMLU.load(tmp_path / "nowhere")


def test_an_unknown_subject_raises_config_error(excerpt: MMLU) -> None:
    with pytest.raises(ConfigError, match="astrology"):
        excerpt.dev("astrology")
    with pytest.raises(ConfigError, match="astrology"):
        excerpt.test("astrology")


# --------------------------------------------------------------------------------------------
# Prompt format.


def test_five_shot_prefix_is_the_standard_mmlu_header() -> None:
    rows = [q("high_school_physics", "Q1?", "B"), q("high_school_physics", "Q2?", "D")]
    assert five_shot_prefix("high_school_physics", rows) == (
        "The following are multiple choice questions (with answers) about high school physics.\n\n"
        "Q1?\nA. w\nB. x\nC. y\nD. z\nAnswer: B\n\n"
        "Q2?\nA. w\nB. x\nC. y\nD. z\nAnswer: D\n\n"
    )


def test_question_suffix_ends_with_answer_colon() -> None:
    assert question_suffix(q("s", "Why?")) == "Why?\nA. w\nB. x\nC. y\nD. z\nAnswer:"


# --------------------------------------------------------------------------------------------
# Skews.


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("uniform", Skew("uniform")),
        ("zipf:1.2", Skew("zipf", 1.2)),
        ("zipf:2", Skew("zipf", 2.0)),
        (" hot:5 ", Skew("hot", 5.0)),
    ],
)
def test_parse_skew_accepts_the_three_forms(spec: str, expected: Skew) -> None:
    assert parse_skew(spec) == expected
    assert parse_skew(str(expected)) == expected
    assert parse_skew(expected) is expected


@pytest.mark.parametrize(
    "spec",
    ["", "zipf", "zipf:", "zipf:0", "zipf:-1", "zipf:nan", "zipf:inf", "zipf:x", "hot", "hot:0",
     "hot:-2", "hot:1.5", "hot:x", "uniform:3", "pareto:1", "Uniform", 3],
)
def test_parse_skew_refuses_anything_else(spec: Any) -> None:
    with pytest.raises(ConfigError):
        parse_skew(spec)


def test_skew_weights() -> None:
    assert parse_skew("uniform").weights(3) == [1.0, 1.0, 1.0]
    zipf = parse_skew("zipf:1").weights(4)
    assert zipf == pytest.approx([1.0, 1 / 2, 1 / 3, 1 / 4])
    hot = parse_skew("hot:2").weights(6)
    assert sum(hot[:2]) == pytest.approx(HOT_SHARE) and sum(hot) == pytest.approx(1.0)
    assert parse_skew("zipf:5000").weights(57)[1:] == [0.0] * 56  # underflows, no OverflowError
    assert parse_skew("hot:3").weights(3) == [1.0, 1.0, 1.0]
    with pytest.raises(ConfigError):
        parse_skew("hot:4").weights(3)


def shares(items: list[WorkloadItem]) -> list[float]:
    counts = Counter(item.prefix_key for item in items)
    return sorted((c / len(items) for c in counts.values()), reverse=True)


def test_zipf_concentrates_requests_on_the_top_subject(excerpt: MMLU) -> None:
    uniform = shares(mmlu_workload(excerpt, 4000, skew="uniform", seed=3))
    zipf = shares(mmlu_workload(excerpt, 4000, skew="zipf:1.2", seed=3))
    harmonic = sum(r**-1.2 for r in range(1, 58))
    assert zipf[0] > 3 * uniform[0]
    assert zipf[0] == pytest.approx(1 / harmonic, abs=0.03)
    assert zipf[1] == pytest.approx(2**-1.2 / harmonic, abs=0.03)
    assert len(uniform) == 57 and uniform[0] < 0.04


def test_hot_subjects_get_their_share(excerpt: MMLU) -> None:
    top = shares(mmlu_workload(excerpt, 4000, skew="hot:3", seed=5))
    assert sum(top[:3]) == pytest.approx(HOT_SHARE, abs=0.03)
    assert max(top[3:]) < min(top[:3]) / 5


def test_the_seed_chooses_which_subjects_are_popular(excerpt: MMLU) -> None:
    def top_subject(seed: int) -> str:
        items = mmlu_workload(excerpt, 500, skew="hot:1", seed=seed)
        return Counter(i.prefix_key for i in items).most_common(1)[0][0]

    assert len({top_subject(seed) for seed in range(6)}) > 1


# --------------------------------------------------------------------------------------------
# MMLU workloads.


def test_mmlu_workload_is_deterministic_from_the_seed(excerpt: MMLU) -> None:
    a = mmlu_workload(excerpt, 300, skew="zipf:1.1", seed=42, rate=5.0)
    assert a == mmlu_workload(excerpt, 300, skew="zipf:1.1", seed=42, rate=5.0)
    assert a != mmlu_workload(excerpt, 300, skew="zipf:1.1", seed=43, rate=5.0)


def test_the_rate_changes_only_the_arrival_times(excerpt: MMLU) -> None:
    closed = mmlu_workload(excerpt, 200, seed=7)
    opened = mmlu_workload(excerpt, 200, seed=7, rate=2.0)
    assert [(i.prefix, i.suffix) for i in closed] == [(i.prefix, i.suffix) for i in opened]
    assert all(i.arrival_s is None for i in closed)


def test_arrivals_are_poisson_at_the_rate(excerpt: MMLU) -> None:
    items = mmlu_workload(excerpt, 3000, seed=11, rate=4.0)
    times = [i.arrival_s for i in items]
    assert all(t is not None and t > 0 for t in times)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]  # type: ignore[operator]
    assert min(gaps) >= 0
    assert statistics.fmean(gaps) == pytest.approx(1 / 4.0, rel=0.08)
    assert statistics.stdev(gaps) == pytest.approx(1 / 4.0, rel=0.1)  # exponential: sd = mean


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(0, 60),
    seed=st.integers(0, 2**64),
    skew=st.sampled_from(["uniform", "zipf:0.5", "zipf:2", "hot:1", "hot:10"]),
    max_tokens=st.integers(1, 64),
)
def test_every_mmlu_item_is_a_five_shot_prefix_and_a_test_question(
    excerpt: MMLU, n: int, seed: int, skew: str, max_tokens: int
) -> None:
    items = mmlu_workload(excerpt, n, skew=skew, seed=seed, max_tokens=max_tokens)
    assert [i.id for i in items] == list(range(n))
    for item in items:
        subject = item.prefix_key.removeprefix("mmlu:")
        assert item.prefix == five_shot_prefix(subject, excerpt.dev(subject))
        assert item.suffix in {question_suffix(t) for t in excerpt.test(subject)}
        assert item.prompt == item.prefix + item.suffix and item.prompt.endswith("Answer:")
        assert item.max_tokens == max_tokens and item.conversation is None and item.turn is None


def test_a_subject_uses_all_its_questions_before_repeating_one(excerpt: MMLU) -> None:
    items = mmlu_workload(excerpt, 200, skew="hot:1", seed=2)
    hot = Counter(i.prefix_key for i in items).most_common(1)[0][0]
    suffixes = [i.suffix for i in items if i.prefix_key == hot]
    assert len(suffixes) >= 12
    for start in range(0, len(suffixes) - 3, 4):
        assert len(set(suffixes[start : start + 4])) == 4
    assert suffixes[4:8] == suffixes[:4]


@pytest.mark.parametrize(
    "kwargs",
    [{"n": -1}, {"n": 1.5}, {"n": True}, {"rate": 0}, {"rate": -1.0}, {"rate": math.inf},
     {"rate": math.nan}, {"max_tokens": 0}, {"skew": "zipf:0"}, {"skew": "hot:58"}],
)
def test_bad_workload_arguments_raise_config_error(excerpt: MMLU, kwargs: dict[str, Any]) -> None:
    arguments: dict[str, Any] = {"n": 5, "seed": 0, **kwargs}
    with pytest.raises(ConfigError):
        mmlu_workload(excerpt, **arguments)


# --------------------------------------------------------------------------------------------
# Multi-turn chat.


def test_multiturn_workload_is_deterministic() -> None:
    a = multiturn_workload(100, conversations=4, turns=5, seed=1, rate=3.0)
    assert a == multiturn_workload(100, conversations=4, turns=5, seed=1, rate=3.0)
    assert a != multiturn_workload(100, conversations=4, turns=5, seed=2, rate=3.0)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 80),
    conversations=st.integers(1, 6),
    turns=st.integers(1, 6),
    seed=st.integers(0, 2**32),
)
def test_each_turn_extends_the_previous_prompt(n: int, conversations: int, turns: int, seed: int) -> None:
    items = multiturn_workload(n, conversations=conversations, turns=turns, seed=seed)
    assert [i.id for i in items] == list(range(n))
    last: dict[int, WorkloadItem] = {}
    open_now: set[int] = set()
    for item in items:
        assert item.conversation is not None and item.turn is not None
        assert 0 <= item.turn < turns
        assert item.suffix.startswith("User: ") and item.suffix.endswith("\nAssistant:")
        previous = last.get(item.conversation)
        if item.turn == 0:
            assert previous is None
            assert item.prefix == CHAT_SYSTEM_PROMPT and item.prefix_key == "chat:system"
        else:
            assert previous is not None and previous.turn == item.turn - 1
            assert item.prefix.startswith(previous.prompt)
            assert len(item.prefix) > len(previous.prompt)  # the placeholder answer
            assert item.prefix_key == f"chat:{item.conversation}:{item.turn}"
        last[item.conversation] = item
        open_now = {c for c, i in last.items() if i.turn is not None and i.turn < turns - 1}
        assert len(open_now) <= conversations


def test_finished_conversations_are_replaced_by_new_ones() -> None:
    items = multiturn_workload(60, conversations=3, turns=2, seed=0)
    ids = sorted({i.conversation for i in items if i.conversation is not None})
    assert len(ids) >= 20 and ids[:3] == [0, 1, 2]
    assert Counter(i.conversation for i in items).most_common(1)[0][1] <= 2


@pytest.mark.parametrize(
    "kwargs",
    [{"conversations": 0}, {"turns": 0}, {"n": -1}, {"rate": 0.0}, {"user_words": (5, 2)},
     {"answer_words": (0, 3)}, {"max_tokens": 0}],
)
def test_bad_multiturn_arguments_raise_config_error(kwargs: dict[str, Any]) -> None:
    arguments: dict[str, Any] = {"n": 5, "conversations": 2, "turns": 3, "seed": 0, **kwargs}
    with pytest.raises(ConfigError):
        multiturn_workload(**arguments)


# --------------------------------------------------------------------------------------------
# Files.

items_strategy = st.lists(
    st.builds(
        WorkloadItem,
        id=st.integers(0, 2**63),
        arrival_s=st.none(),
        prefix_key=st.text(),
        prefix=st.text(),
        suffix=st.text(min_size=1),
        max_tokens=st.integers(1, 10**6),
        conversation=st.none() | st.integers(0, 2**40),
        turn=st.none() | st.integers(0, 1000),
    ),
    max_size=8,
    unique_by=lambda item: item.id,
)


@settings(max_examples=60, deadline=None)
@given(
    items=items_strategy,
    gaps=st.lists(st.floats(0, 1e6, allow_nan=False), min_size=8, max_size=8) | st.none(),
)
def test_save_then_load_is_exact(tmp_path_factory: pytest.TempPathFactory, items: list[WorkloadItem], gaps: list[float] | None) -> None:
    if gaps is not None:
        now = 0.0
        timed = []
        for item, gap in zip(items, gaps, strict=False):
            now += gap
            timed.append(WorkloadItem(**{**_fields(item), "arrival_s": now}))
        items = timed
    path = tmp_path_factory.mktemp("w") / "workload.jsonl"
    save_workload(items, path)
    assert load_workload(path) == items


def _fields(item: WorkloadItem) -> dict[str, Any]:
    return {name: getattr(item, name) for name in WorkloadItem.__dataclass_fields__}


def test_generated_workloads_round_trip(tmp_path: Path, excerpt: MMLU) -> None:
    for items in (
        mmlu_workload(excerpt, 50, skew="zipf:1.2", seed=9, rate=1.5),
        multiturn_workload(50, conversations=3, turns=4, seed=9),
    ):
        path = tmp_path / "w.jsonl"
        save_workload(items, path)
        assert load_workload(path) == items
        assert json.loads(path.read_text().splitlines()[0]) == {"peerinfer_workload": 1, "items": 50}


def _good_line(**changes: Any) -> str:
    row = {"id": 0, "arrival_s": None, "prefix_key": "k", "prefix": "p", "suffix": "s",
           "max_tokens": 4, "conversation": None, "turn": None, **changes}
    return json.dumps(row)


HEADER1 = '{"peerinfer_workload": 1, "items": 1}'
HEADER2 = '{"peerinfer_workload": 1, "items": 2}'


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("", "empty"),
        ("[1]\n", ":1"),
        ('{"peerinfer_workload": 2, "items": 0}\n', ":1"),
        (f"{HEADER2}\n{_good_line()}\n", "announces"),
        (f"{HEADER1}\nnot json\n", ":2"),
        (f"{HEADER1}\n[]\n", ":2"),
        (f"{HEADER1}\n" + _good_line(extra=1) + "\n", ":2"),
        (f"{HEADER1}\n" + json.dumps({"id": 0}) + "\n", ":2"),
        (f"{HEADER1}\n" + _good_line(id=-1) + "\n", "id"),
        (f"{HEADER1}\n" + _good_line(id=True) + "\n", "id"),
        (f"{HEADER1}\n" + _good_line(arrival_s="1") + "\n", "arrival_s"),
        (f"{HEADER1}\n" + _good_line(arrival_s=-0.5) + "\n", "arrival_s"),
        (f"{HEADER1}\n" + _good_line().replace('"arrival_s": null', '"arrival_s": NaN') + "\n", "arrival_s"),
        (f"{HEADER1}\n" + _good_line(prefix=3) + "\n", "prefix"),
        (f"{HEADER1}\n" + _good_line(prefix="", suffix="") + "\n", "empty"),
        (f"{HEADER1}\n" + _good_line(max_tokens=0) + "\n", "max_tokens"),
        (f"{HEADER1}\n" + _good_line(turn=-1) + "\n", "turn"),
        (f"{HEADER1}\n" + _good_line(conversation="c") + "\n", "conversation"),
        (f"{HEADER2}\n{_good_line()}\n{_good_line()}\n", "unique"),
        (f"{HEADER2}\n{_good_line(arrival_s=1.0)}\n{_good_line(id=1)}\n", "every item"),
        (f"{HEADER2}\n{_good_line(arrival_s=2.0)}\n{_good_line(id=1, arrival_s=1.0)}\n", "decrease"),
    ],
)
def test_load_workload_validates(tmp_path: Path, text: str, named: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_workload(path)
    assert named in str(info.value)


def test_loading_a_missing_file_raises_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_workload(tmp_path / "absent.jsonl")
