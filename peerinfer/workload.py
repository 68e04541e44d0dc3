"""Request workloads for the demo, the benchmarks and the simulator.

Two kinds of workload share one item type, ``WorkloadItem``: a prompt split into a *prefix* that
many requests share (its identity is ``prefix_key``) and a *suffix* unique to the request.

MMLU (``mmlu_workload``)
    The prefix is a subject's standard 5-shot block built from the ``dev`` split, the suffix one
    ``test`` question of that subject. Which subject each request asks about follows a *skew*:

    - ``uniform``: every subject equally often.
    - ``zipf:A``: the subjects are ranked in a seeded random order and the subject of rank ``r``
      (1-based) is drawn with weight ``1 / r**A``; ``A > 0``, larger is more skewed.
    - ``hot:K``: the first ``K`` subjects of that seeded ranking share ``HOT_SHARE`` (80 %) of
      the requests equally, the others share the rest equally.

    Within a subject, questions are taken in a seeded shuffled order and reused cyclically once
    exhausted (the packaged excerpt holds only 4 test questions per subject, so long runs repeat
    whole prompts; point ``MMLU.load`` at the full data set to avoid that).

Multi-turn chat (``multiturn_workload``)
    Synthetic conversations that share a system prompt. Turn ``t`` of a conversation is sent
    with the whole conversation so far as its prefix: the previous turn's full prompt followed
    by a deterministic placeholder answer (the model's real reply is not known in advance), and
    the new user message as its suffix.

RAG-style prompts (``rag_workload``)
    Synthetic retrieval-augmented prompts: one of a few system prompts (the application), then
    a long retrieved document drawn by a skew over a pool of documents, then a question. The
    same documents come back under every system prompt, so the long shared prefixes are the
    (system prompt, document) pairs, while a request's scaffold is its system prompt alone.

Scaffolds
    Every item carries its prompt's *scaffold* (``WorkloadItem.scaffold``), the (role, content)
    messages that Mesh LLM's cache hints hash (``peerinfer.core.prefix.scaffold_messages``):
    the system prompt of a chat or a RAG prompt; for MMLU, its 5-shot block, taken as the
    system message of a chat whose user message is the question (the rival's best case: one
    exact scaffold per subject).

Arrivals are a Poisson process of the given ``rate`` (requests per second) or ``None`` for a
closed loop. Everything is deterministic from ``seed``: each independent choice (ranking,
subjects, questions, arrival gaps) draws from its own ``random.Random`` seeded from one master
``random.Random(seed)``, so changing ``rate`` does not change which prompts are sent.

Workloads are saved as JSON lines (``save_workload``): a header line
``{"peerinfer_workload": 1, "items": n}`` and then one object per item; ``load_workload``
validates every field and raises ``ConfigError`` naming the line at fault.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
import os
import random
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from importlib import resources
from itertools import accumulate
from pathlib import Path
from typing import Any, Literal

from peerinfer.core.quickinit import quick_init
from peerinfer.errors import ConfigError

__all__ = [
    "HOT_SHARE",
    "MMLU",
    "MMLUQuestion",
    "Skew",
    "WorkloadItem",
    "default_data_dir",
    "five_shot_prefix",
    "load_workload",
    "mmlu_workload",
    "multiturn_workload",
    "parse_skew",
    "question_suffix",
    "rag_workload",
    "save_workload",
]

ANSWERS = ("A", "B", "C", "D")
#: The share of requests that the ``hot:K`` subjects receive together.
HOT_SHARE = 0.8
#: The packaged excerpt: every subject's dev split and its first test questions.
EXCERPT_RESOURCE = "mmlu_excerpt.json"  # or .json.gz, under peerinfer/data/
EXCERPT_FORMAT = "peerinfer-mmlu-excerpt"
WORKLOAD_FORMAT_VERSION = 1

# --------------------------------------------------------------------------------------------
# MMLU data.


@quick_init
@dataclass(frozen=True, slots=True)
class MMLUQuestion:
    """One multiple-choice question; ``answer`` is the letter of the right choice."""

    subject: str
    question: str
    choices: tuple[str, str, str, str]
    answer: str

    @classmethod
    def from_row(cls, subject: str, row: Sequence[Any], where: str) -> MMLUQuestion:
        """Build from an MMLU row ``[question, A, B, C, D, answer]``; ConfigError if malformed."""
        if not isinstance(row, list | tuple) or len(row) != 6:
            raise ConfigError(f"{where}: expected 6 columns (question, A, B, C, D, answer)")
        if not all(isinstance(cell, str) for cell in row):
            raise ConfigError(f"{where}: every column must be text")
        question, a, b, c, d, answer = row
        if answer not in ANSWERS:
            raise ConfigError(f"{where}: answer {answer!r} is not one of A, B, C, D")
        return cls(subject, question, (a, b, c, d), answer)

    def to_row(self) -> list[str]:
        return [self.question, *self.choices, self.answer]


class MMLU:
    """The MMLU questions of every subject: the ``dev`` split (few-shot examples) and ``test``."""

    def __init__(
        self,
        dev: Mapping[str, Sequence[MMLUQuestion]],
        test: Mapping[str, Sequence[MMLUQuestion]],
        source: str,
    ) -> None:
        if set(dev) != set(test):
            missing = sorted(set(dev) ^ set(test))
            raise ConfigError(f"{source}: subjects lack a dev or a test split: {missing}")
        if not dev:
            raise ConfigError(f"{source}: no MMLU subjects found")
        for subject in dev:
            if not dev[subject] or not test[subject]:
                raise ConfigError(f"{source}: subject {subject!r} has an empty dev or test split")
        self._dev = {s: tuple(rows) for s, rows in sorted(dev.items())}
        self._test = {s: tuple(rows) for s, rows in sorted(test.items())}
        #: Where the questions came from (a directory, a file, or the packaged excerpt).
        self.source = source

    @classmethod
    def load(cls, path: str | Path | None = None) -> MMLU:
        """Load MMLU.

        ``path`` is a directory laid out like the upstream release (``dev/<subject>_dev.csv``
        and ``test/<subject>_test.csv``; ``val/`` is not needed), or an excerpt file
        (``.json`` or ``.json.gz``, as written by ``scripts/make_mmlu_excerpt.py``), or ``None``
        for the excerpt packaged with peerinfer. Raises ConfigError if files are missing or
        malformed.
        """
        if path is None:
            return cls._from_excerpt(_packaged_excerpt(), "packaged MMLU excerpt")
        path = Path(path)
        if path.is_file():
            try:
                raw = path.read_bytes()
                text = (gzip.decompress(raw) if path.suffix == ".gz" else raw).decode("utf-8")
            except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as exc:
                raise ConfigError(f"{path}: cannot read the MMLU excerpt: {exc}") from exc
            return cls._from_excerpt(text, str(path))
        if not path.is_dir():
            raise ConfigError(f"{path}: no such MMLU directory or excerpt file")
        return cls._from_directory(path)

    @classmethod
    def _from_directory(cls, root: Path) -> MMLU:
        dev_dir, test_dir = root / "dev", root / "test"
        for split_dir in (dev_dir, test_dir):
            if not split_dir.is_dir():
                raise ConfigError(f"{root}: not an MMLU directory: {split_dir.name}/ is missing")
        dev_files = sorted(dev_dir.glob("*_dev.csv"))
        if not dev_files:
            raise ConfigError(f"{dev_dir}: no <subject>_dev.csv files")
        dev: dict[str, list[MMLUQuestion]] = {}
        test: dict[str, list[MMLUQuestion]] = {}
        for dev_file in dev_files:
            subject = dev_file.name.removesuffix("_dev.csv")
            test_file = test_dir / f"{subject}_test.csv"
            if not test_file.is_file():
                raise ConfigError(f"{test_file}: missing (there is a dev split for {subject!r})")
            dev[subject] = _read_csv(subject, dev_file)
            test[subject] = _read_csv(subject, test_file)
        return cls(dev, test, str(root))

    @classmethod
    def _from_excerpt(cls, text: str, source: str) -> MMLU:
        try:
            document = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{source}: not JSON: {exc}") from exc
        if not isinstance(document, dict) or document.get("format") != EXCERPT_FORMAT:
            raise ConfigError(f"{source}: not a peerinfer MMLU excerpt")
        subjects = document.get("subjects")
        if not isinstance(subjects, dict):
            raise ConfigError(f"{source}: 'subjects' must be an object")
        dev: dict[str, list[MMLUQuestion]] = {}
        test: dict[str, list[MMLUQuestion]] = {}
        for subject, splits in subjects.items():
            if not isinstance(splits, dict):
                raise ConfigError(f"{source}: subject {subject!r} must be an object")
            for split, out in (("dev", dev), ("test", test)):
                rows = splits.get(split)
                if not isinstance(rows, list):
                    raise ConfigError(f"{source}: {subject}.{split} must be a list of rows")
                out[subject] = [
                    MMLUQuestion.from_row(subject, row, f"{source}: {subject}.{split}[{i}]")
                    for i, row in enumerate(rows)
                ]
        return cls(dev, test, source)

    @property
    def subjects(self) -> list[str]:
        """Subject names (``abstract_algebra``, ...), sorted."""
        return list(self._dev)

    def dev(self, subject: str) -> list[MMLUQuestion]:
        """The few-shot examples of ``subject`` (5 in MMLU)."""
        return list(self._rows(self._dev, subject))

    def test(self, subject: str) -> list[MMLUQuestion]:
        """The test questions of ``subject``, in file order."""
        return list(self._rows(self._test, subject))

    def _rows(
        self, split: Mapping[str, tuple[MMLUQuestion, ...]], subject: str
    ) -> tuple[MMLUQuestion, ...]:
        try:
            return split[subject]
        except KeyError:
            raise ConfigError(f"unknown MMLU subject {subject!r} in {self.source}") from None

    def __repr__(self) -> str:
        return f"MMLU(source={self.source!r}, subjects={len(self._dev)})"


def _packaged_excerpt() -> str:
    data = resources.files("peerinfer").joinpath("data")
    try:
        plain = data.joinpath(EXCERPT_RESOURCE)
        if plain.is_file():
            return plain.read_text(encoding="utf-8")
        return gzip.decompress(data.joinpath(EXCERPT_RESOURCE + ".gz").read_bytes()).decode()
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError) as exc:
        raise ConfigError(f"the packaged MMLU excerpt is missing or unreadable: {exc}") from exc


def _read_csv(subject: str, path: Path) -> list[MMLUQuestion]:
    # newline="" because some upstream files use CRLF and fields may hold newlines.
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            rows = list(csv.reader(handle))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from exc
    return [MMLUQuestion.from_row(subject, row, f"{path}:{i + 1}") for i, row in enumerate(rows)]


def default_data_dir() -> Path | None:
    """Where the full MMLU data set is, if anywhere.

    ``$PEERINFER_MMLU`` when set (returned as given, so a wrong value fails loudly in
    ``MMLU.load``), else ``../shared/data/mmlu`` next to a source checkout of peerinfer when
    that directory exists, else ``None`` (use the packaged excerpt).
    """
    configured = os.environ.get("PEERINFER_MMLU")
    if configured:
        return Path(configured)
    beside_repo = Path(__file__).resolve().parents[2] / "shared" / "data" / "mmlu"
    return beside_repo if (beside_repo / "dev").is_dir() else None


# --------------------------------------------------------------------------------------------
# Prompt format (the one of the original MMLU evaluation code).


def _pretty_subject(subject: str) -> str:
    return subject.replace("_", " ")


def _format_question(question: MMLUQuestion) -> str:
    lines = [question.question]
    lines += [f"{letter}. {choice}" for letter, choice in zip(ANSWERS, question.choices, strict=True)]
    lines.append("Answer:")
    return "\n".join(lines)


def five_shot_prefix(subject: str, dev_rows: Iterable[MMLUQuestion]) -> str:
    """The standard MMLU few-shot header for ``subject``: a title line, then every example
    as ``question / A. .. / .. / D. .. / Answer: X`` followed by a blank line."""
    header = (
        "The following are multiple choice questions (with answers) about "
        f"{_pretty_subject(subject)}.\n\n"
    )
    return header + "".join(f"{_format_question(q)} {q.answer}\n\n" for q in dev_rows)


def question_suffix(question: MMLUQuestion) -> str:
    """``question`` formatted like the few-shot examples, ending with ``Answer:``."""
    return _format_question(question)


# --------------------------------------------------------------------------------------------
# Workload items and skews.


@quick_init
@dataclass(frozen=True, slots=True)
class WorkloadItem:
    """One request of a workload. The prompt is ``prefix + suffix``.

    ``arrival_s`` is the offset from the start of the run (``None``: send when a slot frees up).
    ``prefix_key`` names the shared prefix (``mmlu:<subject>``, ``chat:system``,
    ``chat:<conversation>:<turn>``); ``conversation`` and ``turn`` are set for chat workloads.
    """

    id: int
    arrival_s: float | None
    prefix_key: str
    prefix: str
    suffix: str
    max_tokens: int
    conversation: int | None = None
    turn: int | None = None
    #: the prompt's scaffold as (role, content) messages (see the module docstring); () none
    scaffold: tuple[tuple[str, str], ...] = ()

    @property
    def prompt(self) -> str:
        return self.prefix + self.suffix


@dataclass(frozen=True, slots=True)
class Skew:
    """How requests spread over subjects; see the module docstring. ``str()`` gives the spec."""

    kind: Literal["uniform", "zipf", "hot"]
    value: float = 0.0

    def weights(self, count: int) -> list[float]:
        """Relative weights of ``count`` subjects, in rank order (most requested first)."""
        if count < 1:
            raise ConfigError("a skew needs at least one subject")
        if self.kind == "uniform":
            return [1.0] * count
        if self.kind == "zipf":
            # exp/log rather than rank**A: a large A underflows to 0 instead of overflowing.
            return [math.exp(-self.value * math.log(rank)) for rank in range(1, count + 1)]
        hot = int(self.value)
        if hot > count:
            raise ConfigError(f"skew hot:{hot} asks for more hot subjects than the {count} there are")
        if hot == count:
            return [1.0] * count
        return [HOT_SHARE / hot] * hot + [(1.0 - HOT_SHARE) / (count - hot)] * (count - hot)

    def __str__(self) -> str:
        if self.kind == "uniform":
            return "uniform"
        if self.kind == "hot":
            return f"hot:{int(self.value)}"
        return f"zipf:{self.value:g}"


def parse_skew(spec: str | Skew) -> Skew:
    """``"uniform"``, ``"zipf:A"`` (A > 0) or ``"hot:K"`` (K >= 1) -> Skew; ConfigError otherwise."""
    if isinstance(spec, Skew):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"a skew is a string like 'zipf:1.2', got {type(spec).__name__}")
    kind, sep, arg = spec.strip().partition(":")
    if kind == "uniform" and not sep:
        return Skew("uniform")
    if kind == "zipf" and sep:
        try:
            exponent = float(arg)
        except ValueError:
            exponent = math.nan
        if not (math.isfinite(exponent) and exponent > 0):
            raise ConfigError(f"skew {spec!r}: the Zipf exponent must be a number > 0")
        return Skew("zipf", exponent)
    if kind == "hot" and sep:
        if not arg.isdigit() or int(arg) < 1:
            raise ConfigError(f"skew {spec!r}: the hot-subject count must be an integer >= 1")
        return Skew("hot", float(int(arg)))
    raise ConfigError(f"unknown skew {spec!r}: use 'uniform', 'zipf:A' or 'hot:K'")


def _check_common(n: int, rate: float | None, max_tokens: int) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ConfigError(f"the number of requests must be an integer >= 0, got {n!r}")
    if rate is not None and not (isinstance(rate, int | float) and math.isfinite(rate) and rate > 0):
        raise ConfigError(f"the arrival rate must be a number > 0 (requests/s) or None, got {rate!r}")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ConfigError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")


def _arrivals(n: int, rate: float | None, rng: random.Random) -> list[float | None]:
    if rate is None:
        return [None] * n
    times: list[float | None] = []
    now = 0.0
    for _ in range(n):
        now += rng.expovariate(rate)
        times.append(now)
    return times


def _child(master: random.Random) -> random.Random:
    return random.Random(master.getrandbits(64))


def mmlu_workload(
    mmlu: MMLU,
    n: int,
    *,
    skew: str | Skew = "uniform",
    seed: int,
    rate: float | None = None,
    max_tokens: int = 8,
) -> list[WorkloadItem]:
    """``n`` MMLU requests: a subject's 5-shot prefix plus one of its test questions.

    Subjects follow ``skew`` over a ranking drawn from ``seed``; arrivals are Poisson at
    ``rate`` requests/s (or ``None``). Same arguments, same list.
    """
    _check_common(n, rate, max_tokens)
    parsed = parse_skew(skew)
    master = random.Random(seed)
    rank_rng, subject_rng, question_rng, arrival_rng = (_child(master) for _ in range(4))
    ranking = mmlu.subjects
    rank_rng.shuffle(ranking)
    cumulative = list(accumulate(parsed.weights(len(ranking))))
    prefixes: dict[str, str] = {}
    queues: dict[str, list[MMLUQuestion]] = {}
    next_question: dict[str, int] = {}
    # A subject's questions come round again (Zipf's head): each formatted once, and the
    # repeats share the strings (the simulator tokenizes each distinct string once).
    suffixes: dict[str, list[str | None]] = {}
    keys: dict[str, str] = {}
    scaffolds: dict[str, tuple[tuple[str, str], ...]] = {}
    arrivals = _arrivals(n, rate, arrival_rng)
    items: list[WorkloadItem] = []
    for index in range(n):
        pick = subject_rng.random() * cumulative[-1]
        subject = ranking[min(bisect_left(cumulative, pick), len(ranking) - 1)]
        if subject not in prefixes:
            prefix = prefixes[subject] = five_shot_prefix(subject, mmlu.dev(subject))
            queue = mmlu.test(subject)
            question_rng.shuffle(queue)
            queues[subject] = queue
            next_question[subject] = 0
            suffixes[subject] = [None] * len(queue)
            keys[subject] = f"mmlu:{subject}"
            scaffolds[subject] = (("system", prefix),)
        queue = queues[subject]
        position = next_question[subject] % len(queue)
        next_question[subject] += 1
        suffix = suffixes[subject][position]
        if suffix is None:
            suffix = suffixes[subject][position] = question_suffix(queue[position])
        items.append(
            WorkloadItem(
                id=index,
                arrival_s=arrivals[index],
                prefix_key=keys[subject],
                prefix=prefixes[subject],
                suffix=suffix,
                max_tokens=max_tokens,
                scaffold=scaffolds[subject],
            )
        )
    return items


# --------------------------------------------------------------------------------------------
# Synthetic multi-turn chat.

CHAT_SYSTEM_PROMPT = (
    "You are a helpful assistant running on a peer-to-peer network of home computers. "
    "Answer briefly and accurately.\n\n"
)
_WORDS = (
    "the a network peer cache prefix model token request answer question garden river "
    "mountain city library window kitchen music history science language number planet "
    "energy water light shadow morning evening winter summer travel book letter market "
    "bridge forest ocean island machine engine signal memory story friend teacher student "
    "recipe bread coffee tea paint color shape circle square simple quick slow bright "
    "quiet loud small large old new first last why how what when where explain describe "
    "compare list summarize"
).split()


def _sentence(rng: random.Random, low: int, high: int) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(low, high))]
    return " ".join(words).capitalize() + "."


def multiturn_workload(
    n: int,
    *,
    conversations: int,
    turns: int,
    seed: int,
    rate: float | None = None,
    max_tokens: int = 32,
    user_words: tuple[int, int] = (8, 24),
    answer_words: tuple[int, int] = (12, 40),
) -> list[WorkloadItem]:
    """``n`` requests from ``conversations`` synthetic chats running at once.

    Each request continues a randomly chosen open conversation by one turn; a conversation that
    reached ``turns`` turns is replaced by a new one (conversation ids count up). Turn 0's prefix
    is the shared system prompt (key ``chat:system``); turn ``t > 0``'s prefix is turn ``t-1``'s
    full prompt plus a placeholder answer of ``answer_words`` words (key ``chat:<id>:<t>``), its
    suffix a user message of ``user_words`` words. Within a conversation, turns appear in order.
    """
    _check_common(n, rate, max_tokens)
    for name, count in (("conversations", conversations), ("turns", turns)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(f"{name} must be an integer >= 1, got {count!r}")
    for name, (low, high) in (("user_words", user_words), ("answer_words", answer_words)):
        if not 1 <= low <= high:
            raise ConfigError(f"{name} must be (low, high) with 1 <= low <= high")
    master = random.Random(seed)
    pick_rng, text_rng, arrival_rng = (_child(master) for _ in range(3))
    arrivals = _arrivals(n, rate, arrival_rng)
    # conversation id -> (turns sent, full prompt of the last turn)
    open_chats: dict[int, tuple[int, str]] = {c: (0, "") for c in range(conversations)}
    next_id = conversations
    items: list[WorkloadItem] = []
    for index in range(n):
        conversation = pick_rng.choice(sorted(open_chats))
        turn, last_prompt = open_chats[conversation]
        if turn == 0:
            prefix, key = CHAT_SYSTEM_PROMPT, "chat:system"
        else:
            answer = " " + _sentence(text_rng, *answer_words) + "\n\n"
            prefix, key = last_prompt + answer, f"chat:{conversation}:{turn}"
        suffix = f"User: {_sentence(text_rng, *user_words)}\nAssistant:"
        items.append(
            WorkloadItem(
                id=index,
                arrival_s=arrivals[index],
                prefix_key=key,
                prefix=prefix,
                suffix=suffix,
                max_tokens=max_tokens,
                conversation=conversation,
                turn=turn,
                scaffold=(("system", CHAT_SYSTEM_PROMPT),),
            )
        )
        if turn + 1 >= turns:
            del open_chats[conversation]
            open_chats[next_id] = (0, "")
            next_id += 1
        else:
            open_chats[conversation] = (turn + 1, prefix + suffix)
    return items


# --------------------------------------------------------------------------------------------
# Synthetic RAG: long shared documents under different system prompts.

RAG_SYSTEM_PROMPTS = (
    "You are a support assistant. Answer the customer's question from the document below.",
    "You are a research assistant. Summarize what the document below says about the question.",
    "You are a legal reviewer. Quote the passages of the document below that bear on the question.",
    "You are a tutor. Explain the document below to a student, then answer the question.",
)


def rag_workload(
    n: int,
    *,
    documents: int,
    seed: int,
    skew: str | Skew = "zipf:1.0",
    system_prompts: int = len(RAG_SYSTEM_PROMPTS),
    rate: float | None = None,
    max_tokens: int = 16,
    document_words: tuple[int, int] = (300, 600),
    question_words: tuple[int, int] = (8, 20),
) -> list[WorkloadItem]:
    """``n`` RAG-style requests: a system prompt (uniform over the first ``system_prompts`` of
    ``RAG_SYSTEM_PROMPTS``), then one of ``documents`` synthetic documents of
    ``document_words`` words (drawn by ``skew`` over a seeded ranking), then a question.

    The prefix is the system prompt and the document (key ``rag:<system>:<document>``); the
    scaffold is the system prompt alone. Same arguments, same list.
    """
    _check_common(n, rate, max_tokens)
    if isinstance(documents, bool) or not isinstance(documents, int) or documents < 1:
        raise ConfigError(f"documents must be an integer >= 1, got {documents!r}")
    if not 1 <= system_prompts <= len(RAG_SYSTEM_PROMPTS):
        raise ConfigError(f"system_prompts must be in [1, {len(RAG_SYSTEM_PROMPTS)}]")
    for name, (low, high) in (("document_words", document_words), ("question_words", question_words)):
        if not 1 <= low <= high:
            raise ConfigError(f"{name} must be (low, high) with 1 <= low <= high")
    parsed = parse_skew(skew)
    master = random.Random(seed)
    doc_rng, rank_rng, pick_rng, text_rng, arrival_rng = (_child(master) for _ in range(5))
    texts = []
    for d in range(documents):
        words = doc_rng.randint(*document_words)
        sentences = []
        while words > 0:
            sentence = _sentence(doc_rng, 6, min(18, max(6, words)))
            sentences.append(sentence)
            words -= sentence.count(" ") + 1
        texts.append(f"Document {d}:\n" + " ".join(sentences) + "\n\n")
    ranking = list(range(documents))
    rank_rng.shuffle(ranking)
    cumulative = list(accumulate(parsed.weights(documents)))
    arrivals = _arrivals(n, rate, arrival_rng)
    items: list[WorkloadItem] = []
    for index in range(n):
        system = pick_rng.randrange(system_prompts)
        pick = pick_rng.random() * cumulative[-1]
        doc = ranking[min(bisect_left(cumulative, pick), documents - 1)]
        system_text = RAG_SYSTEM_PROMPTS[system] + "\n\n"
        items.append(
            WorkloadItem(
                id=index,
                arrival_s=arrivals[index],
                prefix_key=f"rag:{system}:{doc}",
                prefix=system_text + texts[doc],
                suffix=f"Question: {_sentence(text_rng, *question_words)}\nAnswer:",
                max_tokens=max_tokens,
                scaffold=(("system", system_text),),
            )
        )
    return items


# --------------------------------------------------------------------------------------------
# Saving and loading.

_FIELD_NAMES = tuple(f.name for f in fields(WorkloadItem))


def save_workload(items: Iterable[WorkloadItem], path: str | Path) -> None:
    """Write ``items`` as JSON lines (a header line, then one object per item)."""
    rows = [asdict(item) for item in items]
    lines = [json.dumps({"peerinfer_workload": WORKLOAD_FORMAT_VERSION, "items": len(rows)})]
    # ASCII escapes keep any str (even a lone surrogate) exact through the round trip.
    lines += [json.dumps(row, allow_nan=False) for row in rows]
    try:
        Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write the workload: {exc}") from exc


def load_workload(path: str | Path) -> list[WorkloadItem]:
    """Read a workload written by ``save_workload``; ConfigError naming the line if invalid.

    Checks: the header and item count, every field's type and range, unique ids, and arrival
    times that are all ``None`` or all set and non-decreasing.
    """
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the workload: {exc}") from exc
    if not lines:
        raise ConfigError(f"{path}: empty file, expected a workload header line")
    header = _json_object(lines[0], f"{path}:1")
    if header.get("peerinfer_workload") != WORKLOAD_FORMAT_VERSION or set(header) != {
        "peerinfer_workload",
        "items",
    }:
        raise ConfigError(f"{path}:1: not a peerinfer workload (version {WORKLOAD_FORMAT_VERSION})")
    body = lines[1:]
    if header["items"] != len(body):
        raise ConfigError(f"{path}: the header announces {header['items']!r} items, found {len(body)}")
    items = [_item_from(_json_object(line, f"{path}:{i + 2}"), f"{path}:{i + 2}") for i, line in enumerate(body)]
    ids = [item.id for item in items]
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{path}: item ids are not unique")
    arrivals = [item.arrival_s for item in items]
    if any(a is None for a in arrivals) and any(a is not None for a in arrivals):
        raise ConfigError(f"{path}: arrival_s must be set on every item or on none")
    timed = [a for a in arrivals if a is not None]
    if any(later < earlier for earlier, later in zip(timed, timed[1:], strict=False)):
        raise ConfigError(f"{path}: arrival times must not decrease")
    return items


def _json_object(line: str, where: str) -> dict[str, Any]:
    try:
        value = json.loads(line)
    except ValueError as exc:
        raise ConfigError(f"{where}: not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _item_from(row: dict[str, Any], where: str) -> WorkloadItem:
    row.setdefault("scaffold", [])  # files written before scaffolds
    if set(row) != set(_FIELD_NAMES):
        raise ConfigError(f"{where}: expected the fields {sorted(_FIELD_NAMES)}, got {sorted(row)}")
    if not _is_int(row["id"]) or row["id"] < 0:
        raise ConfigError(f"{where}: id must be an integer >= 0")
    arrival = row["arrival_s"]
    if arrival is not None:
        if not (_is_int(arrival) or isinstance(arrival, float)) or not (
            math.isfinite(arrival) and arrival >= 0
        ):
            raise ConfigError(f"{where}: arrival_s must be a number >= 0 or null")
        arrival = float(arrival)
    for name in ("prefix_key", "prefix", "suffix"):
        if not isinstance(row[name], str):
            raise ConfigError(f"{where}: {name} must be a string")
    if not row["prefix"] + row["suffix"]:
        raise ConfigError(f"{where}: the prompt is empty")
    if not _is_int(row["max_tokens"]) or row["max_tokens"] < 1:
        raise ConfigError(f"{where}: max_tokens must be an integer >= 1")
    for name in ("conversation", "turn"):
        if row[name] is not None and (not _is_int(row[name]) or row[name] < 0):
            raise ConfigError(f"{where}: {name} must be an integer >= 0 or null")
    scaffold = row["scaffold"]
    if not isinstance(scaffold, list) or not all(
        isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m) for m in scaffold
    ):
        raise ConfigError(f"{where}: scaffold must be a list of [role, content] pairs")
    return WorkloadItem(
        id=row["id"],
        arrival_s=arrival,
        prefix_key=row["prefix_key"],
        prefix=row["prefix"],
        suffix=row["suffix"],
        max_tokens=row["max_tokens"],
        conversation=row["conversation"],
        turn=row["turn"],
        scaffold=tuple((role, content) for role, content in scaffold),
    )
