import json
import time

from specserve.tooling.modelbuild.build import PRESETS, build_pair, pair_dir, weights_digest
from specserve.tooling.modelbuild.corpus import CLASSES, build_corpus


def test_pair_layout_and_cache_hit(tiny_pair_dir):
    meta = json.loads((tiny_pair_dir / "build.json").read_text())
    assert meta["digest"] == PRESETS["tiny"].digest()
    assert tiny_pair_dir == pair_dir(tiny_pair_dir.parent, PRESETS["tiny"])
    for part in ("target", "draft"):
        assert (tiny_pair_dir / part / "config.json").exists()
        assert (tiny_pair_dir / part / "tokenizer.json").exists()
    assert meta["target_params"] > 2 * meta["draft_params"]
    t = time.perf_counter()
    again = build_pair(PRESETS["tiny"], tiny_pair_dir.parent, log=lambda *_: None)
    assert again == tiny_pair_dir and time.perf_counter() - t < 5  # cached by config hash


def test_corpus_is_deterministic_and_covers_three_classes():
    a = build_corpus(1_500_000, 300_000, 20, seed=3)
    b = build_corpus(1_500_000, 300_000, 20, seed=3)
    assert a.fingerprint() == b.fingerprint()
    for cls in CLASSES:
        assert a.train[cls] and a.heldout[cls]
        assert not set(a.train[cls]) & set(a.heldout[cls])  # held-out really is held out
    assert build_corpus(1_500_000, 300_000, 20, seed=4).fingerprint() != a.fingerprint()


def test_eval_prompts_cover_classes(eval_prompts, tiny_pair):
    by_class = {c: [p for p in eval_prompts if p["workload_class"] == c] for c in CLASSES}
    assert all(len(v) >= 7 for v in by_class.values())
    assert all(tiny_pair.tokenizer.encode(p["prompt"]) for p in eval_prompts)


def test_digest_changes_with_config():
    from dataclasses import replace

    assert replace(PRESETS["tiny"], seed=1).digest() != PRESETS["tiny"].digest()


def test_two_builds_of_one_config_have_the_same_weights(tiny_pair_dir, tmp_path):
    """The cached tiny pair is one build, a forced rebuild here the other: same config, same
    sha256 over weights and tokenizer (bf16 autocast included, where the CPU has it)."""
    meta = json.loads((tiny_pair_dir / "build.json").read_text())
    assert meta["weights_sha256"] == weights_digest(tiny_pair_dir)  # the record matches the files
    again = build_pair(PRESETS["tiny"], tmp_path, force=True, log=lambda *_: None)
    assert json.loads((again / "build.json").read_text())["weights_sha256"] == meta["weights_sha256"]
    assert (again / "eval_prompts.json").read_text() == (tiny_pair_dir / "eval_prompts.json").read_text()


def test_find_pair_takes_the_pair_or_the_models_dir(tmp_path):
    import pytest

    from specserve.tooling.modelbuild.build import find_pair

    pair = tmp_path / "default-abc"
    (pair / "target").mkdir(parents=True)
    (tmp_path / "default").symlink_to(pair.name)
    assert find_pair(tmp_path) == pair.resolve()  # `make bench` passes the models dir
    assert find_pair(pair) == pair.resolve()
    with pytest.raises(SystemExit, match="make models"):
        find_pair(tmp_path / "nothing")
