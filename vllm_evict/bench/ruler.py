"""Seeded RULER-style synthetic long-context tasks, measured in tokens of the model's tokenizer.

Tasks (after RULER, Hsieh et al. 2024; templates simplified for small models):

=================  ==========================================================================  ========
task               what is hidden / asked                                                      metric
=================  ==========================================================================  ========
passkey            "The pass key is 7-digit. Remember it. ..." in a noise haystack, at a       all
                   chosen depth; "What is the pass key? The pass key is"
niah_single        "One of the special magic numbers for <adj-noun> is: 7-digit." at a chosen  all
                   depth; asked for that key
niah_multikey      4 such needles with different keys at random depths; asked for one key      all
niah_multivalue    4 needles with the same key and different values; asked for all values      all
vt                 variable tracking: a chain VAR A = 12345. VAR B = VAR A. ... (5 variables)  all
                   spread through the noise, plus a one-shot example; asked for all names
cwe                common-words extraction: numbered word list, 10 words much more frequent    all
                   than the others; asked for the 10 most common
=================  ==========================================================================  ========

Metric ``all`` is RULER's ``string_match_all``: the fraction of reference strings contained
(case-insensitively) in the prediction, i.e. exact match for one reference and recall for several.

Every sample is a *context* segment (instructions + haystack) followed by a *question* segment (question
+ answer prefix). Both are tokenized separately and concatenated (``prompt_ids = context_ids +
question_ids``), so the two evaluation protocols see the identical token sequence and differ only in
where the eviction happens:

* ``aware`` (question-aware): evict at the end of the whole prompt's prefill; the question is in the
  evicted prompt and inside the scoring window.
* ``agnostic`` (question-agnostic, kvpress / Ada-KV protocol): evict at the end of the context's
  prefill (after ``n_context`` tokens); the question tokens are then prefilled against the compressed
  cache (see docs/QUALITY.md for how the runner asks the engine for that).

The haystack is the repeated noise of RULER's passkey task ("The grass is green. The sky is blue. ...");
SmolLM2-135M retrieves reliably from it at 1K-4K, unlike from natural text (docs/QUALITY.md, "Model").

Lengths: the prompt (context + question) has at most ``length`` tokens and at least
``length - length_tolerance(length)`` tokens. Needles are inserted between filler sentences; ``depth`` is
the needle's position as a fraction of the haystack.

Determinism: sample ``i`` of (task, length) draws everything from ``random.Random(f"{seed}/{task}/
{length}/{i}")`` (string seeds are hashed with SHA-512, independent of PYTHONHASHSEED), so any subset
of samples is reproducible on its own and identical on every machine with the same tokenizer.
"""

from __future__ import annotations

import math
import random
import string
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

TASKS: tuple[str, ...] = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe")
VARIANTS: tuple[str, ...] = ("aware", "agnostic")
DEFAULT_DEPTHS: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)

NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")

# single-token (with a leading space) English nouns / adjectives of the SmolLM2 tokenizer
NOUNS = tuple("""
apple river mountain garden window pencil bottle candle basket button camera carpet castle chicken cloud
coffee cookie copper cotton desert dinner doctor dragon engine farmer finger flower forest friend guitar
hammer harbor helmet island jacket kettle kitchen ladder lemon letter lizard magnet market meadow mirror
monkey needle notebook ocean orange oyster paddle palace parrot pepper pillow pirate planet pocket potato
prince puzzle rabbit radio rocket saddle salmon school shadow silver singer spider spoon squirrel statue
stone street summer sunset table teacher temple ticket tiger tomato tower tractor trumpet tunnel turtle
umbrella valley violin wagon wallet walnut whale whistle winter yellow zebra anchor arrow badge balloon
banana barrel beach blanket bridge brush bubble bucket butter cabin cactus canoe canyon carrot cherry
circle clock coconut comet compass cradle crown crystal cushion dolphin donkey drum eagle falcon feather
fence glacier goat grape hawk honey horse jelly jungle lantern lettuce lion lobster mango maple marble
moose mushroom nest olive onion owl panda parcel peach peanut pearl penguin piano pickle pigeon pine pizza
plum pony pumpkin quilt ribbon robot rose sailor shell sheep shovel sled snail sock sparrow sponge star
stove sugar sword tablet thunder toast towel trophy vase velvet village volcano wheat willow wolf yogurt
album attic bacon bakery bamboo beaver bench berry blender bread brick broom buffalo burrow cabbage cake
camel canal cannon chalk cheese chimney cinema clover collar cottage crab crane cricket curtain deer
diamond dough dove envelope fabric ferry fig flute fountain frog garlic ginger giraffe glove goose gravel
harp hedge iris ivory jar kangaroo kiwi lagoon lamb lamp lily lotus mammoth meteor mint mole moss moth
nectar nickel oak oasis orchid oven paint parsley pasta pastry pillar poppy porch prism pudding python
quartz raft reef rhino saffron salad seal shark shrimp spinach spruce squash strawberry toad trout tuna
vanilla wasp
""".split())
ADJECTIVES = tuple("""
ancient bright calm clever curious dusty eager fancy fierce gentle golden happy hidden humble icy lazy
little lucky modest noble odd pale plain polite proud quiet rapid royal sandy shiny silent silly simple
sleepy smooth snowy solid spicy steady stormy sunny swift tall tiny tidy warm wild windy wise witty young
brave cheerful cosmic early fuzzy giant hollow kind loud magic narrow neat purple rainy rough scarlet
secret sharp shy sour stern sweet tender vivid wooden
""".split())

MAX_TOKENS = {"passkey": 12, "niah_single": 12, "niah_multikey": 12, "niah_multivalue": 48, "vt": 32, "cwe": 64}
METRICS = {task: "all" for task in TASKS}
N_MULTI = 4          # needles of niah_multikey / niah_multivalue
VT_HOPS = 4          # variable tracking: chain of VT_HOPS + 1 variables
CWE_COMMON = 10      # common words of cwe


def length_tolerance(length: int) -> int:
    """Allowed shortfall of a prompt below its target length (tokens)."""
    return max(32, length // 64)


# ----------------------------------------------------------------------------- samples


@dataclass
class Sample:
    task: str
    length: int                 # target prompt length (tokens)
    index: int                  # sample index within (task, length)
    seed: int
    context: str                # evicted first under the question-agnostic protocol
    question: str               # question + answer prefix
    context_ids: list[int]
    question_ids: list[int]
    answers: list[str]
    metric: str
    max_tokens: int
    depth: float | None = None  # requested depth of the (queried) needle, fraction of the haystack
    needles: list[str] = field(default_factory=list)           # needle texts, in prompt order
    needle_positions: list[int] = field(default_factory=list)  # token index of each needle's start
    haystack_span: tuple[int, int] = (0, 0)                    # token span of the haystack in prompt_ids
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def uid(self) -> str:
        return f"{self.task}/{self.length}/{self.index}"

    @property
    def prompt_ids(self) -> list[int]:
        return self.context_ids + self.question_ids

    @property
    def n_context(self) -> int:
        return len(self.context_ids)

    @property
    def n_prompt(self) -> int:
        return len(self.context_ids) + len(self.question_ids)

    def score(self, prediction: str) -> float:
        return score(self.metric, prediction, self.answers)

    def to_dict(self, with_ids: bool = False) -> dict[str, Any]:
        d = asdict(self)
        if not with_ids:
            d.pop("context_ids")
            d.pop("question_ids")
        d["n_context"], d["n_prompt"] = self.n_context, self.n_prompt
        return d


# ----------------------------------------------------------------------------- scoring


def postprocess(prediction: str) -> str:
    """RULER's post-processing: drop non-printable characters, strip."""
    return "".join(ch for ch in prediction if ch.isprintable() or ch in "\n\t").strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of references contained in the prediction (case-insensitive): RULER's niah/vt/cwe metric."""
    pred = postprocess(prediction).lower()
    if not references:
        raise ValueError("no references")
    return sum(ref.lower() in pred for ref in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any reference is contained in the prediction (RULER's QA metric)."""
    pred = postprocess(prediction).lower()
    return float(any(ref.lower() in pred for ref in references))


def score(metric: str, prediction: str, references: Sequence[str]) -> float:
    if metric == "all":
        return string_match_all(prediction, references)
    if metric == "part":
        return string_match_part(prediction, references)
    raise ValueError(f"unknown metric {metric!r}")


# ----------------------------------------------------------------------------- tokenizer adapter

Encoder = Callable[[str], list[int]]


def as_encoder(tokenizer: Any) -> Encoder:
    """``text -> ids`` without special tokens, from a HF tokenizer, a `tokenizers.Tokenizer` or a callable."""
    if hasattr(tokenizer, "encode"):
        try:
            out = tokenizer.encode("a", add_special_tokens=False)
        except TypeError:
            out = tokenizer.encode("a")
            if hasattr(out, "ids"):
                return lambda s: list(tokenizer.encode(s).ids)
            return lambda s: list(tokenizer.encode(s))
        if hasattr(out, "ids"):
            return lambda s: list(tokenizer.encode(s, add_special_tokens=False).ids)
        return lambda s: list(tokenizer.encode(s, add_special_tokens=False))
    if callable(tokenizer):
        return lambda s: list(tokenizer(s))
    raise TypeError(f"cannot encode with {type(tokenizer).__name__}")


# ----------------------------------------------------------------------------- building blocks


def _rng(seed: int, task: str, length: int, index: int) -> random.Random:
    return random.Random(f"{seed}/{task}/{length}/{index}")


def _number(rng: random.Random, digits: int = 7) -> str:
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def _key(rng: random.Random) -> str:
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def _var_name(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_uppercase) for _ in range(5))


@dataclass
class _Layout:
    """A context = preamble + haystack (units joined by spaces, needles inserted between units) + suffix."""

    preamble: str
    question: str
    needles: list[str]                  # in insertion order
    fractions: list[float]              # position of each needle as a fraction of the haystack units
    unit: Callable[[int], list[str]]    # u -> list of u filler units
    suffix: str = ""

    def build(self, u: int) -> tuple[str, list[int], tuple[int, int]]:
        units = self.unit(u)
        slots = [min(u, max(0, round(f * u))) for f in self.fractions]
        order = sorted(range(len(self.needles)), key=lambda k: (slots[k], k))
        pieces: list[str] = []
        needle_at: dict[int, int] = {}   # needle index -> index in pieces
        pos = 0
        for k in order:
            pieces.extend(units[pos:slots[k]])
            pos = max(pos, slots[k])
            needle_at[k] = len(pieces)
            pieces.append(self.needles[k])
        pieces.extend(units[pos:])
        haystack = " ".join(pieces)
        # character offsets of the needles inside the haystack
        offsets, cursor = {}, 0
        for i, piece in enumerate(pieces):
            for k, pi in needle_at.items():
                if pi == i:
                    offsets[k] = cursor
            cursor += len(piece) + 1
        context = self.preamble + haystack + self.suffix
        char_pos = [len(self.preamble) + offsets[k] for k in range(len(self.needles))]
        return context, char_pos, (len(self.preamble), len(self.preamble) + len(haystack))


def _noise_units(u: int) -> list[str]:
    return [NOISE[i % len(NOISE)] for i in range(u)]


def _fit(layout: _Layout, length: int, encode: Encoder) -> int:
    """Largest number of filler units whose prompt (context + question tokens) fits in ``length``."""
    q_len = len(encode(layout.question))
    cache: dict[int, int] = {}

    def n(u: int) -> int:
        if u not in cache:
            cache[u] = len(encode(layout.build(u)[0])) + q_len
        return cache[u]

    if n(0) > length:
        raise ValueError(f"length {length} is too short for the fixed text ({n(0)} tokens)")
    per = max(1.0, (n(32) - n(0)) / 32)
    lo, hi = 0, None  # n(lo) <= length; n(hi) > length
    u = max(1, int((length - n(0)) / per))
    for _ in range(64):
        c = n(u)
        if c <= length:
            lo = max(lo, u)
            step = max(1, int((length - c) / per))
            u_next = u + step
        else:
            hi = u if hi is None else min(hi, u)
            u_next = u - max(1, math.ceil((c - length) / per))
        if hi is not None:
            u_next = min(u_next, hi - 1)
        u_next = max(u_next, lo + 1)
        if hi is not None and u_next >= hi:
            break
        u = u_next
    return lo


def _finish(
    task: str, length: int, index: int, seed: int, layout: _Layout, encode: Encoder, answers: list[str],
    depth: float | None, queried: int | None = None, meta: dict[str, Any] | None = None,
) -> Sample:
    u = _fit(layout, length, encode)
    context, char_pos, (h0, h1) = layout.build(u)
    context_ids = encode(context)
    question_ids = encode(layout.question)
    # the space before a needle belongs to the needle's first token ("ĠOne"), so encode the prefix without it
    positions = [len(encode(context[:c].rstrip(" "))) for c in char_pos]
    span = (len(encode(context[:h0])) if h0 else 0, len(encode(context[:h1])))
    order = sorted(range(len(layout.needles)), key=lambda k: (positions[k], k))
    meta = dict(meta or {})
    meta["filler_units"] = u
    if queried is not None:
        meta["queried_needle"] = order.index(queried)
    return Sample(
        task=task, length=length, index=index, seed=seed, context=context, question=layout.question,
        context_ids=context_ids, question_ids=question_ids, answers=answers, metric=METRICS[task],
        max_tokens=MAX_TOKENS[task], depth=depth, needles=[layout.needles[k] for k in order],
        needle_positions=[positions[k] for k in order], haystack_span=span, meta=meta,
    )


# ----------------------------------------------------------------------------- tasks

_NIAH_PREAMBLE = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards.\n\n"
)


def _passkey(rng, task, length, index, seed, encode, depth):
    key = _number(rng)
    layout = _Layout(
        preamble=(
            "There is an important piece of information hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about the important information there.\n\n"
        ),
        question="\n\nWhat is the pass key? The pass key is",
        needles=[f"The pass key is {key}. Remember it. {key} is the pass key."],
        fractions=[depth], unit=_noise_units,
    )
    return _finish(task, length, index, seed, layout, encode, [key], depth)


def _niah_single(rng, task, length, index, seed, encode, depth):
    key, value = _key(rng), _number(rng)
    layout = _Layout(
        preamble=_NIAH_PREAMBLE,
        question=(
            f"\n\nWhat is the special magic number for {key} mentioned in the provided text? "
            f"The special magic number for {key} mentioned in the provided text is"
        ),
        needles=[f"One of the special magic numbers for {key} is: {value}."],
        fractions=[depth], unit=_noise_units,
    )
    return _finish(task, length, index, seed, layout, encode, [value], depth, meta={"key": key})


def _random_fractions(rng: random.Random, k: int) -> list[float]:
    return [round(rng.uniform(0.05, 0.95), 4) for _ in range(k)]


def _niah_multikey(rng, task, length, index, seed, encode, depth):
    keys: list[str] = []
    while len(keys) < N_MULTI:
        k = _key(rng)
        if k not in keys:
            keys.append(k)
    values = [_number(rng) for _ in keys]
    fractions = _random_fractions(rng, N_MULTI)
    q = rng.randrange(N_MULTI)
    layout = _Layout(
        preamble=_NIAH_PREAMBLE,
        question=(
            f"\n\nWhat is the special magic number for {keys[q]} mentioned in the provided text? "
            f"The special magic number for {keys[q]} mentioned in the provided text is"
        ),
        needles=[f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, values)],
        fractions=fractions, unit=_noise_units,
    )
    return _finish(task, length, index, seed, layout, encode, [values[q]], fractions[q], queried=q,
                   meta={"key": keys[q], "distractor_keys": [k for i, k in enumerate(keys) if i != q]})


def _niah_multivalue(rng, task, length, index, seed, encode, depth):
    key = _key(rng)
    values: list[str] = []
    while len(values) < N_MULTI:
        v = _number(rng)
        if v not in values:
            values.append(v)
    fractions = _random_fractions(rng, N_MULTI)
    layout = _Layout(
        preamble=_NIAH_PREAMBLE,
        question=(
            f"\n\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
            f"The special magic numbers for {key} mentioned in the provided text are"
        ),
        needles=[f"One of the special magic numbers for {key} is: {v}." for v in values],
        fractions=fractions, unit=_noise_units,
    )
    return _finish(task, length, index, seed, layout, encode, values, None, meta={"key": key})


def _vt_chain(rng: random.Random, hops: int) -> tuple[list[str], str, list[str]]:
    names: list[str] = []
    while len(names) < hops + 1:
        n = _var_name(rng)
        if n not in names:
            names.append(n)
    value = _number(rng, 5)
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, hops + 1)]
    return names, value, statements


def _vt_question(value: str, n: int) -> str:
    return (
        f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
        f"Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
        f"assigned the value {value}, they are:"
    )


def _vt(rng, task, length, index, seed, encode, depth):
    ex_names, ex_value, ex_statements = _vt_chain(rng, VT_HOPS)
    names, value, statements = _vt_chain(rng, VT_HOPS)
    ex_units = _noise_units(10)
    for i, s in enumerate(ex_statements):  # example chain spread evenly over 10 noise sentences
        ex_units.insert(2 * i + 1, s)
    instruction = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
    example = (
        instruction + " ".join(ex_units) + _vt_question(ex_value, len(ex_names)) + " " + " ".join(ex_names) + "\n\n"
    )
    fractions = sorted(_random_fractions(rng, len(statements)))
    layout = _Layout(
        preamble=example + instruction, question=_vt_question(value, len(names)),
        needles=statements, fractions=fractions, unit=_noise_units,
    )
    return _finish(task, length, index, seed, layout, encode, names, None,
                   meta={"value": value, "example_names": ex_names})


def _cwe(rng, task, length, index, seed, encode, depth):
    pool = list(NOUNS)
    rng.shuffle(pool)
    common, uncommon = pool[:CWE_COMMON], pool[CWE_COMMON:]
    order_seed = rng.random()

    def unit(u: int) -> list[str]:
        f_cw = max(4, (2 * u // 5) // CWE_COMMON)   # about 40% of the items are common words
        words = [w for w in common for _ in range(f_cw)][:u]
        rest = u - len(words)
        f_ucw = max(2, math.ceil(rest / len(uncommon))) if rest > 0 else 0
        if rest > 0 and f_ucw >= f_cw:
            raise ValueError(f"cwe: too few distinct words for {u} items")
        words += [w for w in uncommon for _ in range(f_ucw)][:rest]
        random.Random(f"{order_seed}/{u}").shuffle(words)
        return [f"{i + 1}. {w}" for i, w in enumerate(words)]

    layout = _Layout(
        preamble=(
            "Below is a numbered list of words. In these words, some appear more often than others. "
            "Memorize the ones that appear most often.\n"
        ),
        question=(
            f"\nQuestion: What are the {CWE_COMMON} most common words in the above list? "
            f"Answer: The top {CWE_COMMON} words that appear most often in the list are:"
        ),
        needles=[], fractions=[], unit=unit,
    )
    return _finish(task, length, index, seed, layout, encode, list(common), None)


_BUILDERS = {
    "passkey": _passkey, "niah_single": _niah_single, "niah_multikey": _niah_multikey,
    "niah_multivalue": _niah_multivalue, "vt": _vt, "cwe": _cwe,
}


def generate_sample(
    task: str, length: int, index: int, tokenizer: Any, seed: int = 0,
    depths: Sequence[float] = DEFAULT_DEPTHS,
) -> Sample:
    """Sample ``index`` of ``task`` at ``length`` tokens. Single-needle tasks use ``depths[index % len]``."""
    if task not in _BUILDERS:
        raise ValueError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if not depths or any(not 0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must be fractions in [0, 1], got {depths}")
    encode = tokenizer if getattr(tokenizer, "_is_encoder", False) else as_encoder(tokenizer)
    depth = float(depths[index % len(depths)])
    return _BUILDERS[task](_rng(seed, task, length, index), task, length, index, seed, encode, depth)


def generate_samples(
    tasks: Sequence[str], lengths: Sequence[int], n_samples: int, tokenizer: Any, seed: int = 0,
    depths: Sequence[float] = DEFAULT_DEPTHS,
) -> list[Sample]:
    """``n_samples`` samples of every (task, length), in task-major order."""
    encode = as_encoder(tokenizer)
    encode._is_encoder = True  # type: ignore[attr-defined]
    return [
        generate_sample(task, length, i, encode, seed=seed, depths=depths)
        for task in tasks for length in lengths for i in range(n_samples)
    ]
